"""The one place that decides whether an exception is worth retrying, and whether it is an
outage of the infrastructure rather than a failure of the message.

Non-retryable is the default (design §6): marking an error retryable for convenience turns
a permanent failure into an infinite loop. Retryable: database conflicts and lost
connections (as classified by the store), broker/network timeouts, errors that carry
``retryable = True`` (e.g. a runner's HTTP 5xx/429/408). Such an error may also carry
``retry_after`` (seconds): the retry then waits at least that long.

An outage (`is_outage`) is the broker or the database being unreachable: not the
message's fault, so the delivery waits and tries again in place, spending none of the
message's attempts, however long it lasts (design §6, "outages are not message failures").
"""

from __future__ import annotations

import asyncio

import psycopg
import psycopg_pool
from aiokafka import errors as kafka_errors

from store.errors import is_retryable as store_is_retryable
from streams.runtime.outcome import NonRetryable, Outcome, Retryable

# SQLSTATEs of a database that is away: 08 connection exception, 57P01 admin shutdown,
# 57P02 crash shutdown, 57P03 cannot connect now, 53300 too many connections.
_DATABASE_AWAY_CLASSES = frozenset({"08"})
_DATABASE_AWAY_STATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_BROKER_AWAY = (kafka_errors.KafkaConnectionError, kafka_errors.NodeNotReadyError,
                kafka_errors.KafkaTimeoutError, kafka_errors.RequestTimedOutError,
                kafka_errors.LeaderNotAvailableError, kafka_errors.NotLeaderForPartitionError,
                kafka_errors.NotEnoughReplicasError,
                kafka_errors.NotEnoughReplicasAfterAppendError)


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


def retry_after_of(exc: BaseException) -> float | None:
    """How long ``exc`` asks to wait before a retry (a dependency's ``Retry-After``, carried
    as ``retry_after`` seconds), if it says."""
    delay = getattr(exc, "retry_after", None)
    if isinstance(delay, int | float) and not isinstance(delay, bool) and delay >= 0:
        return float(delay)
    return None


def outcome_of_exception(exc: BaseException) -> Outcome:
    if is_retryable(exc):
        return Retryable(exc, retry_after=retry_after_of(exc))
    return NonRetryable(exc)


def is_backpressure(exc: BaseException) -> bool:
    """Whether ``exc`` says no pooled database connection came free in time: the database
    answers, the worker is busy. Waited out in place like an outage, but told apart in the
    log and the metrics (it is no evidence that anything is down)."""
    return isinstance(exc, psycopg_pool.PoolTimeout)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) says the broker or the database is unreachable."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (psycopg_pool.PoolTimeout, *_BROKER_AWAY)):
            return True
        if isinstance(current, psycopg.OperationalError):
            state = current.sqlstate
            if state is None or state[:2] in _DATABASE_AWAY_CLASSES \
                    or state in _DATABASE_AWAY_STATES:
                return True
        if isinstance(current, ConnectionRefusedError | ConnectionResetError):
            return True
        current = current.__cause__  # an explicit wrap; never a later error in a handler
    return False
