"""Issue 24 on a real worker, broker, database and git repository, with command builds:
a monorepo's projects are built when their paths change and inherit their answer
otherwise; the whole repository is red only for a blocking project's red."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue, answers, git
from tests.pipeline_support import Pipeline
from tests.stack_support import free_ports

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _settle(pipeline: Pipeline, request_id: str) -> str:
    pipeline.wait_terminal([request_id], timeout=180)
    pipeline.wait_quiet(timeout=180)
    return pipeline.states()[request_id]


def _whole(pipeline: Pipeline, request_id: str) -> float | None:
    rows = pipeline.query("SELECT degree FROM validation_fact WHERE queue = %s"
                          " AND request_id = %s AND project = ''", QUEUE, request_id)
    return rows[0][0] if rows else None


def test_projects_are_built_when_touched_and_inherit_otherwise(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo)
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green"), "libs/common/lib.txt": "1\n"})
    pipeline.start_worker()

    # no project has a verdict yet: every one is built, each in its scope
    r1 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r1) == "succeeded"
    assert repo.built("c1") == {"api", "web", "docs"}
    assert answers(pipeline, r1) == {"api": (0.0, False), "web": (0.0, False),
                                     "docs": (0.0, False)}
    assert _whole(pipeline, r1) == 0.0
    # each project's fact is keyed (scope, commit, project)
    assert sorted(pipeline.query(
        "SELECT queue, project, degree FROM validation_fact WHERE uri = %s AND project <> ''",
        repo.uri("c1"))) == [(f"{QUEUE}#api", "api", 0.0), (f"{QUEUE}#docs", "docs", 0.0),
                             (f"{QUEUE}#web", "web", 0.0)]

    # a change to web only (its docs are excluded from it): only web is built
    repo.commit("c2", {"web/app.js": "1\n", "web/docs/guide.md": "x\n"})
    r2 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r2) == "succeeded"
    assert repo.built("c2") == {"web"}
    assert answers(pipeline, r2) == {"api": (0.0, True), "web": (0.0, False),
                                     "docs": (0.0, True)}
    # the build was told what changed since its base
    changed = (repo.out / f"changed-web-{repo.shas['c2']}").read_text().split()
    assert sorted(changed) == ["web/app.js", "web/docs/guide.md"]

    # the shared library touches api and web, not docs; api breaks: the whole repo is red
    repo.commit("c3", {"libs/common/lib.txt": "2\n", **repo.outcome("api", "red")})
    r3 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r3) == "failed"
    assert repo.built("c3") == {"api", "web"}
    assert answers(pipeline, r3) == {"api": (1.0, False), "web": (0.0, False),
                                     "docs": (0.0, True)}
    assert _whole(pipeline, r3) == 1.0
    assert pipeline.request(r3)["request"]["reason"] == "red: api"

    # docs (bring-up, not blocking) breaks; api is still red by inheritance: red
    repo.commit("c4", repo.outcome("docs", "red"))
    r4 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r4) == "failed"
    assert repo.built("c4") == {"docs"}
    assert answers(pipeline, r4) == {"api": (1.0, True), "web": (0.0, True),
                                     "docs": (1.0, False)}

    # api is fixed: the whole repository is green although docs stays red
    repo.commit("c5", repo.outcome("api", "green"))
    r5 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r5) == "succeeded"
    assert repo.built("c5") == {"api"}
    assert answers(pipeline, r5) == {"api": (0.0, False), "web": (0.0, True),
                                     "docs": (1.0, True)}
    assert _whole(pipeline, r5) == 0.0
    shown = pipeline.queue(QUEUE)
    assert shown["last_green_request_id"] == r5
    # each project's bookmark: its newest Request green, built or inherited
    assert dict(pipeline.query(
        "SELECT DISTINCT ON (project) project, request_id FROM project_answer"
        " WHERE queue = %s AND degree = 0"
        " ORDER BY project, request_rank(request_id) DESC", QUEUE)) == {
        "api": r5, "web": r5, "docs": r3}
    # web's own promotion ref follows web's bookmark, verified-main the whole repository's
    assert git(repo.work, "rev-parse", "verified/web") == repo.shas["c5"]
    assert git(repo.work, "rev-parse", "verified-main") == repo.shas["c5"]
    assert pipeline.invariant_violations(strict_bookmark=True) == []
    assert pipeline.dead_letters() == 0


def test_a_red_project_finds_its_own_culprit_in_its_scope(pipeline: Pipeline,
                                                           tmp_path: Path) -> None:
    """One push of five commits in which the third breaks api (and web changes too): api is
    red, web green; api's culprit is found by bisecting api's scope only (its probes build
    api alone), and the whole repository's red names no search of its own."""
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo, backfill={"mode": "bisect", "max_builds": 6})
    repo.commit("c0", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    pipeline.start_worker()
    r0 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r0) == "succeeded"

    repo.commit("c1", {"services/api/a.txt": "1\n"})
    repo.commit("c2", {"web/w.txt": "1\n"})
    repo.commit("c3", {**repo.outcome("api", "red")})
    repo.commit("c4", {"services/api/a.txt": "2\n"})
    repo.commit("c5", {"web/w.txt": "2\n"})
    head = pipeline.ingest(QUEUE)
    assert _settle(pipeline, head) == "failed"
    assert answers(pipeline, head) == {"api": (1.0, False), "web": (0.0, False),
                                       "docs": (0.0, True)}

    def search() -> tuple[str, str | None, str]:
        rows = pipeline.query("SELECT state, culprit_uri, queue FROM culprit_search")
        return rows[0] if rows else ("none", None, "")

    from tests.waiting import wait_until
    wait_until(lambda: search()[0] not in ("none", "bisecting"), timeout=180,
               what="api's culprit search to end")
    state, culprit, scope = search()
    assert (state, culprit, scope) == ("found", repo.uri("c3"), f"{QUEUE}#api")
    pipeline.wait_quiet(timeout=180)
    # every probe built api only
    probes = [line for line in repo.started_lines() if "~" in line[2]]
    assert probes and {line[1] for line in probes} == {"api"}
    assert pipeline.query("SELECT count(*) FROM culprit_search WHERE queue = %s",
                          QUEUE) == [(0,)]


def _plan(pipeline: Pipeline, request_id: str) -> tuple[list[str], str]:
    [(affected, reason)] = pipeline.query(
        "SELECT affected, reason FROM request_plan WHERE queue = %s AND request_id = %s",
        QUEUE, request_id)
    return sorted(affected), reason


def test_a_history_rewrite_affects_every_project_and_says_why(pipeline: Pipeline,
                                                              tmp_path: Path) -> None:
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo)
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    pipeline.start_worker()
    r1 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r1) == "succeeded"
    repo.commit("c2", {"web/w.txt": "1\n"})
    r2 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r2) == "succeeded"
    assert _plan(pipeline, r2) == (["web"], "")

    # the branch is rewritten: a new root commit, touching docs only
    git(repo.work, "checkout", "-q", "--orphan", "rewritten")
    repo.commit("x1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green"), "docs/new.md": "x\n"})
    git(repo.work, "branch", "-q", "-f", "main", "rewritten")
    git(repo.work, "checkout", "-q", "main")
    r3 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r3) == "succeeded"
    affected, reason = _plan(pipeline, r3)
    assert affected == ["api", "docs", "web"]
    assert reason.startswith("history rewrite: the base ") and "not an ancestor" in reason
    assert repo.built("x1") == {"api", "web", "docs"}


def test_an_affected_command_names_the_projects_and_its_failure_affects_every_one(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """The queue's `affected` command replaces the path rules: it is given the base and
    head (and the changed paths) and names projects; when it fails, every project is
    affected with the reason."""
    repo = Monorepo(tmp_path)
    answer = tmp_path / "affected-answer"
    seen = tmp_path / "affected-seen"
    command = (f'echo "$STOVEPIPE_BASE_SHA $STOVEPIPE_HEAD_SHA" >> {seen}; '
               f'cat "$STOVEPIPE_CHANGED_PATHS" >> {seen}; cat {answer}')
    add_projects_queue(pipeline, repo, affected={"command": command, "timeout": "20s"})
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    pipeline.start_worker()
    r1 = pipeline.ingest(QUEUE)  # no base yet: every project, the command not asked
    assert _settle(pipeline, r1) == "succeeded"
    assert not seen.exists()

    answer.write_text("docs\n")  # whatever changed, the command says docs
    repo.commit("c2", {"web/w.txt": "1\n"})
    r2 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r2) == "succeeded"
    assert _plan(pipeline, r2) == (["docs"], "")
    assert repo.built("c2") == {"docs"}
    assert seen.read_text().split() == [repo.shas["c1"], repo.shas["c2"], "web/w.txt"]

    answer.write_text("nosuchproject\n")
    repo.commit("c3", {"web/w.txt": "2\n"})
    r3 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r3) == "succeeded"
    assert _plan(pipeline, r3) == (
        ["api", "docs", "web"], "the affected command named unknown projects: nosuchproject")

    answer.unlink()  # cat fails: exit status 1
    repo.commit("c4", {"web/w.txt": "3\n"})
    r4 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r4) == "succeeded"
    affected, reason = _plan(pipeline, r4)
    assert affected == ["api", "docs", "web"]
    assert reason.startswith("the affected command failed (exit status 1)")


def test_a_backstop_builds_every_project_and_reports_a_red_the_rules_missed(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """api's build reads config/, which its path rules leave out: a change there that
    breaks api is missed (api inherits green) until the backstop builds every project,
    finds api red, and says the rules said it was unaffected."""
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo, backstop="1h")
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    pipeline.start_worker()
    r1 = pipeline.ingest(QUEUE)  # the first Request is a backstop: there was none
    assert _settle(pipeline, r1) == "succeeded"
    assert pipeline.query("SELECT backstop FROM request_plan WHERE request_id = %s",
                          r1) == [(True,)]

    repo.commit("c2", {"config/break-api": "x\n"})
    r2 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r2) == "succeeded"  # the rules miss it: nothing is built
    assert repo.built("c2") == set()
    assert answers(pipeline, r2)["api"] == (0.0, True)

    # an hour later (the last backstop's time set back): the next Request is a backstop
    pipeline.execute("UPDATE request_plan SET created_at = created_at - interval '2 hours'"
                     " WHERE queue = %s AND backstop", QUEUE)
    repo.commit("c3", {"README.md": "x\n"})
    r3 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r3) == "failed"
    assert repo.built("c3") == {"api", "web", "docs"}
    [(backstop, unaffected, reason)] = pipeline.query(
        "SELECT backstop, rules_unaffected, reason FROM request_plan WHERE request_id = %s",
        r3)
    assert backstop and sorted(unaffected) == ["api", "docs", "web"]
    assert reason.startswith("backstop: every project is validated every 3600s")
    assert answers(pipeline, r3)["api"] == (1.0, False)
    assert "backstop_red_where_unaffected project=api" in pipeline.full_logs()


def _diffs(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(r'^stovepipe_affected_diffs_total\{queue="mono/main"\} (\S+)$', text,
                      re.M)
    return float(found.group(1)) if found else 0.0


def test_a_chain_of_heads_costs_one_diff_each_however_spread_the_bases(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """Each head touches another project, so the projects' bases spread over the chain
    (api's at c0, web's at c1, docs' at c2); each head is still planned by one diff, from
    the previous head — and every answer is the one a diff from each base gives."""
    repo = Monorepo(tmp_path)
    add_projects_queue(pipeline, repo)
    repo.commit("c0", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    [port] = free_ports(1)
    pipeline.start_worker(web_port=port)
    r0 = pipeline.ingest(QUEUE)
    assert _settle(pipeline, r0) == "succeeded"
    assert _diffs(port) == 0  # no base yet: nothing to diff

    heads = {}
    for name, files in (("c1", {"web/w.txt": "1\n"}), ("c2", {"docs/d.md": "1\n"}),
                        ("c3", {"services/api/a.txt": "1\n"}),
                        ("c4", {"libs/common/lib.txt": "1\n"})):
        repo.commit(name, files)
        heads[name] = pipeline.ingest(QUEUE)
        assert _settle(pipeline, heads[name]) == "succeeded"
    assert _diffs(port) == 4
    assert {name: repo.built(name) for name in heads} == {
        "c1": {"web"}, "c2": {"docs"}, "c3": {"api"}, "c4": {"api", "web"}}
    sources = dict(pipeline.query(
        "SELECT project, source_uri FROM project_answer WHERE queue = %s AND request_id = %s",
        QUEUE, heads["c3"]))
    # what each inherits is its own base, not the head it was diffed from
    assert sources == {"api": repo.uri("c3"), "web": repo.uri("c1"), "docs": repo.uri("c2")}
    assert answers(pipeline, heads["c4"]) == {"api": (0.0, False), "web": (0.0, False),
                                              "docs": (0.0, True)}
    assert pipeline.invariant_violations(strict_bookmark=True) == []
