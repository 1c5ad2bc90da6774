"""Each store's contract on a real PostgreSQL: create, get, not found, already exists,
compare-and-set success and stale version, and the invariants the schema enforces."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

import psycopg
import pytest

from store import (
    AlreadyExists,
    AmbiguousKey,
    BuildStatus,
    BuildStrategy,
    Database,
    InvariantViolation,
    NotFound,
    RequestState,
    VersionMismatch,
    make_request_id,
)

pytestmark = pytest.mark.postgres

Q = "monorepo/main"
URI = "git://example/monorepo/ref/main/aaaa"
URI2 = "git://example/monorepo/ref/main/bbbb"


def with_db(dsn: str, body: Callable[[Database], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await Database.open(dsn, min_size=1, max_size=4) as db:
            await body(db)

    asyncio.run(main())


# --- queue -----------------------------------------------------------------------------


def test_queue_create_get_and_not_found(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        with pytest.raises(NotFound) as missing:
            await db.queues.get(Q)
        assert missing.value.entity == "queue"
        assert missing.value.key == {"name": Q}
        created = await db.queues.create(Q)
        assert (created.name, created.in_flight_count, created.version) == (Q, 0, 1)
        assert created.last_green_uri is None and created.latest_request_id is None
        assert await db.queues.get(Q) == created
        with pytest.raises(AlreadyExists):
            await db.queues.create(Q)

    with_db(migrated_dsn, body)


def test_queue_get_or_create_is_idempotent_under_a_race(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        results = await asyncio.gather(*(db.queues.get_or_create(Q) for _ in range(8)))
        assert {q.version for q in results} == {1}
        assert len({q.created_at for q in results}) == 1

    with_db(migrated_dsn, body)


def test_queue_latest_request_moves_forward_by_compare_and_set(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q1 = await db.queues.get_or_create(Q)
        q2 = await db.queues.set_latest_request(q1, make_request_id(Q, 9))
        assert (q2.latest_request_id, q2.version) == (make_request_id(Q, 9), 2)
        # 10 is newer than 9 by ingest order even though "10" < "9" as text.
        q3 = await db.queues.set_latest_request(q2, make_request_id(Q, 10))
        assert q3.latest_request_id == make_request_id(Q, 10)
        with pytest.raises(InvariantViolation):
            await db.queues.set_latest_request(q3, make_request_id(Q, 10))
        with pytest.raises(VersionMismatch) as stale:
            await db.queues.set_latest_request(q1, make_request_id(Q, 11))
        assert (stale.value.expected_version, stale.value.actual_version) == (1, 3)
        assert await db.queues.get(Q) == q3

    with_db(migrated_dsn, body)


def test_queue_slots_take_and_release(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        with pytest.raises(InvariantViolation):
            await db.queues.release_slot(q)
        taken = await db.queues.take_slot(q)
        assert (taken.in_flight_count, taken.version) == (1, 2)
        with pytest.raises(VersionMismatch):
            await db.queues.take_slot(q)
        released = await db.queues.release_slot(taken)
        assert (released.in_flight_count, released.version) == (0, 3)
        with pytest.raises(VersionMismatch):
            await db.queues.release_slot(taken)

    with_db(migrated_dsn, body)


def test_queue_cas_on_a_missing_row_is_not_found(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        with pytest.raises(NotFound):
            await db.queues.take_slot(dataclasses.replace(q, name="ghost"))

    with_db(migrated_dsn, body)


def test_in_flight_count_cannot_go_negative_in_the_database(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        await db.queues.get_or_create(Q)

    with_db(migrated_dsn, body)
    with psycopg.connect(migrated_dsn) as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE queue SET in_flight_count = -1 WHERE name = %s", (Q,))


async def _green_request(db: Database, n: int, uri: str) -> str:
    request_id = make_request_id(Q, n)
    r = await db.requests.create(Q, request_id, uri)
    r = await db.requests.transition(r, RequestState.PROCESSING, strategy=BuildStrategy.FULL)
    await db.requests.transition(r, RequestState.SUCCEEDED)
    await db.facts.create(Q, uri, degree=0.0, request_id=request_id)
    return request_id


def test_bookmark_advances_only_forward_and_only_to_a_green_fact(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        q = await db.queues.get_or_create(Q)
        # No fact at all: refused by the database.
        with pytest.raises(InvariantViolation) as no_fact:
            await db.queues.advance_bookmark(q, uri=URI, request_id=make_request_id(Q, 1))
        assert no_fact.value.constraint == "queue_bookmark_names_green_fact"

        green1 = await _green_request(db, 1, URI)
        q = await db.queues.advance_bookmark(q, uri=URI, request_id=green1)
        assert (q.last_green_uri, q.last_green_request_id, q.version) == (URI, green1, 2)

        # A red fact cannot be bookmarked.
        red = make_request_id(Q, 2)
        r = await db.requests.create(Q, red, URI2)
        r = await db.requests.transition(r, RequestState.PROCESSING, strategy=BuildStrategy.FULL)
        await db.requests.transition(r, RequestState.FAILED)
        await db.facts.create(Q, URI2, degree=1.0, request_id=red)
        with pytest.raises(InvariantViolation):
            await db.queues.advance_bookmark(q, uri=URI2, request_id=red)

        # Backwards (or in place) is refused before writing.
        with pytest.raises(InvariantViolation):
            await db.queues.advance_bookmark(q, uri=URI, request_id=green1)
        assert (await db.queues.get(Q)).version == 2

        green3 = await _green_request(db, 3, "git://example/monorepo/ref/main/cccc")
        stale = await db.queues.take_slot(q)
        with pytest.raises(VersionMismatch):
            await db.queues.advance_bookmark(
                q, uri="git://example/monorepo/ref/main/cccc", request_id=green3
            )
        moved = await db.queues.advance_bookmark(
            stale, uri="git://example/monorepo/ref/main/cccc", request_id=green3
        )
        assert moved.last_green_request_id == green3

    with_db(migrated_dsn, body)


# --- request ---------------------------------------------------------------------------


def test_request_create_get_and_not_found(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = make_request_id(Q, 1)
        with pytest.raises(NotFound) as missing:
            await db.requests.get(Q, rid)
        assert missing.value.key == {"queue": Q, "id": rid}
        r = await db.requests.create(Q, rid, URI)
        assert (r.queue, r.id, r.uri, r.state, r.version) == (
            Q,
            rid,
            URI,
            RequestState.ACCEPTED,
            1,
        )
        assert r.build_strategy is None and r.base_uri is None and r.seq == 1
        assert await db.requests.get(Q, rid) == r
        assert await db.requests.get_by_id(rid) == r
        with pytest.raises(AlreadyExists):
            await db.requests.create(Q, rid, URI2)
        with pytest.raises(NotFound):
            await db.requests.get("other/main", rid)

    with_db(migrated_dsn, body)


def test_request_transitions_by_compare_and_set(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        r1 = await db.requests.create(Q, make_request_id(Q, 1), URI)
        r2 = await db.requests.transition(
            r1, RequestState.PROCESSING, strategy=BuildStrategy.INCREMENTAL, base_uri=URI2
        )
        assert (r2.state, r2.build_strategy, r2.base_uri, r2.version) == (
            RequestState.PROCESSING,
            BuildStrategy.INCREMENTAL,
            URI2,
            2,
        )
        assert r2.updated_at >= r1.updated_at
        with pytest.raises(VersionMismatch):
            await db.requests.transition(r1, RequestState.SUPERSEDED)
        r3 = await db.requests.transition(r2, RequestState.SUCCEEDED)
        assert (r3.state, r3.build_strategy, r3.base_uri, r3.version) == (
            RequestState.SUCCEEDED,
            BuildStrategy.INCREMENTAL,
            URI2,
            3,
        )
        # Terminal is final.
        with pytest.raises(InvariantViolation):
            await db.requests.transition(r3, RequestState.FAILED)
        assert await db.requests.get(Q, r1.id) == r3

    with_db(migrated_dsn, body)


def test_request_transition_arguments_are_checked(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        with pytest.raises(ValueError, match="strategy"):
            await db.requests.transition(r, RequestState.PROCESSING)
        with pytest.raises(ValueError, match="base URI"):
            await db.requests.transition(
                r, RequestState.PROCESSING, strategy=BuildStrategy.INCREMENTAL
            )
        with pytest.raises(ValueError, match="base URI"):
            await db.requests.transition(
                r, RequestState.PROCESSING, strategy=BuildStrategy.FULL, base_uri=URI2
            )
        with pytest.raises(ValueError, match="only when moving to processing"):
            await db.requests.transition(r, RequestState.SUPERSEDED, strategy=BuildStrategy.FULL)
        with pytest.raises(InvariantViolation):
            await db.requests.transition(r, RequestState.SUCCEEDED)
        superseded = await db.requests.transition(r, RequestState.SUPERSEDED)
        assert superseded.state is RequestState.SUPERSEDED
        assert superseded.build_strategy is None

    with_db(migrated_dsn, body)


def test_request_state_machine_and_strategy_are_enforced_by_the_database(
    migrated_dsn: str,
) -> None:
    async def body(db: Database) -> None:
        r = await db.requests.create(Q, make_request_id(Q, 1), URI)
        await db.requests.transition(
            r, RequestState.PROCESSING, strategy=BuildStrategy.INCREMENTAL, base_uri=URI2
        )

    with_db(migrated_dsn, body)
    refused = {
        "UPDATE request SET state = 'accepted'": "request_state_transition",
        "UPDATE request SET build_strategy = 'full', base_uri = NULL": "request_strategy_immutable",
        "UPDATE request SET base_uri = 'git://elsewhere'": "request_strategy_immutable",
        "UPDATE request SET uri = 'git://elsewhere'": "request_identity_immutable",
    }
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        for statement, constraint in refused.items():
            with pytest.raises(psycopg.IntegrityError) as err:
                conn.execute(statement)
            assert err.value.diag.constraint_name == constraint, statement


# --- request_uri -----------------------------------------------------------------------


def test_request_uri_create_get_and_adopt_the_winner(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        with pytest.raises(NotFound):
            await db.request_uris.get(Q, URI)
        m = await db.request_uris.create(Q, URI, make_request_id(Q, 1))
        assert (m.queue, m.uri, m.request_id) == (Q, URI, make_request_id(Q, 1))
        assert await db.request_uris.get(Q, URI) == m
        with pytest.raises(AlreadyExists):
            await db.request_uris.create(Q, URI, make_request_id(Q, 2))
        adopted = await db.request_uris.get_or_create(Q, URI, make_request_id(Q, 3))
        assert adopted == m
        # Same URI in another queue is a different head.
        other = await db.request_uris.get_or_create("other/main", URI, "request/other/main/1")
        assert other.request_id == "request/other/main/1"

        racers = await asyncio.gather(
            *(db.request_uris.get_or_create(Q, URI2, make_request_id(Q, n)) for n in range(4, 12))
        )
        assert len({m.request_id for m in racers}) == 1

    with_db(migrated_dsn, body)


# --- build -----------------------------------------------------------------------------


def test_build_create_get_and_lookup_by_id(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = make_request_id(Q, 1)
        await db.requests.create(Q, rid, URI)
        with pytest.raises(NotFound):
            await db.builds.get(Q, "b-1")
        with pytest.raises(NotFound):
            await db.builds.get_by_id("b-1")
        b = await db.builds.create(Q, "b-1", rid)
        assert (b.queue, b.id, b.request_id, b.status, b.version) == (
            Q,
            "b-1",
            rid,
            BuildStatus.ACCEPTED,
            1,
        )
        assert await db.builds.get(Q, "b-1") == b
        assert await db.builds.get_by_id("b-1") == b
        with pytest.raises(AlreadyExists):
            await db.builds.create(Q, "b-1", rid)
        assert await db.builds.get_or_create(Q, "b-1", rid) == b
        second = await db.builds.get_or_create(Q, "b-2", rid)
        assert [x.id for x in await db.builds.list_for_request(Q, rid)] == ["b-1", "b-2"]

        # The id belongs to another request: not absorbed silently.
        rid2 = make_request_id(Q, 2)
        await db.requests.create(Q, rid2, URI2)
        with pytest.raises(AlreadyExists):
            await db.builds.get_or_create(Q, "b-2", rid2)
        assert await db.builds.get(Q, "b-2") == second

        # A build needs its request.
        with pytest.raises(NotFound) as no_request:
            await db.builds.create(Q, "b-3", make_request_id(Q, 99))
        assert no_request.value.entity == "request"

        # Runners mint ids per queue; the same id in two queues is ambiguous without one.
        other_rid = "request/other/main/1"
        await db.requests.create("other/main", other_rid, URI)
        await db.builds.create("other/main", "b-1", other_rid)
        with pytest.raises(AmbiguousKey):
            await db.builds.get_by_id("b-1")
        assert (await db.builds.get("other/main", "b-1")).request_id == other_rid

    with_db(migrated_dsn, body)


def test_build_status_cas_and_terminal_is_write_once(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = make_request_id(Q, 1)
        await db.requests.create(Q, rid, URI)
        b1 = await db.builds.create(Q, "b-1", rid)
        b2 = await db.builds.set_status(b1, BuildStatus.RUNNING)
        assert (b2.status, b2.version) == (BuildStatus.RUNNING, 2)
        with pytest.raises(VersionMismatch):
            await db.builds.set_status(b1, BuildStatus.FAILED)
        b3 = await db.builds.set_status(b2, BuildStatus.SUCCEEDED)
        assert b3.status is BuildStatus.SUCCEEDED
        with pytest.raises(InvariantViolation):
            await db.builds.set_status(b3, BuildStatus.FAILED)
        assert await db.builds.get(Q, "b-1") == b3

    with_db(migrated_dsn, body)
    with psycopg.connect(migrated_dsn) as conn, pytest.raises(psycopg.IntegrityError) as err:
        conn.execute("UPDATE build SET status = 'failed'")
    assert err.value.diag.constraint_name == "build_status_write_once"


# --- validation_fact -------------------------------------------------------------------


def test_fact_create_get_first_fact_wins(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = make_request_id(Q, 1)
        await db.requests.create(Q, rid, URI)
        with pytest.raises(NotFound):
            await db.facts.get(Q, URI)
        fact = await db.facts.create(Q, URI, degree=0.0, request_id=rid)
        assert (fact.queue, fact.uri, fact.project, fact.degree, fact.request_id) == (
            Q,
            URI,
            "",
            0.0,
            rid,
        )
        assert fact.is_green
        assert await db.facts.get(Q, URI) == fact
        with pytest.raises(AlreadyExists):
            await db.facts.create(Q, URI, degree=1.0, request_id=rid)
        assert await db.facts.get_or_create(Q, URI, degree=1.0, request_id=rid) == fact
        # Per project, a separate fact.
        partial = await db.facts.create(Q, URI, degree=0.25, request_id=rid, project="web")
        assert not partial.is_green
        assert await db.facts.get(Q, URI, "web") == partial
        assert await db.facts.get(Q, URI) == fact

        for bad in (-0.1, 1.5, float("nan")):
            with pytest.raises(ValueError):
                await db.facts.create(Q, URI2, degree=bad, request_id=rid)
        with pytest.raises(NotFound) as no_request:
            await db.facts.create(Q, URI2, degree=0.0, request_id=make_request_id(Q, 7))
        assert no_request.value.entity == "request"

    with_db(migrated_dsn, body)


def test_facts_cannot_be_updated_deleted_or_truncated(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        rid = make_request_id(Q, 1)
        await db.requests.create(Q, rid, URI)
        await db.facts.create(Q, URI, degree=1.0, request_id=rid)

    with_db(migrated_dsn, body)
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        for statement in (
            "UPDATE validation_fact SET degree = 0",
            "UPDATE validation_fact SET request_id = request_id",
            "DELETE FROM validation_fact",
            "TRUNCATE validation_fact",
        ):
            with pytest.raises(psycopg.IntegrityError) as err:
                conn.execute(statement)
            assert err.value.diag.constraint_name == "validation_fact_immutable"
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO validation_fact (queue, uri, degree, request_id)"
                " VALUES (%s, 'u2', 'NaN', %s)",
                (Q, make_request_id(Q, 1)),
            )
        row = conn.execute("SELECT degree, count(*) OVER () FROM validation_fact").fetchone()
    assert row == (1.0, 1)


# --- counter ---------------------------------------------------------------------------


def test_counter_counts_per_queue_from_one(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        assert await db.counters.current(Q) == 0
        assert [await db.counters.next(Q) for _ in range(3)] == [1, 2, 3]
        assert await db.counters.next("other/main") == 1
        assert await db.counters.current(Q) == 3

    with_db(migrated_dsn, body)


# --- parked ----------------------------------------------------------------------------


def test_parked_messages_round_trip_idempotently(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        assert await db.parked.count() == 0
        headers = (("x-error-class", b"DecodeError"), ("binary", b"\xff\x00"), ("none", None))
        first = await db.parked.park(
            topic="ingest_dlq",
            partition=2,
            offset=41,
            key=b"k",
            value=b"\x00garbage",
            headers=headers,
            error="undecodable protojson",
        )
        assert (first.topic, first.partition, first.offset) == ("ingest_dlq", 2, 41)
        assert (first.key, first.value, first.error) == (
            b"k",
            b"\x00garbage",
            "undecodable protojson",
        )
        assert first.headers == headers
        # A redelivered DLQ message parks nothing new.
        again = await db.parked.park(
            topic="ingest_dlq", partition=2, offset=41, key=None, value=None
        )
        assert again == first
        second = await db.parked.park(
            topic="record_dlq", partition=0, offset=1, key=None, value=None
        )
        assert second.key is None and second.headers == ()
        assert await db.parked.get(first.id) == first
        assert await db.parked.count() == 2
        assert await db.parked.count(topic="ingest_dlq") == 1
        assert [m.id for m in await db.parked.list_messages()] == [first.id, second.id]
        assert [m.id for m in await db.parked.list_messages(topic="record_dlq")] == [second.id]
        assert [m.id for m in await db.parked.list_messages(after_id=first.id, limit=5)] == [
            second.id
        ]
        assert [m.id for m in await db.parked.list_messages(limit=1)] == [first.id]
        assert await db.parked.delete(first.id) is True
        assert await db.parked.delete(first.id) is False
        with pytest.raises(NotFound):
            await db.parked.get(first.id)

    with_db(migrated_dsn, body)


def test_request_uri_reassign_is_a_compare_and_set(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        first = await db.request_uris.create(Q, URI, make_request_id(Q, 1))
        moved = await db.request_uris.reassign(first, make_request_id(Q, 2))
        assert moved.request_id == make_request_id(Q, 2)
        with pytest.raises(VersionMismatch):  # `first` is stale now
            await db.request_uris.reassign(first, make_request_id(Q, 3))
        assert (await db.request_uris.get(Q, URI)).request_id == make_request_id(Q, 2)
        racers = await asyncio.gather(
            *(db.request_uris.reassign(moved, make_request_id(Q, n)) for n in range(4, 9)),
            return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in racers) == 1
        assert all(isinstance(r, VersionMismatch) for r in racers if isinstance(r, BaseException))

    with_db(migrated_dsn, body)
