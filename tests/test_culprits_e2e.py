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
    backfill_builds,
    facts_by_commit,
    promoted,
    request_of,
    search_row,
    wait_search,
)
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


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
