"""Many messages of a stage at once, one key at a time (design §10).

A stage's agent hands every event it receives to `Lanes.submit`, which returns as soon as
the event is under way. Events with the same Kafka key run one after another, in the
order they arrived; events with different keys run concurrently — so a slow call for one
queue or one build never stalls the others, and `process`, keyed by queue, keeps its
single writer per queue. An event is acknowledged only when it and every earlier event of
its partition are done: Faust commits below the oldest unfinished event of each partition
(acks stay in order per partition, which also keeps Faust's own commit tracking exact).
At most ``limit`` events are under way at once per worker (a semaphore shared by every
stage), so memory stays flat under any backlog: the agent stops taking events and Faust
stops fetching.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Pending:
    event: Any
    done: bool = False


@dataclass
class _Partition:
    pending: deque[_Pending] = field(default_factory=deque)


class Lanes:
    """Runs ``work(event)`` for submitted events: per key in order, across keys at once,
    acking per partition in order. ``key_of`` and ``partition_of`` read an event."""

    def __init__(self, work: Callable[[Any], Awaitable[None]], *,
                 slots: asyncio.Semaphore, key_of: Callable[[Any], Any],
                 partition_of: Callable[[Any], Any], ack: Callable[[Any], None]) -> None:
        self.work = work
        self.slots = slots
        self.key_of = key_of
        self.partition_of = partition_of
        self.ack = ack
        self._tails: dict[Any, asyncio.Task[None]] = {}
        self._partitions: dict[Any, _Partition] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def submit(self, event: Any) -> None:
        """Start ``event`` (after its key's previous event); waits only for a free slot."""
        await self.slots.acquire()
        key = self.key_of(event)
        pending = _Pending(event)
        self._partitions.setdefault(self.partition_of(event), _Partition()).pending.append(
            pending)
        previous = self._tails.get(key)
        task = asyncio.create_task(self._run(pending, previous))
        self._tails[key] = task
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, key=key))

    async def _run(self, pending: _Pending, previous: asyncio.Task[None] | None) -> None:
        try:
            if previous is not None:
                # the same key's earlier event first; its outcome is its own business
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(previous)
            await self.work(pending.event)
            pending.done = True
            self._ack_done(self.partition_of(pending.event))
        finally:
            self.slots.release()

    def _finished(self, task: asyncio.Task[None], *, key: Any) -> None:
        self._tasks.discard(task)
        if self._tails.get(key) is task:
            del self._tails[key]

    def _ack_done(self, partition: Any) -> None:
        lane = self._partitions.get(partition)
        if lane is None:
            return
        while lane.pending and lane.pending[0].done:
            self.ack(lane.pending.popleft().event)
        if not lane.pending:
            del self._partitions[partition]

    async def close(self) -> None:
        """Stop everything under way; what was not acknowledged is delivered again."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
