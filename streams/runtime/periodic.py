"""Work a worker does on a timer rather than per message (the sweeper, design §6).

A `PeriodicTask` is a plain async function of the worker's deps and publisher; the
runtime calls it every ``interval`` seconds for as long as the worker runs. A failure never
stops the timer: an outage is logged (rate-limited) and the next round tries again, any
other error is logged with its class and the next round tries again. Whether a round may
run on this worker at all (one at a time across workers) is the task's own business.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from streams.runtime import metrics
from streams.runtime.classify import is_outage
from streams.runtime.logs import bounded
from streams.runtime.stage import Publisher

D = TypeVar("D")

log = logging.getLogger("stovepipe.periodic")
outage_log = logging.getLogger("stovepipe.outage")


@dataclass(frozen=True)
class PeriodicTask(Generic[D]):
    name: str
    interval: float  # seconds between the starts of two rounds
    run: Callable[[D, Publisher], Awaitable[Any]]


async def run_periodically(task: PeriodicTask[D], deps: D, publish: Publisher) -> None:
    """Round after round until cancelled."""
    while True:
        await asyncio.sleep(task.interval)
        try:
            await task.run(deps, publish)
            metrics.PERIODIC_ROUNDS.labels(task=task.name, outcome="ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the timer must outlive any one round
            metrics.PERIODIC_ROUNDS.labels(task=task.name, outcome="failed").inc()
            if is_outage(exc):
                outage_log.warning("periodic_round_waiting task=%s error=%s", task.name,
                                   bounded(f"{type(exc).__name__}: {exc}"))
            else:
                log.error("periodic_round_failed task=%s error=%s", task.name,
                          bounded(f"{type(exc).__name__}: {exc}"))
