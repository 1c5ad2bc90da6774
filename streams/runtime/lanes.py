"""Many messages of a stage at once, one key at a time (design §10).

A stage's agent hands every event it receives to `Lanes.submit`, which returns as soon as
the event is buffered. Events with the same Kafka key run one after another, in the order
they arrived; events with different keys run concurrently — so a slow call for one queue
or one build never stalls the others, and `process`, keyed by queue, keeps its single
writer per queue. An event is acknowledged only when it and every earlier event of its
partition are done, so the committed offset of a partition never passes an event still
under way (and acks stay in order, which keeps Faust's own commit tracking exact).

Two bounds, each with its own job:

- **slots** (``limit``): at most this many events *run* at once. A slot belongs to running
  work only: an event waiting for its key's earlier event holds none. A key runs at most
  one event at a time, and keys with work waiting take the free slots in turn (round
  robin), so a key with thousands of events waiting delays another key by at most one
  handler's time — the time until some slot comes free.
- **buffer** (``buffer``): at most this many events are held (running or waiting). Beyond
  that `submit` waits, the agent stops taking events and Faust stops fetching for it, so
  memory stays flat under any backlog.

A failure of ``work`` itself (the delivery runtime handles every handler error, so this
is a bug) is never skipped over: its event stays unacknowledged, which stops the
partition's commits, nothing more runs, and the next `submit` raises `LanesHalted` so the
agent crashes loudly (the worker then has the group deliver the uncommitted messages
again: `streams.runtime.worker`).

When the group moves partitions away (a rebalance), `revoke` stops their events at once:
running ones are cancelled, waiting ones dropped, none is acknowledged afterwards — so two
members never work on one partition's messages at once, whatever a handler was waiting
for.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from streams.runtime import metrics

log = logging.getLogger("stovepipe.lanes")

# events held per slot by default (5,000 a stage at the default 500 slots, a few MB): room
# for a busy key's backlog of thousands while other keys' events still flow in. Faust
# holds up to its stream_buffer_maxsize (4,096) more per agent before the lanes.
BUFFER_PER_SLOT = 10


class LanesHalted(RuntimeError):
    """A delivery failed outside the runtime's error handling (a bug): nothing more runs."""


@dataclass
class _Pending:
    event: Any
    done: bool = False


class Lanes:
    """Runs ``work(event)`` for submitted events: per key in order, across keys at once,
    acking per partition in order. ``key_of`` and ``partition_of`` read an event."""

    def __init__(self, work: Callable[[Any], Awaitable[None]], *, limit: int,
                 key_of: Callable[[Any], Any], partition_of: Callable[[Any], Any],
                 ack: Callable[[Any], None], name: str = "",
                 buffer: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"lanes need room for at least one event, got limit={limit}")
        self.work = work
        self.key_of = key_of
        self.partition_of = partition_of
        self.ack = ack
        self.limit = limit
        self.buffer = max(limit, buffer if buffer is not None else limit * BUFFER_PER_SLOT)
        self._waiting: dict[Any, deque[_Pending]] = {}  # per key, not yet started
        self._turns: deque[Any] = deque()  # keys with events waiting and none running
        self._running: dict[Any, tuple[asyncio.Task[None], _Pending]] = {}  # per key
        self._partitions: dict[Any, deque[_Pending]] = {}  # unacknowledged, in order
        self._held = 0  # events submitted and not finished
        self._room = asyncio.Event()
        self._room.set()
        self._failure: BaseException | None = None
        self.halted = asyncio.Event()  # set by a failure of ``work``: nothing more runs
        self._gauge = metrics.IN_FLIGHT.labels(stage=name)

    @property
    def in_flight(self) -> int:
        """Events held: running or waiting for their key or a slot."""
        return self._held

    @property
    def running(self) -> int:
        return len(self._running)

    def failure(self) -> LanesHalted | None:
        """The halt, as the error the agent raises (None while nothing failed)."""
        if self._failure is None:
            return None
        halted = LanesHalted("a delivery failed outside the runtime's error handling; "
                             "its partition stops here")
        halted.__cause__ = self._failure
        return halted

    async def submit(self, event: Any) -> None:
        """Hold ``event`` (it starts once its key's earlier events are done and a slot is
        free); waits only while the buffer is full."""
        while self._held >= self.buffer:
            self._room.clear()
            await self._room.wait()
        halted = self.failure()
        if halted is not None:
            raise halted
        key = self.key_of(event)
        pending = _Pending(event)
        self._partitions.setdefault(self.partition_of(event), deque()).append(pending)
        self._held += 1
        self._gauge.set(self._held)
        waiting = self._waiting.get(key)
        if waiting is None:
            self._waiting[key] = waiting = deque()
            if key not in self._running:
                self._turns.append(key)
        waiting.append(pending)
        self._start_what_can_run()

    def _start_what_can_run(self) -> None:
        """Give free slots to the keys whose turn it is."""
        while self._turns and len(self._running) < self.limit:
            key = self._turns.popleft()
            waiting = self._waiting[key]
            pending = waiting.popleft()
            if not waiting:
                del self._waiting[key]
            task = asyncio.create_task(self._run(pending))
            self._running[key] = (task, pending)
            task.add_done_callback(functools.partial(self._finished, key=key))

    async def _run(self, pending: _Pending) -> None:
        if self._failure is not None:
            return  # halted: nothing after a failed event runs or is acknowledged
        try:
            await self.work(pending.event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("delivery_failed_outside_runtime: partition halted")
            self._failure = self._failure or exc
            self.halted.set()
            return
        pending.done = True
        self._ack_done(self.partition_of(pending.event))

    def _finished(self, task: asyncio.Task[None], *, key: Any) -> None:
        if self._running.get(key, (None,))[0] is task:
            del self._running[key]
        self._held -= 1
        self._gauge.set(self._held)
        self._room.set()
        if key in self._waiting:  # its next event waits its turn behind the others
            self._turns.append(key)
        if not task.cancelled():
            self._start_what_can_run()

    def _ack_done(self, partition: Any) -> None:
        waiting = self._partitions.get(partition)
        if waiting is None:
            return
        while waiting and waiting[0].done:
            self.ack(waiting.popleft().event)
        if not waiting:
            del self._partitions[partition]

    async def revoke(self, partitions: Collection[Any]) -> int:
        """Stop every event of ``partitions`` (their group moved them to another member):
        waiting ones are dropped, running ones cancelled, none is acknowledged after this
        returns — the new owner delivers them again from the committed offset. Returns how
        many events were stopped."""
        gone = set(partitions)
        stopped = 0
        for key in [k for k, w in self._waiting.items()
                    if self.partition_of(w[0].event) in gone]:
            stopped += len(self._waiting.pop(key))
        self._turns = deque(k for k in self._turns if k in self._waiting
                            or k in self._running)
        self._held -= stopped
        cancelled = [task for task, pending in self._running.values()
                     if self.partition_of(pending.event) in gone]
        for partition in gone:
            self._partitions.pop(partition, None)
        for task in cancelled:
            task.cancel()
        # gather, not one await per task: it returns only after every task's own done
        # callback (`_finished`, registered first) has run, so no cancelled key is still
        # counted as running when this returns
        await asyncio.gather(*cancelled, return_exceptions=True)
        self._gauge.set(self._held)
        self._room.set()
        self._start_what_can_run()
        return stopped + len(cancelled)

    async def close(self) -> None:
        """Stop everything under way; what was not acknowledged is delivered again."""
        self._turns.clear()
        self._held -= sum(len(w) for w in self._waiting.values())
        self._waiting.clear()
        tasks = [task for task, _ in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._gauge.set(0)
