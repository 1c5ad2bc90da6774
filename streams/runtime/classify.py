"""The one place that decides whether an exception is worth retrying.

Non-retryable is the default (design §6): marking an error retryable for convenience turns
a permanent failure into an infinite loop. Retryable: database conflicts and lost
connections (as classified by the store), broker/network timeouts, errors that carry
``retryable = True`` (e.g. a runner's HTTP 5xx/429/408).
"""

from __future__ import annotations

import asyncio

from store.errors import is_retryable as store_is_retryable
from streams.runtime.outcome import NonRetryable, Outcome, Retryable


def is_retryable(exc: BaseException) -> bool:
    flag = getattr(exc, "retryable", None)
    if isinstance(flag, bool):
        return flag
    # aiokafka records retryability on the error type itself
    flag = getattr(exc, "retriable", None)
    if isinstance(flag, bool):
        return flag
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | ConnectionError):
        return True
    return bool(store_is_retryable(exc))


def outcome_of_exception(exc: BaseException) -> Outcome:
    return Retryable(exc) if is_retryable(exc) else NonRetryable(exc)
