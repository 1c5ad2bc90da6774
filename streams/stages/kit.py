"""Small helpers the stage modules share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from google.protobuf.message import Message

from store import StoreError, VersionMismatch
from streams.runtime import Wait
from streams.runtime.classify import is_outage, is_retryable, retry_after_of
from streams.runtime.stage import Context

T = TypeVar("T")
CAS_ATTEMPTS = 5


async def with_cas_retries(step: Callable[[], Awaitable[T]],
                           attempts: int = CAS_ATTEMPTS) -> T:
    """Run ``step`` again (from a fresh read) when a compare-and-set lost to a concurrent
    writer. Each step is a complete, idempotent decision, so re-running is safe; after
    ``attempts`` losses the VersionMismatch (retryable) goes to the runtime's backoff."""
    for _ in range(attempts - 1):
        try:
            return await step()
        except VersionMismatch:
            continue
    return await step()


def seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


# --- waiting out a dependency's outage (design §6) -------------------------------------

WAIT_FIRST = 1.0  # seconds before the first call again, unless the loop's delay is longer
# the longest wait between two calls to a dependency that keeps failing (a Retry-After may
# ask for longer): how late Stovepipe may notice that it is back
WAIT_CAP = 60.0


def is_dependency_unavailable(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a call to a build runner or a source control, says the
    dependency is unavailable for now (5xx, 429, a rate-limit 403, a timeout, a refused
    connection: the extension marked it retryable) — not the broker or the database (an
    outage, which the runtime waits out in place) and not a failure of the message."""
    return (not is_outage(exc) and not isinstance(exc, StoreError)
            and is_retryable(exc))


def dependency_wait(ctx: Context[Any], error: BaseException, *, floor: float,
                    payload: Message | None = None) -> Wait:
    """A `Wait` before calling the dependency again: capped exponential backoff from
    ``floor`` (a loop's own delay: so an outage never calls more often than the healthy
    loop would), never sooner than the dependency's Retry-After."""
    delay = min(max(floor, WAIT_FIRST * 2 ** min(ctx.waits, 16)), max(floor, WAIT_CAP))
    asked = retry_after_of(error)
    if asked is not None:
        delay = max(delay, asked)
    return Wait(delay, error, payload)
