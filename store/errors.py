"""Typed store errors, and the one place that decides whether a database error is retryable.

Stores raise these instead of driver errors when the database gave an *answer*:
the row is missing (`NotFound`), the key is taken (`AlreadyExists`), someone else wrote
first (`VersionMismatch`), or the write would break an invariant the schema enforces
(`InvariantViolation`). Everything else (lost connections, timeouts, deadlocks) reaches
the caller as the driver raised it; `is_retryable` classifies both kinds.
"""

from __future__ import annotations

from collections.abc import Mapping

import psycopg
import psycopg_pool


def _describe(key: Mapping[str, object]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in key.items())


class StoreError(Exception):
    """Base of every error the store raises on purpose. `retryable` says what to do with it."""

    retryable: bool = False


class NotFound(StoreError):
    """The row named by `entity` and `key` does not exist."""

    def __init__(self, entity: str, key: Mapping[str, object]) -> None:
        self.entity = entity
        self.key = dict(key)
        super().__init__(f"{entity} not found: {_describe(key)}")


class AlreadyExists(StoreError):
    """A row with this primary key already exists (the first writer won)."""

    def __init__(self, entity: str, key: Mapping[str, object]) -> None:
        self.entity = entity
        self.key = dict(key)
        super().__init__(f"{entity} already exists: {_describe(key)}")


class VersionMismatch(StoreError):
    """A compare-and-set lost: the row's version is no longer `expected_version`.

    Retryable: reload the entity and decide again.
    """

    retryable = True

    def __init__(
        self,
        entity: str,
        key: Mapping[str, object],
        *,
        expected_version: int,
        actual_version: int | None,
    ) -> None:
        self.entity = entity
        self.key = dict(key)
        self.expected_version = expected_version
        self.actual_version = actual_version
        super().__init__(
            f"{entity} changed concurrently: {_describe(key)}, "
            f"expected version {expected_version}, found {actual_version}"
        )


class InvariantViolation(StoreError):
    """The write would break an invariant: an illegal state transition, a second terminal
    build status, a bookmark that moves backwards or names no green fact, an update to an
    immutable fact. Never retryable: the same write would fail again.

    Raised before the write when the store can tell, otherwise translated from the
    database trigger or constraint that refused it. `constraint` names that check.
    """

    def __init__(
        self, entity: str, key: Mapping[str, object], reason: str, *, constraint: str = ""
    ) -> None:
        self.entity = entity
        self.key = dict(key)
        self.reason = reason
        self.constraint = constraint
        super().__init__(f"{entity} {_describe(key)}: {reason}")


class AmbiguousKey(StoreError):
    """A lookup by a partial key (a build id without its queue) matched several rows."""

    def __init__(self, entity: str, key: Mapping[str, object], matches: int) -> None:
        self.entity = entity
        self.key = dict(key)
        self.matches = matches
        super().__init__(f"{entity} {_describe(key)} is ambiguous: {matches} rows match")


class MigrationError(StoreError):
    """The schema cannot be migrated as asked (edited migration, no schema selected)."""


# SQLSTATE classes whose errors go away on their own: 08 connection exception,
# 40 transaction rollback (serialization failure, deadlock), 53 insufficient resources
# (too many connections, out of memory, disk full), 57 operator intervention (admin
# shutdown, cannot connect now, statement timeout / query canceled).
_RETRYABLE_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57"})
# 55P03 lock_not_available (lock_timeout, NOWAIT), 55006 object_in_use.
_RETRYABLE_SQLSTATES = frozenset({"55P03", "55006"})


def is_retryable(exc: BaseException) -> bool:
    """Whether retrying the operation that raised `exc` may succeed.

    The only classification of database errors in Stovepipe. Retryable: compare-and-set
    conflicts (`VersionMismatch`), serialization failures and deadlocks, lost or refused
    connections, statement and lock timeouts, pool exhaustion, `TimeoutError` and
    `ConnectionError`. Constraint violations are
    answers, never retryable (stores turn unique violations into `AlreadyExists`). Anything
    not recognised here is non-retryable: a permanent failure must not loop forever.
    """
    if isinstance(exc, StoreError):
        return exc.retryable
    # PoolTimeout: no connection free in time. PoolClosed only happens while a worker
    # shuts down; the message is not committed and another worker must redo it.
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg_pool.PoolClosed):
        return True
    if isinstance(exc, psycopg.Error):
        sqlstate = exc.sqlstate
        if sqlstate is None:
            # Raised by the client, not the server: connection lost/refused/timed out
            # and "the connection is closed" are OperationalErrors; misuse is not.
            return isinstance(exc, psycopg.OperationalError)
        return sqlstate[:2] in _RETRYABLE_SQLSTATE_CLASSES or sqlstate in _RETRYABLE_SQLSTATES
    # A deadline around a database call (asyncio.timeout) or a socket-level failure.
    return isinstance(exc, TimeoutError | ConnectionError)
