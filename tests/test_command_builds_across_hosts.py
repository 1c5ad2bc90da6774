"""The command BuildRunner across hosts: a build runs on the host that triggered it, and
any other host answers its status and cancels it through its row in PostgreSQL; a host
that stops heartbeating has its builds reported failed within the bound, and never green
afterwards. Each host is a runner with its own host id and its own work_dir (its own
STOVEPIPE_HOME), all on one real database, running real processes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.entities import BuildStatus
from store.worker_hosts import HEARTBEAT_GAP
from streams.extensions.buildrunner.local_builds import LOG_TAIL_BYTES
from tests.command_support import HOST_A, HOST_B, Builds, Repo, dead, gate
from tests.waiting import wait_until

pytestmark = pytest.mark.postgres


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    return Repo(tmp_path / "repo")


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def builds(tmp_path: Path, repo: Repo, migrated_dsn: str) -> Iterator[Builds]:
    made = Builds(tmp_path, repo, migrated_dsn)
    yield made
    made.cleanup()


def test_another_host_sees_the_owner_s_progress_through_the_row(builds: Builds, repo: Repo,
                                                               out: Path) -> None:
    command = f"echo step one; {gate(out, 'release')}; echo step two"
    a, b = builds.runner(command), builds.runner(command, host=HOST_B)
    build_id = builds.trigger(a, repo.uri(3))
    builds.tend_in_background(a)
    seen = builds.wait_for(b, build_id, lambda s: s is BuildStatus.RUNNING, "to run")
    assert (seen.metadata["host"], seen.metadata["reason"]) == (HOST_A, "running")
    assert seen.metadata["log"] == str(builds.work_dir / build_id / "log")  # on host A
    wait_until(lambda: "step one" in builds.report(b, build_id).metadata["log_tail"],
               timeout=20, what="the log's tail in the row")
    assert not (b.work_dir / build_id).exists()  # nothing of it on host B
    (out / "release").touch()
    result = builds.finished(b, build_id)
    assert (result.status, result.metadata["exit_code"]) == (BuildStatus.SUCCEEDED, "0")
    assert result.metadata["log_tail"].endswith("step two\n")
    builds.run(b.cancel(build_id))  # a finished build stays as it ended
    assert builds.status(b, build_id) is BuildStatus.SUCCEEDED
    assert builds.status(a, build_id) is BuildStatus.SUCCEEDED


def test_a_cancel_from_another_host_stops_the_build_on_its_owner(builds: Builds, repo: Repo,
                                                                 out: Path) -> None:
    command = f"sleep 60 & echo $! > {out}/child-$STOVEPIPE_BUILD_ID; wait"
    a = builds.runner(command, max_parallel=1)
    b = builds.runner(command, host=HOST_B, max_parallel=1)
    running, queued = builds.trigger(a, repo.uri(3)), builds.trigger(a, repo.uri(2))
    wait_until((out / f"child-{running}").exists, timeout=20, what="the build's child")
    child = int((out / f"child-{running}").read_text())
    wrapper = int((builds.work_dir / running / "pid").read_text())
    assert builds.status(b, running) is BuildStatus.RUNNING
    assert builds.status(b, queued) is BuildStatus.ACCEPTED

    builds.run(b.cancel(running))
    builds.run(b.cancel(queued))  # a queued build cancelled never runs
    assert builds.row(running).cancel_requested_at is not None
    builds.tend_in_background(a)  # host A applies what host B asked
    for build_id in (running, queued):
        result = builds.wait_for(b, build_id, lambda s: s.is_terminal, "to be cancelled")
        assert (result.status, result.metadata["reason"]) == (BuildStatus.CANCELLED,
                                                              "cancelled")
    wait_until(lambda: dead(child) and dead(wrapper), timeout=20,
               what="the build's processes on host A to be stopped")
    builds.run(b.cancel(running))  # idempotent
    assert builds.status(b, running) is BuildStatus.CANCELLED
    assert not (builds.work_dir / queued / "pid").exists()
    wait_until(lambda: os.listdir(builds.work_dir / "active") == [], timeout=20,
               what="host A to retire both builds")


def test_a_host_that_stops_heartbeating_is_failed_within_the_bound_and_never_green_after(
        builds: Builds, repo: Repo, out: Path) -> None:
    host_timeout = 2.0
    finishing = f"{gate(out, 'release')}; exit 0"  # would be green, had its host stayed
    hanging = f"sleep 60 & echo $! > {out}/child; wait"
    a1, a2 = builds.runner(finishing), builds.runner(hanging)
    b = builds.runner(finishing, host=HOST_B, host_timeout=host_timeout)
    builds.alive_in_background(HOST_B)  # host B's worker runs: it may judge host A
    first, second = builds.trigger(a1, repo.uri(3)), builds.trigger(a2, repo.uri(2))
    tending = builds.tend_in_background(a1)  # one work_dir: it tends both builds
    wait_until((out / "child").exists, timeout=20, what="the second build's child")
    child = int((out / "child").read_text())

    # while host A heartbeats, host B sees the builds run, however long that lasts
    def heartbeats_outlived_the_timeout() -> bool:
        row = builds.row(first)
        return (row.heartbeat_at - row.created_at).total_seconds() > 2 * host_timeout

    wait_until(heartbeats_outlived_the_timeout, timeout=30, what="heartbeats")
    assert [builds.status(b, first), builds.status(b, second)] == [BuildStatus.RUNNING] * 2

    builds.stop_tending(tending)  # host A dies (its processes live on)
    last_seen = {build_id: builds.row(build_id).heartbeat_at for build_id in (first, second)}
    for build_id in (first, second):
        result = builds.wait_for(b, build_id, lambda s: s.is_terminal,
                                 "to be failed for its silent host", timeout=host_timeout + 20)
        assert (result.status, result.metadata["reason"]) == (BuildStatus.FAILED, "host_lost")
        # a lost build gives no verdict: its attempt could not validate the commit
        assert result.unvalidated.startswith("its host was lost: host ")
        assert result.metadata["detail"].startswith(
            f"host {HOST_A} stopped heartbeating (last seen ")
        row = builds.row(build_id)
        assert row.heartbeat_at == last_seen[build_id] and row.finished_at is not None
        # decided by the database's clock: not before the timeout, soon after it
        assert host_timeout <= (row.finished_at - row.heartbeat_at).total_seconds() \
            < host_timeout + 15

    # host A comes back: the first build ended green meanwhile, the second still runs
    (out / "release").touch()
    wait_until((builds.work_dir / first / "exit_code").exists, timeout=20,
               what="the first build to end on host A")
    builds.run(a1.tend())
    wait_until(lambda: dead(child), timeout=20, what="host A to stop the second build")
    for runner in (a1, b):
        assert builds.status(runner, first) is BuildStatus.FAILED  # never green
    assert builds.report(a2, second).metadata["reason"] == "host_lost"
    assert builds.row(first).exit_code is None  # the row kept what was decided


def test_a_trigger_repeated_on_another_host_returns_the_build_already_started(
        builds: Builds, repo: Repo, out: Path) -> None:
    command = gate(out, "release")
    a, b = builds.runner(command), builds.runner(command, host=HOST_B)
    key = {"trigger_key": "request/mono/main/7", "request_id": "request/mono/main/7"}
    build_id = builds.trigger(a, repo.uri(3), None, key)
    assert builds.trigger(b, repo.uri(3), None, key) == build_id
    assert not b.work_dir.exists() or not any(p.name.startswith("cmd-")
                                              for p in b.work_dir.iterdir())
    assert builds.row(build_id).host == HOST_A
    (out / "release").touch()
    assert builds.finished(a, build_id).status is BuildStatus.SUCCEEDED


def test_the_log_tail_is_bounded_and_clean(builds: Builds, repo: Repo) -> None:
    runner = builds.runner("head -c 10000 /dev/zero | tr '\\0' x; printf '\\000\\377end\\n'")
    build_id = builds.trigger(runner, repo.uri(3))
    tail = builds.finished(runner, build_id).metadata["log_tail"]
    assert tail.endswith("\ufffd\ufffdend\n")  # NUL and the invalid byte, replaced
    assert len(tail.encode("utf-8")) <= LOG_TAIL_BYTES + 2 * 2  # two 3-byte replacements
    assert tail.startswith("x") and "\x00" not in tail


def test_a_build_found_without_a_row_is_adopted_by_its_host(builds: Builds, repo: Repo,
                                                            out: Path) -> None:
    command = f"{gate(out, 'release')}; exit 3"
    a, b = builds.runner(command), builds.runner(command, host=HOST_B)
    build_id = builds.trigger(a, repo.uri(3), None, {"request_id": "request/mono/main/9"})
    # as if it had been started by a version of Stovepipe without rows
    assert builds.run(_delete_row(builds, build_id)) == 1
    builds.run(a.tend())
    row = builds.row(build_id)
    assert (row.host, row.status, row.request_id, row.trigger_key) == (
        HOST_A, BuildStatus.RUNNING, "request/mono/main/9", None)
    builds.tend_in_background(a)
    (out / "release").touch()
    result = builds.finished(b, build_id)
    assert (result.status, result.metadata["exit_code"]) == (BuildStatus.FAILED, "3")


async def _delete_row(builds: Builds, build_id: str) -> int:
    async with builds.db.pool.connection() as conn:
        cursor = await conn.execute("DELETE FROM command_build WHERE build_id = %s",
                                    (build_id,))
        return cursor.rowcount



def test_a_database_outage_is_no_evidence_that_a_host_died(builds: Builds, repo: Repo,
                                                           out: Path) -> None:
    """Every host's heartbeats stop while the database is away (here: every host's tend
    stops at once, for longer than host_timeout). When it is back, the first host to poll
    sees an old heartbeat — and does not declare the owner lost: it has not itself reached
    the database for host_timeout yet, and by then the owner heartbeats again. The build
    ends green."""
    host_timeout = 2.0
    command = f"{gate(out, 'release')}; exit 0"
    a = builds.runner(command)
    b = builds.runner(command, host=HOST_B, host_timeout=host_timeout)
    first = builds.trigger(a, repo.uri(3))
    tending_a = builds.tend_in_background(a)
    alive_b = builds.alive_in_background(HOST_B)
    builds.wait_for(b, first, lambda s: s is BuildStatus.RUNNING, "to run")

    builds.stop_tending(tending_a)  # the database goes away: nobody heartbeats
    builds.stop_tending(alive_b)
    # (longer than a gap a host's own heartbeats may have without it starting afresh)
    wait_until(lambda: builds.row(first).heartbeat_age > HEARTBEAT_GAP + 2, timeout=30,
               what="the owner's heartbeat to be older than host_timeout")
    # back: host B is first, and polls before the owner has heartbeaten again
    builds.alive_in_background(HOST_B)
    assert builds.status(b, first) is BuildStatus.RUNNING  # not declared lost
    builds.tend_in_background(a)
    deadline = time.monotonic() + host_timeout * 2
    while time.monotonic() < deadline:
        assert builds.status(b, first) is BuildStatus.RUNNING
    assert builds.row(first).heartbeat_age < 1  # the owner heartbeats again
    (out / "release").touch()
    result = builds.finished(b, first)
    assert (result.status, result.metadata["reason"]) == (BuildStatus.SUCCEEDED, "exit_code")
