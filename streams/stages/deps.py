"""What the pipeline's stages share: the database, the queue configuration and the
extensions it names. Built once per worker (or per CLI call)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from store import Database
from streams.config.queues import Extensions, QueueConfig, QueuesConfig
from streams.runtime.stage import Context


class PollLoops:
    """Which builds this worker polled lately, to drop duplicate poll loops.

    Duplicates arise when build re-publishes a loop (a duplicate BuildRequest). All loops
    of a build share its Kafka key, so one worker handles them one after another. A loop
    that polled holds for `delay` and, holds never being early, comes back no sooner; a
    loop arriving before that is a duplicate and ends. The loop that polled has already
    produced its next hold (its delivery finished before this one started), or it is
    redelivered after a crash, so this never ends the last loop; losing this memory (a
    restart, a rebalance) only lets duplicates live on.
    """

    LIMIT = 50_000
    MARGIN = 0.9  # of the hold: clocks of the hold's due time and of this memory differ

    def __init__(self) -> None:
        self._last: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def is_duplicate(self, build_id: str) -> bool:
        last = self._last.get(build_id)
        return last is not None and time.monotonic() - last[0] < self.MARGIN * last[1]

    def polled(self, build_id: str, hold: float) -> None:
        self._last[build_id] = (time.monotonic(), hold)
        self._last.move_to_end(build_id)
        while len(self._last) > self.LIMIT:
            self._last.popitem(last=False)


@dataclass
class Deps:
    db: Database
    queues: QueuesConfig
    extensions: Extensions
    poll_loops: PollLoops = field(default_factory=PollLoops)

    def queue_config(self, name: str) -> QueueConfig:
        """Raises UnknownQueue (a user error) for a queue the configuration lacks."""
        return self.queues.get(name)


class WrongQueue(ValueError):
    """A payload's queue_name disagrees with the stored entity: a malformed message."""


def check_queue_name(payload_queue: str, stored_queue: str, what: str) -> None:
    """`queue_name` may be empty on old payloads; when present it must match."""
    if payload_queue and payload_queue != stored_queue:
        raise WrongQueue(f"{what} belongs to queue {stored_queue!r}, "
                         f"but the message says {payload_queue!r}")


StageContext = Context[Deps]
