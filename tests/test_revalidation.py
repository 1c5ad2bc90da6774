"""Issue 23, items 4 and 5: validating a head again by itself is bounded, a permanent
cause waits for a person, and a head the branch returns to after it could not be
validated is the newest head — on a real worker, broker and database (the fake source
control and build runner), plus the spacing rule on the statement itself.

`stovepipe ingest` stands for a poll or a push: each is an ingest of the branch's head.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from store import BuildStrategy, Database, RequestState
from store.steps import Revalidation
from tests.shared_worker import Lane, lane_queue
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _request(lane: Lane, request_id: str) -> dict[str, Any]:
    return lane.request(request_id)["request"]


def _settled_for(lane: Lane, request_id: str) -> float:
    """Seconds since the Request ended, by the database's clock."""
    [(seconds,)] = lane.query("SELECT EXTRACT(EPOCH FROM now() - updated_at)::float8"
                              " FROM request WHERE id = %s", request_id)
    return float(seconds)


@lane_queue("q", poll_deadline="1s", retry={"unvalidated": 1, "backoff": "500ms"})
def test_a_head_that_never_starts_is_validated_again_by_ingests_a_bounded_number_of_times(
        lane: Lane) -> None:
    """A build that never starts (its CI has no agent for it) could not validate its
    commit, for a cause that looks transient: the next ingest validates it again once
    the spacing passed — retry.unvalidated (1) times, no more; after that only a person's
    retry does (before: every ingest minted another Request, for ever)."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1-queued600")
    first = lane.ingest(queue)
    lane.wait_terminal([first], timeout=120)
    shown = _request(lane, first)
    assert (shown["state"], shown["verdict"], shown["unvalidated_cause"]) == (
        "failed", None, "transient")
    assert shown["attempt"] == 2 and shown["revalidations"] == 0

    wait_until(lambda: _settled_for(lane, first) > 0.6, timeout=30, what="the spacing")
    second = lane.ingest(queue)
    assert second == f"{first}.2"
    assert _request(lane, second)["revalidations"] == 1
    lane.wait_terminal([second], timeout=120)
    assert _request(lane, second)["unvalidated_cause"] == "transient"

    # the bound is reached: however long one waits, an ingest validates nothing again
    wait_until(lambda: _settled_for(lane, second) > 2.0, timeout=30, what="the spacing")
    assert lane.ingest(queue) == second
    assert lane.ingest(queue) == second
    assert lane.query("SELECT count(*) FROM request WHERE queue = %s", queue) == [(2,)]
    # a person still can
    third = lane.cli("retry", queue).stdout.strip()
    assert third == f"{first}.3"
    assert _request(lane, third)["kind"] == "retry"
    assert _request(lane, third)["revalidations"] == 0
    shown = lane.cli("request", second).stdout
    assert "by the next ingest of the head" in shown and "transient" in shown


@lane_queue("q", retry={"unvalidated": 2, "backoff": "500ms"})
def test_a_refused_trigger_is_not_tried_again_until_a_person_asks(lane: Lane) -> None:
    """A trigger the runner refuses (401, 404, 422, a bad configuration) would be refused
    again: the Request ends at once, after one attempt, without a verdict and with its
    cause permanent; ingests of the head validate nothing again, `stovepipe retry` does
    (before: three attempts, then a new Request on every ingest)."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1-triggererror")
    first = lane.ingest(queue)
    lane.wait_terminal([first], timeout=120)
    shown = _request(lane, first)
    assert (shown["state"], shown["verdict"], shown["unvalidated_cause"]) == (
        "failed", None, "permanent")
    assert shown["attempt"] == 1
    assert "its trigger was refused" in shown["reason"]
    assert "would fail the same way" in shown["reason"]
    wait_until(lambda: _settled_for(lane, first) > 2.0, timeout=30, what="any spacing")
    assert lane.ingest(queue) == first
    assert lane.query("SELECT count(*) FROM build WHERE queue = %s", queue) == [(0,)]
    assert "only on request (stovepipe retry)" in lane.cli("request", first).stdout
    again = lane.cli("retry", queue).stdout.strip()
    assert again == f"{first}.2"
    lane.wait_terminal([again], timeout=120)
    assert lane.dead_letters() == 0


@lane_queue("q", trigger_deadline="1s", retry={"unvalidated": 1, "backoff": "500ms"})
def test_a_head_the_branch_returns_to_after_it_could_not_be_validated_is_the_newest(
        lane: Lane) -> None:
    """c1 could not be validated (its CI was down past the trigger deadline); c2 was
    pushed and is green; the branch is force-pushed back to c1. The ingest validates c1
    again as the branch's newest head: it is built, green, and takes the bookmark (before:
    its new Request sorted at c1's first ingest, older than c2's, and was superseded on
    sight)."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1")
    lane.set_ci_reachable(False)
    try:
        first = lane.ingest(queue)
        lane.wait_terminal([first], timeout=120)
    finally:
        lane.set_ci_reachable(True)
    assert _request(lane, first)["unvalidated_cause"] == "transient"
    lane.repo.push(ref, "c2")
    second = lane.ingest(queue)
    lane.wait_quiet(timeout=120)
    assert lane.states()[second] == "succeeded"

    lane.repo.force_push(ref, "c1")
    back = lane.ingest(queue)
    assert back not in (first, second)
    lane.wait_quiet(timeout=120)
    assert lane.states()[back] == "succeeded"
    shown = lane.queue(queue)
    assert shown["latest_request_id"] == back
    assert shown["last_green_request_id"] == back
    assert lane.repo.promoted(f"{ref}-verified-main") == "c1"
    assert lane.invariant_violations(strict_bookmark=False) == []


def test_an_ingest_validates_again_only_once_the_spacing_has_passed(
        migrated_dsn: str) -> None:
    """The spacing grows: the n-th validation again by an ingest waits spacing * 2**n
    from the end of the Request before it; until then the ingest answers that Request."""
    queue, uri = "mono/main", "git://example/mono/ref/main/c1"

    async def main() -> None:
        async with await Database.open(migrated_dsn) as db:
            async def mint(policy: Revalidation) -> str:
                async with db.queue_transaction(queue) as tx:
                    found = await tx.steps.find_or_mint(queue, uri, revalidation=policy)
                assert found is not None
                return found.request_id

            async def fail(request_id: str) -> None:
                request = await db.requests.get(queue, request_id)
                request = await db.requests.transition(
                    request, RequestState.PROCESSING, strategy=BuildStrategy.FULL)
                await db.requests.fail_unvalidated(request, "its host was lost")

            first = await mint(Revalidation())
            await fail(first)
            hour = Revalidation(most=3, spacing=3600.0)
            assert await mint(hour) == first  # not due for an hour
            now = Revalidation(most=3, spacing=0.0)
            second = await mint(now)
            assert second == f"{first}.2"
            await fail(second)
            # the second time waits twice the spacing: 0.4 s, not 0.2 s
            spaced = Revalidation(most=3, spacing=0.2)
            deadline = time.monotonic() + 30
            while (third := await mint(spaced)) == second:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert third == f"{first}.3"
            async with db.pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT EXTRACT(EPOCH FROM t.created_at - s.updated_at)::float8"
                    " FROM request s, request t WHERE s.id = %s AND t.id = %s",
                    (second, third))
                row = await cur.fetchone()
            assert row is not None and row[0] >= 0.4  # by the database's clock
            await fail(third)
            # and no more than `most`
            assert await mint(Revalidation(most=2, spacing=0.0)) == third

    asyncio.run(main())
