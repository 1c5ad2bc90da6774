"""In-memory surroundings for the pipeline model test (tests/test_pipeline_model.py).

A SourceControl and a BuildRunner that the test drives step by step, the queue knobs the
handlers read through `Deps`, and a message bus standing in for Kafka. Nothing here talks
to Kafka; the store is the real PostgreSQL one.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf.message import Message

from contract import marshal
from store.entities import BuildStatus
from streams.config.queues import BackfillSpec, RetrySpec
from streams.extensions.buildrunner import BuildReport, BuildRunnerError
from streams.extensions.sourcecontrol import (
    CommitNotFound,
    PromotionMoved,
    SourceControlError,
)
from streams.runtime.stage import PublishFailed

# --- injected faults: the only failures the model expects a handler to report ---------------


class InjectedSourceControlError(SourceControlError):
    injected = True


class InjectedRunnerError(BuildRunnerError):
    injected = True


class InjectedPublishFailed(PublishFailed):
    injected = True


class InjectedConnectionLost(ConnectionError):
    """The database connection died around a write: before it, or after it committed."""

    injected = True


def is_injected(exc: BaseException | None) -> bool:
    while exc is not None:
        if getattr(exc, "injected", False):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class ModelViolation(AssertionError):
    """An invariant broke inside a fake (e.g. at promotion time); never classified."""


# --- the database, with crash windows around its writes -------------------------------------

STORE_WRITES = frozenset({"transition", "take_slot", "release_slot", "advance_bookmark",
                          "set_latest_request", "create", "get_or_create", "set_status",
                          "next", "claim_loop"})


class CrashWindows:
    """One armed fault: the ``countdown``-th next write (a store write or a transaction's
    commit) fails ``before`` it takes effect or ``after`` it did (a lost acknowledgement)."""

    def __init__(self) -> None:
        self.armed: tuple[int, str] | None = None

    def tick(self) -> str | None:
        if self.armed is None:
            return None
        countdown, mode = self.armed
        if countdown > 0:
            self.armed = (countdown - 1, mode)
            return None
        self.armed = None
        return mode

    @staticmethod
    def crash(what: str, mode: str) -> InjectedConnectionLost:
        return InjectedConnectionLost(f"injected: connection lost {mode} {what}")


class _FaultyStores:
    def __init__(self, stores: Any, crashes: CrashWindows) -> None:
        self._stores = stores
        self._crashes = crashes

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._stores, name)
        if name in ("queues", "requests", "request_uris", "builds", "facts", "counters",
                    "parked"):
            return _FaultyStore(attr, self._crashes)
        return attr


class _FaultyStore:
    def __init__(self, store: Any, crashes: CrashWindows) -> None:
        self._store = store
        self._crashes = crashes

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name not in STORE_WRITES:
            return method
        crashes, what = self._crashes, f"{type(self._store).__name__}.{name}"

        async def write(*args: Any, **kwargs: Any) -> Any:
            mode = crashes.tick()
            if mode == "before":
                raise crashes.crash(what, mode)
            result = await method(*args, **kwargs)
            if mode == "after":
                raise crashes.crash(what, mode)
            return result

        return write


class FaultyDatabase(_FaultyStores):
    """A `store.Database` whose writes and commits may crash (see `CrashWindows`)."""

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[_FaultyStores]:
        mode = None
        async with self._stores.transaction() as tx:
            yield _FaultyStores(tx, self._crashes)
            mode = self._crashes.tick()
            if mode == "before":
                raise self._crashes.crash("commit", mode)
        if mode == "after":
            raise self._crashes.crash("commit", mode)


# --- SourceControl ---------------------------------------------------------------------------


class MemoryRepo:
    """One queue's branch: a linear history with occasional force-pushes and resets.

    Commits are never deleted, but a commit a force-push abandoned is off the ref for
    good (new commits are always fresh). With ``forget_orphans`` such a commit is also
    unknown to ``is_ancestor`` (as after a fetch that no longer carries it)."""

    def __init__(self, queue: str, *, forget_orphans: bool) -> None:
        self.queue = queue
        self.forget_orphans = forget_orphans
        self.parents: dict[str, str | None] = {"c0": None}
        self.head_sha = "c0"
        self.promoted: str | None = None
        self.faults: dict[str, SourceControlError] = {}
        self.on_promote: Callable[[str, str], Awaitable[None]] | None = None
        self._serial = itertools.count(1)

    # -- the test's side -------------------------------------------------------------
    def uri(self, sha: str) -> str:
        return f"mem://{self.queue}/{sha}"

    def line(self) -> list[str]:
        """The commits on the ref, head first."""
        out: list[str] = []
        sha: str | None = self.head_sha
        while sha is not None:
            out.append(sha)
            sha = self.parents[sha]
        return out

    def on_ref(self, uri: str) -> bool:
        return uri.removeprefix(f"mem://{self.queue}/") in self.line()

    def _new_commit(self, parent: str | None) -> None:
        sha = f"c{next(self._serial)}"
        self.parents[sha] = parent
        self.head_sha = sha

    def push(self) -> None:
        self._new_commit(self.head_sha)

    def force_push(self, back: int) -> None:
        """A new commit on top of the ``back``-th ancestor (beyond the root: a new root)."""
        line = self.line()
        self._new_commit(line[back] if back < len(line) else None)

    def reset(self, back: int) -> None:
        """Move the ref back to an existing ancestor."""
        line = self.line()
        self.head_sha = line[min(back, len(line) - 1)]

    # -- the SourceControl protocol --------------------------------------------------
    def _fault(self, op: str) -> None:
        exc = self.faults.pop(op, None)
        if exc is not None:
            raise exc

    def _sha(self, uri: str) -> str:
        sha = uri.removeprefix(f"mem://{self.queue}/")
        if sha == uri or sha not in self.parents:
            raise CommitNotFound(f"no commit {uri!r} in {self.queue}")
        return sha

    def ancestry(self, ancestor_uri: str, descendant_uri: str) -> bool | None:
        """What ``is_ancestor`` answers now; None for CommitNotFound."""
        prefix = f"mem://{self.queue}/"
        ancestor, descendant = (u.removeprefix(prefix) for u in (ancestor_uri, descendant_uri))
        known = self.line() if self.forget_orphans else self.parents
        if ancestor not in known or descendant not in known:
            return None
        sha: str | None = descendant
        while sha is not None:
            if sha == ancestor:
                return True
            sha = self.parents[sha]
        return False

    async def head(self) -> str:
        return self.uri(self.head_sha)

    async def is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        self._fault("is_ancestor")
        ancestor, descendant = self._sha(ancestor_uri), self._sha(descendant_uri)
        if self.forget_orphans:
            line = self.line()
            for sha, uri in ((ancestor, ancestor_uri), (descendant, descendant_uri)):
                if sha not in line:
                    raise CommitNotFound(f"{uri} is no longer known")
        sha: str | None = descendant
        while sha is not None:
            if sha == ancestor:
                return True
            sha = self.parents[sha]
        return False

    async def promotion_target(self) -> str | None:
        return self.promoted

    async def promote(self, uri: str, *, expected: str | None) -> None:
        self._fault("promote")
        self._sha(uri)
        if self.promoted != expected:
            raise PromotionMoved(f"the promotion ref is at {self.promoted}, not {expected}")
        if not self.on_ref(uri):
            raise CommitNotFound(f"{uri} is not on the ref any more")
        if self.on_promote is not None:
            await self.on_promote(self.queue, uri)
        self.promoted = uri

    async def commit_time(self, uri: str) -> datetime:
        self._sha(uri)
        return datetime(2024, 1, 1, tzinfo=UTC)


# --- BuildRunner -----------------------------------------------------------------------------


@dataclass
class MemoryBuild:
    id: str
    queue: str
    head_uri: str
    base_uri: str | None
    status: BuildStatus = BuildStatus.ACCEPTED
    reported: set[BuildStatus] = field(default_factory=set)
    cancel_calls: int = 0


class MemoryRunner:
    """Builds whose progress the test decides; ``status`` records what it reported."""

    def __init__(self, queue: str, prefix: str) -> None:
        self.queue = queue
        self.prefix = prefix
        self.builds: dict[str, MemoryBuild] = {}
        self.faults: dict[str, BuildRunnerError] = {}
        self._serial = itertools.count(1)

    def _fault(self, op: str) -> None:
        exc = self.faults.pop(op, None)
        if exc is not None:
            raise exc

    def advance(self, build_id: str, to: BuildStatus) -> None:
        build = self.builds[build_id]
        assert not build.status.is_terminal and to is not build.status
        build.status = to

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        self._fault("trigger")
        build_id = f"{self.prefix}-b{next(self._serial)}"
        self.builds[build_id] = MemoryBuild(build_id, self.queue, head_uri, base_uri)
        return build_id

    async def status(self, build_id: str) -> BuildReport:
        self._fault("status")
        build = self.builds.get(build_id)
        if build is None:
            raise BuildRunnerError(f"unknown build {build_id}")
        build.reported.add(build.status)
        return BuildReport(build.status)

    async def cancel(self, build_id: str) -> None:
        build = self.builds[build_id]
        build.cancel_calls += 1
        if not build.status.is_terminal:
            build.status = BuildStatus.CANCELLED


# --- configuration and extensions, as `Deps` exposes them ------------------------------------


@dataclass
class Knobs:
    max_concurrent: int
    gate_delay: timedelta = timedelta(seconds=1)
    poll_delay_queued: timedelta = timedelta(seconds=5)
    poll_delay_running: timedelta = timedelta(seconds=1)
    poll_deadline: timedelta = timedelta(days=1)
    start_deadline: timedelta | None = None
    trigger_deadline: timedelta = timedelta(hours=1)
    retry: RetrySpec = field(default_factory=RetrySpec)
    backfill: BackfillSpec = field(default_factory=BackfillSpec)  # off: no culprit search
    status_channels: tuple[str, ...] = ()  # the model's queues notify nothing
    alert_channels: tuple[str, ...] = ()
    projects: Mapping[str, Any] = field(default_factory=dict)  # the model's queues have none


class MemoryQueues:
    def __init__(self, knobs: dict[str, Knobs]) -> None:
        self.knobs = knobs

    def get(self, name: str) -> Knobs:
        try:
            return self.knobs[name]
        except KeyError:
            raise LookupError(f"unknown queue {name!r}") from None


class MemoryExtensions:
    def __init__(self, repos: dict[str, MemoryRepo], runners: dict[str, MemoryRunner]) -> None:
        self.repos = repos
        self.runners = runners

    def source_control(self, queue: str) -> MemoryRepo:
        return self.repos[queue]

    def build_runner(self, queue: str) -> MemoryRunner:
        return self.runners[queue]


# --- the bus ---------------------------------------------------------------------------------


@dataclass
class Pending:
    key: str  # topic key: "process", …, or "<key>_dlq"
    value: bytes
    attempt: int
    serial: int
    origin: str = ""  # where the delivery a retry retries began; "" for a new message

    def __post_init__(self) -> None:
        self.origin = self.origin or f"0:{self.serial}"


class Bus:
    """The multiset of messages not yet acknowledged. Publishing appends; the test picks
    which one to deliver next."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.fail_next_publish = False
        self._serial = itertools.count()

    def add(self, key: str, value: bytes, attempt: int = 0, *, origin: str = "") -> None:
        self.pending.append(Pending(key, value, attempt, next(self._serial), origin))

    async def publish(self, key: str, payload: Message) -> None:
        if self.fail_next_publish:
            self.fail_next_publish = False
            raise InjectedPublishFailed(f"injected: the broker did not acknowledge {key}")
        self.add(str(key), marshal(payload))
