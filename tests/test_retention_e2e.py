"""Issue 25, item 6, on a real worker and broker: a worker with `retention` in queues.yaml
prunes 2,000 old Requests' history in rounds of `max_rows` while the pipeline validates
new heads — every new Request ends as its head says, the old bookmark (the queue has been
red since) stays with its fact, the metric falls to 0 — and a prune of everything past
retention on a real monorepo's history (projects, a culprit search, a pin) leaves every
gate's answer and every row a person reads."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
import yaml

from store import Database
from streams.stages.retention import PruneReport, prune
from streams.stages.retention_rules import Policy
from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue, git
from tests.pipeline_support import Pipeline
from tests.retention_support import old_history
from tests.test_retention import NAMED
from tests.waiting import wait_until
from tests.web_support import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

OLD = 2000  # old Requests written before the worker starts


def test_a_worker_prunes_old_history_in_rounds_while_the_pipeline_runs(
        pipeline: Pipeline) -> None:
    ref = pipeline.add_queue("q")
    with psycopg.connect(pipeline.dsn, autocommit=True) as conn:
        written = old_history(conn, "q", first=1, count=OLD, age=timedelta(days=200))
        [(bookmark,)] = conn.execute("SELECT last_green_request_id FROM queue").fetchall()
    assert bookmark == f"request/q/{OLD - 1}"
    pipeline.queues_file.write_text(yaml.safe_dump({
        "queues": pipeline.queues,
        "retention": {"older_than": "180d", "keep_newest": 3, "every": "1s",
                      "max_rows": 1500}}))
    port = free_port()
    pipeline.start_worker(web_port=port)

    # new heads while the rounds run: all red, so the old bookmark is still the bookmark
    live = []
    for k in range(6):
        pipeline.repo.push(ref, f"n{k}-fail")
        live.append(pipeline.ingest("q"))
        pipeline.wait_terminal([live[-1]], timeout=120)

    def caught_up() -> bool:
        rows = pipeline.query("SELECT past_retention, finished_at FROM retention_round")
        old = pipeline.query("SELECT count(*) FROM request"
                             " WHERE created_at < now() - interval '180 days'")
        return bool(rows) and rows[0][1] is not None and old == [(1,)] and set(
            rows[0][0].values()) == {0}

    wait_until(caught_up, timeout=180, what="the rounds to prune the old history",
               interval=0.5)
    # (not wait_quiet: the old bookmark is no commit of the fake repository, so the
    # promotion ref was never moved to it)
    wait_until(lambda: not pipeline.missing_facts(), timeout=120, what="every fact")
    # the bookmark stays, with its fact: a gate asking about its commit still hears green
    assert pipeline.query("SELECT id FROM request WHERE created_at < now()"
                          " - interval '180 days'") == [(bookmark,)]
    assert pipeline.query("SELECT degree FROM validation_fact WHERE request_id = %s",
                          bookmark) == [(0.0,)]
    assert pipeline.queue("q")["last_green_request_id"] == bookmark
    # every new Request as its head says
    states = pipeline.states()
    assert [states[request_id] for request_id in live] == ["failed"] * len(live)
    assert pipeline.query("SELECT count(*) FROM validation_fact WHERE degree = 1"
                          " AND request_id = ANY(%s)", live) == [(len(live),)]
    assert pipeline.invariant_violations() == []
    assert pipeline.dead_letters() == 0 and pipeline.parked() == []
    assert pipeline.query(NAMED) == []
    # in several rounds of at most max_rows, one at a time
    rounds = [line for line in pipeline.full_logs().splitlines()
              if "retention_round " in line]
    assert len(rounds) >= 4, rounds
    deleted = [int(re.search(r"deleted=(\d+)", line).group(1))  # type: ignore[union-attr]
               for line in rounds]
    assert max(deleted) <= 1500 + 10  # max_rows, give or take a Request's rows
    # the metric
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        metrics = reply.read().decode()
    assert 'stovepipe_rows_past_retention{table="request"} 0.0' in metrics
    assert f'stovepipe_pruned_rows_total{{table="request"}} {float(OLD - 1)}' in metrics
    # all but the bookmark's Request, mapping, build and fact (its sent status goes)
    assert sum(deleted) == sum(written.values()) - 4
    assert "stovepipe_retention_round_finished_timestamp_seconds" in metrics


def test_pruning_everything_past_retention_keeps_what_the_gates_and_people_read(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo, backfill={"mode": "bisect", "max_builds": 4})
    pipeline.start_worker()
    ok = {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
          **repo.outcome("docs", "green"), "libs/common/x": "0\n"}
    heads = {}
    for name, files in (("c0", ok), ("c0b", {"docs/d": "b\n"}), ("c0c", {"web/w": "c\n"})):
        repo.commit(name, files)
        heads[name] = pipeline.ingest(QUEUE)
        pipeline.wait_terminal([heads[name]], timeout=240)
    repo.commit("c1", {"services/api/a": "1\n"})
    heads["c1"] = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([heads["c1"]], timeout=240)
    # three commits in one push: the second breaks api; its culprit search bisects
    repo.commit("c2", {"web/w": "2\n"})
    repo.commit("c3", repo.outcome("api", "red"))
    repo.commit("c4", {"web/w": "4\n"})
    heads["c4"] = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([heads["c4"]], timeout=240)
    wait_until(lambda: pipeline.query("SELECT count(*) FROM culprit_search"
                                      " WHERE state <> 'bisecting'") == [(1,)],
               timeout=240, what="the api culprit search to end")
    pipeline.wait_quiet(timeout=240)
    pinned = pipeline.cli("pin", QUEUE, repo.shas["c1"], "--reason", "hold c1")
    assert pinned.returncode == 0
    # web's own promotion ref held at c0c, where web was last built before c2
    pinned_web = pipeline.cli("pin", QUEUE, repo.shas["c0c"], "--project", "web",
                              "--reason", "hold web at c0c")
    assert pinned_web.returncode == 0, pinned_web.stderr
    web_pin = pipeline.query("SELECT pinned_uri, pinned_request_id FROM project_state"
                             " WHERE queue = %s AND project = 'web'", QUEUE)
    assert web_pin == [(repo.uri("c0c"), heads["c0c"])]
    before = {name: _gate(pipeline, repo, name) for name in ("c0", "c1", "c4")}
    web_before = _gate(pipeline, repo, "c0c", "web")
    assert before["c1"] == before["c0"] == 0 and before["c4"] == 3
    shown = _shown(pipeline)
    assert "red since" in shown[f"{QUEUE}#api"]  # the api search's culprit

    # everything is past retention now: only the rules keep anything
    report = _prune_all(pipeline)
    assert report.deleted["request"] >= 2 and report.skipped == 0
    assert report.deleted["validation_fact"] >= 2  # what no pin, bookmark or answer names
    assert pipeline.query(NAMED) == []
    assert pipeline.invariant_violations() == []
    # c0's and c0b's own Requests went (projects' Requests named as sources stay)
    assert pipeline.query("SELECT id FROM request WHERE id = ANY(%s)",
                          [heads["c0"], heads["c0b"]]) == []
    # the gates answer as before for what they still know; c0 is no longer known
    assert _gate(pipeline, repo, "c1") == 0 and _gate(pipeline, repo, "c4") == 3
    assert _gate(pipeline, repo, "c0") == 3
    # what a person reads of the queue and its projects is what it was
    assert _shown(pipeline) == shown
    state = pipeline.query("SELECT last_green_request_id, pinned_request_id FROM queue"
                           " WHERE name = %s", QUEUE)
    assert state == [(heads["c1"], heads["c1"])]
    # web's pin keeps the Request whose answer it names, and web's ref stays at c0c
    assert pipeline.query("SELECT pinned_uri, pinned_request_id FROM project_state"
                          " WHERE queue = %s AND project = 'web'", QUEUE) == web_pin
    assert pipeline.query("SELECT id FROM request WHERE id = %s", heads["c0c"]) == [
        (heads["c0c"],)]
    assert web_before == 0 and _gate(pipeline, repo, "c0c", "web") == 0
    assert git(repo.work, "rev-parse", "verified/web") == repo.shas["c0c"]

    # and the pipeline goes on: the fix validates green
    repo.commit("c5", repo.outcome("api", "green"))
    fixed = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([fixed], timeout=240)
    pipeline.wait_quiet(timeout=240)
    assert pipeline.states()[fixed] == "succeeded"
    assert _gate(pipeline, repo, "c5") == 0
    assert pipeline.invariant_violations() == []
    assert pipeline.dead_letters() == 0 and pipeline.parked() == []


def _shown(pipeline: Pipeline) -> dict[str, str]:
    """`stovepipe queue` and `stovepipe explain` of the queue and each project's scope."""
    return {name: pipeline.cli("queue", name).stdout + pipeline.cli("explain", name).stdout
            for name in (QUEUE, f"{QUEUE}#api", f"{QUEUE}#web", f"{QUEUE}#docs")}


def _gate(pipeline: Pipeline, repo: Monorepo, name: str, project: str | None = None) -> int:
    """`stovepipe fact`'s exit status for the commit (for the project if one is named): 0
    green, 3 not green."""
    scope = ("--project", project) if project else ()
    return pipeline.cli("fact", QUEUE, repo.shas[name], *scope, check=False).returncode


def _prune_all(pipeline: Pipeline) -> PruneReport:
    async def main() -> PruneReport:
        db = await Database.open(pipeline.dsn, max_size=4)
        try:
            cutoff = await db.retention.now() + timedelta(days=1)
            return await prune(db, Policy(timedelta(days=180), 1), cutoff=cutoff)
        finally:
            await db.close()
    return asyncio.run(main())

