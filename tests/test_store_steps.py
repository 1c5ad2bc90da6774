"""The pipeline's single-statement state changes (store/steps.py) on a real PostgreSQL:
each writes only when the conditions its caller decided on still hold, writes nothing
otherwise, and stays exact when concurrent callers race it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import psycopg
import pytest

from store import (
    Build,
    BuildStatus,
    BuildStrategy,
    Database,
    InvariantViolation,
    Request,
    RequestState,
    make_request_id,
)

pytestmark = pytest.mark.postgres

Q = "mono/main"


def with_db(dsn: str, body: Callable[[Database], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await Database.open(dsn, min_size=1, max_size=12) as db:
            await body(db)

    asyncio.run(main())


async def _ingest(db: Database, uri: str, queue: str = Q) -> str:
    async with db.queue_transaction(queue) as tx:
        return (await tx.steps.find_or_mint(queue, uri)).request_id


async def _processing(db: Database, request_id: str, queue: str = Q) -> Request:
    request, row = await db.steps.request_with_queue(queue, request_id)
    assert row is not None
    admitted = await db.steps.admit(request, strategy=BuildStrategy.FULL, base_uri=None,
                                    max_concurrent=100,
                                    last_green_request_id=row.last_green_request_id)
    assert admitted is not None
    return admitted


async def _green(db: Database, request_id: str, uri: str, queue: str = Q) -> None:
    request = await _processing(db, request_id, queue)
    build = await db.builds.create(queue, f"b-{request_id}", request.id)
    settled = await db.steps.settle(build, BuildStatus.SUCCEEDED)
    assert settled.request is not None
    recorded = await db.steps.record_fact(queue, uri, request_id=request_id, degree=0.0)
    assert recorded.holds_bookmark


# --- ingest: find or mint ---------------------------------------------------------------


def test_find_or_mint_mints_once_per_head_and_moves_latest_forward(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        async with db.queue_transaction(Q) as tx:
            first = await tx.steps.find_or_mint(Q, "u1")
        assert (first.request_id, first.state, first.minted) == (
            make_request_id(Q, 1), RequestState.ACCEPTED, True)
        async with db.queue_transaction(Q) as tx:
            again = await tx.steps.find_or_mint(Q, "u1")
        assert (again.request_id, again.minted) == (first.request_id, False)
        second = await _ingest(db, "u2")
        assert second == make_request_id(Q, 2)
        assert (await db.queues.get(Q)).latest_request_id == second
        # reporting the older head again changes nothing: latest never moves back
        assert await _ingest(db, "u1") == first.request_id
        assert (await db.queues.get(Q)).latest_request_id == second
        assert await db.counters.current(Q) == 2

    with_db(migrated_dsn, body)


def test_find_or_mint_revalidates_a_head_whose_request_was_superseded(
        migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        old = await _ingest(db, "u1")
        await _ingest(db, "u2")
        await db.requests.transition(await db.requests.get(Q, old), RequestState.SUPERSEDED)
        # the branch was reset back to u1: never built, so it is validated after all
        again = await _ingest(db, "u1")
        assert again == make_request_id(Q, 3)
        assert (await db.request_uris.get(Q, "u1")).request_id == again
        assert (await db.queues.get(Q)).latest_request_id == again
        assert (await db.requests.get(Q, again)).state is RequestState.ACCEPTED

    with_db(migrated_dsn, body)


def test_find_or_mint_mints_for_a_mapping_without_its_request(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        await db.request_uris.create(Q, "u1", make_request_id(Q, 7))  # Request never written
        minted = await _ingest(db, "u1")
        assert minted == make_request_id(Q, 1)
        assert (await db.request_uris.get(Q, "u1")).request_id == minted
        await db.requests.get(Q, minted)

    with_db(migrated_dsn, body)


def test_the_queue_lock_orders_concurrent_ingests_of_one_queue(migrated_dsn: str) -> None:
    """Twenty ingests of five heads at once: each head gets exactly one Request, ids are
    dense, and the queue's latest is the newest id."""
    async def body(db: Database) -> None:
        heads = [f"u{i % 5}" for i in range(20)]
        ids = await asyncio.gather(*(_ingest(db, head) for head in heads))
        by_head: dict[str, set[str]] = {}
        for head, rid in zip(heads, ids, strict=True):
            by_head.setdefault(head, set()).add(rid)
        assert all(len(v) == 1 for v in by_head.values()), by_head
        assert sorted(int(r.rsplit("/", 1)[1]) for r in set(ids)) == [1, 2, 3, 4, 5]
        assert (await db.queues.get(Q)).latest_request_id == make_request_id(Q, 5)

    with_db(migrated_dsn, body)


def test_a_failed_block_rolls_the_queue_transaction_back(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        with pytest.raises(RuntimeError, match="boom"):
            async with db.queue_transaction(Q) as tx:
                await tx.steps.find_or_mint(Q, "u1")
                raise RuntimeError("boom")
        assert await db.counters.current(Q) == 0
        # the lock went with the transaction: the next one gets it at once
        assert await asyncio.wait_for(_ingest(db, "u1"), 10) == make_request_id(Q, 1)

    with_db(migrated_dsn, body)


# --- process: admit ---------------------------------------------------------------------


def test_admit_takes_a_slot_and_moves_the_request_in_one_statement(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = await _ingest(db, "u1")
        request, queue = await db.steps.request_with_queue(Q, rid)
        assert queue is not None and queue.latest_request_id == rid
        admitted = await db.steps.admit(request, strategy=BuildStrategy.FULL, base_uri=None,
                                        max_concurrent=1, last_green_request_id=None)
        assert admitted is not None
        assert (admitted.state, admitted.build_strategy, admitted.version) == (
            RequestState.PROCESSING, BuildStrategy.FULL, request.version + 1)
        assert (await db.queues.get(Q)).in_flight_count == 1

    with_db(migrated_dsn, body)


@pytest.mark.parametrize("what", ["gate full", "newer latest", "bookmark moved",
                                  "request changed"])
def test_admit_writes_nothing_when_its_decision_no_longer_holds(migrated_dsn: str,
                                                                 what: str) -> None:
    async def body(db: Database) -> None:
        green = await _ingest(db, "g")
        await _green(db, green, "g")
        rid = await _ingest(db, "u1")
        request, queue = await db.steps.request_with_queue(Q, rid)
        assert queue is not None
        max_concurrent, last_green = 5, queue.last_green_request_id
        if what == "gate full":
            max_concurrent = queue.in_flight_count
        elif what == "newer latest":
            await _ingest(db, "u2")
        elif what == "bookmark moved":
            last_green = None
        else:
            await db.requests.transition(request, RequestState.FAILED)
        before = await db.queues.get(Q)
        admitted = await db.steps.admit(request, strategy=BuildStrategy.INCREMENTAL,
                                        base_uri="g", max_concurrent=max_concurrent,
                                        last_green_request_id=last_green)
        assert admitted is None
        after = await db.queues.get(Q)
        assert after.in_flight_count == before.in_flight_count
        assert after.version == before.version
        assert (await db.requests.get(Q, rid)).build_strategy is None

    with_db(migrated_dsn, body)


def test_concurrent_admissions_never_exceed_the_gate(migrated_dsn: str) -> None:
    """Twelve accepted Requests of one queue admitted at once with a gate of three:
    exactly three get in, and the slot count says three."""
    async def body(db: Database) -> None:
        await db.queues.get_or_create(Q)
        requests = [await db.requests.create(Q, make_request_id(Q, n), f"u{n}")
                    for n in range(1, 13)]
        results = await asyncio.gather(*(
            db.steps.admit(r, strategy=BuildStrategy.FULL, base_uri=None, max_concurrent=3,
                           last_green_request_id=None) for r in requests))
        admitted = [r for r in results if r is not None]
        assert len(admitted) == 3
        assert (await db.queues.get(Q)).in_flight_count == 3
        states = [(await db.requests.get(Q, r.id)).state for r in requests]
        assert states.count(RequestState.PROCESSING) == 3

    with_db(migrated_dsn, body)


# --- buildsignal: settle ----------------------------------------------------------------


async def _building(db: Database, builds: int = 1) -> tuple[Request, list[Build]]:
    rid = await _ingest(db, "u1")
    request = await _processing(db, rid)
    return request, [await db.builds.create(Q, f"b{i}", rid) for i in range(builds)]


def test_settle_stamps_the_outcome_and_releases_the_slot_once(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        request, (first, second) = await _building(db, builds=2)
        settled = await db.steps.settle(first, BuildStatus.FAILED)
        assert settled.build_status is BuildStatus.FAILED
        assert settled.request is not None and settled.request.state is RequestState.FAILED
        assert (await db.queues.get(Q)).in_flight_count == 0
        # a later build of the same Request finds it settled: nothing more is released
        late = await db.steps.settle(second, BuildStatus.SUCCEEDED)
        assert (late.build_status, late.request) == (BuildStatus.SUCCEEDED, None)
        assert (await db.queues.get(Q)).in_flight_count == 0
        assert (await db.requests.get(Q, request.id)).state is RequestState.FAILED

    with_db(migrated_dsn, body)


def test_settle_keeps_a_terminal_status_stored_first(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        _request, (build,) = await _building(db)
        await db.builds.set_status(build, BuildStatus.SUCCEEDED)  # stored by another poll
        settled = await db.steps.settle(build, BuildStatus.FAILED)  # a late, stale view
        assert settled.build_status is BuildStatus.SUCCEEDED
        assert settled.request is not None
        assert settled.request.state is RequestState.SUCCEEDED  # the stored status decides
        assert (await db.builds.get(Q, build.id)).status is BuildStatus.SUCCEEDED

    with_db(migrated_dsn, body)


def test_concurrent_settles_of_one_request_release_one_slot(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        _request, builds = await _building(db, builds=8)
        results = await asyncio.gather(*(db.steps.settle(b, BuildStatus.SUCCEEDED)
                                         for b in builds))
        assert sum(r.request is not None for r in results) == 1
        assert (await db.queues.get(Q)).in_flight_count == 0
        assert all(r.build_status is BuildStatus.SUCCEEDED for r in results)

    with_db(migrated_dsn, body)


def test_settle_refuses_a_status_that_is_not_terminal(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        _, (build,) = await _building(db)
        with pytest.raises(ValueError, match="terminal"):
            await db.steps.settle(build, BuildStatus.RUNNING)

    with_db(migrated_dsn, body)


# --- record: fact and bookmark ----------------------------------------------------------


async def _settled(db: Database, uri: str, status: BuildStatus) -> str:
    rid = await _ingest(db, uri)
    request = await _processing(db, rid)
    build = await db.builds.create(Q, f"b-{rid}", rid)
    assert (await db.steps.settle(build, status)).request is not None
    return request.id


def test_record_fact_moves_the_bookmark_forward_only(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        older = await _settled(db, "u1", BuildStatus.SUCCEEDED)
        newer = await _settled(db, "u2", BuildStatus.SUCCEEDED)
        recorded = await db.steps.record_fact(Q, "u2", request_id=newer, degree=0.0)
        assert recorded.fact is not None and recorded.fact.request_id == newer
        assert recorded.holds_bookmark
        # the older green commit records its fact, but the bookmark stays on the newer
        late = await db.steps.record_fact(Q, "u1", request_id=older, degree=0.0)
        assert late.fact is not None and late.fact.is_green and not late.holds_bookmark
        queue = await db.queues.get(Q)
        assert (queue.last_green_uri, queue.last_green_request_id) == ("u2", newer)
        # a redelivery of the holder's record: still the holder, nothing changes
        again = await db.steps.record_fact(Q, "u2", request_id=newer, degree=0.0)
        assert again.holds_bookmark and again.fact == recorded.fact
        assert (await db.queues.get(Q)).version == queue.version

    with_db(migrated_dsn, body)


def test_record_fact_of_a_red_build_leaves_the_bookmark(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = await _settled(db, "u1", BuildStatus.FAILED)
        recorded = await db.steps.record_fact(Q, "u1", request_id=rid, degree=1.0)
        assert recorded.fact is not None and not recorded.fact.is_green
        assert not recorded.holds_bookmark
        assert (await db.queues.get(Q)).last_green_request_id is None

    with_db(migrated_dsn, body)


def test_record_fact_keeps_every_requests_fact_and_one_green_per_commit(
        migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        first = await _settled(db, "u1", BuildStatus.FAILED)
        await db.steps.record_fact(Q, "u1", request_id=first, degree=1.0)
        again = await db.requests.create(Q, make_request_id(Q, 1, validation=2), "u1")
        recorded = await db.steps.record_fact(Q, "u1", request_id=again.id, degree=0.0)
        # the second validation has a fact of its own; the red one stays readable
        assert recorded.fact is not None and recorded.fact.request_id == again.id
        assert recorded.fact.is_green and recorded.holds_bookmark
        assert (await db.facts.of_request(Q, first)).degree == 1.0  # type: ignore[union-attr]
        assert (await db.facts.get(Q, "u1")).request_id == again.id  # the newest answers
        # a commit has one green fact: another Request's green is refused with it
        third = await db.requests.create(Q, make_request_id(Q, 1, validation=3), "u1")
        refused = await db.steps.record_fact(Q, "u1", request_id=third.id, degree=0.0)
        assert refused.fact is not None and refused.fact.request_id == again.id
        assert (await db.queues.get(Q)).last_green_request_id == again.id

    with_db(migrated_dsn, body)


def test_concurrent_records_leave_the_newest_green_holding_the_bookmark(
        migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        ids = [await _settled(db, f"u{n}", BuildStatus.SUCCEEDED) for n in range(1, 9)]
        results = await asyncio.gather(*(
            db.steps.record_fact(Q, f"u{n}", request_id=rid, degree=0.0)
            for n, rid in reversed(list(enumerate(ids, start=1))) for _ in range(2)))
        assert (await db.queues.get(Q)).last_green_request_id == ids[-1]
        assert all(r.fact is None or r.fact.is_green for r in results)

    with_db(migrated_dsn, body)


def test_the_database_refuses_a_bookmark_moved_back(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        older = await _settled(db, "u1", BuildStatus.SUCCEEDED)
        newer = await _settled(db, "u2", BuildStatus.SUCCEEDED)
        await db.steps.record_fact(Q, "u1", request_id=older, degree=0.0)
        await db.steps.record_fact(Q, "u2", request_id=newer, degree=0.0)
        async with db.pool.connection() as conn:
            with pytest.raises(psycopg.errors.IntegrityConstraintViolation,
                               match="only moves forward"):
                await conn.execute("UPDATE queue SET last_green_uri = 'u1',"
                                   " last_green_request_id = %s WHERE name = %s", (older, Q))
        with pytest.raises(InvariantViolation):
            await db.queues.advance_bookmark(await db.queues.get(Q), uri="u1",
                                             request_id=older)

    with_db(migrated_dsn, body)
