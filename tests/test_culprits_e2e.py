"""Issues 18 and 23: when a branch goes red, say which commit broke it. A real worker on
the real broker and database, a real git repository, builds by the command runner whose
outcome a file in each commit decides (tests.culprit_support). A red head after a push of
several commits is searched with backfill Requests — real Requests with real facts,
sorted by their place in the history — using spare capacity only; the culprit named is
the break the head is red for, confirmed, or said to be a break not confirmed as the
head's; an outage of the build machines during a search is waited out, and only builds
that ran are counted; the bookmark and the promotion ref only ever move forward."""

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
    backfill_builds_that_ran,
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
from tests.web_support import WebPipeline

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
    """After green c0, one push of c1..c8 where c5 breaks the build and it stays broken
    (max_builds 4): bisection probes c4 (green); the 3 commits left fit the budget and are
    built newest first (c7, c6, c5: red), so c5 is named, confirmed, after 4 backfill
    builds; their facts are right, the bookmark moves forward to c4 (green, and descending
    from c0), and a head pushed while a backfill build runs is admitted at once."""
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
    assert (found["culprit"], found["confirmed"], found["unconfirmed"]) == (
        branch.uri("c5"), True, None)
    assert (found["builds"], found["lo"], found["hi"], found["commits"]) == (4, 4, 5, 9)
    assert [name for name, _ in branch.started() if name not in ("c0", "c8", "c9")] == [
        "c4", "c7", "c6", "c5"]
    assert [(r, a, s) for r, a, s in backfill_builds(pipeline)] == [
        ("request/mono/main/1~4", 1, "succeeded"), ("request/mono/main/1~7", 1, "failed"),
        ("request/mono/main/1~6", 1, "failed"), ("request/mono/main/1~5", 1, "failed")]
    pipeline.wait_quiet(timeout=120)
    # one red streak, one search: c9's red verdict opened none
    assert len(pipeline.query("SELECT 1 FROM culprit_search")) == 1
    assert facts_by_commit(pipeline, branch) == {
        "c0": ("request/mono/main/1", 0.0), "c4": ("request/mono/main/1~4", 0.0),
        "c5": ("request/mono/main/1~5", 1.0), "c6": ("request/mono/main/1~6", 1.0),
        "c7": ("request/mono/main/1~7", 1.0), "c8": (head, 1.0), "c9": (newer, 1.0)}
    # the facts sort by the commits' places in the history
    order = sorted(facts_by_commit(pipeline, branch).values(),
                   key=lambda fact: request_order(fact[0]))
    assert [branch.name_of(uri) for (uri,) in pipeline.query(
        "SELECT uri FROM validation_fact ORDER BY request_rank(request_id)")] == [
        "c0", "c4", "c5", "c6", "c7", "c8", "c9"] and len(order) == 7
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
    the red head is red for — confirmed, with 3 builds: c4 (green) by bisection, then the
    3 commits left fit the budget and are built newest first: c7 red, c6 green."""
    branch = _start(pipeline, tmp_path)
    outcomes = {1: "green", 2: "red", 3: "red", 4: "green", 5: "green", 6: "green",
                7: "red", 8: "red"}
    for n, outcome in outcomes.items():
        branch.commit(f"c{n}", outcome)
    head = pipeline.ingest(QUEUE)
    found = wait_search(pipeline, "found")
    assert (found["culprit"], found["confirmed"]) == (branch.uri("c7"), True)
    assert found["builds"] == 3
    assert [name for name, _ in branch.started()] == ["c0", "c8", "c4", "c7", "c6"]
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
    bookmark moved to the fix — it never moves the bookmark or the promotion ref back; the
    build it ran is counted when it ends."""
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
    assert found["culprit"] is None
    assert "went green again" in found["detail"]
    pipeline.wait_quiet(timeout=120)
    assert search_row(pipeline)["builds"] == 1 == backfill_builds_that_ran(pipeline)
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
    """With retry.red: 1 every red build is run again to tell a flake from a break, so a
    probe may run 2 builds and starts only while 2 fit in max_builds (8): c4 fails once
    and then passes (a flake), so it counts as green, marked flaky; the 3 commits left fit
    (6 builds) and are built newest first, c7, c6 and c5 red twice each: c5 is named,
    confirmed, after 8 builds, the queue's cap."""
    branch = _start(pipeline, tmp_path, retry={"red": 1, "unvalidated": 0, "backoff": "1s"},
                    backfill={"mode": "bisect", "max_builds": 8})
    for n in range(1, 9):
        outcome = "flaky" if n == 4 else ("green" if n < 5 else "red")
        branch.commit(f"c{n}", outcome)
    head = pipeline.ingest(QUEUE)
    found = wait_search(pipeline, "found")
    assert (found["culprit"], found["confirmed"]) == (branch.uri("c5"), True)
    assert found["builds"] == 8
    pipeline.wait_quiet(timeout=120)
    assert backfill_builds(pipeline) == [
        ("request/mono/main/1~4", 1, "failed"), ("request/mono/main/1~4", 2, "succeeded"),
        ("request/mono/main/1~7", 1, "failed"), ("request/mono/main/1~7", 2, "failed"),
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
            branch.commit(f"c{n}", outcome, hold="probe" if n == 3 else None)
        head = pipeline.ingest(QUEUE)
        # the first backfill build (c3: the budget covers the range, newest first) is held
        # until the red alert went out
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
        assert (named["sha"], named["subject"], named["request_id"], named["builds"],
                named["confirmed"], named["unconfirmed_reason"]) == (
            c3, "c3: make it red", "request/mono/main/1~3", 2, True, None)

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
    """c0 green on a queue whose alerts go to ``services`` (and whose worker serves HTTP
    when ``pipeline`` is a WebPipeline)."""
    branch = Branch(tmp_path)
    add_culprit_queue(pipeline, branch, notify={"webhook": {"url_env": WEBHOOK_ENV},
                                                "slack": {"url_env": SLACK_ENV}})
    branch.commit("c0", "green")
    env = {WEBHOOK_ENV: services.webhook_url, SLACK_ENV: services.slack_url}
    if isinstance(pipeline, WebPipeline):
        pipeline.start_web_worker(env=env)
        pipeline.wait_healthy()
    else:
        pipeline.start_worker(env=env)
    first = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([first], timeout=120)
    return branch


# --- issue 23: an honest culprit, and searches that survive outages ---------------------

OLD_BREAK = {1: "green", 2: "green", 3: "red", 4: "red", 5: "green", 6: "green", 7: "red",
             8: "red", 9: "red"}


def _push_old_break(branch: Branch) -> None:
    """One push of c1..c9 onto green c0: c3 breaks, c5 fixes, c7 breaks again; the head
    c9 is red for c7's break. The middle (c4) is red from the old one."""
    for n, outcome in OLD_BREAK.items():
        branch.commit(f"c{n}", outcome)


def test_an_old_break_fixed_inside_the_range_is_not_the_culprit(pipeline: Pipeline,
                                                                 tmp_path: Path) -> None:
    """Issue 23: with room for every commit of the range (max_builds 10), the commits are
    built newest first — c8 and c7 red, c6 green — and c7 is named, confirmed, after 3
    builds; never c3, whose break c5 fixed. `explain --json` and `queue --json` say the
    culprit is confirmed."""
    branch = _start(pipeline, tmp_path, backfill={"mode": "bisect", "max_builds": 10})
    _push_old_break(branch)
    head = pipeline.ingest(QUEUE)
    found = wait_search(pipeline, "found")
    assert (found["culprit"], found["confirmed"], found["unconfirmed"]) == (
        branch.uri("c7"), True, None)
    assert found["builds"] == 3 == backfill_builds_that_ran(pipeline)
    assert [name for name, _ in branch.started()] == ["c0", "c9", "c8", "c7", "c6"]
    pipeline.wait_quiet(timeout=120)
    assert request_of(pipeline, branch, "c9") == (head, "failed", "red")
    told = json.loads(pipeline.cli("explain", QUEUE, "--json").stdout)
    culprit = told["culprit"]
    assert (culprit["sha"], culprit["confirmed"], culprit["unconfirmed_reason"]) == (
        branch.shas["c7"], True, None)
    assert told["search"]["confirmed"] is True
    assert told["summary"].startswith(
        f'{QUEUE} is red since {branch.shas["c7"][:12]} "c7: make it red" by Ada Lovelace '
        f"<ada@example.invalid>, found after 3 backfill builds.")
    words = {branch.name_of(e["uri"]): e["words"] for e in told["story"]}
    assert words["c7"] == ("red — the culprit: its first parent is green and every commit "
                           "after it is red")
    assert set(words) == {"c9", "c8", "c7", "c6"}  # the story starts at the bookmark, c6
    shown = json.loads(pipeline.cli("queue", QUEUE, "--json").stdout)
    assert (shown["culprit"]["sha"], shown["culprit"]["confirmed"]) == (branch.shas["c7"], True)
    assert pipeline.invariant_violations() == []


def test_a_budget_too_small_to_confirm_names_a_break_not_confirmed(web: WebPipeline,
                                                                    tmp_path: Path) -> None:
    """Issue 23: the same range with max_builds 4. Bisection probes c4 (red, from the old
    break), c2 (green) and c3 (red): a break. The last build goes to the commits between
    it and the head, newest first (c8, red), and then the budget is spent: c3 is named as
    "a break, not confirmed as the head's", with the reason, in the API, the CLI, the
    story and the culprit's alert — never as the culprit."""
    with fake_services() as services:
        branch = _start_notifying(web, tmp_path, services)
        _push_old_break(branch)
        web.ingest(QUEUE)
        found = wait_search(web, "found")
        assert (found["culprit"], found["confirmed"], found["builds"]) == (
            branch.uri("c3"), False, 4)
        reason = ("backfill.max_builds (4) was spent with 3 commits between it and the head "
                  "not built, and a later fix and break could hide there")
        assert found["unconfirmed"] == reason
        assert [name for name, _ in branch.started()] == ["c0", "c9", "c4", "c2", "c3", "c8"]
        web.wait_quiet(timeout=120)

        c3 = f'{branch.shas["c3"][:12]} "c3: make it red"'
        overview = web.get(f"/api/queues/{QUEUE}").body
        assert (overview["culprit"]["sha"], overview["culprit"]["confirmed"],
                overview["culprit"]["unconfirmed_reason"]) == (branch.shas["c3"], False, reason)
        assert overview["search"]["confirmed"] is False
        told = web.get(f"/api/queues/{QUEUE}/explain").body
        assert told["culprit"]["confirmed"] is False
        assert told["summary"].startswith(
            f"{QUEUE} is red; a break, not confirmed as the head's: {c3} by Ada Lovelace "
            f"<ada@example.invalid>, found after 4 backfill builds ({reason}).")
        assert json.loads(web.cli("explain", QUEUE, "--json").stdout)["culprit"] == told[
            "culprit"]
        words = {branch.name_of(e["uri"]): e["words"] for e in told["story"]}
        assert words["c3"] == (f"red — a break (its first parent is green), not confirmed "
                               f"as the head's: {reason}")
        assert words["c9"] == f"red — after {c3}, a break not confirmed as the head's"
        assert words["c6"] == (f"never built: between the break {c3} and the head, so a "
                               f"later fix and break could hide here")
        shown = web.cli("queue", QUEUE).stdout
        assert f"  a break     {branch.shas['c3']} by Ada Lovelace" in shown
        assert f"not confirmed as the head's: {reason}" in shown
        assert "red since" not in shown

        wait_until(lambda: len(services.delivered(SLACK)) == 2, timeout=60,
                   what="the red alert and the culprit's message")
        message = services.delivered(SLACK)[1]["text"]
        assert (f"; a break, not confirmed as the head's: {c3} by Ada Lovelace "
                f"<ada@example.invalid> (found after 4 backfill builds; {reason}).") in message
        posted = services.delivered(WEBHOOK)[1]
        assert posted["event"] == "culprit"
        assert (posted["culprit"]["confirmed"], posted["culprit"]["unconfirmed_reason"]) == (
            False, reason)


def test_an_outage_during_a_search_is_waited_out(pipeline: Pipeline, tmp_path: Path) -> None:
    """Issue 23: c0 green, one push of c1..c8, c5 breaks. While the first probe (c4) is
    held, the build machines go down: every build is lost with its processes (could not
    validate). c4 is probed again after a backoff (1 s, then 2 s), each lost again; the
    search stays bisecting, counts no build and starts no other probe. When the machines
    are back the sweeper resumes it at c4's next due time, and it names c5, confirmed:
    builds counted = the 4 builds that ran, not the lost ones."""
    branch = _start(pipeline, tmp_path, retry={"unvalidated": 0, "red": 0, "backoff": "1s"},
                    backfill={"mode": "bisect", "max_builds": 4, "probe_backoff": "1s",
                              "unvalidated_probes": 10})
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 5 else "red", hold="probe" if n == 4 else None)
    head = pipeline.ingest(QUEUE)
    wait_until(lambda: ("c4", "request/mono/main/1~4") in branch.started(), timeout=120,
               what="the first probe, c4, to start")
    branch.set_down(True)
    branch.release("probe")
    wait_until(lambda: len(branch.lost()) >= 2, timeout=120,
               what="two probes of c4 lost in the outage")
    during = search_row(pipeline)
    assert during["state"] == "bisecting" and during["builds"] == 0
    lost = branch.lost()
    assert {name for name, _ in lost} == {"c4"}
    assert [r for _, r in lost[:2]] == ["request/mono/main/1~4", "request/mono/main/1~4.2"]
    branch.set_down(False)

    found = wait_search(pipeline, "found")
    assert (found["culprit"], found["confirmed"]) == (branch.uri("c5"), True)
    pipeline.wait_quiet(timeout=120)
    lost = branch.lost()
    c4_probes = [f"request/mono/main/1~4.{k}" if k > 1 else "request/mono/main/1~4"
                 for k in range(1, len(lost) + 2)]
    assert [r for _, r in lost] == c4_probes[:-1]
    # every probe of c4 but the last could not validate: no fact, and no build counted
    assert [request_of(pipeline, branch, "c4")] == [(c4_probes[-1], "succeeded", "green")]
    unvalidated = pipeline.query(
        "SELECT id FROM request WHERE queue = %s AND kind = 'backfill' AND state = 'failed'"
        " AND verdict IS NULL ORDER BY request_rank(id)", QUEUE)
    assert [r for (r,) in unvalidated] == c4_probes[:-1]
    assert found["builds"] == 4 == backfill_builds_that_ran(pipeline)
    assert len(backfill_builds(pipeline)) == 4 + len(lost)
    started = [name for name, _ in branch.started() if name not in ("c0", "c8")]
    assert started == ["c4"] * len(c4_probes) + ["c7", "c6", "c5"]
    assert request_of(pipeline, branch, "c8") == (head, "failed", "red")
    # nothing but the sweeper advances a search that only waits: it resumed this one
    assert "sweeper_republished what=culprit_search" in pipeline.full_logs()
    assert pipeline.invariant_violations(strict_bookmark=False) == []
    assert pipeline.dead_letters() == 0
