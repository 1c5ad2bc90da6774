"""From a handler's outcome to the delivery action: pure, so it is tested with Hypothesis.

``attempt`` counts the handler invocations that already failed for this message (0 on the
first delivery); it travels in a header so it survives restarts and redeliveries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streams.runtime.outcome import Ack, Hold, NonRetryable, Outcome, Retryable, Wait

# The longest wait a dependency's Retry-After may impose on one retry: GitHub's hourly
# rate-limit window. A longer demand is met by the following retries.
MAX_RETRY_AFTER = 3600.0


@dataclass(frozen=True)
class Retry:
    """How a topic retries: ``max_attempts`` handler calls in all (None: forever) and the
    delay before each retry; past the end of ``backoff`` its last value repeats (the cap).
    ``park_after`` (reconcilers): handler calls that fail for good before the message is
    parked; transient failures never park."""

    max_attempts: int | None
    backoff: tuple[float, ...]
    park_after: int = 3

    def __post_init__(self) -> None:
        if not self.backoff or any(d < 0 for d in self.backoff):
            raise ValueError("backoff needs at least one non-negative delay")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.park_after < 1:
            raise ValueError("park_after must be >= 1")

    def delay_before(self, retry_number: int) -> float:
        """Delay before the ``retry_number``-th retry (1-based)."""
        return self.backoff[min(retry_number, len(self.backoff)) - 1]


@dataclass(frozen=True)
class Commit:
    """Acknowledge the source message."""


@dataclass(frozen=True)
class Redeliver:
    """Produce the same message back to its topic after ``delay`` s, with ``attempt``."""

    delay: float
    attempt: int


@dataclass(frozen=True)
class DeadLetter:
    attempts: int
    error: BaseException


@dataclass(frozen=True)
class ParkMessage:
    """A reconciler's message that can never be reconciled: keep it in PostgreSQL, ack."""

    attempts: int
    error: BaseException


Action = Commit | Redeliver | DeadLetter | ParkMessage


def decide(outcome: Outcome, *, attempt: int, retry: Retry, reconciler: bool) -> Action:
    """The action for ``outcome`` on a message that already failed ``attempt`` times.

    A retry waits the topic's backoff, or longer when the error asked for longer
    (`Retryable.retry_after`, capped at `MAX_RETRY_AFTER`).

    Reconcilers never dead-letter (design §6: a ``_dlq`` consumer has no DLQ of its own):
    a transient failure is retried forever with the capped backoff; one that can never
    succeed is retried up to ``park_after`` calls in all, then parked.
    """
    match outcome:
        case Ack():
            return Commit()
        case Hold(delay=delay):
            # a hold is progress (a poll that answered, a gate that looked): the failures
            # before it were not consecutive, so they no longer count towards the limit —
            # else a few transient errors scattered over a long build's life would
            # dead-letter it
            return Redeliver(delay=delay, attempt=0)
        case Wait(delay=delay):
            # a dependency's outage is no failure of the message: its attempts stay as
            # they are, and a reconciler waits the same way
            return Redeliver(delay=min(delay, MAX_RETRY_AFTER), attempt=attempt)
        case Retryable(error=error) | NonRetryable(error=error):
            failures = attempt + 1
            exhausted = retry.max_attempts is not None and failures >= retry.max_attempts
            if reconciler:
                if isinstance(outcome, NonRetryable) and failures >= retry.park_after:
                    return ParkMessage(attempts=failures, error=error)
            elif isinstance(outcome, NonRetryable) or exhausted:
                return DeadLetter(attempts=failures, error=error)
            delay = retry.delay_before(failures)
            if isinstance(outcome, Retryable) and outcome.retry_after is not None:
                # the dependency said when to come back: never sooner (a rate limit
                # retried early only spends another attempt), never absurdly later
                delay = max(delay, min(outcome.retry_after, MAX_RETRY_AFTER))
            return Redeliver(delay=delay, attempt=failures)
    raise TypeError(f"not an Outcome: {outcome!r}")


def choose_tier(remaining: float, tiers: Sequence[float]) -> float:
    """The delay tier for a message still ``remaining`` s from due: the longest tier that
    does not overshoot, else the shortest (its consumer then waits only until due)."""
    ordered = sorted(tiers)
    fitting = [t for t in ordered if t <= remaining]
    return fitting[-1] if fitting else ordered[0]


def tier_wake_time(*, due: float, appended: float, tier: float) -> float:
    """When a tier consumer may act on a message: never after ``due``, and never later than
    ``appended + tier`` — monotonic in append order, so waiting on the head of a partition
    never delays the messages behind it (they were appended later)."""
    return min(due, appended + tier)
