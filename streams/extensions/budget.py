"""Rate budgets: every call to a hosted API draws from a budget per credential (issue 17).

A provider limits requests per credential — Buildkite 200 a minute per organization (all
its users and tools together), GitHub 5,000 an hour per token — and Stovepipe must not
spend all of it: people and other tools use the same credential. A `Budget` is this
deployment's share of one credential's limit, spread evenly over its workers: each worker
spends ``per_minute / workers`` a minute, as a token bucket that refills continuously and
holds at most ten seconds' worth (a burst never spends a minute's worth at once). Calls
wait their turn first come, first served, so no queue starves another; nothing is
dropped — a short budget spreads the calls out (and the poll loops lengthen their period
to what the budget allows, `poll_period`).

Budgets are shared by every runner and notifier of the worker that uses the same
credential (`budget_for`): the key names the provider, the API and the credential (a
token's hash, never the token; an organization for Buildkite), so two queues on one
organization draw from one budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field

BURST_SECONDS = 10.0  # the bucket holds this many seconds of the per-worker rate
# a poll loop's period leaves this much of the budget for triggers, cancels and the
# per-build calls a batched poll could not answer
POLL_SHARE = 0.8


@dataclass
class Budget:
    key: str
    per_minute: float  # the deployment's share of the credential's limit
    workers: int = 1  # live workers sharing it (refreshed by the runners' tend)
    tokens: float = field(default=-1.0)  # -1: full on first use
    _updated: float = field(default=0.0)
    _lock: asyncio.Lock | None = field(default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    spent: int = 0  # calls this worker made on it (for the benchmarks and tests)

    @property
    def per_second(self) -> float:
        """This worker's rate."""
        return self.per_minute / 60.0 / max(1, self.workers)

    @property
    def capacity(self) -> float:
        return max(1.0, self.per_second * BURST_SECONDS)

    def _refill(self, now: float) -> None:
        if self.tokens < 0:
            self.tokens = self.capacity
        else:
            self.tokens = min(self.capacity, self.tokens + (now - self._updated)
                              * self.per_second)
        self._updated = now

    async def acquire(self) -> None:
        """Wait for this call's turn and its share of the rate."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:  # one lock per event loop
            self._lock, self._loop = asyncio.Lock(), loop
        async with self._lock:  # fair: waiters are served in the order they came
            self._refill(time.monotonic())
            if self.tokens < 1:
                await asyncio.sleep((1 - self.tokens) / self.per_second)
                self._refill(time.monotonic())
            self.tokens -= 1
            self.spent += 1

    def poll_period(self, loops: int, floor: float) -> float:
        """Seconds between two polls of each of ``loops`` poll loops on this budget (one
        call each, e.g. one batched list per pipeline), so that together they spend at
        most `POLL_SHARE` of this worker's rate; never less than ``floor``."""
        if loops <= 0:
            return floor
        return max(floor, loops / (self.per_second * POLL_SHARE))


_BUDGETS: dict[str, Budget] = {}
DEFAULT_WORKERS = 1


def budget_key(provider: str, api_url: str, credential: str) -> str:
    """A budget's key: the provider, the API and the credential's identity (a hash: a
    token never appears in a key, a log or an error)."""
    digest = hashlib.sha256(credential.encode()).hexdigest()[:16]
    return f"{provider}:{api_url.rstrip('/')}:{digest}"


def budget_for(key: str, per_minute: float) -> Budget:
    """The worker's budget for ``key`` (made on first use with ``per_minute``; a later
    caller asking for a smaller share lowers it: the strictest configuration wins)."""
    budget = _BUDGETS.get(key)
    if budget is None:
        budget = _BUDGETS[key] = Budget(key, per_minute)
    elif per_minute < budget.per_minute:
        budget.per_minute = per_minute
    return budget


def share_among(workers: int) -> None:
    """Every budget of this worker is shared by ``workers`` live workers (the worker
    counts them from their heartbeats, `streams.stages.pipeline`)."""
    for budget in _BUDGETS.values():
        budget.workers = max(1, workers)
