"""Sharing the hosted APIs' budgets among the worker processes (issue 23; design §6, a
dependency's outages, and §10, horizontal scale).

Run by every worker at every tend (`pipeline.TEND_INTERVAL`). A worker process:

1. heartbeats its own row and counts the live worker processes in one statement
   (`WorkerHostStore.beat_process`): three processes sharing a host and a
   ``STOVEPIPE_HOME`` are three. From its second heartbeat on, every budget of the worker
   — made before or after — is divided by that count (`budget.share_among`). Its first
   count is not used: workers started at the same moment may not have heartbeaten yet, so
   until one tend later it spends the conservative share (`budget.UNCOUNTED_WORKERS`);
2. writes the rate-limit pauses it was answered since its last tend and reads everyone's
   (`CredentialPauseStore.exchange`), so a credential one worker was told to leave alone
   is left alone by every worker within two tends.

Invariant: the workers together spend at most their share, except for the moments a
worker joins and the others have not counted it yet (at most one tend: they count it at
their next tend, it spends the conservative share meanwhile).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket

from store import Database
from store.worker_hosts import HEARTBEAT_GAP
from streams.extensions import budget

log = logging.getLogger("stovepipe.budgets")

# this process, for as long as it runs: its host, pid and a random part (a pid is reused)
PROCESS_ID = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
# a process is live while its last heartbeat is younger than this (as a host: 2 gaps)
LIVE_WITHIN = 2 * HEARTBEAT_GAP

_beats = 0  # heartbeats of this process that were written


async def share_budgets(db: Database, host: str) -> None:
    """One round of sharing (see the module docstring)."""
    global _beats
    alive = await db.worker_hosts.beat_process(PROCESS_ID, host, LIVE_WITHIN)
    _beats += 1
    if _beats >= 2:
        if alive != budget.workers_sharing():
            log.info("budget_workers_counted workers=%d process=%s", alive, PROCESS_ID)
        budget.share_among(alive)
    if not budget.in_use():
        return  # no hosted API called here yet: nothing to tell, nothing to heed
    learned = budget.pauses_to_share()
    running = await db.credential_pauses.exchange(learned)
    budget.mark_shared(learned)
    for credential, seconds in running.items():
        budget.pause_from_elsewhere(credential, seconds)
