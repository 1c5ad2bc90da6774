"""The command BuildRunner: a shell command run in a clean checkout of the head commit
(design §8).

Builds run detached from the worker, and everything about one lives in files, so any
worker process on the machine can poll or cancel any build, and a build outlives the
worker that started it. A build id is ``cmd-<32 hex digits>``; its state directory is
``<work_dir>/<build id>/``:

- ``build.json``  what to run: head/base URIs and shas, clone source, command, queue,
  request id, queued_at (written once, at trigger);
- ``launching``   the build is being started (written just before the launch);
- ``pid``, ``pgid``, ``start_time``  the build's wrapper shell, its process group (the
  build's own session) and its start time from ``/proc/<pid>/stat`` (clock ticks since
  boot), which tells the wrapper from a later process that reuses its pid. ``pid`` is
  written last: present means all three are;
- ``log``         the build's stdout and stderr, kept after the build;
- ``exit_code``   written by the wrapper shell when the command ends (tmp file + rename);
- ``cancelled`` / ``timed_out``  markers written by `cancel` / by a poll past ``timeout``;
- ``checkout/``   the clean checkout the command runs in, removed once the build is over.

Status, from those files alone: a ``cancelled`` (``timed_out``) marker written before any
exit code → cancelled (failed); an exit code → succeeded (0) or failed; not launched →
accepted (queued); the wrapper alive → running; otherwise → failed ("vanished": killed
behind our back, the machine rebooted, or the pid now belongs to another process).
Liveness is checked *before* the exit code is read, and the wrapper writes the exit code
before it exits, so a build is never reported vanished for finishing between the two.

Launching: a short-lived ``sh`` in a new session starts the wrapper in the background and
exits, so the wrapper is nobody's child (no zombie to reap, nothing tied to the worker's
lifetime) and leads nothing: its process group is the session's. The wrapper first waits
for a "go" on a pipe that the launching worker writes only after it has recorded
pid/pgid/start_time; if that worker dies first, the wrapper reads end-of-file and records
exit code 125 without running anything, so no build ever runs unrecorded. Then it makes
the checkout (``git clone --shared --no-checkout`` from the repository or its cache, then
``checkout --detach <sha>``: a fresh directory per build, sharing objects, never reused)
and runs ``sh -c <command>`` there.

Bounded concurrency: at most ``max_parallel`` builds of one work_dir run at once. A trigger
over the bound is *queued*, not refused: it reports ``accepted`` and starts, oldest first,
when a later trigger, status poll or cancel on the same work_dir finds a free slot. (A
retryable error instead would spend the build stage's retry budget while the runner is
merely busy, and a few busy minutes would dead-letter Requests; the buildsignal poll loop
already waits on ``accepted`` builds, and the queue's poll deadline still bounds the wait.)
Admission, launching and every status decision happen under an exclusive ``flock`` on
``<work_dir>/admission.lock``; builds queued or running are listed in ``<work_dir>/active/``
so a poll reads only those, never the whole history.

Every poll also tidies up: a build that is over loses its checkout (its log stays) and any
process it left behind; a running build past ``timeout`` is stopped (SIGTERM, then SIGKILL
after ``kill_grace``) and reported failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field
from pydantic.dataclasses import dataclass as spec_dataclass

from store.entities import BuildStatus
from streams.extensions import ExtensionContext
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.extensions.buildrunner.processes import (
    BUILD_FILE,
    CANCELLED,
    CHECKOUT,
    EXIT_CODE,
    LAUNCHER,
    LAUNCHING,
    LOG,
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
from streams.extensions.sourcecontrol.contract import SourceControlError
from streams.extensions.sourcecontrol.gitrepo import GitRepository, Repository
from streams.extensions.sourcecontrol.gituri import parse_uri
from streams.schema.fields import SPEC, ConfigPath, Duration, PositiveInt

BUILD_ID_PREFIX = "cmd-"
DEFAULT_MAX_PARALLEL = 2
DEFAULT_KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
LAUNCH_ABORTED_EXIT_CODE = 125  # the wrapper's code when it could not start the command
ACTIVE_DIR = "active"
KEYS_DIR = "keys"  # trigger key (hashed) -> the build started for it
LOCK_FILE = "admission.lock"
_BUILD_ID = re.compile(r"cmd-[0-9a-f]{32}")
_STOP_POLL_INTERVAL = 0.05

@dataclass(frozen=True)
class _Observed:
    status: BuildStatus
    reason: str  # queued, running, exit_code, cancelled, timeout, vanished
    exit_code: int | None = None
    process: BuildProcess | None = None
    alive: bool = False  # the wrapper still runs

    def report(self, log: Path) -> BuildReport:
        metadata = {"runner": "command", "reason": self.reason, "log": str(log)}
        if self.exit_code is not None:
            metadata["exit_code"] = str(self.exit_code)
        return BuildReport(self.status, metadata)


# --- queues.yaml --------------------------------------------------------------------------


def _shell_command(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty shell command, got {value!r}")
    return value


@spec_dataclass(frozen=True, config=SPEC)
class CommandBuildRunnerSpec:
    """`kind: command`: a shell command in a clean checkout of the head commit (this
    module)."""

    wants_repository: ClassVar[bool] = True  # None: the queue's git repository
    command: Annotated[str, BeforeValidator(_shell_command),
                       Field(examples=["command: make test"])]
    repository: Repository | None = None
    work_dir: ConfigPath | None = None  # None: $STOVEPIPE_HOME/builds/<queue>
    max_parallel: PositiveInt = DEFAULT_MAX_PARALLEL  # builds of the work_dir at once
    timeout: Duration | None = None  # then the build is stopped and failed
    kind: Literal["command"] = "command"

    def build(self, context: ExtensionContext) -> CommandBuildRunner:
        repository = self.repository or context.repository
        if repository is None:
            raise ValueError(f"queue {context.queue!r}: a command build runner needs "
                             f"'repository' when the source_control is not git")
        return CommandBuildRunner(
            self.command, repository,
            self.work_dir or default_work_dir(context.home, context.queue),
            queue=context.queue, max_parallel=self.max_parallel,
            timeout=self.timeout.total_seconds() if self.timeout is not None else None,
            cache_root=context.git_cache)


def default_work_dir(home: Path, queue: str) -> Path:
    """Where a queue's command builds live by default: <home>/builds/<queue>."""
    parts = [f"_{part}" if part in (".", "..") else part for part in queue.split("/")]
    return home / "builds" / Path(*parts)


class CommandBuildRunner:
    """Runs ``command`` with ``sh -c`` in a clean checkout of the head commit of
    ``repository`` (a local path or a URL, read as GitRepository reads it), with the build's
    state under ``work_dir`` (see the module docstring).

    ``max_parallel`` builds of the work_dir run at once, the rest queue; ``timeout``
    (seconds, optional) fails a build that runs longer; ``kill_grace`` is how long a
    stopped build gets between SIGTERM and SIGKILL. ``queue`` names the queue in the
    build's environment when the trigger metadata does not.

    File work happens in worker threads and git in subprocesses: nothing blocks the loop.
    Errors: a malformed or unknown build id, or a head commit the repository does not
    have, is a non-retryable BuildRunnerError; an unreachable remote is retryable.
    """

    def __init__(self, command: str, repository: str, work_dir: Path | str, *,
                 queue: str = "", max_parallel: int = DEFAULT_MAX_PARALLEL,
                 timeout: float | None = None, kill_grace: float = DEFAULT_KILL_GRACE,
                 cache_root: Path | str | None = None) -> None:
        if not command.strip():
            raise ValueError("a build command must be non-empty")
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.command = command
        self.repo = GitRepository(repository, cache_root=cache_root)
        self.work_dir = Path(work_dir).expanduser().absolute()
        self.queue = queue
        self.max_parallel = max_parallel
        self.timeout = timeout
        self.kill_grace = kill_grace
        self._admission_lock: asyncio.Lock | None = None
        self._admission_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (f"CommandBuildRunner({self.command!r}, repository={self.repo.repository!r}, "
                f"work_dir={str(self.work_dir)!r}, max_parallel={self.max_parallel})")

    # --- the contract ---

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        try:
            head = parse_uri(head_uri)
            base_sha = parse_uri(base_uri).sha if base_uri else ""
            source = await self.repo.git_dir()
            present = await self.repo.ensure_commit(head.sha, head.ref)
        except SourceControlError as exc:
            raise BuildRunnerError(f"command runner: cannot build {head_uri}: {exc}",
                                   retryable=exc.retryable) from exc
        if not present:
            raise BuildRunnerError(f"command runner: {self.repo.repository} has no commit "
                                   f"{head.sha} (from {head_uri}); cannot build it")
        build_id = f"{BUILD_ID_PREFIX}{uuid.uuid4().hex}"
        spec = {
            "build_id": build_id,
            "queue": metadata.get("queue") or self.queue,
            "request_id": metadata.get("request_id", ""),
            "head_uri": head_uri,
            "base_uri": base_uri or "",
            "head_sha": head.sha,
            "base_sha": base_sha,
            "source": str(source),
            "command": self.command,
            "queued_at": time.time(),
        }
        async with self._admission:
            build_id, removals = await asyncio.to_thread(
                self._enqueue, build_id, spec, metadata.get("trigger_key", ""))
        await asyncio.to_thread(remove_trees, removals)
        return build_id

    async def status(self, build_id: str) -> BuildReport:
        self._check_id(build_id)
        async with self._admission:
            observed, removals = await asyncio.to_thread(self._poll, build_id)
        await asyncio.to_thread(remove_trees, removals)
        if observed.reason == "timeout" and observed.alive:
            await self._stop(build_id)
            async with self._admission:  # retire it and give its slot to the next build
                _, removals = await asyncio.to_thread(self._poll, build_id)
            await asyncio.to_thread(remove_trees, removals)
        return observed.report(self._dir(build_id) / LOG)

    async def cancel(self, build_id: str) -> None:
        self._check_id(build_id)
        async with self._admission:
            observed = await asyncio.to_thread(self._mark_cancelled, build_id)
        if observed.process is not None and observed.status is BuildStatus.CANCELLED:
            await self._stop(build_id)
        async with self._admission:  # tidy up and give the freed slot to the next build
            _, removals = await asyncio.to_thread(self._poll, build_id)
        await asyncio.to_thread(remove_trees, removals)

    @property
    def _admission(self) -> asyncio.Lock:
        """Lets one task of this process at a time wait on the work_dir's flock (each
        waits in a thread). One lock per event loop: tests run several loops."""
        loop = asyncio.get_running_loop()
        if self._admission_lock is None or self._admission_loop is not loop:
            self._admission_lock, self._admission_loop = asyncio.Lock(), loop
        return self._admission_lock

    # --- the state directory ---

    def _dir(self, build_id: str) -> Path:
        return self.work_dir / build_id

    def _check_id(self, build_id: str) -> None:
        if not _BUILD_ID.fullmatch(build_id):
            raise BuildRunnerError(f"not a command build id: {build_id!r} (want "
                                   f"{BUILD_ID_PREFIX}<32 hex digits>)")

    def _spec(self, build_id: str) -> dict[str, Any]:
        try:
            return json.loads((self._dir(build_id) / BUILD_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise BuildRunnerError(f"command runner: no build {build_id} under "
                                   f"{self.work_dir}") from None
        except (OSError, ValueError) as exc:
            raise BuildRunnerError(f"command runner: build {build_id}: unreadable "
                                   f"{BUILD_FILE}: {exc}") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The work_dir's admission lock (blocking: call from a worker thread)."""
        (self.work_dir / ACTIVE_DIR).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # --- blocking halves, run in a worker thread under the lock ---

    def _enqueue(self, build_id: str, spec: dict[str, Any],
                 trigger_key: str) -> tuple[str, list[Path]]:
        """Queue a new build, or return the one already queued for ``trigger_key`` (a
        trigger repeated after a crash starts no second build)."""
        with self._locked():
            key_file = (self.work_dir / KEYS_DIR
                        / hashlib.sha256(trigger_key.encode()).hexdigest())
            if trigger_key:
                known = key_file.read_text(encoding="utf-8").strip() \
                    if key_file.exists() else ""
                if known and (self._dir(known) / BUILD_FILE).exists():
                    return known, []
            state = self._dir(build_id)
            state.mkdir()
            write_atomically(state / BUILD_FILE, json.dumps(spec, indent=1))
            if trigger_key:
                key_file.parent.mkdir(exist_ok=True)
                write_atomically(key_file, f"{build_id}\n")
            (self.work_dir / ACTIVE_DIR / build_id).touch()
            return build_id, self._sweep()

    def _poll(self, build_id: str) -> tuple[_Observed, list[Path]]:
        with self._locked():
            self._spec(build_id)  # unknown → BuildRunnerError
            removals = self._sweep()  # may launch this very build
            observed = self._observe(build_id)
            if (observed.status.is_terminal
                    and (self.work_dir / ACTIVE_DIR / build_id).exists()):
                removals += self._sweep()  # it ended just now: retire it before reporting
            return observed, removals

    def _mark_cancelled(self, build_id: str) -> _Observed:
        with self._locked():
            self._spec(build_id)
            observed = self._observe(build_id)
            if observed.status.is_terminal:
                return observed  # a finished build stays as it ended; idempotent
            write_atomically(self._dir(build_id) / CANCELLED, f"{time.time()!r}\n")
            return self._observe(build_id)

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
                    write_atomically(self._dir(build_id) / TIMED_OUT, f"{time.time()!r}\n")
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
                removals.append(self._dir(build_id) / CHECKOUT)
        for _, build_id in sorted(queued)[:max(0, self.max_parallel - busy)]:
            self._launch(build_id)
        return removals

    def _observe(self, build_id: str) -> _Observed:
        """The build's status from its files (see the module docstring for the rules)."""
        state = self._dir(build_id)
        process = read_process(state)
        alive = process is not None and leader_alive(process)
        # read after the liveness check: the wrapper writes its exit code, then exits
        exit_code = read_int(state / EXIT_CODE)
        code_at = mtime_ns(state / EXIT_CODE)
        for marker, status, reason in ((CANCELLED, BuildStatus.CANCELLED, "cancelled"),
                                       (TIMED_OUT, BuildStatus.FAILED, "timeout")):
            marked_at = mtime_ns(state / marker)
            if marked_at is not None and (code_at is None or code_at >= marked_at):
                return _Observed(status, reason, exit_code, process, alive)
        if exit_code is not None:
            status = BuildStatus.SUCCEEDED if exit_code == 0 else BuildStatus.FAILED
            return _Observed(status, "exit_code", exit_code, process, alive)
        if process is None:
            if (state / LAUNCHING).exists():  # the launching worker died mid-launch
                return _Observed(BuildStatus.FAILED, "vanished")
            return _Observed(BuildStatus.ACCEPTED, "queued")
        if alive:
            return _Observed(BuildStatus.RUNNING, "running", None, process, alive)
        return _Observed(BuildStatus.FAILED, "vanished", None, process)

    def _past_timeout(self, observed: _Observed) -> bool:
        return (self.timeout is not None and observed.process is not None
                and time.time() - observed.process.started_at > self.timeout)

    def _grace_over(self, build_id: str) -> bool:
        state = self._dir(build_id)
        stamps = [t for t in (mtime_ns(state / CANCELLED), mtime_ns(state / TIMED_OUT))
                  if t is not None]
        return not stamps or time.time() - min(stamps) / 1e9 > self.kill_grace

    def _launch(self, build_id: str) -> None:
        """Start a queued build (under the lock). A failure to start fails the build."""
        state = self._dir(build_id)
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
        process = read_process(self._dir(build_id))
        return process is not None and (leader_alive(process)
                                        or bool(group_members(process.pgid, build_id)))

    async def _stop(self, build_id: str) -> None:
        """SIGTERM the build's processes, SIGKILL what is left after the grace period."""
        for sig, patience in ((signal.SIGTERM, self.kill_grace), (signal.SIGKILL, 5.0)):
            process = await asyncio.to_thread(read_process, self._dir(build_id))
            await asyncio.to_thread(self._signal, build_id, process, sig)
            deadline = time.monotonic() + patience
            while time.monotonic() < deadline:
                if not await asyncio.to_thread(self._running_processes, build_id):
                    return
                await asyncio.sleep(_STOP_POLL_INTERVAL)

