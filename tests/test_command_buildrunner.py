"""The command BuildRunner with real commands: outcomes, the checkout, the environment,
cancelling a process group, a worker that goes away, vanished builds, the concurrency bound."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from store.entities import BuildStatus
from streams.extensions.buildrunner import BuildRunner, BuildRunnerError
from streams.extensions.buildrunner.command import ACTIVE_DIR, CHECKOUT, CommandBuildRunner
from streams.extensions.sourcecontrol.gituri import git_uri
from tests.command_support import Builds, Repo, dead, gate, git
from tests.waiting import wait_until

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path / "repo")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A directory commands write what they saw into."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def builds(tmp_path: Path, repo: Repo, migrated_dsn: str) -> Iterator[Builds]:
    made = Builds(tmp_path, repo, migrated_dsn)
    yield made
    made.cleanup()


# --- outcomes -------------------------------------------------------------------------------


def test_it_is_a_build_runner(builds: Builds) -> None:
    runner: BuildRunner = builds.runner("true")
    assert runner is not None


def test_a_passing_build(builds: Builds, repo: Repo) -> None:
    runner = builds.runner("echo building; exit 0")
    build_id = builds.trigger(runner, repo.uri(3))
    assert build_id.startswith("cmd-") and len(build_id) == 36
    result = builds.finished(runner, build_id)
    assert result.status is BuildStatus.SUCCEEDED
    assert result.metadata["exit_code"] == "0" and result.metadata["reason"] == "exit_code"
    state = builds.work_dir / build_id
    log = Path(result.metadata["log"])
    assert log == state / "log" and "building" in log.read_text()
    # every host reads the same from the row: the owner and the end of the log
    assert result.metadata["host"] == "host-a"
    assert result.metadata["log_tail"].endswith("building\n")
    row = builds.row(build_id)
    assert (row.status, row.exit_code, row.host, row.work_dir) == (
        BuildStatus.SUCCEEDED, 0, "host-a", str(builds.work_dir))
    assert row.started_at is not None and row.finished_at is not None
    assert {"build.json", "pid", "pgid", "start_time", "exit_code", "log"} <= set(
        os.listdir(state))
    assert not (state / CHECKOUT).exists()  # the checkout is removed, the log is kept
    assert os.listdir(builds.work_dir / ACTIVE_DIR) == []
    assert builds.status(runner, build_id) is BuildStatus.SUCCEEDED  # and stays so


def test_a_failing_build(builds: Builds, repo: Repo) -> None:
    runner = builds.runner("echo broken >&2; exit 3")
    build_id = builds.trigger(runner, repo.uri(3))
    result = builds.finished(runner, build_id)
    assert result.status is BuildStatus.FAILED and result.metadata["exit_code"] == "3"
    assert "broken" in Path(result.metadata["log"]).read_text()


def test_a_slow_build_runs_then_ends(builds: Builds, repo: Repo) -> None:
    runner = builds.runner("sleep 2")
    started = time.monotonic()
    build_id = builds.trigger(runner, repo.uri(3))
    assert builds.status(runner, build_id) is BuildStatus.RUNNING
    assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED
    assert time.monotonic() - started >= 2


def test_the_command_runs_in_a_clean_checkout_of_the_head_commit(builds: Builds, repo: Repo,
                                                                 out: Path) -> None:
    command = (f"git rev-parse HEAD > {out}/head-$STOVEPIPE_BUILD_ID; "
               f"ls > {out}/files-$STOVEPIPE_BUILD_ID; test ! -e dirty && touch dirty")
    runner = builds.runner(command)
    old = builds.trigger(runner, repo.uri(1))  # not main's head: the commit asked for
    assert builds.finished(runner, old).status is BuildStatus.SUCCEEDED
    assert (out / f"head-{old}").read_text().strip() == repo.shas[0]
    assert (out / f"files-{old}").read_text().split() == ["file1"]
    new = builds.trigger(runner, repo.uri(3))  # a fresh checkout: the `dirty` file is not there
    assert builds.finished(runner, new).status is BuildStatus.SUCCEEDED
    assert (out / f"head-{new}").read_text().strip() == repo.shas[2]
    assert (out / f"files-{new}").read_text().split() == ["file1", "file2", "file3"]


def test_the_build_sees_its_variables(builds: Builds, repo: Repo, out: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STOVEPIPE_POSTGRES_DSN", "postgresql://secret@db/stovepipe")
    monkeypatch.setenv("BUILD_FLAVOUR", "inherited")
    runner = builds.runner(f"env | grep -E '^(STOVEPIPE_|BUILD_FLAVOUR)' | sort "
                           f"> {out}/env-$STOVEPIPE_BUILD_ID; "
                           f"git cat-file -e \"${{STOVEPIPE_BASE_SHA:-HEAD}}^{{commit}}\"")

    def seen(build_id: str) -> dict[str, str]:
        assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED
        lines = (out / f"env-{build_id}").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines)

    incremental = builds.trigger(runner, repo.uri(3), repo.uri(1),
                          {"queue": "mono/main", "request_id": "request/mono/main/7",
                           "strategy": "incremental"})
    assert seen(incremental) == {
        "BUILD_FLAVOUR": "inherited",
        "STOVEPIPE_BASE_SHA": repo.shas[0],
        "STOVEPIPE_BASE_URI": repo.uri(1),
        "STOVEPIPE_BUILD_ID": incremental,
        "STOVEPIPE_HEAD_SHA": repo.shas[2],
        "STOVEPIPE_HEAD_URI": repo.uri(3),
        "STOVEPIPE_QUEUE": "mono/main",
        "STOVEPIPE_REQUEST_ID": "request/mono/main/7",
    }  # the base commit is in the checkout's history; the worker's settings are not
    full = builds.trigger(runner, repo.uri(2), None, {"request_id": "request/mono/main/8"})
    assert seen(full) | {"STOVEPIPE_BUILD_ID": ""} == {
        "BUILD_FLAVOUR": "inherited", "STOVEPIPE_BASE_SHA": "", "STOVEPIPE_BASE_URI": "",
        "STOVEPIPE_BUILD_ID": "", "STOVEPIPE_HEAD_SHA": repo.shas[1],
        "STOVEPIPE_HEAD_URI": repo.uri(2), "STOVEPIPE_QUEUE": "mono/main",  # the runner's
        "STOVEPIPE_REQUEST_ID": "request/mono/main/8"}


def test_a_remote_repository_is_built_from_its_cache(builds: Builds, repo: Repo, out: Path,
                                                     tmp_path: Path) -> None:
    bare = tmp_path / "origin.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo.path), str(bare))
    url = bare.as_uri()
    runner = builds.runner(f"git rev-parse HEAD > {out}/head", repository=url,
                           cache_root=tmp_path / "cache")
    (repo.path / "file4").write_text("4\n")
    git(repo.path, "add", "-A")
    git(repo.path, "commit", "-q", "-m", "c4")
    git(repo.path, "push", "-q", str(bare), "main")
    sha = git(repo.path, "rev-parse", "HEAD")
    build_id = builds.trigger(runner, git_uri(url, "main", sha))
    assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED
    assert (out / "head").read_text().strip() == sha


# --- cancelling, timeouts, vanishing -----------------------------------------------------------


def test_cancel_kills_the_whole_process_group(builds: Builds, repo: Repo, out: Path) -> None:
    runner = builds.runner(f"sleep 60 & echo $! > {out}/grandchild; "
                           f"sleep 60 & echo $! > {out}/child; wait")
    build_id = builds.trigger(runner, repo.uri(3))
    wait_until(lambda: (out / "child").exists() and (out / "grandchild").exists(),
               timeout=20, what="the build's processes")
    pids = [int((out / name).read_text()) for name in ("child", "grandchild")]
    wrapper = int((builds.work_dir / build_id / "pid").read_text())
    assert builds.status(runner, build_id) is BuildStatus.RUNNING
    builds.run(runner.cancel(build_id))
    assert all(dead(pid) for pid in [*pids, wrapper])
    result = builds.report(runner, build_id)
    assert (result.status, result.metadata["reason"]) == (BuildStatus.CANCELLED, "cancelled")
    builds.run(runner.cancel(build_id))  # idempotent
    assert builds.status(runner, build_id) is BuildStatus.CANCELLED
    assert not (builds.work_dir / build_id / CHECKOUT).exists()


def test_a_build_that_ignores_sigterm_is_killed(builds: Builds, repo: Repo, out: Path) -> None:
    runner = builds.runner(f"trap '' TERM; touch {out}/started; sleep 60", kill_grace=0.5)
    build_id = builds.trigger(runner, repo.uri(3))
    wait_until((out / "started").exists, timeout=20, what="the build to start")
    started = time.monotonic()
    builds.run(runner.cancel(build_id))
    assert 0.5 <= time.monotonic() - started < 10
    assert dead(int((builds.work_dir / build_id / "pid").read_text()))
    assert builds.status(runner, build_id) is BuildStatus.CANCELLED


def test_a_finished_build_stays_as_it_ended(builds: Builds, repo: Repo) -> None:
    runner = builds.runner("exit 0")
    build_id = builds.trigger(runner, repo.uri(3))
    assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED
    builds.run(runner.cancel(build_id))
    assert builds.status(runner, build_id) is BuildStatus.SUCCEEDED


def test_a_build_past_its_timeout_is_stopped_and_failed(builds: Builds, repo: Repo,
                                                        out: Path) -> None:
    runner = builds.runner(f"echo $$ > {out}/shell; sleep 60", timeout=0.5)
    build_id = builds.trigger(runner, repo.uri(3))
    result = builds.wait_for(runner, build_id, lambda s: s.is_terminal, "to time out")
    assert (result.status, result.metadata["reason"]) == (BuildStatus.FAILED, "timeout")
    assert dead(int((out / "shell").read_text()))
    assert not (builds.work_dir / build_id / CHECKOUT).exists()
    assert os.listdir(builds.work_dir / ACTIVE_DIR) == []
    assert builds.status(runner, build_id) is BuildStatus.FAILED


def test_a_build_killed_behind_the_runner_s_back_vanished(builds: Builds, repo: Repo,
                                                          out: Path) -> None:
    runner = builds.runner(f"touch {out}/started; sleep 60")
    build_id = builds.trigger(runner, repo.uri(3))
    wait_until((out / "started").exists, timeout=20, what="the build to start")
    pgid = int((builds.work_dir / build_id / "pgid").read_text())
    assert pgid == os.getpgid(int((builds.work_dir / build_id / "pid").read_text()))
    assert pgid != os.getpgid(0)  # a session of its own
    os.killpg(pgid, signal.SIGKILL)
    result = builds.wait_for(runner, build_id, lambda s: s.is_terminal, "to be seen gone")
    assert (result.status, result.metadata["reason"]) == (BuildStatus.FAILED, "vanished")
    assert not (builds.work_dir / build_id / CHECKOUT).exists()
    assert os.listdir(builds.work_dir / ACTIVE_DIR) == []


def test_a_reused_pid_is_not_mistaken_for_the_build(builds: Builds, repo: Repo,
                                                    out: Path) -> None:
    runner = builds.runner(f"echo $$ > {out}/shell; sleep 60")
    build_id = builds.trigger(runner, repo.uri(3))
    wait_until((out / "shell").exists, timeout=20, what="the build to start")
    start_time = builds.work_dir / build_id / "start_time"
    # as if the wrapper died and another process now had its pid
    start_time.write_text(f"{int(start_time.read_text()) + 1}\n")
    result = builds.report(runner, build_id)
    assert (result.status, result.metadata["reason"]) == (BuildStatus.FAILED, "vanished")
    # what the build left running is still found by its id, and stopped
    wait_until(lambda: dead(int((out / "shell").read_text())), timeout=10,
               what="the leftover build processes to be killed")


def test_a_launch_cut_short_is_failed(builds: Builds, repo: Repo, out: Path) -> None:
    runner = builds.runner(gate(out, "go"), max_parallel=1)
    first = builds.trigger(runner, repo.uri(3))
    queued = builds.trigger(runner, repo.uri(3))
    assert builds.status(runner, queued) is BuildStatus.ACCEPTED
    (builds.work_dir / queued / "launching").touch()  # a worker died mid-launch
    result = builds.report(runner, queued)
    assert (result.status, result.metadata["reason"]) == (BuildStatus.FAILED, "vanished")
    (out / "go").touch()
    assert builds.finished(runner, first).status is BuildStatus.SUCCEEDED


# --- another worker ---------------------------------------------------------------------------

_TRIGGER_AND_EXIT = """
import asyncio, sys
from store import Database
from streams.extensions.buildrunner.command import CommandBuildRunner
command, repository, work_dir, head, dsn = sys.argv[1:]

async def main():
    async with await Database.open(dsn, max_size=1) as db:
        runner = CommandBuildRunner(command, repository, work_dir, database=db,
                                    host="host-a")
        print(await runner.trigger(None, head, {"request_id": "request/q/1",
                                                "trigger_key": "request/q/1"}))

asyncio.run(main())
"""


def test_a_build_outlives_the_worker_that_started_it(builds: Builds, repo: Repo,
                                                     out: Path, migrated_dsn: str) -> None:
    command = f"{gate(out, 'release')}; exit 4"
    started = subprocess.run(
        [sys.executable, "-c", _TRIGGER_AND_EXIT, command, str(repo.path),
         str(builds.work_dir), repo.uri(3), migrated_dsn],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=60)
    build_id = started.stdout.strip()
    runner = builds.runner(command)  # a fresh instance in another process, same host
    assert builds.status(runner, build_id) is BuildStatus.RUNNING
    # the trigger repeated after a crash: the same build, nothing started twice
    assert builds.trigger(runner, repo.uri(3), None, {"trigger_key": "request/q/1"}) == build_id
    assert [b for b in os.listdir(builds.work_dir) if b.startswith("cmd-")] == [build_id]
    (out / "release").touch()
    result = builds.finished(runner, build_id)
    assert (result.status, result.metadata["exit_code"]) == (BuildStatus.FAILED, "4")
    spec = json.loads((builds.work_dir / build_id / "build.json").read_text())
    assert spec["request_id"] == "request/q/1"
    assert builds.row(build_id).request_id == "request/q/1"


# --- bounded concurrency ----------------------------------------------------------------------


def test_builds_over_the_bound_queue_and_start_in_order(builds: Builds, repo: Repo,
                                                        out: Path) -> None:
    command = f"touch {out}/ran-$STOVEPIPE_BUILD_ID; {gate(out, 'release-$STOVEPIPE_BUILD_ID')}"
    runner = builds.runner(command, max_parallel=2)
    other = builds.runner(command, max_parallel=2)  # another worker, same work_dir
    ids = [builds.trigger(runner, repo.uri(3)), builds.trigger(other, repo.uri(2)),
           builds.trigger(runner, repo.uri(1)), builds.trigger(other, repo.uri(3))]
    assert [builds.status(runner, b) for b in ids] == [
        BuildStatus.RUNNING, BuildStatus.RUNNING, BuildStatus.ACCEPTED, BuildStatus.ACCEPTED]
    assert [builds.status(other, b) for b in ids[2:]] == [BuildStatus.ACCEPTED] * 2

    builds.run(other.cancel(ids[0]))  # frees a slot: the oldest queued build starts
    assert [builds.status(other, b) for b in ids] == [
        BuildStatus.CANCELLED, BuildStatus.RUNNING, BuildStatus.RUNNING, BuildStatus.ACCEPTED]
    builds.run(runner.cancel(ids[3]))  # a queued build cancelled never runs
    (out / f"release-{ids[1]}").touch()
    assert builds.finished(runner, ids[1]).status is BuildStatus.SUCCEEDED
    (out / f"release-{ids[2]}").touch()
    assert builds.finished(other, ids[2]).status is BuildStatus.SUCCEEDED
    assert builds.status(runner, ids[3]) is BuildStatus.CANCELLED
    assert not (out / f"ran-{ids[3]}").exists()
    assert not (builds.work_dir / ids[3] / "pid").exists()
    assert os.listdir(builds.work_dir / ACTIVE_DIR) == []


def test_concurrent_triggers_respect_the_bound(builds: Builds, repo: Repo, out: Path) -> None:
    runner = builds.runner(gate(out, "release"), max_parallel=3)

    async def many() -> list[str]:
        return await asyncio.gather(*(runner.trigger(None, repo.uri(3), {})
                                      for _ in range(6)))

    ids = builds.run(many())
    statuses = [builds.status(runner, b) for b in ids]
    assert statuses.count(BuildStatus.RUNNING) == 3
    assert statuses.count(BuildStatus.ACCEPTED) == 3
    (out / "release").touch()
    for build_id in ids:  # each poll starts the next ones
        assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED


# --- errors -----------------------------------------------------------------------------------


def test_a_trigger_key_names_one_commit(builds: Builds, repo: Repo) -> None:
    """The row keeps the head it builds: a repeated trigger of the key for that commit
    finds the build; one for another commit is a broken invariant (here a row edited by
    hand), never that build's outcome reported for it."""
    runner = builds.runner("true")
    key = {"trigger_key": "request/q/1", "request_id": "request/q/1"}
    build_id = builds.trigger(runner, repo.uri(3), None, key)
    assert builds.row(build_id).head_sha == repo.shas[2]
    assert builds.finished(runner, build_id).status is BuildStatus.SUCCEEDED
    assert builds.trigger(runner, repo.uri(3), None, key) == build_id  # the same commit

    with pytest.raises(BuildRunnerError) as caught:
        builds.trigger(runner, repo.uri(2), repo.uri(1), key)
    assert not caught.value.retryable
    assert "invariant" in str(caught.value) and build_id in str(caught.value)
    assert repo.shas[2] in str(caught.value) and repo.shas[1] in str(caught.value)
    assert builds.run(builds.db.command_builds.find_by_trigger_key(
        "request/q/1")) == builds.row(build_id)  # nothing new was started

    # a row from before the head was stored: its key is trusted, as it always was
    async def forget_head() -> None:
        async with builds.db.pool.connection() as conn:
            await conn.execute("UPDATE command_build SET head_sha = NULL")

    builds.run(forget_head())
    assert builds.trigger(runner, repo.uri(2), None, key) == build_id


def test_unknown_build_ids_are_not_retryable(builds: Builds) -> None:
    runner = builds.runner("true")
    for build_id in ("cmd-" + "0" * 32, "fake-abc", "cmd-../../etc", ""):
        with pytest.raises(BuildRunnerError) as info:
            builds.run(runner.status(build_id))
        assert not info.value.retryable
        with pytest.raises(BuildRunnerError):
            builds.run(runner.cancel(build_id))


def test_a_head_the_repository_does_not_have_is_not_retryable(builds: Builds,
                                                              repo: Repo) -> None:
    runner = builds.runner("true")
    for head in (git_uri(str(repo.path), "main", "0" * 40), "fake://demo/main/c1", "nonsense"):
        with pytest.raises(BuildRunnerError) as info:
            builds.trigger(runner, head)
        assert not info.value.retryable


def test_an_unreachable_remote_is_retryable(builds: Builds, tmp_path: Path) -> None:
    url = "http://127.0.0.1:1/mono.git"
    runner = builds.runner("true", repository=url, cache_root=tmp_path / "cache")
    with pytest.raises(BuildRunnerError) as info:
        builds.trigger(runner, git_uri(url, "main", "a" * 40))
    assert info.value.retryable


def test_bad_settings_are_refused(builds: Builds, tmp_path: Path) -> None:
    def make(command: str, **kwargs: Any) -> CommandBuildRunner:
        kwargs.setdefault("host", "host-a")
        return CommandBuildRunner(command, "/r", tmp_path, database=builds.db, **kwargs)

    with pytest.raises(ValueError, match="non-empty"):
        make(" ")
    with pytest.raises(ValueError, match="max_parallel"):
        make("true", max_parallel=0)
    with pytest.raises(ValueError, match="timeout"):
        make("true", timeout=0)
    with pytest.raises(ValueError, match="host_timeout"):
        make("true", host_timeout=0)
    with pytest.raises(ValueError, match="host id"):
        make("true", host=" ")
