"""The command BuildRunner: a shell command run in a clean checkout of the head commit
(design §8), on the host that triggered it, with its state shared by every host.

Two truths, each with one writer:

- **The build's row** (``command_build`` in PostgreSQL, `store.command_builds`) is what
  every host reads: owning ``host``, status and reason, pid/pgid/start time, exit code,
  the tail of the log, ``heartbeat_at``, ``cancel_requested_at``. So `status` and
  `cancel` answer on any worker on any machine.
- **The files under ``work_dir``** on the owning host are the truth about the process;
  only that host (`LocalBuilds`) launches, watches and stops it.

The owner writes what it observes into the row: on every trigger, status and cancel it
handles, and in `tend`, which the worker runs every few seconds for every command runner.
A tend launches queued builds into free slots, stops builds past their timeout, applies
cancels other hosts asked for, records changes (status, exit code, log tail), and renews
the heartbeat of all its live builds in one statement. Another host's `status` reads the
row; a live build whose heartbeat is older than ``host_timeout`` (by the database's clock)
is failed there and then, reason ``host_lost`` (compare-and-set: whoever decides first
decides) — but only by a host that has itself been heartbeating without a gap for
``host_timeout`` (`store.worker_hosts`): a database outage stops every heartbeat, and is
never evidence that a host died. A lost build gives no verdict: its attempt is tried again
(`BuildReport.unvalidated`). Another host's `cancel` writes ``cancel_requested_at``; the
owner's next tend stops the build and records it ``cancelled``. A terminal status is
write-once, so an owner that comes back after being declared lost finds its build failed
and stops it: a lost build is never reported green afterwards.

Bound: a host that dies (or loses the database on its own) has its builds reported failed
by the first poll after ``host_timeout`` since its last heartbeat, i.e. within
``host_timeout`` plus the queue's ``poll_delay_running``; when the dead host's worker was
also the one polling, add the time Kafka takes to hand its partitions over (the session
timeout, 10 s); when the polling host itself had a gap in its own heartbeats (it restarted,
or the database was away), add up to another ``host_timeout``.

A build id is ``cmd-<32 hex digits>``; its state directory on the owner is
``<work_dir>/<build id>/``:

- ``build.json``  what to run: head/base URIs and shas, clone source, command, queue,
  request id, queued_at (written once, at trigger, before the row);
- ``launching``   the build is being started (written just before the launch);
- ``pid``, ``pgid``, ``start_time``  the build's wrapper shell, its process group (the
  build's own session) and its start time from ``/proc/<pid>/stat`` (clock ticks since
  boot), which tells the wrapper from a later process that reuses its pid. ``pid`` is
  written last: present means all three are;
- ``log``         the build's stdout and stderr, kept after the build;
- ``exit_code``   written by the wrapper shell when the command ends (tmp file + rename);
- ``cancelled`` / ``timed_out``  markers written by a cancel / by a poll past ``timeout``;
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

Triggering: the state directory is written first (invisible: nothing launches it), then
the row is inserted (its unique trigger key makes a trigger repeated after a crash, on
any host, return the build already started), then the build is queued locally. A crash
between the row and the queueing is repaired by the owner's next tend.

Bounded concurrency: at most ``max_parallel`` builds of one work_dir run at once. A trigger
over the bound is *queued*, not refused: it reports ``accepted`` and starts, oldest first,
when a tend, trigger, status poll or cancel on the owner finds a free slot. (A retryable
error instead would spend the build stage's retry budget while the runner is merely
busy; the buildsignal poll loop already waits on ``accepted`` builds, and the queue's poll
deadline still bounds the wait.) Admission, launching and every status decision happen
under an exclusive ``flock`` on ``<work_dir>/admission.lock``; builds queued or running
are listed in ``<work_dir>/active/`` so a poll reads only those, never the whole history.

Every sweep also tidies up: a build that is over loses its checkout (its log stays) and
any process it left behind; a running build past ``timeout`` is stopped (SIGTERM, then
SIGKILL after ``kill_grace``) and reported failed.

A build started by a version of Stovepipe without rows (found active under the work_dir
with no row) is adopted by its host: given a row in its current state.
"""

from __future__ import annotations

import logging
import re
import signal
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic.dataclasses import dataclass as spec_dataclass

from store.command_builds import CommandBuildStore, Observation
from store.entities import BuildStatus, CommandBuild
from store.errors import NotFound
from store.worker_hosts import HEARTBEAT_GAP, MIN_HOST_TIMEOUT
from streams.extensions import ExtensionContext
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.extensions.buildrunner.local_builds import (
    ACTIVE_DIR,
    LAUNCH_ABORTED_EXIT_CODE,
    LocalBuilds,
    Observed,
)
from streams.extensions.buildrunner.processes import CHECKOUT, LOG
from streams.extensions.sourcecontrol.contract import SourceControlError
from streams.extensions.sourcecontrol.gitrepo import GitRepository
from streams.extensions.sourcecontrol.gituri import parse_uri
from streams.extensions.sourcecontrol.gitvalues import Repository
from streams.schema.fields import SPEC, ConfigPath, Duration, PositiveInt

if TYPE_CHECKING:
    from store import Database

__all__ = ["ACTIVE_DIR", "CHECKOUT", "LAUNCH_ABORTED_EXIT_CODE", "CommandBuildRunner",
           "CommandBuildRunnerSpec", "default_work_dir"]

BUILD_ID_PREFIX = "cmd-"
DEFAULT_MAX_PARALLEL = 2
DEFAULT_KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
DEFAULT_HOST_TIMEOUT = 60.0  # seconds without a heartbeat before a build is failed
_BUILD_ID = re.compile(r"cmd-[0-9a-f]{32}")

log = logging.getLogger("stovepipe.buildrunner.command")
# a failed build's reasons that give no verdict on the commit (design §4), in words
UNVALIDATED_REASONS = {
    "host_lost": "its host was lost",
    "vanished": "its process vanished before it finished",
    "not_run": "its command never ran",
}


# --- queues.yaml --------------------------------------------------------------------------


def _host_timeout(value: timedelta) -> timedelta:
    if value.total_seconds() < MIN_HOST_TIMEOUT:
        raise ValueError(f"must be at least {MIN_HOST_TIMEOUT:g}s: a host is judged lost "
                         f"only after missing heartbeats (every 2 s) for this long, and a "
                         f"short database outage must not look like that")
    return value


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
    # a live build whose host has not heartbeated for this long is failed
    host_timeout: Annotated[Duration, AfterValidator(_host_timeout)] = timedelta(
        seconds=DEFAULT_HOST_TIMEOUT)
    kind: Literal["command"] = "command"

    def build(self, context: ExtensionContext) -> CommandBuildRunner:
        repository = self.repository or context.repository
        if repository is None:
            raise ValueError(f"queue {context.queue!r}: a command build runner needs "
                             f"'repository' when the source_control is not git")
        return CommandBuildRunner(
            self.command, repository,
            self.work_dir or default_work_dir(context.home, context.queue),
            database=context.database, host=context.host,
            host_timeout=self.host_timeout.total_seconds(),
            queue=context.queue, max_parallel=self.max_parallel,
            timeout=self.timeout.total_seconds() if self.timeout is not None else None,
            cache_root=context.git_cache)


def default_work_dir(home: Path, queue: str) -> Path:
    """Where a queue's command builds live by default: <home>/builds/<queue>."""
    parts = [f"_{part}" if part in (".", "..") else part for part in queue.split("/")]
    return home / "builds" / Path(*parts)


class CommandBuildRunner:
    """Runs ``command`` with ``sh -c`` in a clean checkout of the head commit of
    ``repository`` (a local path or a URL, read as GitRepository reads it), on this
    ``host``, with the build's process state under ``work_dir`` and its shared state in
    ``database`` (see the module docstring).

    ``max_parallel`` builds of the work_dir run at once, the rest queue; ``timeout``
    (seconds, optional) fails a build that runs longer; ``kill_grace`` is how long a
    stopped build gets between SIGTERM and SIGKILL; ``host_timeout`` is how long a build's
    owner may go without a heartbeat before other hosts report the build failed. ``queue``
    names the queue in the build's environment when the trigger metadata does not.

    File work happens in worker threads and git in subprocesses: nothing blocks the loop.
    Errors: a malformed or unknown build id, a head commit the repository does not have,
    or a runner built without a database is a non-retryable BuildRunnerError; an
    unreachable remote is retryable; database errors pass through (the runtime
    classifies them).
    """

    def __init__(self, command: str, repository: str, work_dir: Path | str, *,
                 database: Database | None, host: str,
                 host_timeout: float = DEFAULT_HOST_TIMEOUT,
                 queue: str = "", max_parallel: int = DEFAULT_MAX_PARALLEL,
                 timeout: float | None = None, kill_grace: float = DEFAULT_KILL_GRACE,
                 cache_root: Path | str | None = None) -> None:
        if not command.strip():
            raise ValueError("a build command must be non-empty")
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be at least 1, got {max_parallel}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if host_timeout <= 0:
            raise ValueError(f"host_timeout must be positive, got {host_timeout}")
        if database is not None and not host.strip():
            raise ValueError("a command build runner needs this worker's host id")
        self.command = command
        self.repo = GitRepository(repository, cache_root=cache_root)
        self.work_dir = Path(work_dir).expanduser().absolute()
        self.database = database
        self.host = host
        self.host_timeout = host_timeout
        self.queue = queue
        self.max_parallel = max_parallel
        self.timeout = timeout
        self.kill_grace = kill_grace
        self.local = LocalBuilds(self.work_dir, max_parallel=max_parallel, timeout=timeout,
                                 kill_grace=kill_grace)

    def __repr__(self) -> str:
        return (f"CommandBuildRunner({self.command!r}, repository={self.repo.repository!r}, "
                f"work_dir={str(self.work_dir)!r}, host={self.host!r}, "
                f"max_parallel={self.max_parallel})")

    # --- the contract ---

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        rows = self._rows()
        trigger_key = metadata.get("trigger_key") or None
        try:
            head = parse_uri(head_uri)
        except SourceControlError as exc:
            raise BuildRunnerError(f"command runner: cannot build {head_uri}: {exc}",
                                   retryable=exc.retryable) from exc
        if trigger_key is not None:
            known = await rows.find_by_trigger_key(trigger_key)
            if known is not None:  # a repeated trigger: the build started for it
                return _same_head(known, trigger_key, head.sha).build_id
        try:
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
        queue = metadata.get("queue") or self.queue
        request_id = metadata.get("request_id", "")
        await self.local.prepare(build_id, {
            "build_id": build_id, "queue": queue, "request_id": request_id,
            "head_uri": head_uri, "base_uri": base_uri or "", "head_sha": head.sha,
            "base_sha": base_sha, "source": str(source), "command": self.command,
            "queued_at": time.time()})
        # should this fail after the row committed, the owner's tend queues the build
        row, created = await rows.create_or_get(
            build_id, queue=queue, request_id=request_id, trigger_key=trigger_key,
            host=self.host, work_dir=str(self.work_dir), head_sha=head.sha)
        if not created:  # a concurrent trigger of the same key won
            await self.local.discard(build_id)
            assert trigger_key is not None  # without a key every insert is new
            return _same_head(row, trigger_key, head.sha).build_id
        await self.local.activate(build_id)
        await self._reconcile(row)
        return build_id

    async def status(self, build_id: str) -> BuildReport:
        row = await self._row(build_id)
        if self._owns(row):
            row = await self._reconcile(row, wait_for_stop=True)
        elif not row.status.is_terminal and row.heartbeat_age > self.host_timeout:
            row = await self._declare_lost(row)
        return self._report(row)

    async def cancel(self, build_id: str) -> None:
        row = await self._row(build_id)
        if not self._owns(row):
            if not row.status.is_terminal:  # the owner's tend stops it
                await self._rows().request_cancel(build_id)
            return
        if not row.status.is_terminal:
            observed = await self.local.mark_cancelled(build_id)
            if observed.process is not None and observed.status is BuildStatus.CANCELLED:
                await self.local.stop(build_id)
        await self._reconcile(row)  # records it (a finished build stays as it ended)

    async def tend(self) -> None:
        """What the owner does every few seconds (the worker's periodic task): launch,
        time out and retire builds, apply cancels asked for by other hosts, record what
        changed, stop builds another host failed, and renew the heartbeat of all live
        builds of this host under this work_dir (one statement)."""
        rows = self._rows()
        await self.local.sweep()
        live = {row.build_id: row for row in
                await rows.list_live(self.host, str(self.work_dir))}
        unlisted = [b for b in await self.local.active_ids() if b not in live]
        stored = await rows.get_many(unlisted) if unlisted else {}
        for build_id in [*unlisted, *live]:
            row = live.get(build_id) or stored.get(build_id)
            try:
                if row is None:
                    await self._adopt(build_id)
                elif self._owns(row):  # terminal ones among the unlisted: stopped here
                    await self._reconcile(row, swept=True)
            except (BuildRunnerError, OSError) as exc:
                # one broken build must not stop the heartbeat of the others
                log.error("command_build_tend_failed build_id=%s error=%s", build_id,
                          f"{type(exc).__name__}: {exc}")
        await rows.heartbeat(self.host, str(self.work_dir))

    # --- the owner: local observations into the row ---

    def _owns(self, row: CommandBuild) -> bool:
        return row.host == self.host and row.work_dir == str(self.work_dir)

    async def _reconcile(self, row: CommandBuild, *, wait_for_stop: bool = False,
                         swept: bool = False) -> CommandBuild:
        """Bring an owned build's row and process into agreement: the row's terminal
        status wins (the process is stopped), otherwise the local observation is
        recorded. ``swept``: the work_dir was just swept (the tend), so only look."""
        build_id = row.build_id
        if not await self.local.known(build_id):
            if row.status.is_terminal:
                return row
            return await self._record(row, Observation(
                BuildStatus.FAILED, "vanished", log_tail=row.log_tail,
                detail=f"its state directory {self.local.dir(build_id)} is gone"))
        observed = await (self.local.observe if swept else self.local.poll)(build_id)
        if row.status.is_terminal:
            if not observed.status.is_terminal:
                # stopped like a cancelled build: sweeps escalate to SIGKILL
                await self.local.mark_cancelled(build_id)
                await self.local.signal(build_id, signal.SIGTERM)
                log.warning("command_build_stopped build_id=%s status=%s reason=%s",
                            build_id, row.status, row.reason)
            return row
        if row.cancel_requested_at is not None and not observed.status.is_terminal:
            observed = await self.local.mark_cancelled(build_id)
            await self.local.signal(build_id, signal.SIGTERM)
        if observed.reason == "queued":
            await self.local.activate(build_id)  # the trigger died before queueing it
            observed = await self.local.observe(build_id)
        if wait_for_stop and observed.reason == "timeout" and observed.alive:
            await self.local.stop(build_id)
            observed = await self.local.poll(build_id)  # retires it, frees its slot
        return await self._record(row, await self._observation(build_id, observed))

    async def _observation(self, build_id: str, observed: Observed) -> Observation:
        process = observed.process
        return Observation(
            observed.status, observed.reason, exit_code=observed.exit_code,
            pid=process.pid if process else None, pgid=process.pgid if process else None,
            proc_start_time=process.start_time if process else None,
            log_tail=await self.local.log_tail(build_id))

    async def _record(self, row: CommandBuild, observed: Observation) -> CommandBuild:
        if _same(row, observed):
            return row
        recorded = await self._rows().record(row.build_id, self.host, observed)
        if recorded is not None:
            return recorded
        # another host decided first (a terminal status is write-once): that stays
        latest = await self._rows().get(row.build_id)
        return await self._reconcile(latest) if latest.status.is_terminal else latest

    async def _adopt(self, build_id: str) -> CommandBuild:
        """Give a build found here without a row (started by a version without rows)
        one, in its current state."""
        spec = await self.local.spec(build_id)
        observed = await self._observation(build_id, await self.local.poll(build_id))
        row, _ = await self._rows().create_or_get(
            build_id, queue=str(spec.get("queue", self.queue)),
            request_id=str(spec.get("request_id", "")), trigger_key=None, host=self.host,
            work_dir=str(self.work_dir), head_sha=str(spec.get("head_sha") or "") or None,
            observed=observed)
        log.info("command_build_adopted build_id=%s status=%s", build_id, row.status)
        return row

    # --- any host ---

    async def _declare_lost(self, row: CommandBuild) -> CommandBuild:
        failed = await self._rows().fail_if_silent(row.build_id, self.host_timeout,
                                                   declarer=self.host, gap=HEARTBEAT_GAP)
        if failed is None:  # it heartbeated or ended meanwhile
            return await self._rows().get(row.build_id)
        log.warning("command_build_host_lost build_id=%s host=%s detail=%s",
                    failed.build_id, failed.host, failed.detail)
        return failed

    async def _row(self, build_id: str) -> CommandBuild:
        """The build's row; a build of this work_dir without one is adopted. Unknown or
        malformed ids are a non-retryable BuildRunnerError."""
        if not _BUILD_ID.fullmatch(build_id):
            raise BuildRunnerError(f"not a command build id: {build_id!r} (want "
                                   f"{BUILD_ID_PREFIX}<32 hex digits>)")
        try:
            return await self._rows().get(build_id)
        except NotFound:
            if await self.local.known(build_id):
                return await self._adopt(build_id)
            raise BuildRunnerError(f"command runner: no build {build_id}") from None

    def _rows(self) -> CommandBuildStore:
        if self.database is None:
            raise BuildRunnerError(
                "command runner: built without a database, so no host could see its "
                "builds; it runs inside a worker, which passes its own")
        return self.database.command_builds

    def _report(self, row: CommandBuild) -> BuildReport:
        metadata = {"runner": "command", "reason": row.reason, "host": row.host,
                    "log": str(Path(row.work_dir) / row.build_id / LOG),
                    "log_tail": row.log_tail}
        if row.exit_code is not None:
            metadata["exit_code"] = str(row.exit_code)
        if row.detail:
            metadata["detail"] = row.detail
        unvalidated = ""
        if row.status is BuildStatus.FAILED and row.reason in UNVALIDATED_REASONS:
            # the build did not run to its end on a live host: no verdict on the commit
            unvalidated = f"{UNVALIDATED_REASONS[row.reason]}: {row.detail or row.reason}"
        return BuildReport(row.status, metadata, unvalidated,
                           # its checkout failed: building it again fails the same way
                           permanent=bool(unvalidated) and row.reason == "not_run",
                           waiting=_waiting(row), started_at=row.started_at
                           if row.status is not BuildStatus.ACCEPTED else None)


def _waiting(row: CommandBuild) -> str:
    """What a command build that has not started waits for: a free slot on its host."""
    if row.status is BuildStatus.ACCEPTED:
        return f"waiting for a free slot on its host {row.host} (max_parallel)"
    return ""


def _same_head(row: CommandBuild, trigger_key: str, head_sha: str) -> CommandBuild:
    """``row``, found by ``trigger_key`` for a trigger of ``head_sha``, if it builds that
    commit. A trigger key is one Request's, and a Request validates one commit: a build of
    another commit under it is a broken invariant (a hand-edited row, a reused id), never
    a build to report for this one — a non-retryable error naming both commits. A row from
    before the head was stored (None) is trusted, as it always was."""
    if row.head_sha is not None and row.head_sha != head_sha:
        raise BuildRunnerError(
            f"command runner: invariant broken: trigger key {trigger_key!r} names build "
            f"{row.build_id} of commit {row.head_sha}, but this trigger is for commit "
            f"{head_sha}; refusing to report that build for it")
    return row


def _same(row: CommandBuild, observed: Observation) -> bool:
    return (row.status, row.reason, row.detail, row.pid, row.pgid, row.proc_start_time,
            row.exit_code, row.log_tail) == (
        observed.status, observed.reason, observed.detail, observed.pid, observed.pgid,
        observed.proc_start_time, observed.exit_code, observed.log_tail)
