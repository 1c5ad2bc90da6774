"""Issue 23, item 1 on a real worker, broker and database: a hang is measured from the
build's start, never from its trigger (design §5, buildsignal).

The fake runner queues a build ``queuedN`` seconds before it starts and reports its start
as the trigger plus N (as a provider reports its own ``started_at``); the database's
timestamps show when the worker judged it. Hosted providers with their published answers
and the shipped timings are in tests/test_buildkite_runner.py and the congestion bench.
"""

from __future__ import annotations

import pytest

from tests.shared_worker import Lane, lane_queue

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _build(lane: Lane, request_id: str) -> dict[str, object]:
    """The Request's one build: its end, and how long it was queued and ran (seconds,
    from its trigger to its start, and from its start to its end)."""
    [row] = lane.query(
        "SELECT id, status, verdict, reason,"
        " EXTRACT(EPOCH FROM started_at - created_at)::float8,"
        " EXTRACT(EPOCH FROM updated_at - started_at)::float8"
        " FROM build WHERE queue = %s AND request_id = %s", lane.name("q"), request_id)
    return dict(zip(("id", "status", "verdict", "reason", "queued_s", "ran_s"), row,
                    strict=True))


@lane_queue("q", poll_deadline="4s", retry={"unvalidated": 0})
def test_a_build_queued_for_an_agent_then_passing_is_green(lane: Lane) -> None:
    """Queued 3 s, then running 2 s, under a 4 s poll deadline: 5 s after its trigger it
    is still running, but it ran for 2 s only. Green (before: red, "it ran past the poll
    deadline")."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1-queued3-slow2")
    rid = lane.ingest(queue)
    lane.wait_quiet(timeout=120)
    assert lane.states() == {rid: "succeeded"}
    build = _build(lane, rid)
    assert build["status"] == "succeeded" and build["verdict"] == "green"
    # its start is the provider's (trigger + 3 s), not the trigger
    assert 2.5 <= float(build["queued_s"]) <= 4.5, build  # type: ignore[arg-type]
    assert lane.request(rid)["fact"]["degree"] == 0


@lane_queue("q", poll_deadline="3s", retry={"unvalidated": 0})
def test_a_build_that_hangs_after_a_queue_is_red_only_after_running_past_the_deadline(
        lane: Lane) -> None:
    """Queued 2 s, then running for ever, under a 3 s poll deadline: red — a hang — but
    only once it has run for 3 s since it started, and the reason says so."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c2-queued2-hang")
    rid = lane.ingest(queue)
    lane.wait_quiet(timeout=120)
    assert lane.states() == {rid: "failed"}
    request = lane.request(rid)["request"]
    assert request["verdict"] == "red"
    build = _build(lane, rid)
    assert build["verdict"] == "red"
    assert "ran past the poll deadline (3s since it started)" in str(build["reason"])
    assert float(build["ran_s"]) >= 3.0, build  # type: ignore[arg-type]
    assert float(build["queued_s"]) >= 1.5, build  # type: ignore[arg-type]
    assert lane.request(rid)["fact"]["degree"] == 1


@lane_queue("q", poll_deadline="2s", start_deadline="3s", retry={"unvalidated": 0})
def test_a_build_that_never_starts_gives_no_verdict_and_says_what_it_waited_for(
        lane: Lane) -> None:
    """Queued for ever: past the start deadline (from the trigger) the attempt could not
    validate — no fact, the cause transient, the reason naming what it waited for."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c3-queued600")
    rid = lane.ingest(queue)
    lane.wait_quiet(timeout=120)
    assert lane.states() == {rid: "failed"}
    request = lane.request(rid)["request"]
    assert request["verdict"] is None
    assert request["unvalidated_cause"] == "transient"
    assert "start deadline (3s since its trigger, never started)" in request["reason"]
    assert "queued for an agent" in request["reason"]
    assert lane.request(rid)["fact"] is None
    build = _build(lane, rid)
    assert build["queued_s"] is None  # it never started
    assert build["id"] in lane.cancelled_builds()  # nobody waits for it any more
