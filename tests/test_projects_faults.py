"""Issue 24 under replays and crashes, on a real broker and database (the fake source
control, whose commits name the paths they change, and the fake build runner, whose
``failfor<project>`` fails one project's builds): replaying every topic changes no
project's fact or answer, and with two workers, one SIGKILLed mid-run, every project's
fact and answer is exact."""

from __future__ import annotations

import random

import pytest

from streams.extensions.sourcecontrol.fakefile import read_state
from streams.stages.affected import PathRules
from tests.pipeline_support import (
    Pipeline,
    group_lag,
    produce_ingests,
    reset_group_to_beginning,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

PROJECTS = {
    "api": {"paths": ["services/api/**", "libs/common/**"]},
    "web": {"paths": ["web/**", "libs/common/**"]},
    "docs": {"paths": ["docs/**"], "blocking": False},
}
RULES = {p: PathRules(tuple(spec["paths"])) for p, spec in PROJECTS.items()}
FILES = ["services/api/a.py", "web/w.js", "libs/common/c.py", "docs/d.md", "README.md"]


def _push(pipeline: Pipeline, ref: str, rng: random.Random, name: str) -> tuple[str, list[str]]:
    paths = rng.sample(FILES, rng.randint(1, 2))
    tokens = [name]
    if rng.random() < 0.3:
        tokens.append(f"failfor{rng.choice(list(PROJECTS))}")
    sha = "-".join(tokens)
    pipeline.repo.push(ref, sha, paths={sha: paths})
    return sha, paths


def _projects_queue(pipeline: Pipeline, name: str, max_concurrent: int = 1) -> str:
    ref = pipeline.add_queue(name, max_concurrent=max_concurrent)
    body = dict(pipeline.queues[name])
    body["projects"] = PROJECTS
    pipeline.add_raw_queue(name, body)
    return ref


def _changed_paths(pipeline: Pipeline, base_uri: str, head_uri: str) -> set[str]:
    """What the fake repository says changed from ``base_uri`` to ``head_uri``."""
    state = read_state(pipeline.repo.path)
    assert state is not None

    def reachable(sha: str) -> set[str]:
        seen, todo = set(), [sha]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(state.parents(current))
        return seen

    base, head = base_uri.rsplit("/", 1)[1], head_uri.rsplit("/", 1)[1]
    return {path for sha in reachable(head) - reachable(base)
            for path in state.commits[sha].get("paths", [])}


def exact_project_problems(pipeline: Pipeline) -> list[str]:
    """Every project fact says what its commit's tokens say for its project; every
    inherited answer is its source fact's, and the project's paths did not change
    between the source commit and the answer's; every decided Request's verdict is its
    blocking projects'."""
    problems = []
    for queue, uri, project, degree in pipeline.query(
            "SELECT queue, uri, project, degree FROM validation_fact WHERE project <> ''"):
        sha = uri.rsplit("/", 1)[1]
        expected = 1.0 if f"failfor{project}" in sha.split("-") else 0.0
        if degree != expected:
            problems.append(f"{queue} {sha}: degree {degree}, expected {expected}")
    facts = {(q, r): d for q, r, d in pipeline.query(
        "SELECT queue, request_id, degree FROM validation_fact WHERE project <> ''")}
    for queue, request_id, project, uri, degree, inherited, source, source_uri in \
            pipeline.query("SELECT queue, request_id, project, uri, degree, inherited,"
                           " source_request_id, source_uri FROM project_answer"):
        scope = f"{queue}#{project}"
        if facts.get((scope, source)) != degree:
            problems.append(f"{request_id} {project}: answer {degree}, its source "
                            f"{source} says {facts.get((scope, source))}")
        if inherited:
            changed = _changed_paths(pipeline, source_uri, uri)
            if RULES[project].touched_by(changed):
                problems.append(f"{request_id} {project}: inherited although {changed} "
                                f"changed since {source_uri}")
    for queue, request_id, state, verdict in pipeline.query(
            "SELECT r.queue, r.id, r.state, r.verdict FROM request r JOIN request_plan p"
            " ON p.queue = r.queue AND p.request_id = r.id WHERE p.completed"):
        answers = dict(pipeline.query("SELECT project, degree FROM project_answer"
                                      " WHERE queue = %s AND request_id = %s",
                                      queue, request_id))
        blocking = [p for p, spec in PROJECTS.items() if spec.get("blocking", True)]
        if any(answers.get(p, 0) > 0 for p in blocking):
            expected = ("failed", "red")
        elif all(p in answers for p in blocking):
            expected = ("succeeded", "green")
        else:
            expected = ("failed", None)
        if (state, verdict) != expected and state in ("succeeded", "failed"):
            problems.append(f"{request_id}: {state}/{verdict}, its projects say {expected}")
    return problems


def test_replaying_every_topic_changes_no_project_fact(pipeline: Pipeline) -> None:
    rng = random.Random(3)
    refs = {q: _projects_queue(pipeline, q) for q in ("m1", "m2")}
    pipeline.start_worker()
    for i in range(5):
        for q, ref in refs.items():
            _push(pipeline, ref, rng, f"{q}-c{i}")
            pipeline.ingest(q)
        pipeline.wait_quiet(timeout=120)
    assert exact_project_problems(pipeline) == []
    before = pipeline.dump()
    assert before["project_answer"] and before["request_plan"]
    pipeline.stop_workers()

    from tests.test_pipeline_e2e import _groups_and_topics
    groups = _groups_and_topics(pipeline)
    for group, topics in groups.items():
        reset_group_to_beginning(pipeline.bootstrap, group, topics)
    pipeline.start_worker()
    for group, topics in groups.items():
        wait_until(lambda g=group, t=topics: group_lag(pipeline.bootstrap, g, t) == 0,
                   timeout=120, what=f"{group} to drain the replay", interval=0.5)
    assert pipeline.dump() == before
    assert pipeline.invariant_violations(strict_bookmark=True) == []


def test_two_workers_one_killed_mid_run_every_project_fact_exact(
        pipeline: Pipeline) -> None:
    rng = random.Random(11)
    names = [f"k{i}" for i in range(4)]
    refs = {q: _projects_queue(pipeline, q, max_concurrent=rng.choice([1, 2]))
            for q in names}
    workers = [pipeline.start_worker(), pipeline.start_worker()]
    rounds = 6
    for r in range(rounds):
        for q, ref in refs.items():
            _push(pipeline, ref, rng, f"{q}-h{r}-slow0.5")
        produce_ingests(pipeline.bootstrap, pipeline.topics, names)
        if r == rounds // 2:
            pipeline.kill_worker(workers.pop(0))
            workers.append(pipeline.start_worker())
    wait_until(lambda: _all_heads_in(pipeline, refs), timeout=240,
               what="every queue's last head ingested", interval=0.5)
    pipeline.wait_quiet(timeout=240)
    # and a last head touching no project: every project inherits its answer
    for q, ref in refs.items():
        sha = f"{q}-last"
        pipeline.repo.push(ref, sha, paths={sha: ["README.md"]})
        pipeline.ingest(q)
    pipeline.wait_quiet(timeout=240)
    assert exact_project_problems(pipeline) == []
    # the run had them all: built answers red and green, inherited ones
    kinds = set(pipeline.query("SELECT inherited, degree FROM project_answer"))
    assert {(False, 0.0), (False, 1.0)} <= kinds, kinds
    assert any(inherited for inherited, _ in kinds), kinds
    assert pipeline.invariant_violations(strict_bookmark=True) == []
    assert pipeline.dead_letters() == 0
    # the newest head of every queue was decided from its projects
    for q in names:
        latest = pipeline.queue_latest(q)
        assert latest is not None
        assert pipeline.query("SELECT completed FROM request_plan WHERE queue = %s"
                              " AND request_id = %s", q, latest) == [(True,)], q


def _all_heads_in(pipeline: Pipeline, refs: dict[str, str]) -> bool:
    for q, ref in refs.items():
        latest = pipeline.queue_latest(q)
        if latest is None:
            return False
        [(uri,)] = pipeline.query("SELECT uri FROM request WHERE queue = %s AND id = %s",
                                  q, latest)
        if uri.rsplit("/", 1)[1] != pipeline.repo.head(ref):
            return False
    return True


def test_a_project_whose_request_a_reconciler_fails_decides_its_head_at_once(
        pipeline: Pipeline) -> None:
    """Every project's build status fails for good (dead-lettered, then failed by the
    reconciler): the head is decided — could not be validated, naming each project — as
    soon as the last one is, not when the sweeper next looks (60 s later)."""
    ref = _projects_queue(pipeline, "r")
    pipeline.repo.push(ref, "r-c1-statuserror", paths={"r-c1-statuserror": FILES})
    pipeline.start_worker()
    rid = pipeline.ingest("r")
    pipeline.wait_terminal([rid], timeout=120)
    [(state, verdict, reason)] = pipeline.query(
        "SELECT state, verdict, reason FROM request WHERE queue = 'r' AND id = %s", rid)
    assert (state, verdict) == ("failed", None)
    assert reason.startswith("could not be validated: api: could not be validated: its "
                             "buildsignal step failed for good"), reason
    # decided by the reconciler that failed the last project's Request, not by the sweeper
    decided = [line for line in pipeline.full_logs().splitlines()
               if f"decided request_id={rid} " in line]
    assert len(decided) == 1 and "stage=buildsignal_dlq" in decided[0], decided
