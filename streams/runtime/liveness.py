"""Whether this worker can make progress, for its liveness probe (design §12).

A worker that cannot make progress — a handler stuck in a call that never returns, a
deadlock — should be restarted; a worker waiting out an outage of the broker or the
database must not be: a restart would not bring them back, and a liveness probe that
checks them turns every outage into a restart storm. So liveness is judged from this
process alone: every delivery under way says when it last made progress, and the retry
loops that wait out an outage (`Delivery._handle_through_outages`, `produce_until_acked`,
`_until_done`) count each try as progress. A delivery that has not made progress for
longer than the bound (``STOVEPIPE_LIVENESS_STUCK_AFTER``, default `STUCK_AFTER`) is
stuck. An event loop that is stuck answers no probe at all, which a probe's timeout
reports the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

# seconds without progress after which a delivery is stuck: longer than any call a handler
# makes in one go (git's and the providers' own deadlines are minutes at most) and than
# an outage-retry's longest backoff, so only a call that never returns reaches it
STUCK_AFTER = 600.0
ENV_STUCK_AFTER = "STOVEPIPE_LIVENESS_STUCK_AFTER"


def stuck_after() -> float:
    """The bound, from ``STOVEPIPE_LIVENESS_STUCK_AFTER`` (seconds) or `STUCK_AFTER`."""
    raw = os.environ.get(ENV_STUCK_AFTER, "").strip()
    if not raw:
        return STUCK_AFTER
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_STUCK_AFTER}={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{ENV_STUCK_AFTER}={raw!r}: expected a positive number of seconds")
    return value


@dataclass
class _Underway:
    stage: str
    what: str
    started: float
    progressed: float


@dataclass(frozen=True)
class Stuck:
    stage: str
    what: str  # the message's id, bounded
    for_s: float  # seconds since it last made progress


class Progress:
    """The deliveries under way in this process, and when each last made progress."""

    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock  # type: ignore[assignment]
        self._underway: dict[int, _Underway] = {}
        self._ids = itertools.count()

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator, no-any-return]

    @contextlib.contextmanager
    def delivering(self, stage: str, what: str) -> Iterator[None]:
        """Track one delivery while the block runs; `tick` inside it marks progress."""
        number = next(self._ids)
        now = self._now()
        self._underway[number] = _Underway(stage, what, now, now)
        token = _current.set((self, number))
        try:
            yield
        finally:
            _current.reset(token)
            self._underway.pop(number, None)

    def _tick(self, number: int) -> None:
        underway = self._underway.get(number)
        if underway is not None:
            underway.progressed = self._now()

    def stuck(self, after: float) -> list[Stuck]:
        """The deliveries without progress for more than ``after`` seconds, longest
        first."""
        now = self._now()
        found = [Stuck(u.stage, u.what, now - u.progressed) for u in self._underway.values()
                 if now - u.progressed > after]
        return sorted(found, key=lambda s: -s.for_s)

    @property
    def underway(self) -> int:
        return len(self._underway)


_current: ContextVar[tuple[Progress, int] | None] = ContextVar("stovepipe_progress",
                                                               default=None)


def tick() -> None:
    """Mark the current delivery as making progress (a try of an outage-retry loop)."""
    current = _current.get()
    if current is not None:
        progress, number = current
        progress._tick(number)
