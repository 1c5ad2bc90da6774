"""Races on a real PostgreSQL: compare-and-set has exactly one winner, the counter is
unique and increasing under load, and a transaction applies all of its writes or none."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from store import (
    BuildStrategy,
    Database,
    InvariantViolation,
    NotFound,
    Queue,
    RequestState,
    VersionMismatch,
    make_request_id,
)

pytestmark = pytest.mark.postgres

Q = "monorepo/main"
URI = "git://example/monorepo/ref/main/aaaa"


def with_db(dsn: str, body: Callable[[Database], Awaitable[None]], *, max_size: int = 4) -> None:
    async def main() -> None:
        async with await Database.open(dsn, min_size=1, max_size=max_size) as db:
            await body(db)

    asyncio.run(main())


async def _outcomes(calls: list[Awaitable[Any]]) -> tuple[list[Any], list[BaseException]]:
    results = await asyncio.gather(*calls, return_exceptions=True)
    won = [r for r in results if not isinstance(r, BaseException)]
    lost = [r for r in results if isinstance(r, BaseException)]
    return won, lost


def test_concurrent_compare_and_sets_on_one_row_have_exactly_one_winner(
    migrated_dsn: str,
) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        # Ten writers, each on its own pooled connection, all from the same read.
        won, lost = await _outcomes([db.queues.take_slot(q) for _ in range(10)])
        assert len(won) == 1
        assert all(isinstance(e, VersionMismatch) for e in lost), lost
        stored = await db.queues.get(Q)
        assert (stored.in_flight_count, stored.version) == (1, 2)

        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        won, lost = await _outcomes(
            [
                db.requests.transition(r, RequestState.SUPERSEDED),
                db.requests.transition(r, RequestState.PROCESSING, strategy=BuildStrategy.FULL),
                db.requests.transition(r, RequestState.FAILED),
            ]
        )
        assert len(won) == 1 and len(lost) == 2
        assert all(isinstance(e, VersionMismatch) for e in lost), lost
        assert await db.requests.get(Q, r.id) == won[0]

    with_db(migrated_dsn, body, max_size=10)


def _blocked_on_a_lock(dsn: str, application_name: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND wait_event_type = 'Lock'",
            (application_name,),
        ).fetchone()
    return row is not None and row[0] > 0


def test_a_compare_and_set_waiting_on_the_winners_lock_loses_after_it_commits(
    migrated_dsn: str,
) -> None:
    """The interleaving that matters: B's UPDATE blocks on A's uncommitted row, and once A
    commits, B re-checks the version against the new row and matches nothing."""

    async def main() -> None:
        async with (
            await Database.open(migrated_dsn, name="a") as db_a,
            await Database.open(
                make_conninfo(migrated_dsn, application_name="cas_loser"), name="b"
            ) as db_b,
        ):
            q = await db_a.queues.get_or_create(Q)
            a_wrote = asyncio.Event()
            b_waiting = asyncio.Event()

            async def writer_a() -> Queue:
                async with db_a.transaction() as tx:
                    taken = await tx.queues.take_slot(q)
                    a_wrote.set()
                    await b_waiting.wait()
                return taken

            async def writer_b() -> Queue:
                await a_wrote.wait()
                return await db_b.queues.take_slot(q)

            async def watch_b() -> None:
                await a_wrote.wait()
                deadline = time.monotonic() + 10
                while not await asyncio.to_thread(_blocked_on_a_lock, migrated_dsn, "cas_loser"):
                    assert time.monotonic() < deadline, "B never blocked on A's row lock"
                    await asyncio.sleep(0.02)
                b_waiting.set()

            a, b, _ = await asyncio.gather(
                writer_a(), writer_b(), watch_b(), return_exceptions=True
            )
            assert isinstance(a, Queue) and a.in_flight_count == 1, a
            assert isinstance(b, VersionMismatch), b
            assert (b.expected_version, b.actual_version) == (1, 2)
            assert (await db_a.queues.get(Q)).in_flight_count == 1

    asyncio.run(main())


def test_a_thousand_concurrent_counter_draws_are_unique_and_increasing(
    migrated_dsn: str,
) -> None:
    queues = [f"team{i}/main" for i in range(10)]
    drawers, draws_each = 50, 20  # drawer d's i-th draw is from queue (d + i) % 10

    async def body(db: Database) -> None:
        async def drawer(d: int) -> list[tuple[str, int]]:
            drawn = []
            for i in range(draws_each):
                queue = queues[(d + i) % len(queues)]
                drawn.append((queue, await db.counters.next(queue)))
            return drawn

        per_drawer = await asyncio.gather(*(drawer(d) for d in range(drawers)))
        by_queue: dict[str, list[int]] = defaultdict(list)
        for drawn in per_drawer:
            mine: dict[str, list[int]] = defaultdict(list)
            for queue, value in drawn:
                by_queue[queue].append(value)
                mine[queue].append(value)
            for values in mine.values():
                assert values == sorted(values) and len(set(values)) == len(values)
        assert sum(len(v) for v in by_queue.values()) == 1000
        for queue in queues:
            assert sorted(by_queue[queue]) == list(range(1, 101)), queue
            assert await db.counters.current(queue) == 100

    with_db(migrated_dsn, body, max_size=20)


def test_transaction_commits_both_writes(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        async with db.transaction() as tx:
            q2 = await tx.queues.take_slot(q)
            r2 = await tx.requests.transition(
                r, RequestState.PROCESSING, strategy=BuildStrategy.FULL
            )
            # Read-your-writes inside the transaction.
            assert await tx.queues.get(Q) == q2
        assert await db.queues.get(Q) == q2
        assert await db.requests.get(Q, r.id) == r2
        assert (q2.in_flight_count, r2.state) == (1, RequestState.PROCESSING)

    with_db(migrated_dsn, body)


def test_transaction_rolls_back_the_first_cas_when_the_second_loses(
    migrated_dsn: str,
) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        # Someone else moves the request first: our read of it is stale.
        await db.requests.transition(r, RequestState.SUPERSEDED)

        with pytest.raises(VersionMismatch):
            async with db.transaction() as tx:
                await tx.queues.take_slot(q)  # applied inside the transaction ...
                await tx.requests.transition(
                    r, RequestState.PROCESSING, strategy=BuildStrategy.FULL
                )
        assert await db.queues.get(Q) == q  # ... and rolled back with it
        assert (await db.requests.get(Q, r.id)).state is RequestState.SUPERSEDED

    with_db(migrated_dsn, body)


def test_transaction_rolls_back_when_the_first_cas_loses(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        await db.queues.take_slot(q)  # q is now stale

        with pytest.raises(VersionMismatch):
            async with db.transaction() as tx:
                await tx.requests.transition(
                    r, RequestState.PROCESSING, strategy=BuildStrategy.FULL
                )
                await tx.queues.take_slot(q)
        assert await db.requests.get(Q, r.id) == r

    with_db(migrated_dsn, body)


def test_transaction_rolls_back_on_a_database_refusal(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        with pytest.raises(InvariantViolation):
            async with db.transaction() as tx:
                await tx.queues.take_slot(q)
                # No green fact for this bookmark: the trigger aborts the transaction.
                await tx.queues.advance_bookmark(await tx.queues.get(Q), uri=URI, request_id=r.id)
        assert await db.queues.get(Q) == q

    with_db(migrated_dsn, body)


def test_transaction_survives_answers_and_refuses_to_commit_after_swallowed_errors(
    migrated_dsn: str,
) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        async with db.transaction() as tx:
            with pytest.raises(NotFound):
                await tx.requests.get(Q, make_request_id(Q, 1))
            await tx.queues.take_slot(q)
        assert (await db.queues.get(Q)).in_flight_count == 1

        with pytest.raises(RuntimeError, match="nothing was committed"):
            async with db.transaction() as tx:
                await tx.queues.take_slot(await tx.queues.get(Q))
                with pytest.raises(psycopg.errors.DivisionByZero):
                    await tx.connection.execute("SELECT 1 / 0")
        assert (await db.queues.get(Q)).in_flight_count == 1

        async with db.transaction() as tx:
            pass
        with pytest.raises(RuntimeError, match="transaction has ended"):
            await tx.queues.get(Q)

    with_db(migrated_dsn, body)


def test_slot_release_and_failure_commit_together(migrated_dsn: str) -> None:
    """The reconciler's write (design §6): release the slot and fail the request at once."""

    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        async with db.transaction() as tx:
            q = await tx.queues.take_slot(q)
            r = await tx.requests.transition(
                r, RequestState.PROCESSING, strategy=BuildStrategy.FULL
            )
        async with db.transaction() as tx:
            await tx.queues.release_slot(q)
            await tx.requests.transition(r, RequestState.FAILED)
        assert (await db.queues.get(Q)).in_flight_count == 0
        assert (await db.requests.get(Q, r.id)).state is RequestState.FAILED

    with_db(migrated_dsn, body)
