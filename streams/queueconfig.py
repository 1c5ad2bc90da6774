"""queues.yaml: each queue's SourceControl, BuildRunner and knobs (design §8).

`load_queues()` reads the file (``STOVEPIPE_QUEUES_FILE``, else ``queues.yaml`` at the
repository root) into frozen dataclasses, reporting every problem at once in one
`QueueConfigError` that names the file and the YAML path of each. `Extensions` builds a
queue's SourceControl and BuildRunner from it, once per queue per worker.

Durations are `timedelta`s. Relative paths in extension specs are resolved against the
directory of the YAML file, so a configuration means the same from any working directory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

import yaml

from streams import settings as settings_mod
from streams.buildrunner.contract import BuildRunner
from streams.buildrunner.fake import FakeBuildRunner
from streams.sourcecontrol.contract import SourceControl
from streams.sourcecontrol.fake import FakeSourceControl
from streams.topics import format_duration, parse_duration

ENV_QUEUES_FILE = "STOVEPIPE_QUEUES_FILE"
DEFAULT_QUEUES_FILE = settings_mod.REPO_ROOT / "queues.yaml"

MAX_QUEUE_NAME_LENGTH = 200
_QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_QUEUE_NAME_RULE = (f"1-{MAX_QUEUE_NAME_LENGTH} characters: ASCII letters, digits, '.', "
                    f"'_', '-' and '/', starting with a letter or digit, without '//' "
                    f"and not ending in '/'")
_REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
UNKNOWN_QUEUE_LISTS_AT_MOST = 10


# --- errors -----------------------------------------------------------------------------


class InvalidQueueName(ValueError):
    """A queue name that breaks the naming rule: a user error."""


class UnknownQueue(LookupError):
    """No queue of that name in the queue configuration: a user error."""

    retryable = False

    def __init__(self, queue: str, path: Path, known: tuple[str, ...]) -> None:
        self.queue = queue
        self.path = path
        self.known = known
        if not known:
            declared = "declares no queues"
        elif len(known) <= UNKNOWN_QUEUE_LISTS_AT_MOST:
            declared = f"declares {', '.join(known)}"
        else:
            declared = f"declares {len(known)} others"
        super().__init__(f"unknown queue {queue!r}: {path} {declared}. Add the queue there, "
                         f"or set {ENV_QUEUES_FILE} to the file that has it.")


class QueueConfigError(ValueError):
    """queues.yaml is unreadable or invalid. `problems` lists each one, YAML path named."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  {problem}" for problem in problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n{lines}")


def validate_queue_name(name: object) -> str:
    """``name`` if it is a valid queue name, else InvalidQueueName saying why."""
    if not isinstance(name, str):
        raise InvalidQueueName(f"a queue name is a string, got {name!r}")
    valid = _QUEUE_NAME.match(name)
    reason = None
    if not name:
        reason = "it is empty"
    elif len(name) > MAX_QUEUE_NAME_LENGTH:
        reason = f"it is {len(name)} characters long"
    elif valid is None:
        reason = f"it starts with {name[0]!r}, not a letter or digit"
    elif valid.end() < len(name):
        reason = f"it contains {name[valid.end()]!r}"
    elif "//" in name:
        reason = "it contains '//'"
    elif name.endswith("/"):
        reason = "it ends in '/'"
    if reason:
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} chars)"
        raise InvalidQueueName(f"invalid queue name {shown}: {reason}; a queue name is "
                               f"{_QUEUE_NAME_RULE}")
    return name


# --- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeSourceControlSpec:
    """`kind: fake`: a repository in a JSON file (streams.sourcecontrol.fake)."""

    kind: ClassVar[str] = "fake"
    path: Path
    repo: str
    ref: str
    promotion_ref: str | None = None


@dataclass(frozen=True)
class FakeBuildRunnerSpec:
    """`kind: fake`: outcomes chosen by the head commit (streams.buildrunner.fake)."""

    kind: ClassVar[str] = "fake"
    state_dir: Path | None = None  # where cancellations are shared; None: cancel is a no-op


# One member each for now; `kind: git` and `kind: command` join these unions.
SourceControlSpec: TypeAlias = FakeSourceControlSpec
BuildRunnerSpec: TypeAlias = FakeBuildRunnerSpec


@dataclass(frozen=True)
class QueueConfig:
    name: str
    source_control: SourceControlSpec
    build_runner: BuildRunnerSpec
    max_concurrent: int = 1  # builds in flight at once
    gate_delay: timedelta = timedelta(seconds=1)  # hold while the queue is full
    poll_delay_queued: timedelta = timedelta(seconds=5)  # between polls of a queued build
    poll_delay_running: timedelta = timedelta(seconds=2)  # between polls of a running one
    poll_deadline: timedelta = timedelta(hours=1)  # then cancelled and counted failed


@dataclass(frozen=True)
class QueuesConfig:
    path: Path
    queues: Mapping[str, QueueConfig]

    def get(self, name: str) -> QueueConfig:
        """Raises UnknownQueue naming the queue and the file."""
        try:
            return self.queues[name]
        except KeyError:
            raise UnknownQueue(name, self.path, self.names()) from None

    def names(self) -> tuple[str, ...]:
        """The queue names, in file order."""
        return tuple(self.queues)


# --- extensions -------------------------------------------------------------------------


def make_source_control(queue: QueueConfig) -> SourceControl:
    spec = queue.source_control
    if isinstance(spec, FakeSourceControlSpec):
        return FakeSourceControl(spec.path, spec.repo, spec.ref, spec.promotion_ref)
    raise TypeError(f"queue {queue.name!r}: no SourceControl for {spec!r}")


def make_build_runner(queue: QueueConfig) -> BuildRunner:
    spec = queue.build_runner
    if isinstance(spec, FakeBuildRunnerSpec):
        return FakeBuildRunner(spec.state_dir)
    raise TypeError(f"queue {queue.name!r}: no BuildRunner for {spec!r}")


class Extensions:
    """Each queue's SourceControl and BuildRunner, built on first use and then reused."""

    def __init__(self, config: QueuesConfig) -> None:
        self.config = config
        self._source_controls: dict[str, SourceControl] = {}
        self._build_runners: dict[str, BuildRunner] = {}

    def source_control(self, queue: str) -> SourceControl:
        """Raises UnknownQueue."""
        if queue not in self._source_controls:
            self._source_controls[queue] = make_source_control(self.config.get(queue))
        return self._source_controls[queue]

    def build_runner(self, queue: str) -> BuildRunner:
        """Raises UnknownQueue."""
        if queue not in self._build_runners:
            self._build_runners[queue] = make_build_runner(self.config.get(queue))
        return self._build_runners[queue]


# --- loading ----------------------------------------------------------------------------

_TOP_FIELDS = {"defaults", "queues"}
_KNOBS: dict[str, Any] = {
    "max_concurrent": 1,
    "gate_delay": "1s",
    "poll_delay_queued": "5s",
    "poll_delay_running": "2s",
    "poll_deadline": "1h",
}
_QUEUE_FIELDS = {*_KNOBS, "source_control", "build_runner"}
_DURATION_KNOBS = ("gate_delay", "poll_delay_queued", "poll_delay_running", "poll_deadline")
_FAKE_SOURCE_CONTROL_FIELDS = {"kind", "path", "repo", "ref", "promotion_ref"}
_FAKE_BUILD_RUNNER_FIELDS = {"kind", "state_dir"}
_SOURCE_CONTROL_KINDS = ("fake",)
_BUILD_RUNNER_KINDS = ("fake",)


@dataclass
class _Value:
    value: Any
    where: str  # the YAML path it came from


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        line = f"{where}: {message}"
        if line not in self.items:  # a bad default is reported once, not per queue
            self.items.append(line)


def queues_file() -> Path:
    """STOVEPIPE_QUEUES_FILE, else queues.yaml at the repository root."""
    return Path(os.environ.get(ENV_QUEUES_FILE) or DEFAULT_QUEUES_FILE)


def load_queues(path: Path | str | None = None) -> QueuesConfig:
    """Load and validate the queue configuration (default: `queues_file()`).

    Raises QueueConfigError listing every problem found.
    """
    file = Path(path) if path is not None else queues_file()
    raw = _read_yaml(file)
    if not isinstance(raw, dict):
        raise QueueConfigError(file, ["expected a mapping with 'queues' (and optionally "
                                      "'defaults')"])
    problems = _Problems()
    _check_fields(raw, _TOP_FIELDS, "(top level)", problems)
    base_dir = file.resolve().parent

    defaults = _mapping(raw.get("defaults"), "defaults", problems)
    _check_fields(defaults, _QUEUE_FIELDS, "defaults", problems)
    for key, value in defaults.items():
        # checked on their own as well: a bad default is an error even where every queue
        # overrides it (and is reported once, not once per queue)
        _field(key, _Value(value, f"defaults.{key}"), base_dir, problems)
    queues_value = raw.get("queues")
    queues_raw = _mapping(queues_value, "queues", problems)
    if not queues_raw and isinstance(queues_value, dict | None):
        problems.add("queues", "declare at least one queue, e.g. "
                               "queues: {monorepo/main: {source_control: ..., "
                               "build_runner: ...}}")

    queues: dict[str, QueueConfig] = {}
    for name, body in queues_raw.items():
        where = f"queues.{name}"
        try:
            validate_queue_name(name)
        except InvalidQueueName as exc:
            problems.add(where, str(exc))
            continue
        entry = _mapping(body, where, problems)
        _check_fields(entry, _QUEUE_FIELDS, where, problems)
        merged = {key: _Value(value, f"built-in default {key}") for key, value in _KNOBS.items()}
        merged.update({key: _Value(value, f"defaults.{key}") for key, value in defaults.items()})
        merged.update({key: _Value(value, f"{where}.{key}") for key, value in entry.items()})
        queue = _queue(name, where, merged, base_dir, problems)
        if queue is not None:
            queues[name] = queue

    if problems.items:
        raise QueueConfigError(file, problems.items)
    return QueuesConfig(path=file, queues=MappingProxyType(queues))


def _queue(name: str, where: str, merged: dict[str, _Value], base_dir: Path,
           problems: _Problems) -> QueueConfig | None:
    fields = {key: _field(key, value, base_dir, problems) for key, value in merged.items()}
    if "source_control" not in merged:
        problems.add(where, "missing 'source_control' (set it here or in defaults), e.g. "
                            "{kind: fake, path: repo.json, repo: demo, ref: main}")
    if "build_runner" not in merged:
        problems.add(where, "missing 'build_runner' (set it here or in defaults), e.g. "
                            "{kind: fake}")
    if fields.get("source_control") is None or fields.get("build_runner") is None:
        return None  # reported; the file is rejected
    return QueueConfig(name=name, **{k: v for k, v in fields.items() if k in _QUEUE_FIELDS})


def _field(key: str, value: _Value, base_dir: Path, problems: _Problems) -> Any:
    """The checked value of one queue field; None for an unknown one (reported apart)."""
    if key == "max_concurrent":
        return _positive_int(value, problems)
    if key in _DURATION_KNOBS:
        return _duration(value, problems)
    if key == "source_control":
        return _source_control(value, base_dir, problems)
    if key == "build_runner":
        return _build_runner(value, base_dir, problems)
    return None


def _positive_int(value: _Value, problems: _Problems) -> int:
    if isinstance(value.value, bool) or not isinstance(value.value, int) or value.value < 1:
        problems.add(value.where, f"must be a positive integer, got {value.value!r}")
        return 1
    return value.value


def _duration(value: _Value, problems: _Problems) -> timedelta:
    try:
        delta = parse_duration(value.value)
    except ValueError as exc:
        problems.add(value.where, str(exc))
        return timedelta(seconds=1)
    if delta <= timedelta(0):
        problems.add(value.where, f"must be longer than zero, got {value.value!r} "
                                  f"({format_duration(delta)})")
    return delta


def _spec_kind(value: _Value, kinds: tuple[str, ...], what: str, example: str,
               problems: _Problems) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(value.value, dict):
        problems.add(value.where, f"expected a {what} mapping such as {example}, "
                                  f"got {value.value!r}")
        return None
    kind = value.value.get("kind")
    if kind is None:
        problems.add(value.where, f"missing 'kind'; expected one of {list(kinds)}")
        return None
    if kind not in kinds:
        problems.add(f"{value.where}.kind", f"unknown {what} kind {kind!r}; expected one "
                                            f"of {list(kinds)}")
        return None
    return kind, value.value


def _string(spec: dict[str, Any], key: str, where: str, problems: _Problems, *,
            required: bool) -> str | None:
    value = spec.get(key)
    if value is None:
        if required:
            problems.add(where, f"missing {key!r}")
        return None
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        problems.add(f"{where}.{key}", f"expected a non-empty string without surrounding "
                                       f"spaces, got {value!r}")
        return None
    return value


def _resolve(path: str, base_dir: Path) -> Path:
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else base_dir / resolved


def _source_control(value: _Value, base_dir: Path,
                    problems: _Problems) -> SourceControlSpec | None:
    found = _spec_kind(value, _SOURCE_CONTROL_KINDS, "source_control",
                       "{kind: fake, path: repo.json, repo: demo, ref: main}", problems)
    if found is None:
        return None
    _, spec = found  # only `fake` so far
    where = value.where
    _check_fields(spec, _FAKE_SOURCE_CONTROL_FIELDS, where, problems)
    path = _string(spec, "path", where, problems, required=True)
    repo = _string(spec, "repo", where, problems, required=True)
    ref = _string(spec, "ref", where, problems, required=True)
    promotion_ref = _string(spec, "promotion_ref", where, problems, required=False)
    if repo is not None and not _REPO_NAME.fullmatch(repo):
        problems.add(f"{where}.repo", f"must be letters, digits, '.', '_' and '-', starting "
                                      f"with a letter or digit, got {repo!r}")
        repo = None
    if promotion_ref is not None and promotion_ref == ref:
        problems.add(f"{where}.promotion_ref", f"must differ from ref {ref!r}: promotion "
                                               f"moves a ref of its own")
        promotion_ref = None
    if path is None or repo is None or ref is None:
        return None
    return FakeSourceControlSpec(path=_resolve(path, base_dir), repo=repo, ref=ref,
                                 promotion_ref=promotion_ref)


def _build_runner(value: _Value, base_dir: Path,
                  problems: _Problems) -> BuildRunnerSpec | None:
    found = _spec_kind(value, _BUILD_RUNNER_KINDS, "build_runner",
                       "{kind: fake, state_dir: builds}", problems)
    if found is None:
        return None
    _, spec = found  # only `fake` so far
    _check_fields(spec, _FAKE_BUILD_RUNNER_FIELDS, value.where, problems)
    state_dir = _string(spec, "state_dir", value.where, problems, required=False)
    return FakeBuildRunnerSpec(state_dir=_resolve(state_dir, base_dir) if state_dir else None)


def _mapping(raw: Any, where: str, problems: _Problems) -> dict[Any, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add(where, f"expected a mapping, got {type(raw).__name__}")
        return {}
    return raw


def _check_fields(raw: Mapping[Any, Any], allowed: set[str], where: str,
                  problems: _Problems) -> None:
    for key in raw:
        if key not in allowed:
            problems.add(where, f"unknown field {key!r}; expected one of {sorted(allowed)}")


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise QueueConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise QueueConfigError(path, [f"not UTF-8 text: {exc}"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QueueConfigError(path, [f"not valid YAML: {exc}"]) from None
