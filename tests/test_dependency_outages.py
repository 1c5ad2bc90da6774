"""Issue 16, item 1: a dependency's outage changes no outcome (design §6).

A build runner or a repository answering 5xx, 429 (with Retry-After) or nothing at all is
waited out — never a reason to dead-letter while the work's own deadline has not passed —
and the waiting loop calls the dependency no more often than the healthy loop would. On
the real broker and database, with real worker processes; a local HTTP server plays
Buildkite's REST API, the fake build runner and source control play whole-CI and
whole-repository outages (their `down` files).
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.git_http import GitHttpServer, bare_repository
from tests.hosted_ci import FakeBuildkite
from tests.pipeline_support import Pipeline, produce_ingests
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

TOKEN = "bkua_outage-T0KEN"
TOKEN_ENV = "STOVEPIPE_TEST_BUILDKITE_TOKEN"


def _elapse(seconds: float) -> None:
    """Let an outage last ``seconds``: the outage *is* the duration under test (the
    pipeline's progress is waited for by condition everywhere else)."""
    time.sleep(seconds)


def _calls_per_build_per_minute(calls: list[tuple[str, float]], since: float,
                                until: float) -> dict[str, float]:
    minutes = (until - since) / 60
    per_build = Counter(build for build, at in calls if since <= at <= until)
    return {build: n / minutes for build, n in per_build.items()}


def test_a_ci_outage_fails_nothing_and_polls_no_faster_than_the_healthy_loop(
        pipeline: Pipeline) -> None:
    """The shipped poll delays (5 s queued, 2 s running): builds held open by latches, the
    CI down for 30 s (every call answered with a retryable error), then back; the builds
    end green, red and green, and each Request ends exactly as its build."""
    heads = {"ok": "a1-latchA", "red": "b1-latchB-fail", "queued": "c1-queued45-latchC"}
    for name in heads:
        pipeline.add_queue(name, poll_delay_queued="5s", poll_delay_running="2s",
                           poll_deadline="10m")
    pipeline.start_worker()
    ids = {}
    for name, sha in heads.items():
        pipeline.repo.push(f"{name}-main", sha)
        ids[name] = pipeline.ingest(name)
    wait_until(lambda: sorted(s for (s,) in pipeline.query("SELECT status FROM build"))
               == ["accepted", "running", "running"], timeout=90,
               what="two builds running and one queued")

    pipeline.set_ci_reachable(False)
    began = time.time()
    _elapse(30)
    pipeline.set_ci_reachable(True)
    ended = time.time()
    for latch in "ABC":
        pipeline.release(latch)
    pipeline.wait_quiet(timeout=120)

    assert pipeline.states() == {ids["ok"]: "succeeded", ids["red"]: "failed",
                                 ids["queued"]: "succeeded"}
    facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
    assert facts == {ids["ok"]: 0, ids["red"]: 1, ids["queued"]: 0}
    assert pipeline.query("SELECT id FROM request WHERE attempt <> 1") == []
    assert pipeline.dead_letters() == 0
    assert pipeline.query("SELECT count(*) FROM parked_message") == [(0,)]

    statuses = [(subject, at) for call, subject, at in pipeline.outage_calls()
                if call == "status"]
    rates = _calls_per_build_per_minute(statuses, began, ended)
    running = {b for (b,) in pipeline.query(
        "SELECT b.id FROM build b JOIN request r ON r.id = b.request_id"
        " WHERE r.queue IN ('ok', 'red')")}
    queued = {b for (b,) in pipeline.query(
        "SELECT b.id FROM build b JOIN request r ON r.id = b.request_id"
        " WHERE r.queue = 'queued'")}
    assert set(rates) == running | queued, rates  # every loop stayed alive
    # the healthy loop polls a running build 30 times a minute, a queued one 12 times
    assert all(rates[b] <= 30 for b in running), rates
    assert all(rates[b] <= 12 for b in queued), rates
    # and backed off: far fewer than the healthy loop over the whole outage
    assert sum(rates.values()) < 30, rates


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _repository(root: Path, name: str) -> tuple[Path, str]:
    work = root / name
    work.mkdir(parents=True)
    _git(work, "init", "-q")
    (work / "app.txt").write_text(f"{name}\n")
    _git(work, "add", "app.txt")
    _git(work, "commit", "-q", "-m", name)
    return work, _git(work, "rev-parse", "HEAD")


def test_a_hosted_ci_outage_longer_than_the_old_retry_ladder_changes_no_outcome(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """Four queues on one Buildkite organization, their builds running, a 10 s poll. The
    API answers 503 for 60 s, then 429 with Retry-After: 20 for 60 s, then nothing at all
    (every request times out) for 50 s: 170 s in all, longer than the 156 s after which
    the old retry ladder dead-lettered the poll loop and failed the Request. Then three
    builds pass and one fails: each Request ends exactly as its build, nothing is
    dead-lettered, and no build was polled more often than the healthy loop polls it."""
    fake = FakeBuildkite(TOKEN)
    with fake.in_thread():
        shas = {}
        for n in range(4):
            work, shas[f"q{n}"] = _repository(tmp_path, f"repo{n}")
            pipeline.add_raw_queue(f"q{n}", {
                "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
                "build_runner": {"kind": "buildkite", "organization": "acme",
                                 "pipeline": "monorepo", "token_env": TOKEN_ENV,
                                 "api_url": fake.url, "request_timeout": "2s"},
                "gate_delay": "1s", "poll_delay_queued": "10s",
                "poll_delay_running": "10s", "poll_deadline": "30m"})
        pipeline.start_worker(env={TOKEN_ENV: TOKEN})
        ids = {q: pipeline.ingest(q) for q in shas}

        def number_of(sha: str) -> int:
            builds = fake.builds_of(sha)
            return int(builds[0]["number"]) if builds else 0

        wait_until(lambda: all(number_of(s) for s in shas.values()), timeout=120,
                   what="a Buildkite build of every head")
        numbers = {q: number_of(s) for q, s in shas.items()}
        for number in numbers.values():
            fake.set_state(number, "running")
        wait_until(lambda: pipeline.query(
            "SELECT count(*) FROM build WHERE status = 'running'") == [(4,)],
            timeout=120, what="every build seen running")

        began = time.time()
        fake.go_down(503)
        _elapse(60)
        fake.go_down(429, headers={"Retry-After": "20"})
        _elapse(60)
        fake.go_down(hang=True)
        _elapse(50)
        ended = time.time()
        # the builds finished during the outage, unseen
        for q, number in numbers.items():
            fake.set_state(number, "failed" if q == "q3" else "passed")
        fake.come_back()

        pipeline.wait_quiet(timeout=300)
        assert pipeline.states() == {ids["q0"]: "succeeded", ids["q1"]: "succeeded",
                                     ids["q2"]: "succeeded", ids["q3"]: "failed"}
        facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
        assert facts == {ids["q0"]: 0, ids["q1"]: 0, ids["q2"]: 0, ids["q3"]: 1}
        assert pipeline.query("SELECT count(*) FROM build") == [(4,)]  # one attempt each
        assert pipeline.dead_letters() == 0
        assert pipeline.query("SELECT count(*) FROM parked_message") == [(0,)]

        # the builds are polled together (one list of the pipeline answers all four), so
        # the calls are counted for all of them: per build, at most the healthy loop's
        # 6 a minute, and some in every minute of the outage (the loops stayed alive)
        polls = [s.at for s in fake.requests("GET") if began <= s.at <= ended]
        per_build_per_minute = len(polls) / 4 / ((ended - began) / 60)
        print(f"calls per build per minute during the outage: {per_build_per_minute:.2f} "
              f"(the healthy loop: 6)")
        assert per_build_per_minute <= 6, per_build_per_minute
        assert all(any(m <= at < m + 60 for at in polls) for m in (began, began + 60))
        assert len(fake.requests("POST")) == 4  # no build triggered twice


def test_a_repository_outage_during_ingest_admission_and_promotion_fails_nothing(
        pipeline: Pipeline) -> None:
    """The queue's repository unreachable (every call a retryable error) while a head is
    ingested from the `ingest` topic, while a Request waits for its ancestry check at
    admission and while a green fact waits for its promotion: nothing is dead-lettered or
    failed, and everything completes once the repository answers again."""
    ref = pipeline.add_queue("q", poll_deadline="5m")
    promotion_ref = f"{ref}-verified-main"
    pipeline.start_worker()
    pipeline.repo.push(ref, "c1")
    first = pipeline.ingest("q")
    pipeline.wait_quiet()
    assert pipeline.repo.promoted(promotion_ref) == "c1"

    # ingest: the head cannot be resolved
    pipeline.repo.set_reachable(False)
    pipeline.repo.push(ref, "c2-latchA")
    produce_ingests(pipeline.bootstrap, pipeline.topics, ["q"])
    _elapse(8)
    assert pipeline.states() == {first: "succeeded"}  # nothing minted, nothing failed
    pipeline.repo.set_reachable(True)
    wait_until(lambda: len(pipeline.states()) == 2, timeout=60, what="c2 ingested")
    second = next(r for r in pipeline.states() if r != first)
    wait_until(lambda: pipeline.states()[second] == "processing", timeout=60,
               what="c2 admitted")

    # admission and promotion: c3 waits at the gate while c2 builds; then the repository
    # goes away and c2 ends green
    pipeline.repo.push(ref, "c3")
    third = pipeline.ingest("q")
    pipeline.repo.set_reachable(False)
    pipeline.release("A")
    wait_until(lambda: pipeline.query(
        "SELECT count(*) FROM validation_fact WHERE request_id = %s", second) == [(1,)],
        timeout=60, what="c2's fact, written while its promotion waits")
    _elapse(8)
    assert pipeline.states()[second] == "succeeded"
    assert pipeline.states()[third] == "accepted"  # its ancestry check waits
    assert pipeline.queue("q")["last_green_request_id"] == second
    assert pipeline.repo.promoted(promotion_ref) == "c1"  # the promotion waits
    assert pipeline.dead_letters() == 0

    pipeline.repo.set_reachable(True)
    pipeline.wait_quiet(timeout=90)
    assert pipeline.states() == {first: "succeeded", second: "succeeded",
                                 third: "succeeded"}
    assert pipeline.repo.promoted(promotion_ref) == "c3"
    strategy = pipeline.query("SELECT build_strategy, base_uri FROM request WHERE id = %s",
                              third)
    assert strategy == [("incremental", pipeline.repo.uri("r", ref, "c2-latchA"))]
    assert pipeline.exact_outcome_problems() == []
    logs = pipeline.full_logs()
    assert "dependency_wait stage=ingest" in logs
    assert "dependency_wait stage=process" in logs
    assert "dependency_wait stage=record" in logs


def test_a_git_host_outage_during_ingest_and_promotion_fails_nothing(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """A real git host over smart HTTP answering 503 to everything while a head is ingested
    from the `ingest` topic, and later while a green commit's promotion is pushed: nothing
    fails or is dead-lettered, and both complete once the host is back."""
    served = tmp_path / "served"
    served.mkdir()
    server = GitHttpServer(served, "ci", "pw")
    with server.running():
        work = tmp_path / "work"
        bare = bare_repository(served, "mono.git", work)
        hold = tmp_path / "hold"

        def commit(name: str) -> str:
            (work / "app.txt").write_text(f"{name}\n")
            _git(work, "add", "app.txt")
            _git(work, "commit", "-q", "-m", name)
            _git(work, "push", "-q", "origin", "HEAD:main")  # to the bare path, not HTTP
            return _git(work, "rev-parse", "HEAD")

        def promoted() -> str | None:
            try:
                return _git(bare, "rev-parse", "refs/heads/verified-main")
            except subprocess.CalledProcessError:
                return None

        c1 = commit("c1")
        pipeline.add_raw_queue("mono", {
            "source_control": {"kind": "git", "repository": server.url("mono.git"),
                               "ref": "main", "promotion_ref": "verified-main"},
            "build_runner": {"kind": "command",
                             "command": f'while [ -e "{hold}" ]; do sleep 0.2; done'},
            "gate_delay": "200ms", "poll_delay_queued": "200ms",
            "poll_delay_running": "200ms", "poll_deadline": "5m"})
        pipeline.start_worker()
        first = pipeline.ingest("mono")
        pipeline.wait_quiet(timeout=120)
        wait_until(lambda: promoted() == c1, timeout=60, what="c1 promoted")

        # ingest: the head cannot be fetched
        server.down = True
        c2 = commit("c2")
        produce_ingests(pipeline.bootstrap, pipeline.topics, ["mono"])
        _elapse(8)
        assert pipeline.states() == {first: "succeeded"}
        assert pipeline.dead_letters() == 0
        server.down = False
        wait_until(lambda: len(pipeline.states()) == 2, timeout=90, what="c2 ingested")
        pipeline.wait_quiet(timeout=120)
        wait_until(lambda: promoted() == c2, timeout=60, what="c2 promoted")

        # promotion: c3's build ends while the host is down
        hold.touch()
        c3 = commit("c3")
        third = pipeline.ingest("mono")
        wait_until(lambda: pipeline.states()[third] == "processing", timeout=60,
                   what="c3 building")
        wait_until(lambda: pipeline.query("SELECT count(*) FROM command_build WHERE"
                                          " status = 'running'") == [(1,)], timeout=60,
                   what="c3's build running")
        server.down = True
        hold.unlink()
        wait_until(lambda: pipeline.query("SELECT count(*) FROM validation_fact"
                                          " WHERE request_id = %s", third) == [(1,)],
                   timeout=60, what="c3's fact, while its promotion waits")
        _elapse(6)
        assert promoted() == c2
        assert pipeline.queue("mono")["last_green_request_id"] == third
        server.down = False
        wait_until(lambda: promoted() == c3, timeout=120, what="the promotion, once back")
        pipeline.wait_quiet(timeout=60)
        assert set(pipeline.states().values()) == {"succeeded"}
        assert pipeline.dead_letters() == 0
        assert pipeline.query("SELECT count(*) FROM parked_message") == [(0,)]
        logs = pipeline.full_logs()
        assert "dependency_wait stage=ingest" in logs
        assert "dependency_wait stage=record" in logs
