"""Many messages of a stage at once, one key at a time (design §10).

A stage's agent hands every event it receives to `Lanes.submit`, which returns as soon as
the event is under way. Events with the same Kafka key run one after another, in the
order they arrived; events with different keys run concurrently — so a slow call for one
queue or one build never stalls the others, and `process`, keyed by queue, keeps its
single writer per queue. An event is acknowledged only when it and every earlier event of
its partition are done, so the committed offset of a partition never passes an event
still under way (and acks stay in order, which keeps Faust's own commit tracking exact).
At most ``limit`` events are under way at once: beyond that `submit` waits, the agent
stops taking events and Faust stops fetching for it, so memory stays flat under any
backlog.

A failure of ``work`` itself (the delivery runtime handles every handler error, so this
is a bug) is never skipped over: its event stays unacknowledged, which stops the
partition's commits, and the next `submit` raises it so the agent crashes loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streams.runtime import metrics

log = logging.getLogger("stovepipe.lanes")


@dataclass
class _Pending:
    event: Any
    done: bool = False


class Lanes:
    """Runs ``work(event)`` for submitted events: per key in order, across keys at once,
    acking per partition in order. ``key_of`` and ``partition_of`` read an event."""

    def __init__(self, work: Callable[[Any], Awaitable[None]], *, limit: int,
                 key_of: Callable[[Any], Any], partition_of: Callable[[Any], Any],
                 ack: Callable[[Any], None], name: str = "") -> None:
        if limit < 1:
            raise ValueError(f"lanes need room for at least one event, got limit={limit}")
        self.work = work
        self.key_of = key_of
        self.partition_of = partition_of
        self.ack = ack
        self._slots = asyncio.Semaphore(limit)
        self._tails: dict[Any, asyncio.Task[None]] = {}  # each key's last event under way
        self._partitions: dict[Any, deque[_Pending]] = {}  # unacknowledged, in order
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._gauge = metrics.IN_FLIGHT.labels(stage=name)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def submit(self, event: Any) -> None:
        """Start ``event`` (after its key's earlier events); waits only for room."""
        await self._slots.acquire()
        if self._failure is not None:
            self._slots.release()
            raise RuntimeError("a delivery failed outside the runtime's error handling; "
                               "its partition stops here") from self._failure
        key = self.key_of(event)
        pending = _Pending(event)
        self._partitions.setdefault(self.partition_of(event), deque()).append(pending)
        task = asyncio.create_task(self._run(pending, self._tails.get(key)))
        self._tails[key] = task
        self._tasks.add(task)
        self._gauge.set(len(self._tasks))
        task.add_done_callback(functools.partial(self._finished, key=key))

    async def _run(self, pending: _Pending, previous: asyncio.Task[None] | None) -> None:
        try:
            if previous is not None:
                # the same key's earlier event first, whatever became of it
                await asyncio.wait([previous])
            if self._failure is not None:
                return  # halted: nothing after a failed event runs or is acknowledged
            await self.work(pending.event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("delivery_failed_outside_runtime: partition halted")
            self._failure = self._failure or exc
            return
        finally:
            self._slots.release()
        pending.done = True
        self._ack_done(self.partition_of(pending.event))

    def _finished(self, task: asyncio.Task[None], *, key: Any) -> None:
        self._tasks.discard(task)
        self._gauge.set(len(self._tasks))
        if self._tails.get(key) is task:
            del self._tails[key]

    def _ack_done(self, partition: Any) -> None:
        waiting = self._partitions.get(partition)
        if waiting is None:
            return
        while waiting and waiting[0].done:
            self.ack(waiting.popleft().event)
        if not waiting:
            del self._partitions[partition]

    async def close(self) -> None:
        """Stop everything under way; what was not acknowledged is delivered again."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._gauge.set(0)
