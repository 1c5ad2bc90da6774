"""Issue 23, item 6 on a real PostgreSQL: the statements that mint a Request for a commit
(FIND_OR_MINT, VALIDATE_AGAIN, MINT_BACKFILL) are race-free.

Each race is held open, not slept through: one side's transaction stays open (or is held
inside its statement by a trigger waiting on an advisory lock the test holds — a latch)
until the other side is seen waiting on a lock in `pg_stat_activity`; then it is let go.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from store import BuildStrategy, Database, RequestState, Stores
from store.steps import Again, Minted

pytestmark = pytest.mark.postgres

Q = "mono/main"
URI = "git://example/mono/ref/main/c1"
LATCH = (0x4C41, 0x5443)
T = TypeVar("T")  # the test's advisory lock a trigger waits on ("LA", "TC")


def _waiting(dsn: str, application_name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                           " AND wait_event_type = 'Lock'", (application_name,)).fetchone()
    return row is not None and row[0] > 0


async def _until_waiting(dsn: str, application_name: str) -> None:
    deadline = time.monotonic() + 20
    while not await asyncio.to_thread(_waiting, dsn, application_name):
        assert time.monotonic() < deadline, f"{application_name} never waited on a lock"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def _databases(dsn: str, *names: str) -> AsyncIterator[list[Database]]:
    opened = [await Database.open(make_conninfo(dsn, application_name=name), name=name)
              for name in names]
    try:
        yield opened
    finally:
        for db in opened:
            await db.close()


async def _commit_failed(db: Database, uri: str, *, red: bool) -> str:
    """A head ingested, built and failed: red, or without a verdict (a transient cause)."""
    async with db.queue_transaction(Q) as tx:
        minted = await tx.steps.find_or_mint(Q, uri)
    assert minted is not None
    request = await db.requests.get(Q, minted.request_id)
    request = await db.requests.transition(request, RequestState.PROCESSING,
                                           strategy=BuildStrategy.FULL)
    if red:
        await db.requests.transition(request, RequestState.FAILED)
    else:
        await db.requests.fail_unvalidated(request, "its host was lost")
    return request.id


async def _live(db: Database, uri: str) -> list[str]:
    """The commit's Requests not yet terminal, and check the mapping names the newest."""
    async with db.pool.connection() as conn:
        cur = await conn.execute("SELECT id FROM request WHERE queue = %s AND uri = %s"
                                 " AND state IN ('accepted', 'processing') ORDER BY id",
                                 (Q, uri))
        live = [row[0] for row in await cur.fetchall()]
    mapping = await db.request_uris.get(Q, uri)
    assert [mapping.request_id] == live or not live, (mapping, live)
    return live


async def _second_while_first_is_open(dsn: str, db_a: Database, db_b: Database,
                                      name_b: str,
                                      call: Callable[[Stores], Awaitable[T]]) -> tuple[T, T]:
    """``call`` on A's transaction, held open until ``call`` on B (application name
    ``name_b``) is seen waiting on a lock; then A commits and B goes on. Both results."""
    a_wrote, b_waits = asyncio.Event(), asyncio.Event()

    async def first() -> T:
        async with db_a.transaction() as tx:
            result = await call(tx)
            a_wrote.set()
            await b_waits.wait()
        return result

    async def second() -> T:
        await a_wrote.wait()
        return await call(db_b)

    async def watch() -> None:
        await a_wrote.wait()
        await _until_waiting(dsn, name_b)
        b_waits.set()

    a, b, _ = await asyncio.gather(first(), second(), watch())
    return a, b


def test_two_retries_of_one_commit_at_once_mint_one_and_tell_the_second_so(
        migrated_dsn: str) -> None:
    """The first retry's transaction stays open until the second waits on it; then the
    second is told the commit is being validated by the first's Request — not "never
    ingested" (before: the re-check saw the moved mapping against the old Request row)."""

    async def main() -> None:
        async with _databases(migrated_dsn, "retry_a", "retry_b") as (db_a, db_b):
            first = await _commit_failed(db_a, URI, red=True)
            a, b = await _second_while_first_is_open(
                migrated_dsn, db_a, db_b, "retry_b",
                lambda stores: stores.steps.validate_again(Q, URI))
            assert a == Again(first, RequestState.FAILED, f"{first}.2")
            assert b == Again(f"{first}.2", RequestState.ACCEPTED, None)
            assert await _live(db_a, URI) == [f"{first}.2"]

    asyncio.run(main())


def test_two_probes_of_one_commit_at_once_leave_one_live_request(migrated_dsn: str) -> None:
    """A culprit search's probe of a commit that could not be validated, minted twice at
    once (a redelivered advance beside the sweeper's): one live Request (before: the
    second minted a fresh id beside the first's `.2`)."""

    async def main() -> None:
        async with _databases(migrated_dsn, "probe_a", "probe_b") as (db_a, db_b):
            first = await _commit_failed(db_a, URI, red=False)
            a, b = await _second_while_first_is_open(
                migrated_dsn, db_a, db_b, "probe_b",
                lambda stores: stores.steps.mint_backfill(Q, URI, f"{first}~1"))
            assert a.minted_id == f"{first}.2"
            assert b.minted_id is None and b.newest_id == f"{first}.2"
            assert b.newest_state is RequestState.ACCEPTED
            assert await _live(db_a, URI) == [f"{first}.2"]

    asyncio.run(main())


def test_an_ingest_whose_id_was_taken_gives_its_lease_back(migrated_dsn: str) -> None:
    """The id an ingest draws is taken already (a counter set back by a restore): it
    mints nothing, says so, and the queue's ingest lease is free at once (before: held
    until it ran out, 30 s without an ingest of the queue)."""

    async def main() -> None:
        async with _databases(migrated_dsn, "ingest") as (db,):
            async with db.queue_transaction(Q) as tx:
                await tx.steps.find_or_mint(Q, "git://example/mono/ref/main/c0")
            # the next draw is 2: a Request numbered 2 exists already, of no mapped commit
            await db.requests.create(Q, f"request/{Q}/2", "git://example/mono/ref/main/x")
            assert await db.ingest_leases.try_acquire(Q, "holder-1", 30.0) is not None
            found = await db.steps.find_or_mint(Q, URI, lease_holder="holder-1")
            assert found is None
            # free for the next ingest now, which mints 3
            assert await db.ingest_leases.try_acquire(Q, "holder-2", 30.0) is not None
            found = await db.steps.find_or_mint(Q, URI, lease_holder="holder-2")
            assert isinstance(found, Minted) and found.request_id == f"request/{Q}/3"

    asyncio.run(main())


def _latch_sql(action: str) -> str:
    return f"SELECT {action}({LATCH[0]}, {LATCH[1]})"


def test_a_retry_and_an_ingest_of_one_commit_never_deadlock(migrated_dsn: str) -> None:
    """A retry of a commit that could not be validated holds the commit while it inserts
    its Request — held there by a trigger waiting on the test's latch — and an ingest of
    the same head starts meanwhile. Both end, one Request is minted and the other is
    told of it (before: the two statements took their locks in opposite orders, and
    PostgreSQL broke the deadlock by failing one)."""

    async def main() -> None:
        async with _databases(migrated_dsn, "retry", "ingest") as (db_retry, db_ingest):
            first = await _commit_failed(db_retry, URI, red=False)
            async with db_retry.pool.connection() as conn:
                await conn.execute(f"""
                    CREATE FUNCTION hold_retry_insert() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN
                        PERFORM pg_advisory_lock({LATCH[0]}, {LATCH[1]});
                        PERFORM pg_advisory_unlock({LATCH[0]}, {LATCH[1]});
                        RETURN NEW;
                    END $$;
                    CREATE TRIGGER hold_retry_insert BEFORE INSERT ON request
                        FOR EACH ROW WHEN (NEW.kind = 'retry')
                        EXECUTE FUNCTION hold_retry_insert();""")
            latch = await psycopg.AsyncConnection.connect(migrated_dsn, autocommit=True)
            try:
                await latch.execute(_latch_sql("pg_advisory_lock"))

                async def retry() -> Again:
                    return await db_retry.steps.validate_again(Q, URI)

                async def ingest() -> Minted | None:
                    await _until_waiting(migrated_dsn, "retry")  # held at its insert
                    async with db_ingest.queue_transaction(Q) as tx:
                        return await tx.steps.find_or_mint(Q, URI)

                async def release() -> None:
                    await _until_waiting(migrated_dsn, "retry")
                    await _until_waiting(migrated_dsn, "ingest")
                    await latch.execute(_latch_sql("pg_advisory_unlock"))

                results: list[Any] = list(await asyncio.gather(
                    retry(), ingest(), release(), return_exceptions=True))
            finally:
                await latch.close()
            again, minted = results[0], results[1]
            assert isinstance(again, Again), again
            assert isinstance(minted, Minted), minted
            assert again.minted_id == f"{first}.2"
            assert (minted.request_id, minted.minted) == (f"{first}.2", False)
            assert await _live(db_retry, URI) == [f"{first}.2"]

    asyncio.run(main())

