"""Issue 18: when a branch goes red, say which commit broke it. A real worker on the real
broker and database, a real git repository, builds by the command runner whose outcome a
file in each commit decides (tests.culprit_support). A red head after a push of several
commits is bisected with backfill Requests — real Requests with real facts, sorted by
their place in the history — using spare capacity only; the culprit is named, the
bookmark and the promotion ref only ever move forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from store import request_order
from tests.culprit_support import (
    QUEUE,
    Branch,
    add_culprit_queue,
    assert_promotion_only_moved_forward,
    backfill_builds,
    facts_by_commit,
    promoted,
    promotion_history,
    request_of,
    search_row,
    wait_search,
)
from tests.notify_http import SLACK, WEBHOOK, FakeServices, fake_services
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
WEBHOOK_ENV, SLACK_ENV = "STOVEPIPE_TEST_WEBHOOK_URL", "STOVEPIPE_TEST_SLACK_URL"


def _start(pipeline: Pipeline, tmp_path: Path, **knobs: object) -> Branch:
    branch = Branch(tmp_path)
    add_culprit_queue(pipeline, branch, **knobs)
    branch.commit("c0", "green")
    pipeline.start_worker()
    first = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([first], timeout=120)
    assert pipeline.states() == {first: "succeeded"}
    return branch


def test_one_push_of_eight_the_fifth_breaks(pipeline: Pipeline, tmp_path: Path) -> None:
    """After green c0, one push of c1..c8 where c5 breaks the build and it stays broken:
    c5 is named after 3 backfill builds (c4, c6, c5), their facts are right, the bookmark
    moves forward to c4 (green, and descending from c0), and a head pushed while a backfill
    build runs is admitted at once."""
    branch = _start(pipeline, tmp_path)
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 5 else "red", hold="probe" if n == 4 else None)
    head = pipeline.ingest(QUEUE)
    assert head == "request/mono/main/2"
    pipeline.wait_terminal([head], timeout=120)
    assert request_of(pipeline, branch, "c8") == (head, "failed", "red")

    # the first probe is the middle: c4, held by its latch
    wait_until(lambda: ("c4", "request/mono/main/1~4") in branch.started(), timeout=120,
               what="the backfill build of c4 to start")
    assert search_row(pipeline)["state"] == "bisecting"
    # a new head while the backfill runs: admitted and built now, not after the backfill
    branch.commit("c9", "red")
    newer = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([newer], timeout=120)
    assert request_of(pipeline, branch, "c4") == ("request/mono/main/1~4", "processing", None)
    assert request_of(pipeline, branch, "c9") == (newer, "failed", "red")

    branch.release("probe")
    found = wait_search(pipeline, "found")
    assert found["culprit"] == branch.uri("c5")
    assert (found["builds"], found["lo"], found["hi"], found["commits"]) == (3, 4, 5, 9)
    assert [name for name, _ in branch.started() if name not in ("c0", "c8", "c9")] == [
        "c4", "c6", "c5"]
    assert [(r, a, s) for r, a, s in backfill_builds(pipeline)] == [
        ("request/mono/main/1~4", 1, "succeeded"), ("request/mono/main/1~6", 1, "failed"),
        ("request/mono/main/1~5", 1, "failed")]
    pipeline.wait_quiet(timeout=120)
    # one red streak, one search: c9's red verdict opened none
    assert len(pipeline.query("SELECT 1 FROM culprit_search")) == 1
    assert facts_by_commit(pipeline, branch) == {
        "c0": ("request/mono/main/1", 0.0), "c4": ("request/mono/main/1~4", 0.0),
        "c5": ("request/mono/main/1~5", 1.0), "c6": ("request/mono/main/1~6", 1.0),
        "c8": (head, 1.0), "c9": (newer, 1.0)}
    # the facts sort by the commits' places in the history
    order = sorted(facts_by_commit(pipeline, branch).values(),
                   key=lambda fact: request_order(fact[0]))
    assert [branch.name_of(uri) for (uri,) in pipeline.query(
        "SELECT uri FROM validation_fact ORDER BY request_rank(request_id)")] == [
        "c0", "c4", "c5", "c6", "c8", "c9"] and len(order) == 6
    # the bookmark moved forward to the newest green commit, and the promotion ref with it
    [(bookmark, bookmark_uri)] = pipeline.query(
        "SELECT last_green_request_id, last_green_uri FROM queue")
    assert (bookmark, bookmark_uri) == ("request/mono/main/1~4", branch.uri("c4"))
    assert promoted(branch) == branch.shas["c4"]
    assert promotion_history(branch) == [branch.shas["c0"], branch.shas["c4"]]
    # the gate's neighbours are exact: c5's newest green ancestor is c4
    answer = json.loads(pipeline.cli("fact", QUEUE, branch.shas["c5"], "--json",
                                     check=False).stdout)
    assert answer["green"] is False and answer["fact"]["request_id"] == "request/mono/main/1~5"
    assert answer["prior_green"]["request_id"] == "request/mono/main/1~4"
    answer = json.loads(pipeline.cli("fact", QUEUE, branch.shas["c3"], "--json",
                                     check=False).stdout)
    assert answer["fact"] is None
    assert answer["prior_green"]["request_id"] == "request/mono/main/1"
    assert answer["next_green"]["request_id"] == "request/mono/main/1~4"
    assert pipeline.invariant_violations(strict_bookmark=False) == []
    # nothing dead-lettered or parked
    assert pipeline.dead_letters() == 0
    assert pipeline.query("SELECT count(*) FROM parked_message") == [(0,)]


def test_a_break_fixed_inside_the_range(pipeline: Pipeline, tmp_path: Path) -> None:
    """c2 breaks, c4 fixes, c7 breaks again, head c8 red: the culprit is c7 — the break
    the red head is red for, found from the newest green commit — with 3 builds."""
    branch = _start(pipeline, tmp_path)
    outcomes = {1: "green", 2: "red", 3: "red", 4: "green", 5: "green", 6: "green",
                7: "red", 8: "red"}
    for n, outcome in outcomes.items():
        branch.commit(f"c{n}", outcome)
    head = pipeline.ingest(QUEUE)
    found = wait_search(pipeline, "found")
    assert found["culprit"] == branch.uri("c7")
    assert found["builds"] == 3
    assert [name for name, _ in branch.started()] == ["c0", "c8", "c4", "c6", "c7"]
    pipeline.wait_quiet(timeout=120)
    assert {name: degree for name, (_, degree) in facts_by_commit(pipeline, branch).items()
            } == {"c0": 0.0, "c4": 0.0, "c6": 0.0, "c7": 1.0, "c8": 1.0}
    assert request_of(pipeline, branch, "c8") == (head, "failed", "red")
    # the bookmark moved forward twice, to c4 then c6; the promotion ref followed
    [(bookmark,)] = pipeline.query("SELECT last_green_uri FROM queue")
    assert bookmark == branch.uri("c6")
    assert promoted(branch) == branch.shas["c6"]
    assert promotion_history(branch) == [branch.shas[c] for c in ("c0", "c4", "c6")]
    assert pipeline.invariant_violations() == []


def test_the_branch_going_green_stops_the_search(pipeline: Pipeline,
                                                  tmp_path: Path) -> None:
    """While the first backfill build (c4, green) runs, a fix lands and the branch is green
    again: the search stops without another build, and c4's green fact arrives after the
    bookmark moved to the fix — it never moves the bookmark or the promotion ref back."""
    branch = _start(pipeline, tmp_path)
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 6 else "red", hold="probe" if n == 4 else None)
    head = pipeline.ingest(QUEUE)
    wait_until(lambda: any(name == "c4" for name, _ in branch.started()), timeout=120,
               what="the backfill build of c4 to start")
    branch.commit("c9", "green")
    fix = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([head, fix], timeout=120)
    wait_until(lambda: promoted(branch) == branch.shas["c9"], timeout=60,
               what="the promotion ref at the fix")
    branch.release("probe")
    found = wait_search(pipeline, "fixed")
    assert found["culprit"] is None and found["builds"] == 1
    assert "went green again" in found["detail"]
    pipeline.wait_quiet(timeout=120)
    facts = facts_by_commit(pipeline, branch)
    assert facts["c4"] == ("request/mono/main/1~4", 0.0)
    assert facts["c9"] == (fix, 0.0)
    [(bookmark,)] = pipeline.query("SELECT last_green_request_id FROM queue")
    assert bookmark == fix
    assert promoted(branch) == branch.shas["c9"]
    assert promotion_history(branch) == [branch.shas["c0"], branch.shas["c9"]]
    assert_promotion_only_moved_forward(branch)
    # no build after the fix: only c0, c8, c4 and c9 ever built
    assert sorted(name for name, _ in branch.started()) == ["c0", "c4", "c8", "c9"]
    assert pipeline.invariant_violations(strict_bookmark=False) == []


def test_a_flaky_candidate_with_retry_red(pipeline: Pipeline, tmp_path: Path) -> None:
    """With retry.red: 1 every red build is run again to tell a flake from a break: c4
    fails once and then passes (a flake), so it counts as green, marked flaky, and the
    culprit is still c5; c6 and c5 are red twice. 6 backfill builds, the queue's cap."""
    branch = _start(pipeline, tmp_path, retry={"red": 1, "unvalidated": 0, "backoff": "1s"},
                    backfill={"mode": "bisect", "max_builds": 6})
    for n in range(1, 9):
        outcome = "flaky" if n == 4 else ("green" if n < 5 else "red")
        branch.commit(f"c{n}", outcome)
    head = pipeline.ingest(QUEUE)
    found = wait_search(pipeline, "found")
    assert found["culprit"] == branch.uri("c5")
    assert found["builds"] == 6
    pipeline.wait_quiet(timeout=120)
    assert backfill_builds(pipeline) == [
        ("request/mono/main/1~4", 1, "failed"), ("request/mono/main/1~4", 2, "succeeded"),
        ("request/mono/main/1~6", 1, "failed"), ("request/mono/main/1~6", 2, "failed"),
        ("request/mono/main/1~5", 1, "failed"), ("request/mono/main/1~5", 2, "failed")]
    flaky = pipeline.query("SELECT request_id, attempts, flaky, degree FROM validation_fact"
                           " WHERE flaky")
    assert flaky == [("request/mono/main/1~4", 2, True, 0.0)]
    assert request_of(pipeline, branch, "c8") == (head, "failed", "red")
    assert pipeline.invariant_violations() == []


def test_alerts_name_the_culprit(pipeline: Pipeline, tmp_path: Path) -> None:
    """The red alert says the culprit is being looked for, and a later message names it
    when bisection found it; a red commit right after a green one is named in the red
    alert itself."""
    with fake_services() as services:
        branch = _start_notifying(pipeline, tmp_path, services)
        for n, outcome in ((1, "green"), (2, "green"), (3, "red"), (4, "red")):
            branch.commit(f"c{n}", outcome, hold="probe" if n == 2 else None)
        head = pipeline.ingest(QUEUE)
        # the first backfill build (c2) is held until the red alert went out
        wait_until(lambda: len(services.delivered(SLACK)) == 1, timeout=60,
                   what="the red alert")
        branch.release("probe")
        found = wait_search(pipeline, "found")
        assert found["culprit"] == branch.uri("c3") and found["builds"] == 2
        wait_until(lambda: len(services.delivered(SLACK)) == 2, timeout=60,
                   what="the red alert and the culprit's message")
        c3 = branch.shas["c3"]
        red, culprit = (b["text"] for b in services.delivered(SLACK))
        assert red.startswith(f":red_circle: Stovepipe: {QUEUE} is RED at "
                              f"{branch.shas['c4'][:12]} ({head}; was green). Finding the "
                              f"culprit among 4 commits (bisecting)"), red
        assert culprit.startswith(
            f":mag: Stovepipe: {QUEUE} has been red since "), culprit
        assert (f'; the culprit is {c3[:12]} "c3: make it red" by Ada Lovelace '
                f"<ada@example.invalid> (found after 2 backfill builds).") in culprit
        posted = services.delivered(WEBHOOK)
        assert [p["event"] for p in posted] == ["red", "culprit"]
        assert posted[0]["bisecting"] == {"commits": 4, "builds": 0}
        named = posted[1]["culprit"]
        assert (named["sha"], named["subject"], named["request_id"], named["builds"]) == (
            c3, "c3: make it red", "request/mono/main/1~3", 2)

        # fixed, then broken by the next commit alone: the red alert names it at once
        branch.commit("c5", "green")
        fixed = pipeline.ingest(QUEUE)
        pipeline.wait_terminal([fixed], timeout=120)
        branch.commit("c6", "red")
        broken = pipeline.ingest(QUEUE)
        wait_until(lambda: len(services.delivered(SLACK)) == 4, timeout=60,
                   what="the green and the second red alert")
        again = services.delivered(SLACK)[3]["text"]
        assert again.startswith(f":red_circle: Stovepipe: {QUEUE} is RED at "
                                f"{branch.shas['c6'][:12]} ({broken}; was green). Culprit: "
                                f'{branch.shas["c6"][:12]} "c6: make it red" by Ada '
                                f"Lovelace <ada@example.invalid>."), again
        assert search_row(pipeline)["builds"] == 0
        pipeline.wait_quiet(timeout=60)
        assert len(services.delivered(SLACK)) == 4  # no separate message for c6


def _start_notifying(pipeline: Pipeline, tmp_path: Path, services: FakeServices) -> Branch:
    branch = Branch(tmp_path)
    add_culprit_queue(pipeline, branch, notify={"webhook": {"url_env": WEBHOOK_ENV},
                                                "slack": {"url_env": SLACK_ENV}})
    branch.commit("c0", "green")
    pipeline.start_worker(env={WEBHOOK_ENV: services.webhook_url,
                               SLACK_ENV: services.slack_url})
    first = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([first], timeout=120)
    return branch
