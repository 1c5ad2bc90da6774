"""The fake BuildRunner: outcomes chosen by the head commit, stateless (design §8).

Any worker may poll any build, so a build id carries everything ``status`` needs::

    fake-<unpadded urlsafe base64 of {"head": uri, "base": uri|null, "t": epoch s}>-<nonce>

where the nonce is 16 hex digits, so two triggers of one commit are two builds.

Behaviour comes from the head commit's sha — the text after the last ``/`` of the head
URI, whatever the URI scheme — read as ``-``-separated tokens, e.g. ``c7-queued1-slow3-fail``:

- no token: ``succeeded`` from the first poll;
- ``fail``: ends ``failed`` instead of ``succeeded``;
- ``queuedN``: ``accepted`` for the first N seconds after the trigger;
- ``slowN``: then ``running`` for N seconds, then the outcome;
- ``hang``: then ``running`` forever;
- ``latchNAME``: then ``running`` until the file ``<state_dir>/latches/NAME`` exists — a
  test holds a build open for exactly as long as it needs, whatever the machine's load;
- ``triggerlatchNAME``: the ``trigger`` call itself does not return until the file
  ``<state_dir>/latches/NAME`` exists — a hosted CI hanging on one call, held exactly as
  long as a test needs;
- ``triggererror`` / ``triggerretry``: ``trigger`` raises, non-retryable / retryable;
- ``statuserror`` / ``statusretry``: ``status`` raises, non-retryable / retryable;
- ``statusflaky``: with a ``state_dir``, every other ``status`` call of the build raises a
  retryable error (the 1st, 3rd, …; counted in ``<state_dir>/status_calls.log``) — a hosted
  CI answering 5xx now and then over a long build.

N may be fractional (``slow0.5``). Other tokens are ignored.

An outage of the whole CI: with a ``state_dir``, while the file ``<state_dir>/down`` exists
every ``trigger``, ``status`` and ``cancel`` fails with a retryable error (with
``retry_after`` when the file holds a number of seconds), and each such call is appended
to ``<state_dir>/outage_calls.log`` (``<call> <build id> <epoch s>``), so a test can count
how often the workers called a CI that was down.

With a ``state_dir``, a trigger carrying a ``trigger_key`` in its metadata returns the
build it already started for that key (``<state_dir>/triggers.log``), so a trigger
repeated after a crash starts no second build. ``latency`` simulates a hosted CI's call
latencies, e.g. ``{trigger: 300ms, status: 200ms}``.

Cancelling: with a ``state_dir``, ``cancel`` appends ``<build id> <epoch s>`` to
``<state_dir>/cancelled.log`` (under an ``flock``), so every runner sharing the directory
sees it; a build cancelled before its behaviour finished it reports ``cancelled`` from
then on, one that had already finished stays as it ended. Without a ``state_dir``
``cancel`` does nothing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fcntl
import json
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic.dataclasses import dataclass as spec_dataclass

from store.entities import BuildStatus
from streams.extensions import ExtensionContext
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.schema.fields import SPEC, ConfigPath, Duration

BUILD_ID_PREFIX = "fake-"
CANCELLED_FILE = "cancelled.log"
_TIMED_TOKEN = re.compile(r"(queued|slow)(\d+(?:\.\d+)?)")
_LATCH_TOKEN = re.compile(r"latch([A-Za-z0-9_]+)")
_TRIGGER_LATCH_TOKEN = re.compile(r"triggerlatch([A-Za-z0-9_]+)")
LATCH_POLL = 0.05  # seconds between two looks for a trigger latch
LATCH_DIR = "latches"
TRIGGERS_FILE = "triggers.log"
STATUS_CALLS_FILE = "status_calls.log"
DOWN_FILE = "down"
OUTAGE_CALLS_FILE = "outage_calls.log"
_NONCE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class Behaviour:
    """What a build of one head commit does, read from its sha."""

    fail: bool = False
    queued: float = 0.0  # seconds `accepted` after the trigger
    slow: float = 0.0  # then seconds `running`
    hang: bool = False  # then `running` forever
    latch: str = ""  # then `running` until <state_dir>/latches/<latch> exists
    trigger_latch: str = ""  # `trigger` returns once <state_dir>/latches/<this> exists
    trigger_error: bool = False
    trigger_retry: bool = False
    status_error: bool = False
    status_retry: bool = False
    status_flaky: bool = False

    @classmethod
    def of(cls, head_uri: str) -> Behaviour:
        sha = head_uri.rpartition("/")[2]
        fields: dict[str, Any] = {}
        for token in sha.split("-"):
            timed = _TIMED_TOKEN.fullmatch(token)
            latch = _LATCH_TOKEN.fullmatch(token)
            trigger_latch = _TRIGGER_LATCH_TOKEN.fullmatch(token)
            if trigger_latch:
                fields["trigger_latch"] = trigger_latch.group(1)
            elif timed:
                fields[timed.group(1)] = float(timed.group(2))
            elif latch:
                fields["latch"] = latch.group(1)
            elif token in _FLAGS:
                fields[_FLAGS[token]] = True
        return cls(**fields)

    def finishes_after(self, released_after: float | None = None) -> float:
        """Seconds from trigger to the terminal status; infinite for ``hang`` and for a
        latch not yet released (``released_after``: seconds from trigger to the release)."""
        if self.hang:
            return math.inf
        if self.latch:
            if released_after is None:
                return math.inf
            return max(self.queued + self.slow, released_after)
        return self.queued + self.slow

    def status_at(self, elapsed: float, released_after: float | None = None) -> BuildStatus:
        """The status ``elapsed`` seconds after the trigger."""
        if elapsed < self.queued:
            return BuildStatus.ACCEPTED
        if elapsed < self.finishes_after(released_after):
            return BuildStatus.RUNNING
        return BuildStatus.FAILED if self.fail else BuildStatus.SUCCEEDED


_FLAGS = {
    "fail": "fail",
    "hang": "hang",
    "triggererror": "trigger_error",
    "triggerretry": "trigger_retry",
    "statuserror": "status_error",
    "statusretry": "status_retry",
    "statusflaky": "status_flaky",
}


@dataclass(frozen=True)
class FakeBuild:
    """What a fake build id encodes."""

    head_uri: str
    base_uri: str | None
    triggered_at: float  # epoch seconds
    nonce: str

    def build_id(self) -> str:
        body = json.dumps({"head": self.head_uri, "base": self.base_uri,
                           "t": self.triggered_at}, separators=(",", ":"))
        encoded = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
        return f"{BUILD_ID_PREFIX}{encoded}-{self.nonce}"

    @classmethod
    def parse(cls, build_id: str) -> FakeBuild:
        """Raises a non-retryable BuildRunnerError naming a malformed id."""
        encoded, _, nonce = build_id.removeprefix(BUILD_ID_PREFIX).rpartition("-")
        try:
            if not build_id.startswith(BUILD_ID_PREFIX) or not _NONCE.fullmatch(nonce):
                raise ValueError("bad prefix or nonce")
            raw = json.loads(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)))
            head, base, t = raw["head"], raw["base"], raw["t"]
            if not (isinstance(head, str) and head and (base is None or isinstance(base, str))
                    and isinstance(t, int | float) and not isinstance(t, bool)):
                raise ValueError("bad fields")
        except (ValueError, TypeError, KeyError, binascii.Error):
            raise BuildRunnerError(f"not a fake build id: {build_id!r}") from None
        return cls(head, base, float(t), nonce)


@spec_dataclass(frozen=True, config=SPEC)
class FakeBuildRunnerSpec:
    """`kind: fake`: outcomes chosen by the head commit (this module)."""

    wants_repository: ClassVar[bool] = False
    state_dir: ConfigPath | None = None  # where cancellations are shared; None: a no-op
    # simulated call latencies, e.g. {trigger: 300ms, status: 200ms} (benchmarks, tests)
    latency: dict[Literal["trigger", "status", "cancel"], Duration] | None = None
    kind: Literal["fake"] = "fake"

    def build(self, context: ExtensionContext) -> FakeBuildRunner:
        latency = {str(call): delay.total_seconds()
                   for call, delay in (self.latency or {}).items()}
        return FakeBuildRunner(self.state_dir, latency=latency)


class FakeBuildRunner:
    """A BuildRunner whose builds exist only in their ids (see the module docstring).

    ``state_dir`` (optional) is where cancellations are shared between processes;
    ``clock`` gives epoch seconds (tests may replace it).
    """

    def __init__(self, state_dir: Path | str | None = None, *,
                 clock: Callable[[], float] = time.time,
                 latency: Mapping[str, float] | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self._clock = clock
        self.latency = dict(latency or {})

    def __repr__(self) -> str:
        return f"FakeBuildRunner(state_dir={self.state_dir!r})"

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        await self._wait("trigger")
        await self._reachable("trigger", metadata.get("trigger_key", ""))
        behaviour = Behaviour.of(head_uri)
        if behaviour.trigger_latch and self.state_dir is not None:
            latch = self.state_dir / LATCH_DIR / behaviour.trigger_latch
            # the latch is a file another process creates: no event to wait on
            while not await asyncio.to_thread(latch.exists):  # noqa: ASYNC110
                await asyncio.sleep(LATCH_POLL)
        if behaviour.trigger_retry:
            raise BuildRunnerError(f"fake runner: trigger of {head_uri} failed (triggerretry)",
                                   retryable=True)
        if behaviour.trigger_error:
            raise BuildRunnerError(f"fake runner: trigger of {head_uri} rejected "
                                   f"(triggererror)")
        new_id = FakeBuild(head_uri, base_uri, self._clock(), secrets.token_hex(8)).build_id()
        key = metadata.get("trigger_key", "")
        if key and self.state_dir is not None:
            return await asyncio.to_thread(self._build_of_key, self.state_dir, key, new_id)
        return new_id

    async def status(self, build_id: str) -> BuildReport:
        await self._wait("status")
        await self._reachable("status", build_id)
        build = FakeBuild.parse(build_id)
        behaviour = Behaviour.of(build.head_uri)
        if behaviour.status_retry:
            raise BuildRunnerError(f"fake runner: status of {build_id} unavailable "
                                   f"(statusretry)", retryable=True)
        if behaviour.status_error:
            raise BuildRunnerError(f"fake runner: status of {build_id} failed (statuserror)")
        if behaviour.status_flaky and self.state_dir is not None:
            calls = await asyncio.to_thread(self._count_status_call, self.state_dir, build_id)
            if calls % 2:
                raise BuildRunnerError(f"fake runner: status of {build_id} unavailable "
                                       f"(statusflaky, call {calls})", retryable=True)
        now = self._clock()
        released = await asyncio.to_thread(self._released_after, behaviour, build)
        status = behaviour.status_at(now - build.triggered_at, released)
        if self.state_dir is not None:
            cancelled_at = await asyncio.to_thread(self._cancelled_at, self.state_dir,
                                                   build_id)
            if (cancelled_at is not None and cancelled_at - build.triggered_at
                    < behaviour.finishes_after(released)):
                status = BuildStatus.CANCELLED  # stopped before its behaviour finished it
        started = build.triggered_at + behaviour.queued
        return BuildReport(status, {"runner": "fake", "head_uri": build.head_uri,
                                    "base_uri": build.base_uri or ""},
                           waiting="queued for an agent"
                           if status is BuildStatus.ACCEPTED else "",
                           started_at=datetime.fromtimestamp(started, UTC)
                           if status is not BuildStatus.ACCEPTED and now >= started else None)

    async def cancel(self, build_id: str) -> None:
        await self._wait("cancel")
        await self._reachable("cancel", build_id)
        FakeBuild.parse(build_id)
        if self.state_dir is not None:
            await asyncio.to_thread(self._record_cancel, self.state_dir, build_id,
                                    self._clock())

    async def _wait(self, call: str) -> None:
        delay = self.latency.get(call, 0.0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _reachable(self, call: str, subject: str) -> None:
        """An injected outage of the whole CI (the module docstring)."""
        if self.state_dir is None:
            return
        said = await asyncio.to_thread(self._outage, self.state_dir, call, subject)
        if said is not None:
            raise BuildRunnerError(f"fake runner: {call} unavailable (an injected outage: "
                                   f"{self.state_dir / DOWN_FILE} exists)", retryable=True,
                                   retry_after=said or None)

    def _outage(self, state_dir: Path, call: str, subject: str) -> float | None:
        """None when the CI is up; else the Retry-After it asks for (0: none), the call
        logged."""
        try:
            text = (state_dir / DOWN_FILE).read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        with (state_dir / OUTAGE_CALLS_FILE).open("a", encoding="utf-8") as log:
            log.write(f"{call} {subject or '-'} {self._clock()!r}\n")
        try:
            return max(0.0, float(text)) if text else 0.0
        except ValueError:
            return 0.0

    def _released_after(self, behaviour: Behaviour, build: FakeBuild) -> float | None:
        """Seconds from the trigger to the release of the build's latch; None while it is
        held (or without a state_dir, where no latch is ever released)."""
        if not behaviour.latch or self.state_dir is None:
            return None
        try:
            released_at = (self.state_dir / LATCH_DIR / behaviour.latch).stat().st_mtime
        except FileNotFoundError:
            return None
        return max(0.0, released_at - build.triggered_at)

    @staticmethod
    def _count_status_call(state_dir: Path, build_id: str) -> int:
        """Record one more status call of ``build_id``; how many there have been."""
        path = state_dir / STATUS_CALLS_FILE
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{build_id}\n".encode())
            with open(path, encoding="utf-8") as lines:
                return sum(1 for line in lines if line.rstrip("\n") == build_id)
        finally:
            os.close(fd)

    def _build_of_key(self, state_dir: Path, key: str, new_id: str) -> str:
        """The build already started for ``key``, else ``new_id``, recorded for it."""
        path = state_dir / TRIGGERS_FILE
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with open(path, encoding="utf-8") as lines:
                for line in lines:
                    known, _, build_id = line.rstrip("\n").partition("\t")
                    if known == key:
                        return build_id
            os.write(fd, f"{key}\t{new_id}\n".encode())
            return new_id
        finally:
            os.close(fd)

    # --- the shared cancellation log, in a worker thread ---

    @staticmethod
    @contextlib.contextmanager
    def _cancel_log(state_dir: Path, *, exclusive: bool) -> Iterator[Path]:
        path = state_dir / CANCELLED_FILE
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise BuildRunnerError(f"fake runner: cannot open {path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield path
        finally:
            os.close(fd)

    def _record_cancel(self, state_dir: Path, build_id: str, when: float) -> None:
        with self._cancel_log(state_dir, exclusive=True) as path:
            if self._cancelled_at_unlocked(path, build_id) is None:  # idempotent
                with path.open("a", encoding="utf-8") as out:
                    out.write(f"{build_id} {when!r}\n")

    def _cancelled_at(self, state_dir: Path, build_id: str) -> float | None:
        with self._cancel_log(state_dir, exclusive=False) as path:
            return self._cancelled_at_unlocked(path, build_id)

    @staticmethod
    def _cancelled_at_unlocked(path: Path, build_id: str) -> float | None:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                cancelled, _, when = line.rstrip("\n").partition(" ")
                if cancelled == build_id:
                    return float(when)
        return None
