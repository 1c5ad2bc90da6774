"""Small helpers the stage modules share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from store import VersionMismatch

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
