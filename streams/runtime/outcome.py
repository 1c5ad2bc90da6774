"""The ways a handler can end (design §6)."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import Message


class RetryableError(Exception):
    """Raise (or subclass) to say: the same message may succeed later."""

    retryable = True


@dataclass(frozen=True)
class Ack:
    """Done: commit past the message."""


@dataclass(frozen=True)
class Hold:
    """Bring the message back after ``delay`` seconds; costs no retry attempt.

    ``payload``, when given, is what comes back instead of the original bytes (same key,
    same topic): a loop hands its next turn the token it holds now."""

    delay: float
    payload: Message | None = None

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError(f"hold delay must be >= 0, got {self.delay}")


@dataclass(frozen=True)
class Wait:
    """A dependency the handler needs (a build runner, a source control) is unavailable:
    bring the message back after ``delay`` seconds, spending none of its attempts (design
    §6: a dependency's outage is waited out, never climbed). The runtime counts the
    consecutive waits of a message (`Context.waits`) and how long ago the first began
    (`Context.waiting_for`), so the handler can back off and keep its own deadline; a
    hold (progress) starts the count afresh. ``payload``, when given, replaces the
    original bytes, as for a hold."""

    delay: float
    error: BaseException
    payload: Message | None = None

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError(f"wait delay must be >= 0, got {self.delay}")


@dataclass(frozen=True)
class Retryable:
    """Failed, may succeed later: redeliver after the topic's backoff, or after
    ``retry_after`` seconds when the failing dependency asked for longer (a
    ``Retry-After``)."""

    error: BaseException
    retry_after: float | None = None


@dataclass(frozen=True)
class NonRetryable:
    """Failed for good: dead-letter it (reconcilers: retry anyway, they never cascade)."""

    error: BaseException


Outcome = Ack | Hold | Wait | Retryable | NonRetryable

ACK = Ack()
