"""WebhookDeliveryStore on a real PostgreSQL: a delivery id is claimed by one claimant at
a time, marked ingested once, released for a retry after a failure, taken over when its
claimant died, and forgotten after its retention."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import psycopg
import pytest

from store import Database, DeliveryState

pytestmark = pytest.mark.postgres

WEEK = 7 * 24 * 3600.0
MINUTE = 60.0


def with_db(dsn: str, body: Callable[[Database], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await Database.open(dsn, min_size=1, max_size=12) as db:
            await body(db)

    asyncio.run(main())


def token() -> str:
    return str(uuid.uuid4())


def test_one_claimant_at_a_time_then_ingested_once(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        store = db.webhook_deliveries
        first, second = token(), token()
        assert await store.claim("github", "d-1", first, stale_after=MINUTE, keep=WEEK)
        assert not await store.claim("github", "d-1", second, stale_after=MINUTE, keep=WEEK)
        assert await store.claim("gitlab", "d-1", second, stale_after=MINUTE, keep=WEEK)
        held = await store.get("github", "d-1")
        assert held is not None
        assert (held.state, held.request_ids, held.ingested_at) == (
            DeliveryState.INGESTING, (), None)

        assert not await store.complete("github", "d-1", second, ["request/q/9"])
        assert not await store.release("github", "d-1", second)
        assert await store.complete("github", "d-1", first, ["request/q/1", "request/a/b/2"])
        done = await store.get("github", "d-1")
        assert done is not None
        assert done.state is DeliveryState.INGESTED
        assert done.request_ids == ("request/q/1", "request/a/b/2")
        assert done.ingested_at is not None
        # ingested: never claimed again, however old its claim, and never released
        assert not await store.claim("github", "d-1", second, stale_after=0, keep=WEEK)
        assert not await store.release("github", "d-1", first)
        assert not await store.complete("github", "d-1", first, [])
        assert (await store.get("github", "d-1")) == done
        assert await store.get("github", "unknown") is None

    with_db(migrated_dsn, body)


def test_a_released_claim_can_be_claimed_again(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        store = db.webhook_deliveries
        failed, retry = token(), token()
        assert await store.claim("gitlab", "d-2", failed, stale_after=MINUTE, keep=WEEK)
        assert await store.release("gitlab", "d-2", failed)
        assert await store.get("gitlab", "d-2") is None
        assert await store.claim("gitlab", "d-2", retry, stale_after=MINUTE, keep=WEEK)
        assert not await store.complete("gitlab", "d-2", failed, ["request/q/1"])
        assert await store.complete("gitlab", "d-2", retry, ["request/q/1"])

    with_db(migrated_dsn, body)


def test_a_claim_whose_claimant_died_is_taken_over(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        store = db.webhook_deliveries
        dead, alive = token(), token()
        assert await store.claim("github", "d-3", dead, stale_after=MINUTE, keep=WEEK)
        assert not await store.claim("github", "d-3", alive, stale_after=MINUTE, keep=WEEK)
        async with db.pool.connection() as conn:
            await conn.execute("UPDATE webhook_delivery SET claimed_at = now() - interval '61s'"
                               " WHERE delivery_id = 'd-3'")
        assert await store.claim("github", "d-3", alive, stale_after=MINUTE, keep=WEEK)
        # the dead claimant, were it to come back, can neither finish nor release it
        assert not await store.complete("github", "d-3", dead, ["request/q/1"])
        assert not await store.release("github", "d-3", dead)
        assert await store.complete("github", "d-3", alive, ["request/q/2"])
        done = await store.get("github", "d-3")
        assert done is not None and done.request_ids == ("request/q/2",)

    with_db(migrated_dsn, body)


def test_concurrent_claims_of_one_delivery_have_exactly_one_winner(migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        store = db.webhook_deliveries
        for round_ in range(5):
            delivery = f"race-{round_}"
            claims = [token() for _ in range(10)]
            won = await asyncio.gather(*(
                store.claim("github", delivery, claim, stale_after=MINUTE, keep=WEEK)
                for claim in claims))
            assert won.count(True) == 1, won
            winner = claims[won.index(True)]
            assert [await store.complete("github", delivery, c, []) for c in claims] == [
                c == winner for c in claims]

    with_db(migrated_dsn, body)


def test_deliveries_older_than_the_retention_are_deleted_by_later_claims(
        migrated_dsn: str) -> None:
    async def body(db: Database) -> None:
        store = db.webhook_deliveries
        for n in range(150):
            assert await store.claim("github", f"old-{n}", token(), stale_after=MINUTE,
                                     keep=WEEK)
        assert await store.claim("github", "recent", token(), stale_after=MINUTE, keep=WEEK)
        async with db.pool.connection() as conn:
            await conn.execute("UPDATE webhook_delivery SET received_at = now() - interval"
                               " '8 days' WHERE delivery_id LIKE 'old-%'")

        async def count(pattern: str) -> int:
            async with db.pool.connection() as conn:
                cur = await conn.execute("SELECT count(*) FROM webhook_delivery"
                                         " WHERE delivery_id LIKE %s", (pattern,))
                row = await cur.fetchone()
                assert row is not None
                return int(row[0])

        # a claim of an expired delivery's own id keeps its row (it is the one in question)
        assert not await store.claim("github", "old-0", token(), stale_after=MINUTE,
                                     keep=WEEK)
        assert await count("old-%") == 150 - 100  # at most a batch per claim, oldest first
        assert await store.get("github", "old-0") is not None
        assert await store.claim("gitlab", "new-1", token(), stale_after=MINUTE, keep=WEEK)
        assert await count("old-%") == 0
        assert await store.get("github", "recent") is not None
        assert await count("new-%") == 1

    with_db(migrated_dsn, body)


def test_the_table_refuses_an_unknown_provider_or_state(migrated_dsn: str) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO webhook_delivery (provider, delivery_id, claim)"
                         " VALUES ('bitbucket', 'x', gen_random_uuid())")
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("INSERT INTO webhook_delivery (provider, delivery_id, claim, state)"
                         " VALUES ('github', 'x', gen_random_uuid(), 'ingested')")
