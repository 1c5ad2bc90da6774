"""Shared pieces of the command build runner's tests: a real git repository, and runners
over a real database driven from synchronous tests.

The database pool and the runners live on one event loop in a thread of its own (a
`Portal`), so a test calls ``builds.trigger(runner, …)`` and reads plain results, and
every runner of a test — one per simulated host — shares that loop and pool.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from store import Database
from store.entities import BuildStatus, CommandBuild
from store.worker_hosts import HEARTBEAT_GAP
from streams.extensions.buildrunner import BuildReport
from streams.extensions.buildrunner.command import CommandBuildRunner
from streams.extensions.sourcecontrol.gitrepo import GIT_LOCATION_VARIABLES
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.runtime.periodic import PeriodicTask, run_periodically
from tests.waiting import wait_until

T = TypeVar("T")
HOST_A, HOST_B = "host-a", "host-b"


def git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    return subprocess.run(
        ["git", "-c", "user.name=Stovepipe Test", "-c", "user.email=test@stovepipe.invalid",
         "-c", "init.defaultBranch=main", *args],
        cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


class Repo:
    """A local repository with three commits on main, each adding a file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        git(path.parent, "init", "-q", str(path))
        self.shas = []
        for n in (1, 2, 3):
            (path / f"file{n}").write_text(f"{n}\n")
            git(path, "add", "-A")
            git(path, "commit", "-q", "-m", f"c{n}")
            self.shas.append(git(path, "rev-parse", "HEAD"))

    def uri(self, n: int) -> str:
        return git_uri(str(self.path), "main", self.shas[n - 1])


class Portal:
    """An event loop running in a thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()


class Builds:
    """Makes runners (one per simulated host, each with a work_dir of its own by default)
    over one database and, afterwards, stops whatever is still running."""

    def __init__(self, root: Path, repo: Repo, dsn: str) -> None:
        self.root = root
        self.work_dir = root / "work"  # host A's
        self.repo = repo
        self.portal = Portal()
        self.db: Database = self.portal.run(Database.open(dsn, min_size=1, max_size=4))
        self.runners: list[CommandBuildRunner] = []
        self._tending: list[asyncio.Task[None]] = []

    def tend_in_background(self, runner: CommandBuildRunner) -> asyncio.Task[None]:
        """The worker's periodic tend of ``runner``'s host (its own heartbeat, then the
        runner's tend), faster, until `stop_tending` (the host dies) or the end of the
        test."""
        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(run_periodically(
                PeriodicTask("tend", TEND_INTERVAL, _tend_of(runner, self.db)), None,
                _no_publish))

        task = self.run(start())
        self._tending.append(task)
        return task

    def alive_in_background(self, host: str) -> asyncio.Task[None]:
        """A host whose worker runs (and heartbeats) but owns no build of the test: the
        host that judges another lost."""
        async def heartbeat(deps: Any, publish: Any) -> None:
            await self.db.worker_hosts.heartbeat(host, HEARTBEAT_GAP)

        async def start() -> asyncio.Task[None]:
            return asyncio.create_task(run_periodically(
                PeriodicTask("alive", TEND_INTERVAL, heartbeat), None, _no_publish))

        task = self.run(start())
        self._tending.append(task)
        return task

    def stop_tending(self, task: asyncio.Task[None]) -> None:
        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self.run(stop())

    def runner(self, command: str, *, host: str = HOST_A, work_dir: Path | None = None,
               **kwargs: Any) -> CommandBuildRunner:
        kwargs.setdefault("kill_grace", 2.0)
        if work_dir is None:
            work_dir = self.work_dir if host == HOST_A else self.root / f"{host}-home" / "work"
        runner = CommandBuildRunner(command, kwargs.pop("repository", str(self.repo.path)),
                                    work_dir, database=self.db, host=host, queue="mono/main",
                                    **kwargs)
        self.runners.append(runner)
        return runner

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return self.portal.run(coro, timeout)

    def trigger(self, runner: CommandBuildRunner, head_uri: str, base_uri: str | None = None,
                metadata: dict[str, str] | None = None) -> str:
        return self.run(runner.trigger(base_uri, head_uri, metadata or {}))

    def report(self, runner: CommandBuildRunner, build_id: str) -> BuildReport:
        return self.run(runner.status(build_id))

    def status(self, runner: CommandBuildRunner, build_id: str) -> BuildStatus:
        return self.report(runner, build_id).status

    def row(self, build_id: str) -> CommandBuild:
        return self.run(self.db.command_builds.get(build_id))

    def wait_for(self, runner: CommandBuildRunner, build_id: str,
                 condition: Callable[[BuildStatus], bool], what: str,
                 timeout: float = 20) -> BuildReport:
        seen: list[BuildReport] = []

        def check() -> bool:
            seen.append(self.report(runner, build_id))
            return condition(seen[-1].status)

        wait_until(check, timeout=timeout, what=f"{build_id} {what}")
        return seen[-1]

    def finished(self, runner: CommandBuildRunner, build_id: str,
                 timeout: float = 20) -> BuildReport:
        return self.wait_for(runner, build_id, lambda s: s.is_terminal, "to finish", timeout)

    def cleanup(self) -> None:
        try:
            for task in self._tending:  # the hosts stop tending first
                self.stop_tending(task)
            owners = {(r.host, r.work_dir): r for r in self.runners}
            for runner in owners.values():
                if runner.work_dir.exists():
                    for build_id in os.listdir(runner.work_dir):
                        if build_id.startswith("cmd-"):
                            self.run(_stop_quietly(runner, build_id))
            self.run(self.db.close())
        finally:
            self.portal.close()


TEND_INTERVAL = 0.1  # a test's tend is 20 times as frequent as a worker's


def _tend_of(runner: CommandBuildRunner,
             db: Database) -> Callable[[Any, Any], Coroutine[Any, Any, None]]:
    """The runner's tend as the worker runs it: a periodic task (`run_periodically`) that
    first renews the host's own heartbeat (`streams.stages.pipeline.tend_build_runners`)."""

    async def tend(deps: Any, publish: Any) -> None:
        await db.worker_hosts.heartbeat(runner.host, HEARTBEAT_GAP)
        await runner.tend()

    return tend


async def _no_publish(*args: Any) -> None:
    raise AssertionError("a tend publishes nothing")


async def _stop_quietly(runner: CommandBuildRunner, build_id: str) -> None:
    """Stop a build's processes on its own machine, whatever its row says."""
    if await runner.local.known(build_id):
        observed = await runner.local.mark_cancelled(build_id)
        if observed.alive or not observed.status.is_terminal:
            await runner.local.stop(build_id)


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def gate(out: Path, name: str) -> str:
    """A command fragment that waits until the test creates ``out/name`` (``name`` may use
    the build's variables)."""
    return f'while [ ! -e "{out}/{name}" ]; do sleep 0.05; done'
