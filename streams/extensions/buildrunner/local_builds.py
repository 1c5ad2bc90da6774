"""The command BuildRunner's builds on one machine: the state directories under a
work_dir, admission under ``max_parallel``, launching, observing and signalling (see
`streams.extensions.buildrunner.command` for the whole protocol). Only the host that
owns a build calls this for it; what it observes is then recorded in the build's row.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from store.entities import BuildStatus
from streams.extensions.buildrunner.contract import BuildRunnerError
from streams.extensions.buildrunner.processes import (
    BUILD_FILE,
    CANCELLED,
    CHECKOUT,
    EXIT_CODE,
    LAUNCHER,
    LAUNCHING,
    LOG,
    NOT_RUN,
    PGID,
    PID,
    START_TIME,
    TIMED_OUT,
    WRAPPER,
    BuildProcess,
    build_environment,
    group_members,
    leader_alive,
    mtime_ns,
    read_int,
    read_process,
    remove_trees,
    stat_fields,
    write_atomically,
)

LAUNCH_ABORTED_EXIT_CODE = 125  # the wrapper's code when it could not start the command
ACTIVE_DIR = "active"
LOCK_FILE = "admission.lock"
LOG_TAIL_BYTES = 4096  # how much of a build's log its row carries
_STOP_POLL_INTERVAL = 0.05
T = TypeVar("T")


@dataclass(frozen=True)
class Observed:
    status: BuildStatus
    reason: str  # queued, running, exit_code, cancelled, timeout, vanished
    exit_code: int | None = None
    process: BuildProcess | None = None
    alive: bool = False  # the wrapper still runs


class LocalBuilds:
    """The builds under ``work_dir`` on this machine. Blocking file work runs in worker
    threads under the work_dir's ``flock``; the async methods are what the runner
    calls."""

    def __init__(self, work_dir: Path, *, max_parallel: int, timeout: float | None,
                 kill_grace: float) -> None:
        self.work_dir = work_dir
        self.max_parallel = max_parallel
        self.timeout = timeout
        self.kill_grace = kill_grace
        self._admission_lock: asyncio.Lock | None = None
        self._admission_loop: asyncio.AbstractEventLoop | None = None

    def dir(self, build_id: str) -> Path:
        return self.work_dir / build_id

    # --- async, for the runner ---

    async def prepare(self, build_id: str, spec: dict[str, Any]) -> None:
        """Write the build's state directory; it stays invisible (never launched) until
        `activate`."""
        await asyncio.to_thread(self._prepare, build_id, spec)

    async def discard(self, build_id: str) -> None:
        """Remove a prepared build that was never activated."""
        await asyncio.to_thread(remove_trees, [self.dir(build_id)])

    async def activate(self, build_id: str) -> None:
        """Queue a prepared build (idempotent: one launched or over stays as it is), and
        launch what the free slots allow."""
        await self._locked_call(self._activate, build_id)

    async def poll(self, build_id: str) -> Observed:
        """The build's status, after bringing the work_dir up to date."""
        return await self._locked_call(self._poll, build_id)

    async def observe(self, build_id: str) -> Observed:
        """The build's status as its files say, without touching the work_dir."""
        return await self._locked_call(self._observe_locked, build_id)

    async def sweep(self) -> None:
        """Bring the work_dir up to date: stop builds past their timeout, escalate stops
        past their grace, retire finished builds, launch queued ones."""
        await self._locked_call(self._sweep_now)

    async def mark_cancelled(self, build_id: str) -> Observed:
        """Mark a build not yet over cancelled (a finished one stays as it ended)."""
        return await self._locked_call(self._mark_cancelled, build_id)

    async def signal(self, build_id: str, sig: int) -> None:
        process = await asyncio.to_thread(read_process, self.dir(build_id))
        await asyncio.to_thread(self._signal, build_id, process, sig)

    async def stop(self, build_id: str) -> None:
        """SIGTERM the build's processes, SIGKILL what is left after the grace period."""
        for sig, patience in ((signal.SIGTERM, self.kill_grace), (signal.SIGKILL, 5.0)):
            await self.signal(build_id, sig)
            deadline = time.monotonic() + patience
            while time.monotonic() < deadline:
                if not await asyncio.to_thread(self._running_processes, build_id):
                    return
                await asyncio.sleep(_STOP_POLL_INTERVAL)

    async def known(self, build_id: str) -> bool:
        return await asyncio.to_thread((self.dir(build_id) / BUILD_FILE).is_file)

    async def spec(self, build_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._spec, build_id)

    async def active_ids(self) -> list[str]:
        def listed() -> list[str]:
            try:
                return sorted(os.listdir(self.work_dir / ACTIVE_DIR))
            except FileNotFoundError:
                return []
        return await asyncio.to_thread(listed)

    async def log_tail(self, build_id: str) -> str:
        """The end of the build's log (``LOG_TAIL_BYTES``), decoded with replacement."""
        def tail() -> str:
            try:
                with open(self.dir(build_id) / LOG, "rb") as log:
                    log.seek(max(0, os.fstat(log.fileno()).st_size - LOG_TAIL_BYTES))
                    data = log.read(LOG_TAIL_BYTES)
            except FileNotFoundError:
                return ""
            # PostgreSQL text holds no NUL
            return data.decode("utf-8", errors="replace").replace("\x00", "\ufffd")
        return await asyncio.to_thread(tail)

    async def _locked_call(self, blocking: Callable[..., tuple[T, list[Path]]],
                           *args: Any) -> T:
        async with self._admission:
            result, removals = await asyncio.to_thread(blocking, *args)
        await asyncio.to_thread(remove_trees, removals)
        return result

    @property
    def _admission(self) -> asyncio.Lock:
        """Lets one task of this process at a time wait on the work_dir's flock (each
        waits in a thread). One lock per event loop: tests run several loops."""
        loop = asyncio.get_running_loop()
        if self._admission_lock is None or self._admission_loop is not loop:
            self._admission_lock, self._admission_loop = asyncio.Lock(), loop
        return self._admission_lock

    # --- blocking halves, run in a worker thread ---

    def _spec(self, build_id: str) -> dict[str, Any]:
        try:
            return json.loads((self.dir(build_id) / BUILD_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BuildRunnerError(f"command runner: no build {build_id} under "
                                   f"{self.work_dir}") from None
        except (OSError, ValueError) as exc:
            raise BuildRunnerError(f"command runner: build {build_id}: unreadable "
                                   f"{BUILD_FILE}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The work_dir's admission lock."""
        (self.work_dir / ACTIVE_DIR).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _prepare(self, build_id: str, spec: dict[str, Any]) -> None:
        state = self.dir(build_id)
        state.mkdir(parents=True)
        write_atomically(state / BUILD_FILE, json.dumps(spec, indent=1))

    def _activate(self, build_id: str) -> tuple[None, list[Path]]:
        with self._locked():
            self._spec(build_id)
            entry = self.work_dir / ACTIVE_DIR / build_id
            if entry.exists() or self._observe(build_id).reason != "queued":
                return None, []  # queued already, or launched: nothing to do
            entry.touch()
            return None, self._sweep()

    def _observe_locked(self, build_id: str) -> tuple[Observed, list[Path]]:
        with self._locked():
            self._spec(build_id)
            return self._observe(build_id), []

    def _sweep_now(self) -> tuple[None, list[Path]]:
        with self._locked():
            return None, self._sweep()

    def _poll(self, build_id: str) -> tuple[Observed, list[Path]]:
        with self._locked():
            self._spec(build_id)  # unknown → BuildRunnerError
            removals = self._sweep()  # may launch this very build
            observed = self._observe(build_id)
            if (observed.status.is_terminal
                    and (self.work_dir / ACTIVE_DIR / build_id).exists()):
                removals += self._sweep()  # it ended just now: retire it before reporting
            return observed, removals

    def _mark_cancelled(self, build_id: str) -> tuple[Observed, list[Path]]:
        with self._locked():
            self._spec(build_id)
            observed = self._observe(build_id)
            if observed.status.is_terminal:
                return observed, []  # a finished build stays as it ended; idempotent
            write_atomically(self.dir(build_id) / CANCELLED, f"{time.time()!r}\n")
            return self._observe(build_id), []

    def _sweep(self) -> list[Path]:
        """Bring the active builds up to date (under the lock): stop those past their
        timeout, retire the finished ones, and launch queued ones, oldest first, into the
        free slots. Returns the checkouts to remove once the lock is released."""
        removals: list[Path] = []
        busy = 0
        queued: list[tuple[float, str]] = []
        for build_id in sorted(os.listdir(self.work_dir / ACTIVE_DIR)):
            entry = self.work_dir / ACTIVE_DIR / build_id
            try:
                spec = self._spec(build_id)
            except BuildRunnerError:
                entry.unlink(missing_ok=True)  # not a build of ours
                continue
            observed = self._observe(build_id)
            if observed.status is BuildStatus.ACCEPTED:
                queued.append((float(spec.get("queued_at", 0.0)), build_id))
            elif observed.status is BuildStatus.RUNNING:
                busy += 1
                if self._past_timeout(observed):
                    write_atomically(self.dir(build_id) / TIMED_OUT, f"{time.time()!r}\n")
                    self._signal(build_id, observed.process, signal.SIGTERM)
            elif observed.alive and observed.reason in ("cancelled", "timeout"):
                busy += 1  # being stopped: escalate once the grace period is over
                if self._grace_over(build_id):
                    self._signal(build_id, observed.process, signal.SIGKILL)
            else:
                # over; whatever it left running goes (a wrapper that wrote its exit code
                # has nothing left to do but exit)
                self._signal(build_id, observed.process, signal.SIGKILL)
                entry.unlink(missing_ok=True)
                removals.append(self.dir(build_id) / CHECKOUT)
        for _, build_id in sorted(queued)[:max(0, self.max_parallel - busy)]:
            self._launch(build_id)
        return removals

    def _observe(self, build_id: str) -> Observed:
        """The build's status from its files (see the command module's docstring)."""
        state = self.dir(build_id)
        process = read_process(state)
        alive = process is not None and leader_alive(process)
        # read after the liveness check: the wrapper writes its exit code, then exits
        exit_code = read_int(state / EXIT_CODE)
        code_at = mtime_ns(state / EXIT_CODE)
        for marker, status, reason in ((CANCELLED, BuildStatus.CANCELLED, "cancelled"),
                                       (TIMED_OUT, BuildStatus.FAILED, "timeout")):
            marked_at = mtime_ns(state / marker)
            if marked_at is not None and (code_at is None or code_at >= marked_at):
                return Observed(status, reason, exit_code, process, alive)
        if exit_code is not None:
            if exit_code == LAUNCH_ABORTED_EXIT_CODE and (state / NOT_RUN).exists():
                return Observed(BuildStatus.FAILED, "not_run", exit_code, process, alive)
            status = BuildStatus.SUCCEEDED if exit_code == 0 else BuildStatus.FAILED
            return Observed(status, "exit_code", exit_code, process, alive)
        if process is None:
            if (state / LAUNCHING).exists():  # the launching worker died mid-launch
                return Observed(BuildStatus.FAILED, "vanished")
            return Observed(BuildStatus.ACCEPTED, "queued")
        if alive:
            return Observed(BuildStatus.RUNNING, "running", None, process, alive)
        return Observed(BuildStatus.FAILED, "vanished", None, process)

    def _past_timeout(self, observed: Observed) -> bool:
        return (self.timeout is not None and observed.process is not None
                and time.time() - observed.process.started_at > self.timeout)

    def _grace_over(self, build_id: str) -> bool:
        state = self.dir(build_id)
        stamps = [t for t in (mtime_ns(state / CANCELLED), mtime_ns(state / TIMED_OUT))
                  if t is not None]
        return not stamps or time.time() - min(stamps) / 1e9 > self.kill_grace

    def _launch(self, build_id: str) -> None:
        """Start a queued build (under the lock). A failure to start fails the build."""
        state = self.dir(build_id)
        spec = self._spec(build_id)
        (state / LAUNCHING).touch()
        read_end, write_end = os.pipe()
        try:
            try:
                launched = subprocess.run(
                    ["/bin/sh", "-c", LAUNCHER, "stovepipe-launch", WRAPPER, str(state),
                     spec["source"], spec["head_sha"], spec["command"], str(state / LOG)],
                    stdin=read_end, capture_output=True, env=build_environment(spec),
                    start_new_session=True, close_fds=True, timeout=30, check=True)
                pid = int(launched.stdout.strip())
                pgid, start_time = stat_fields(pid)
            finally:
                os.close(read_end)
            write_atomically(state / PGID, f"{pgid}\n")
            write_atomically(state / START_TIME, f"{start_time}\n")
            write_atomically(state / PID, f"{pid}\n")  # last: the process is recorded
            os.write(write_end, b"go\n")
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            # the wrapper, if it started, reads end-of-file and exits without running
            with (state / LOG).open("a", encoding="utf-8") as log:
                log.write(f"stovepipe: could not start the build: {exc!r}\n")
            (state / NOT_RUN).touch()
            write_atomically(state / EXIT_CODE, f"{LAUNCH_ABORTED_EXIT_CODE}\n")
        finally:
            os.close(write_end)

    def _signal(self, build_id: str, process: BuildProcess | None, sig: int) -> None:
        """Signal every process of the build: the whole group while its wrapper (checked
        by start time) is alive, else each process still in the group that carries this
        build's id in its environment — never a stranger that reused a number."""
        if process is None:
            return
        if leader_alive(process):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pgid, sig)
            return
        for pid in group_members(process.pgid, build_id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def _running_processes(self, build_id: str) -> bool:
        process = read_process(self.dir(build_id))
        return process is not None and (leader_alive(process)
                                        or bool(group_members(process.pgid, build_id)))
