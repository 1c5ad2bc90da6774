"""The connection pool, the stores bound to it, and transactions spanning several stores.

    async with await Database.open(dsn) as db:
        request = await db.requests.get(queue, request_id)          # one pooled statement
        async with db.transaction() as tx:                          # one connection
            await tx.queues.take_slot(queue_row)
            await tx.requests.transition(request, RequestState.PROCESSING, strategy=…)
        # both writes committed, or (on any exception, e.g. VersionMismatch) neither

Pooled connections run in autocommit, so a plain store call is a single-statement
transaction with one round trip.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, Self

from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg_pool import AsyncConnectionPool

from store._base import ConnectionSource
from store.builds import BuildStore
from store.command_builds import CommandBuildStore
from store.counters import CounterStore
from store.credential_pauses import CredentialPauseStore
from store.culprits import CommitInfoStore, CulpritSearchStore
from store.facts import FactStore
from store.ingest_leases import IngestLeaseStore
from store.notifications import NotificationStore
from store.parked import ParkedStore
from store.pins import PinStore
from store.project_answers import ProjectAnswerStore
from store.project_pins import ProjectPinStore
from store.project_views import ProjectViewStore
from store.projects import ProjectStore
from store.queues import QueueStore
from store.request_uris import RequestUriStore
from store.requests import RequestStore
from store.retention import RetentionStore
from store.steps import StepStore
from store.webhook_deliveries import WebhookDeliveryStore
from store.worker_hosts import WorkerHostStore


class Stores:
    """One store per entity, all drawing connections from the same source."""

    def __init__(self, source: ConnectionSource) -> None:
        self.queues = QueueStore(source)
        self.requests = RequestStore(source)
        self.request_uris = RequestUriStore(source)
        self.builds = BuildStore(source)
        self.command_builds = CommandBuildStore(source)
        self.facts = FactStore(source)
        self.counters = CounterStore(source)
        self.parked = ParkedStore(source)
        self.steps = StepStore(source)
        self.webhook_deliveries = WebhookDeliveryStore(source)
        self.notifications = NotificationStore(source)
        self.ingest_leases = IngestLeaseStore(source)
        self.worker_hosts = WorkerHostStore(source)
        self.credential_pauses = CredentialPauseStore(source)
        self.culprit_searches = CulpritSearchStore(source)
        self.commit_infos = CommitInfoStore(source)
        self.pins = PinStore(source)
        self.projects = ProjectStore(source)
        self.retention = RetentionStore(source)
        self.project_answers = ProjectAnswerStore(source)
        self.project_pins = ProjectPinStore(source)
        self.project_views = ProjectViewStore(source)


class _PoolSource:
    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        self._pool = pool

    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[Any]]:
        return self._pool.connection()


class _TransactionSource:
    def __init__(self, conn: AsyncConnection[Any]) -> None:
        self._conn = conn
        self.finished = False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        if self.finished:
            raise RuntimeError("this transaction has ended; open a new one")
        yield self._conn


# First halves of advisory lock keys ("STVQ", "STVS"); the second half hashes the schema
# and the name, so deployments sharing a database server never wait for each other.
_QUEUE_LOCK_NAMESPACE = 0x53545651
_SINGLETON_LOCK_NAMESPACE = 0x53545653
_LOCK_QUEUE = "SELECT pg_advisory_xact_lock(%s, hashtext(current_schema() || '/' || %s))"


class Transaction(Stores):
    """The stores, bound to one connection inside one database transaction.

    A store error raised without a database error — NotFound from a read, AlreadyExists,
    VersionMismatch, an InvariantViolation detected before writing — leaves the
    transaction usable, so a caller may catch it and carry on. Any database error aborts
    the transaction: it can only be rolled back.
    """

    def __init__(self, conn: AsyncConnection[Any]) -> None:
        self._tx_source = _TransactionSource(conn)
        super().__init__(self._tx_source)
        self.connection = conn

    async def lock_queue(self, queue: str) -> None:
        """Wait for, then hold until this transaction ends, the queue's lock: writers that
        must be ordered per queue (ingest) take it first."""
        await self.connection.execute(_LOCK_QUEUE, (_QUEUE_LOCK_NAMESPACE, queue))


class Database(Stores):
    """The pool and the stores bound to it. Open with `await Database.open(dsn)`."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        super().__init__(_PoolSource(pool))
        self.pool = pool

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        acquire_timeout: float = 30.0,
        name: str | None = None,
    ) -> Database:
        """Open a pool of `min_size`..`max_size` connections to `dsn`, waiting up to
        `acquire_timeout` seconds for the first `min_size` to connect (PoolTimeout
        otherwise). It is also how long a store call waits for a free connection."""
        pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            timeout=acquire_timeout,
            name=name,
            kwargs={"autocommit": True},
            open=False,
        )
        try:
            await pool.open(wait=True, timeout=acquire_timeout)
        except BaseException:
            await pool.close()
            raise
        return cls(pool)

    async def close(self) -> None:
        await self.pool.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @asynccontextmanager
    async def try_exclusive(self, name: str, *, dedicated: bool = False
                            ) -> AsyncIterator[bool]:
        """Hold the lock ``name`` for the block if nobody else holds it; yields whether it
        was taken. One holder at a time across every process using this schema: a
        transaction-level advisory lock on a connection of its own, released when the
        block ends or the connection dies (a crashed holder never keeps it). The
        connection is a pooled one, or with ``dedicated`` one opened for the block: a
        holder that keeps the lock for minutes (a retention round) must not keep one of
        the stages' connections that long."""
        async with contextlib.AsyncExitStack() as stack:
            if dedicated:
                conninfo, kwargs = self.pool.conninfo, self.pool.kwargs
                assert isinstance(conninfo, str) and isinstance(kwargs, dict)  # as `open` set
                conn = await stack.enter_async_context(await AsyncConnection.connect(
                    conninfo, **kwargs))
            else:
                conn = await stack.enter_async_context(self.pool.connection())
            await stack.enter_async_context(conn.transaction())
            cursor = await conn.execute(
                "SELECT pg_try_advisory_xact_lock(%s, hashtext(current_schema() || '/' || %s))",
                (_SINGLETON_LOCK_NAMESPACE, name))
            row = await cursor.fetchone()
            yield bool(row and row[0])

    @asynccontextmanager
    async def queue_transaction(self, queue: str) -> AsyncIterator[Transaction]:
        """A transaction that holds ``queue``'s lock (`Transaction.lock_queue`) from its
        start: BEGIN and the lock travel in one round trip, and the block runs once the
        lock is held. Committed when the block exits normally, rolled back otherwise."""
        async with self.pool.connection() as conn:
            async with conn.pipeline():  # sent together on leaving the block, and awaited
                await conn.execute("BEGIN")
                await conn.execute(_LOCK_QUEUE, (_QUEUE_LOCK_NAMESPACE, queue))
            tx = Transaction(conn)
            try:
                yield tx
                _refuse_aborted(conn)
                await conn.execute("COMMIT")
            except BaseException:
                # the original error matters; a connection too broken to roll back is
                # discarded by the pool, and its transaction dies with it
                with contextlib.suppress(Exception):
                    await conn.execute("ROLLBACK")
                raise
            finally:
                tx._tx_source.finished = True

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Transaction]:
        """A transaction over every store: committed when the block exits normally, rolled
        back when it raises. Runs at READ COMMITTED; the stores' compare-and-sets make
        concurrent writers of the same row conflict (VersionMismatch) instead of
        overwriting each other."""
        async with self.pool.connection() as conn, conn.transaction():
            tx = Transaction(conn)
            try:
                yield tx
                _refuse_aborted(conn)
            finally:
                tx._tx_source.finished = True


def _refuse_aborted(conn: AsyncConnection[Any]) -> None:
    """COMMIT of an aborted transaction silently rolls back: say so instead."""
    if conn.info.transaction_status is TransactionStatus.INERROR:
        raise RuntimeError("the transaction was aborted by a database error the block "
                           "swallowed; nothing was committed")
