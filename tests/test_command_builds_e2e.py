"""Issue 11: the command build runner with workers on two hosts. Two real `stovepipe
worker` processes, each with a STOVEPIPE_HOME and a host id of its own, share the
partitions of one pipeline on the real broker and database; a git queue builds with a
real command. A build's polls that land on the host that did not trigger it are answered
from the build's row, and the Request ends as the build did; a host that dies has its
build reported lost for its silence — no verdict — and its attempt is made again on the
other host (issue 16)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

QUEUE = "mono/main"
HOSTS = ("host-a", "host-b")
MAX_ROUNDS = 12  # each round crosses hosts with probability about 1/2


def _git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-C", str(work), *args], env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def _commit(work: Path, name: str) -> str:
    (work / "app.txt").write_text(f"{name}\n")
    _git(work, "add", "app.txt")
    _git(work, "commit", "-q", "-m", name)
    return _git(work, "rev-parse", "HEAD")


def _setup(pipeline: Pipeline, tmp_path: Path, command: str, *,
           knobs: dict[str, Any] | None = None, **runner: Any) -> Path:
    repo = tmp_path / "mono"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _commit(repo, "c0")
    pipeline.add_raw_queue(QUEUE, {
        "source_control": {"kind": "git", "repository": str(repo), "ref": "main"},
        "build_runner": {"kind": "command", "command": command, **runner},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
        "poll_deadline": "5m", **(knobs or {})})
    for n, host in enumerate(HOSTS, start=1):  # worker-1.log is host-a's, worker-2 host-b's
        pipeline.start_worker(env={"STOVEPIPE_HOME": str(tmp_path / f"home-{host}"),
                                   "STOVEPIPE_HOST_ID": host})
        assert len(pipeline.workers) == n
    _wait_for_both_workers(pipeline)
    return repo


def _wait_for_both_workers(pipeline: Pipeline) -> None:
    """Both workers are members of the group, each with partitions of its own."""
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})

    def split() -> bool:
        group = admin.describe_consumer_groups([pipeline.app_id])[pipeline.app_id]
        try:
            members = group.result(timeout=10).members
        except Exception:
            return False
        return len(members) == 2 and all(
            m.assignment is not None and m.assignment.topic_partitions for m in members)

    wait_until(split, timeout=120, what="both workers to share the partitions", interval=0.5)


def _settled_by(pipeline: Pipeline, build_id: str) -> str | None:
    """The host whose worker settled the build (its log says so)."""
    for n, host in enumerate(HOSTS, start=1):
        log = pipeline.root / f"worker-{n}.log"
        if log.exists() and f"settled build_id={build_id}" in log.read_text(errors="replace"):
            return host
    return None


def test_polls_on_the_host_that_did_not_trigger_the_build_settle_it(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = _setup(pipeline, tmp_path, 'test -f app.txt && echo "built $STOVEPIPE_HEAD_SHA"')
    crossed: list[str] = []
    requests: list[str] = []
    for n in range(1, MAX_ROUNDS + 1):
        sha = _commit(repo, f"c{n}")
        request_id = pipeline.ingest(QUEUE)
        requests.append(request_id)
        pipeline.wait_terminal([request_id], timeout=120)
        [(build_id, host, status, reason, log_tail)] = pipeline.query(
            "SELECT build_id, host, status, reason, log_tail FROM command_build"
            " WHERE request_id = %s", request_id)
        assert (status, reason, log_tail.splitlines()[-1]) == (
            "succeeded", "exit_code", f"built {sha}")
        wait_until(lambda b=build_id: _settled_by(pipeline, b) is not None, timeout=30,
                   what="the settling worker's log line")
        if _settled_by(pipeline, build_id) != host:
            crossed.append(build_id)
            break
    assert crossed, f"in {MAX_ROUNDS} rounds no build was settled by the other host"
    pipeline.wait_quiet(timeout=120)
    assert pipeline.states() == dict.fromkeys(requests, "succeeded")
    facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
    assert facts == dict.fromkeys(requests, 0.0)
    assert pipeline.exact_outcome_problems() == []  # nothing dead-lettered, nothing parked
    # the build ran where it was triggered, and only there
    [(owner,)] = pipeline.query("SELECT host FROM command_build WHERE build_id = %s",
                                crossed[0])
    other = HOSTS[1 - HOSTS.index(owner)]
    assert (tmp_path / f"home-{owner}" / "builds" / "mono" / "main" / crossed[0]).is_dir()
    assert not (tmp_path / f"home-{other}" / "builds" / "mono" / "main" / crossed[0]).exists()


def test_a_dead_host_s_build_is_attempted_again_on_the_other_host(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """The owner's machine goes (its worker and its build at once): the build is declared
    lost for its host's silence — which gives no verdict — and the attempt is made again
    on the surviving host, which ends green. No red fact, no red Request."""
    marker = tmp_path / "first-attempt-ran"
    # the first attempt hangs until its host dies; any later one passes
    _setup(pipeline, tmp_path,
           f'if [ -e "{marker}" ]; then echo again; exit 0; fi; touch "{marker}"; sleep 600',
           host_timeout="10s", knobs={"retry": {"unvalidated": 2, "backoff": "1s"}})
    request_id = pipeline.ingest(QUEUE)

    def running() -> list[tuple[Any, ...]]:
        return pipeline.query("SELECT build_id, host, pgid FROM command_build"
                              " WHERE request_id = %s AND status = 'running'", request_id)

    wait_until(lambda: bool(running()), timeout=120, what="the build to run")
    [(build_id, owner, pgid)] = running()
    dead = pipeline.workers[HOSTS.index(owner)]
    pipeline.kill_worker(dead)
    os.killpg(pgid, signal.SIGKILL)
    pipeline.workers.remove(dead)  # wait_terminal checks the last worker is alive
    pipeline.wait_terminal([request_id], timeout=180)
    assert pipeline.states() == {request_id: "succeeded"}

    [(status, reason, detail)] = pipeline.query(
        "SELECT status, reason, detail FROM command_build WHERE build_id = %s", build_id)
    assert (status, reason) == ("failed", "host_lost")
    assert re.fullmatch(rf"host {owner} stopped heartbeating \(last seen \S+, \d+ s before "
                        r"it was declared lost\)", detail), detail
    survivor = HOSTS[1 - HOSTS.index(owner)]
    attempts = pipeline.query(
        "SELECT b.attempt, b.status, b.verdict, b.reason, c.host FROM build b"
        " JOIN command_build c ON c.build_id = b.id WHERE b.request_id = %s"
        " ORDER BY b.attempt", request_id)
    assert [(a, s, v, h) for a, s, v, _, h in attempts] == [
        (1, "failed", None, owner), (2, "succeeded", "green", survivor)]
    assert attempts[0][3].startswith(f"its host was lost: host {owner} stopped heartbeating")
    survivor_log = (pipeline.root / f"worker-{HOSTS.index(survivor) + 1}.log").read_text(
        errors="replace")
    assert f"command_build_host_lost build_id={build_id} host={owner}" in survivor_log
    pipeline.wait_quiet(timeout=60)
    # one fact, green, from the second attempt: no red fact was ever written
    assert pipeline.query("SELECT degree, attempts, flaky FROM validation_fact") == [
        (0.0, 2, False)]
    assert pipeline.query("SELECT verdict, attempt, unvalidated_retries FROM request") == [
        ("green", 2, 1)]
    assert pipeline.exact_outcome_problems() == []
