"""queues.yaml: each queue's SourceControl, BuildRunner and knobs (design §8).

`load_queues()` reads the file (``STOVEPIPE_QUEUES_FILE``, else ``queues.yaml`` at the
repository root) into frozen dataclasses, reporting every problem at once in one
`QueueConfigError` that names the file and the YAML path of each. `Extensions` builds a
queue's SourceControl and BuildRunner from it, once per queue per worker.

Durations are `timedelta`s. Relative paths in extension specs are resolved against the
directory of the YAML file, so a configuration means the same from any working directory.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

from streams import settings as settings_mod
from streams.buildrunner.command import DEFAULT_MAX_PARALLEL, CommandBuildRunner
from streams.buildrunner.contract import BuildRunner
from streams.buildrunner.fake import FakeBuildRunner
from streams.sourcecontrol.contract import SourceControl
from streams.sourcecontrol.fake import FakeSourceControl
from streams.sourcecontrol.git import GitSourceControl, check_branch_name, is_remote_url
from streams.topics import format_duration, parse_duration
from streams.yamlconfig import Problems as _Problems
from streams.yamlconfig import Value as _Value
from streams.yamlconfig import check_fields as _check_fields
from streams.yamlconfig import mapping as _mapping
from streams.yamlconfig import read_yaml

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


@dataclass(frozen=True)
class GitSourceControlSpec:
    """`kind: git`: a real repository, local path or remote URL
    (streams.sourcecontrol.git)."""

    kind: ClassVar[str] = "git"
    repository: str  # a URL as written, or an absolute local path
    ref: str
    promotion_ref: str | None = None
    push: bool | None = None  # None: push to a remote URL, update a local path in place
    cache_dir: Path | None = None  # where remotes are cached; None: $STOVEPIPE_HOME/git


@dataclass(frozen=True)
class CommandBuildRunnerSpec:
    """`kind: command`: a shell command in a clean checkout of the head commit
    (streams.buildrunner.command)."""

    kind: ClassVar[str] = "command"
    command: str
    repository: str | None = None  # None: the queue's git source_control's repository
    work_dir: Path | None = None  # None: $STOVEPIPE_HOME/builds/<queue>
    max_parallel: int = DEFAULT_MAX_PARALLEL  # builds of the work_dir running at once
    timeout: timedelta | None = None  # then the build is stopped and failed


SourceControlSpec: TypeAlias = FakeSourceControlSpec | GitSourceControlSpec
BuildRunnerSpec: TypeAlias = FakeBuildRunnerSpec | CommandBuildRunnerSpec


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
    if isinstance(spec, GitSourceControlSpec):
        return GitSourceControl(spec.repository, spec.ref, spec.promotion_ref, push=spec.push,
                                cache_dir=spec.cache_dir)
    raise TypeError(f"queue {queue.name!r}: no SourceControl for {spec!r}")


def make_build_runner(queue: QueueConfig) -> BuildRunner:
    spec = queue.build_runner
    if isinstance(spec, FakeBuildRunnerSpec):
        return FakeBuildRunner(spec.state_dir)
    if isinstance(spec, CommandBuildRunnerSpec):
        source_control = queue.source_control
        repository = spec.repository or _queue_repository(source_control)
        if repository is None:
            raise ValueError(f"queue {queue.name!r}: a command build runner needs "
                             f"'repository' when the source_control is not git")
        return CommandBuildRunner(
            spec.command, repository, spec.work_dir or default_work_dir(queue.name),
            queue=queue.name, max_parallel=spec.max_parallel,
            timeout=spec.timeout.total_seconds() if spec.timeout is not None else None,
            # a remote shared with the source control is fetched into one cache
            cache_root=(source_control.cache_dir
                        if isinstance(source_control, GitSourceControlSpec) else None))
    raise TypeError(f"queue {queue.name!r}: no BuildRunner for {spec!r}")


def default_work_dir(queue: str) -> Path:
    """Where a queue's command builds live by default: $STOVEPIPE_HOME/builds/<queue>."""
    parts = [f"_{part}" if part in (".", "..") else part for part in queue.split("/")]
    return settings_mod.load_settings().home / "builds" / Path(*parts)


def _queue_repository(source_control: SourceControlSpec) -> str | None:
    return (source_control.repository if isinstance(source_control, GitSourceControlSpec)
            else None)


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
_GIT_SOURCE_CONTROL_FIELDS = {"kind", "repository", "ref", "promotion_ref", "push",
                              "cache_dir"}
_FAKE_BUILD_RUNNER_FIELDS = {"kind", "state_dir"}
_COMMAND_BUILD_RUNNER_FIELDS = {"kind", "command", "repository", "work_dir", "max_parallel",
                                "timeout"}
_SOURCE_CONTROL_KINDS = ("fake", "git")
_BUILD_RUNNER_KINDS = ("fake", "command")


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
    source_control, build_runner = fields.get("source_control"), fields.get("build_runner")
    if (isinstance(build_runner, CommandBuildRunnerSpec) and build_runner.repository is None
            and source_control is not None):
        repository = _queue_repository(source_control)
        if repository is None:
            from_queue = merged["build_runner"].where.startswith(f"{where}.")
            problems.add(f"{where}.build_runner" if from_queue else where,
                         f"the command build_runner{'' if from_queue else ' (from defaults)'} "
                         f"has no 'repository' and the queue's source_control is kind "
                         f"{source_control.kind!r}, not git: set its repository, e.g. "
                         f"repository: /srv/git/monorepo")
            return None
        fields["build_runner"] = dataclasses.replace(build_runner, repository=repository)
    if source_control is None or build_runner is None:
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
                       "{kind: git, repository: /srv/git/monorepo, ref: main}", problems)
    if found is None:
        return None
    kind, spec = found
    if kind == "git":
        return _git_source_control(spec, value.where, base_dir, problems)
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


def _git_source_control(spec: dict[str, Any], where: str, base_dir: Path,
                        problems: _Problems) -> GitSourceControlSpec | None:
    _check_fields(spec, _GIT_SOURCE_CONTROL_FIELDS, where, problems)
    repository = _repository(spec, where, base_dir, problems, required=True)
    ref = _branch(spec, "ref", where, problems, required=True)
    promotion_ref = _branch(spec, "promotion_ref", where, problems, required=False)
    if promotion_ref is not None and promotion_ref == ref:
        problems.add(f"{where}.promotion_ref", f"must differ from ref {ref!r}: promotion "
                                               f"moves a ref of its own")
        promotion_ref = None
    push = spec.get("push")
    if push is not None and not isinstance(push, bool):
        problems.add(f"{where}.push", f"expected true or false, got {push!r}")
        push = None
    cache_dir = _string(spec, "cache_dir", where, problems, required=False)
    if repository is None or ref is None:
        return None
    return GitSourceControlSpec(repository=repository, ref=ref, promotion_ref=promotion_ref,
                                push=push,
                                cache_dir=_resolve(cache_dir, base_dir) if cache_dir else None)


def _repository(spec: dict[str, Any], where: str, base_dir: Path, problems: _Problems, *,
                required: bool) -> str | None:
    """A remote URL as written, or a local path made absolute (against the file's
    directory)."""
    repository = _string(spec, "repository", where, problems, required=required)
    if repository is None or is_remote_url(repository):
        return repository
    return str(_resolve(repository, base_dir))


def _branch(spec: dict[str, Any], key: str, where: str, problems: _Problems, *,
            required: bool) -> str | None:
    name = _string(spec, key, where, problems, required=required)
    if name is None:
        return None
    try:
        return check_branch_name(name)
    except ValueError as exc:
        problems.add(f"{where}.{key}", str(exc))
        return None


def _build_runner(value: _Value, base_dir: Path,
                  problems: _Problems) -> BuildRunnerSpec | None:
    found = _spec_kind(value, _BUILD_RUNNER_KINDS, "build_runner",
                       "{kind: command, command: make test}", problems)
    if found is None:
        return None
    kind, spec = found
    if kind == "command":
        return _command_build_runner(spec, value.where, base_dir, problems)
    _check_fields(spec, _FAKE_BUILD_RUNNER_FIELDS, value.where, problems)
    state_dir = _string(spec, "state_dir", value.where, problems, required=False)
    return FakeBuildRunnerSpec(state_dir=_resolve(state_dir, base_dir) if state_dir else None)


def _command_build_runner(spec: dict[str, Any], where: str, base_dir: Path,
                          problems: _Problems) -> CommandBuildRunnerSpec | None:
    _check_fields(spec, _COMMAND_BUILD_RUNNER_FIELDS, where, problems)
    command = spec.get("command")
    if command is None:
        problems.add(where, "missing 'command', e.g. command: make test")
    elif not isinstance(command, str) or not command.strip():
        problems.add(f"{where}.command", f"expected a non-empty shell command, got "
                                         f"{command!r}")
        command = None
    repository = _repository(spec, where, base_dir, problems, required=False)
    work_dir = _string(spec, "work_dir", where, problems, required=False)
    max_parallel = DEFAULT_MAX_PARALLEL
    if "max_parallel" in spec:
        max_parallel = _positive_int(_Value(spec["max_parallel"], f"{where}.max_parallel"),
                                     problems)
    timeout = None
    if spec.get("timeout") is not None:
        timeout = _duration(_Value(spec["timeout"], f"{where}.timeout"), problems)
    if command is None:
        return None
    return CommandBuildRunnerSpec(
        command=command, repository=repository,
        work_dir=_resolve(work_dir, base_dir) if work_dir else None,
        max_parallel=max_parallel, timeout=timeout)


def _read_yaml(path: Path) -> Any:
    return read_yaml(path, QueueConfigError)
