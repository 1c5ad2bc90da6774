"""`is_retryable`, the one classifier of database errors, on errors provoked from a real
PostgreSQL wherever possible."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import psycopg_pool
import pytest
from psycopg.conninfo import make_conninfo

from store import (
    AlreadyExists,
    AmbiguousKey,
    Database,
    InvariantViolation,
    MigrationError,
    NotFound,
    StoreError,
    VersionMismatch,
    is_retryable,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def table_dsn(schema_dsn: str) -> Iterator[str]:
    """A schema holding `t(id int primary key, v int check (v >= 0))` with rows 1 and 2."""
    with psycopg.connect(schema_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL CHECK (v >= 0))")
        conn.execute("CREATE TABLE child (id int REFERENCES t (id))")
        conn.execute("INSERT INTO t VALUES (1, 0), (2, 0)")
    yield schema_dsn


def _raised(dsn: str, statement: str) -> psycopg.Error:
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute(statement)
        except psycopg.Error as exc:
            return exc
    raise AssertionError(f"{statement!r} did not fail")


# --- retryable -------------------------------------------------------------------------


def test_serialization_failure_is_retryable(table_dsn: str) -> None:
    with (
        psycopg.connect(table_dsn) as a,
        psycopg.connect(table_dsn, autocommit=True) as b,
    ):
        a.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        a.execute("SELECT v FROM t WHERE id = 1")  # takes the snapshot
        b.execute("UPDATE t SET v = v + 1 WHERE id = 1")
        with pytest.raises(psycopg.errors.SerializationFailure) as err:
            a.execute("UPDATE t SET v = v + 1 WHERE id = 1")
    assert is_retryable(err.value)


def test_deadlock_is_retryable(table_dsn: str) -> None:
    async def main() -> list[BaseException | None]:
        a = await psycopg.AsyncConnection.connect(table_dsn)
        b = await psycopg.AsyncConnection.connect(table_dsn)
        async with a, b:
            await a.execute("UPDATE t SET v = 1 WHERE id = 1")
            await b.execute("UPDATE t SET v = 1 WHERE id = 2")

            async def cross(conn: psycopg.AsyncConnection[object], row: int) -> None:
                await conn.execute("UPDATE t SET v = 2 WHERE id = %s", (row,))

            results = await asyncio.gather(cross(a, 2), cross(b, 1), return_exceptions=True)
            await a.rollback()
            await b.rollback()
        return [r if isinstance(r, BaseException) else None for r in results]

    errors = [e for e in asyncio.run(main()) if e is not None]
    assert len(errors) == 1  # the server breaks the cycle by failing one side
    assert isinstance(errors[0], psycopg.errors.DeadlockDetected)
    assert is_retryable(errors[0])


def test_statement_timeout_is_retryable(schema_dsn: str) -> None:
    dsn = make_conninfo(schema_dsn, options="-c statement_timeout=50")
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.QueryCanceled) as err:
        conn.execute("SELECT pg_sleep(5)")
    assert is_retryable(err.value)


def test_lock_not_available_is_retryable(table_dsn: str) -> None:
    with psycopg.connect(table_dsn) as a, psycopg.connect(table_dsn) as b:
        a.execute("SELECT * FROM t WHERE id = 1 FOR UPDATE")
        with pytest.raises(psycopg.errors.LockNotAvailable) as err:
            b.execute("SELECT * FROM t WHERE id = 1 FOR UPDATE NOWAIT")
    assert is_retryable(err.value)


def test_lost_connection_is_retryable(schema_dsn: str) -> None:
    with psycopg.connect(schema_dsn, autocommit=True) as victim:
        with psycopg.connect(schema_dsn, autocommit=True) as killer:
            killer.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError) as err:
            victim.execute("SELECT 1")
        assert is_retryable(err.value)
        # Once broken, every further use says "the connection is closed": also retryable.
        with pytest.raises(psycopg.OperationalError) as closed:
            victim.execute("SELECT 1")
        assert is_retryable(closed.value)


def test_refused_connection_is_retryable() -> None:
    with pytest.raises(psycopg.OperationalError) as err:
        psycopg.connect("postgresql://nobody@127.0.0.1:1/nothing", connect_timeout=2)
    assert err.value.sqlstate is None
    assert is_retryable(err.value)


def test_pool_exhaustion_and_closed_pool_are_retryable(migrated_dsn: str) -> None:
    async def main() -> tuple[BaseException, BaseException]:
        db = await Database.open(migrated_dsn, min_size=1, max_size=1, acquire_timeout=0.2)
        async with db, db.transaction():  # the transaction holds the only connection
            with pytest.raises(psycopg_pool.PoolTimeout) as timeout:
                await db.queues.get_or_create("monorepo/main")
        with pytest.raises(psycopg_pool.PoolClosed) as closed:
            await db.queues.get_or_create("monorepo/main")
        return timeout.value, closed.value

    timeout, closed = asyncio.run(main())
    assert is_retryable(timeout)
    assert is_retryable(closed)


def test_version_mismatch_is_retryable() -> None:
    exc = VersionMismatch("queue", {"name": "q"}, expected_version=1, actual_version=2)
    assert exc.retryable and is_retryable(exc)
    assert "expected version 1, found 2" in str(exc)


# --- not retryable: answers and bugs ---------------------------------------------------


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("INSERT INTO t VALUES (1, 0)", psycopg.errors.UniqueViolation),
        ("UPDATE t SET v = -1", psycopg.errors.CheckViolation),
        ("INSERT INTO child VALUES (99)", psycopg.errors.ForeignKeyViolation),
        ("INSERT INTO t VALUES (3, NULL)", psycopg.errors.NotNullViolation),
        ("SELEC 1", psycopg.errors.SyntaxError),
        ("SELECT * FROM missing", psycopg.errors.UndefinedTable),
        ("SELECT 1 / 0", psycopg.errors.DivisionByZero),
        ("SELECT 'x'::int", psycopg.errors.InvalidTextRepresentation),
    ],
)
def test_constraint_violations_and_bad_sql_are_not_retryable(
    table_dsn: str, statement: str, error: type[psycopg.Error]
) -> None:
    exc = _raised(table_dsn, statement)
    assert isinstance(exc, error)
    assert not is_retryable(exc)


def test_store_answers_are_not_retryable() -> None:
    answers: list[StoreError] = [
        NotFound("request", {"queue": "q", "id": "request/q/1"}),
        AlreadyExists("build", {"queue": "q", "id": "b"}),
        InvariantViolation("request", {"id": "r"}, "illegal transition"),
        AmbiguousKey("build", {"id": "b"}, 2),
        MigrationError("edited"),
    ]
    for exc in answers:
        assert exc.retryable is False
        assert not is_retryable(exc)
    assert str(answers[0]) == "request not found: queue='q', id='request/q/1'"


def test_database_refusals_become_non_retryable_invariant_violations(
    migrated_dsn: str,
) -> None:
    async def main() -> InvariantViolation:
        async with await Database.open(migrated_dsn) as db:
            q = await db.queues.get_or_create("monorepo/main")
            with pytest.raises(InvariantViolation) as err:
                await db.queues.advance_bookmark(q, uri="u", request_id="request/monorepo/main/1")
            return err.value

    exc = asyncio.run(main())
    assert exc.constraint == "queue_bookmark_names_green_fact"
    assert isinstance(exc.__cause__, psycopg.IntegrityError)
    assert not is_retryable(exc)


def test_deadlines_and_socket_errors_are_retryable() -> None:
    assert is_retryable(TimeoutError())
    assert is_retryable(ConnectionResetError())


def test_unrelated_errors_are_not_retryable() -> None:
    for exc in (ValueError("bad"), RuntimeError("bug"), KeyError("k"), OSError("disk")):
        assert not is_retryable(exc)
    assert not is_retryable(psycopg.InterfaceError("misuse"))
    assert not is_retryable(psycopg.ProgrammingError("misuse"))
