"""queues.yaml: each queue's SourceControl, BuildRunner and knobs (design §8).

`load_queues()` reads the file (``STOVEPIPE_QUEUES_FILE``, else ``queues.yaml`` at the
repository root) into frozen objects, reporting every problem at once in one
`QueueConfigError` that names the file and the YAML path of each. `Extensions` builds a
queue's SourceControl and BuildRunner from it, once per queue per worker.

The file is validated by pydantic models: `QueueFields` for ``defaults`` and for each
queue, whose ``source_control`` and ``build_runner`` are discriminated on ``kind`` over the
kinds the extension registries declare (`streams.extensions.sourcecontrol.SourceControlSpec`,
`streams.extensions.buildrunner.BuildRunnerSpec`). Then each queue is its entry over
``defaults`` over the built-in defaults, field by field (an extension spec is replaced
whole, never merged key by key).

The top-level ``webhooks`` section (which push webhooks are accepted, and the variables
holding their secrets) is `streams.config.webhooks`; `QueuesConfig.watching` says which
queues a push moves.

Durations are `timedelta`s. Relative paths are resolved against the directory of the YAML
file, so a configuration means the same from any working directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from store import Database
from streams.config import settings as settings_mod
from streams.config.attempts import BackfillSpec, RetrySpec, backfill_shorthand
from streams.config.names import (
    InvalidQueueName,
    QueueConfigError,
    UnknownQueue,
    validate_queue_name,
)
from streams.config.projects import (
    AffectedSpec,
    ProjectSpec,
    checked_projects,
    scope_configs,
    unaffected_statuses_named,
)
from streams.config.retention import RetentionConfig, load_retention
from streams.config.webhooks import HostedPath, WebhooksConfig, load_webhooks
from streams.extensions import ExtensionContext, tracing
from streams.extensions.buildrunner import BuildRunner, BuildRunnerSpec
from streams.extensions.notify import Notifier, NotifyError, NotifySpec, build_notifier
from streams.extensions.notify import github_repository as _github_repository
from streams.extensions.sourcecontrol import SourceControl, SourceControlSpec
from streams.schema.fields import (
    Duration,
    KindInfo,
    PositiveInt,
    Problems,
    Section,
    read_yaml,
)

ENV_QUEUES_FILE = settings_mod.ENV_QUEUES_FILE
DEFAULT_QUEUES_FILE = settings_mod.REPO_ROOT / "queues.yaml"

__all__ = ["InvalidQueueName", "QueueConfigError", "UnknownQueue", "validate_queue_name"]

# --- the model --------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueConfig:
    name: str
    source_control: SourceControlSpec
    build_runner: BuildRunnerSpec
    max_concurrent: int = 1  # builds in flight at once
    gate_delay: timedelta = timedelta(seconds=1)  # hold while the queue is full
    poll_delay_queued: timedelta = timedelta(seconds=5)  # between polls of a queued build
    poll_delay_running: timedelta = timedelta(seconds=2)  # between polls of a running one
    # how long a build may run, from its start; then it is cancelled, and counts red if
    # it was running (a hang) or could not validate if it was waiting (blocked, approval)
    poll_deadline: timedelta = timedelta(hours=1)
    # how long a build may wait to start, from its trigger (None: poll_deadline); then it
    # is cancelled and its attempt could not validate
    start_deadline: timedelta | None = None
    # how long a trigger, an ancestry check or a promotion waits out its dependency's
    # outage before it gives up (a trigger: the attempt could not validate)
    trigger_deadline: timedelta = timedelta(hours=1)
    retry: RetrySpec = dataclasses.field(default_factory=RetrySpec)
    backfill: BackfillSpec = dataclasses.field(default_factory=BackfillSpec)
    notify: NotifySpec | None = None  # commit statuses and alerts; None: none
    webhook_repository: str | None = None  # what push webhooks name its repository by
    # its projects (design §11), by name; none: the whole repository is validated as one
    projects: Mapping[str, ProjectSpec] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    affected: AffectedSpec = dataclasses.field(default_factory=AffectedSpec)
    backstop: timedelta | None = None  # every project validated this often; None: never
    # a project's scope: the queue and the project it validates (None: a queue)
    scope_of: tuple[str, str] | None = None
    # the queue whose build runner builds it (a scope without a runner of its own shares
    # its queue's, and so its capacity); None: its own
    shares_runner_of: str | None = None

    @property
    def status_channels(self) -> tuple[str, ...]:
        """The channels a Request's commit statuses go to (empty: none)."""
        return self.notify.status_channels if self.notify is not None else ()

    @property
    def alert_channels(self) -> tuple[str, ...]:
        """The channels the queue's transition alerts go to (empty: none)."""
        return self.notify.alert_channels if self.notify is not None else ()

    def posts_unaffected_status(self, project: str) -> bool:
        """Whether ``project``'s commit status is set on the heads that do not affect it
        (``notify.github_status.unaffected``)."""
        status = self.notify.github_status if self.notify is not None else None
        return status is not None and status.posts_unaffected(project)

    @property
    def blocking_projects(self) -> tuple[str, ...]:
        """The projects whose answer makes the queue's whole-repository answer."""
        return tuple(name for name, spec in self.projects.items() if spec.blocking)

    def hosted_repository(self) -> str | None:
        """The repository's path as push webhooks name it (``acme/monorepo``): the
        queue's ``webhook_repository``, else the path in its git repository's URL; None
        when it has neither (a local path, the fake kind)."""
        return self.webhook_repository or self.source_control.hosted_repository()


@dataclass(frozen=True)
class QueuesConfig:
    path: Path
    queues: Mapping[str, QueueConfig]
    webhooks: WebhooksConfig = dataclasses.field(default_factory=WebhooksConfig)
    # each project's scope (`<queue>#<project>`), by name
    scopes: Mapping[str, QueueConfig] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    retention: RetentionConfig | None = None  # the workers' pruning; None: off

    def get(self, name: str) -> QueueConfig:
        """The queue — or a project's scope — of that name. Raises UnknownQueue naming
        the queue and the file."""
        found = self.queues.get(name) or self.scopes.get(name)
        if found is None:
            raise UnknownQueue(name, self.path, self.names())
        return found

    def names(self) -> tuple[str, ...]:
        """The queue names, in file order."""
        return tuple(self.queues)

    def watching(self, repository: str, branch: str) -> tuple[str, ...]:
        """The queues a push to ``branch`` of ``repository`` (a hosted path such as
        ``acme/monorepo``, compared without regard to case, as GitHub and GitLab do) moves:
        those validating that branch of that repository, in file order."""
        wanted = repository.casefold()
        return tuple(name for name, queue in self.queues.items()
                     if queue.source_control.ref == branch
                     and (queue.hosted_repository() or "").casefold() == wanted)


_KNOBS = ("max_concurrent", "gate_delay", "poll_delay_queued", "poll_delay_running",
          "poll_deadline", "start_deadline", "trigger_deadline", "retry", "backfill",
          "webhook_repository", "affected", "backstop")
_EXTENSIONS = {
    "source_control": "{kind: fake, path: repo.json, repo: demo, ref: main}",
    "build_runner": "{kind: fake}",
}


_EXAMPLES = {
    "source_control": "{kind: git, repository: /srv/git/monorepo, ref: main}",
    "build_runner": "{kind: command, command: make test}",
}


class QueueFields(Section):
    """One queue's entry in queues.yaml, or its ``defaults``: every field optional."""

    max_concurrent: PositiveInt | None = None
    gate_delay: Duration | None = None
    poll_delay_queued: Duration | None = None
    poll_delay_running: Duration | None = None
    poll_deadline: Duration | None = None
    start_deadline: Duration | None = None
    trigger_deadline: Duration | None = None
    retry: RetrySpec | None = None  # replaced whole, like notify
    backfill: Annotated[BackfillSpec, BeforeValidator(backfill_shorthand)] | None = None
    webhook_repository: HostedPath | None = None
    source_control: Annotated[
        SourceControlSpec,
        Field(discriminator="kind"),
        KindInfo("source_control", _EXAMPLES["source_control"]),
    ] | None = None
    build_runner: Annotated[
        BuildRunnerSpec,
        Field(discriminator="kind"),
        KindInfo("build_runner", _EXAMPLES["build_runner"]),
    ] | None = None
    # replaced whole, like source_control and build_runner
    notify: NotifySpec | None = None
    # a queue's own (never in defaults): its projects, by name
    projects: dict[str, ProjectSpec] | None = None
    affected: AffectedSpec | None = None
    backstop: Duration | None = None

    @field_validator("source_control", "build_runner", mode="before")
    @classmethod
    def _not_null(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:  # written but empty: say what belongs there
            what = str(info.field_name)
            example = _EXAMPLES[what]
            raise ValueError(f"expected a {what} mapping such as {example}, got None")
        return value


class _TopLevel(Section):
    defaults: Any = None
    queues: Any = None
    webhooks: Any = None  # validated by streams.config.webhooks
    retention: Any = None  # validated by streams.config.retention


# --- extensions -------------------------------------------------------------------------


def _context(queue: QueueConfig, database: Database | None) -> ExtensionContext:
    settings = settings_mod.load_settings()
    home = settings.home
    return ExtensionContext(queue=queue.name, home=home,
                            git_cache=queue.source_control.shared_git_cache(home),
                            repository=queue.source_control.shared_repository(),
                            database=database, host=settings.host_id)


def make_source_control(queue: QueueConfig, database: Database | None = None) -> SourceControl:
    return queue.source_control.build(_context(queue, database))


def make_build_runner(queue: QueueConfig, database: Database | None = None) -> BuildRunner:
    return queue.build_runner.build(_context(queue, database))


# the calls to a queue's git and CI that trace as spans of their own
_SOURCE_CONTROL_CALLS = frozenset({"head", "is_ancestor", "promotion_target", "promote",
                                   "commit_time", "commit_uri", "commits_between",
                                   "describe", "changed_paths"})
_BUILD_RUNNER_CALLS = frozenset({"trigger", "status", "cancel"})


class Extensions:
    """Each queue's SourceControl and BuildRunner, built on first use and then reused.

    ``database`` is the worker's (extensions that share state across hosts keep it
    there, e.g. the command build runner); None only where no build runs or is asked
    about (a configuration check), and such a runner then refuses to work."""

    def __init__(self, config: QueuesConfig, database: Database | None) -> None:
        self.config = config
        self.database = database
        self._source_controls: dict[str, SourceControl] = {}
        self._build_runners: dict[str, BuildRunner] = {}
        self._notifiers: dict[tuple[str, str], Notifier] = {}

    def source_control(self, queue: str) -> SourceControl:
        """Raises UnknownQueue."""
        if queue not in self._source_controls:
            config = self.config.get(queue)
            self._source_controls[queue] = tracing.traced(
                make_source_control(config, self.database), "git", _SOURCE_CONTROL_CALLS,
                {"stovepipe.queue": queue, "stovepipe.source_control": config.source_control.kind})
        return self._source_controls[queue]

    def build_runner(self, queue: str) -> BuildRunner:
        """Raises UnknownQueue. A project's scope without a runner of its own builds on
        its queue's: the same runner, so the same capacity."""
        shared = self.config.get(queue).shares_runner_of
        if shared is not None:
            return self.build_runner(shared)
        if queue not in self._build_runners:
            config = self.config.get(queue)
            self._build_runners[queue] = tracing.traced(
                make_build_runner(config, self.database), "ci", _BUILD_RUNNER_CALLS,
                {"stovepipe.queue": queue, "stovepipe.build_runner": config.build_runner.kind})
        return self._build_runners[queue]

    async def aclose(self) -> None:
        """Release what the built runners hold open (a hosted CI runner's HTTP session)."""
        for runner in self._build_runners.values():
            close = getattr(runner, "aclose", None)
            if close is not None:
                await close()

    def notifier(self, queue: str, channel: str) -> Notifier:
        """The queue's notifier of ``channel``, its secrets read from the environment.
        Raises UnknownQueue; NotifyError when the queue no longer has the channel
        (permanent) or a secret's variable is not set (retryable)."""
        key = (queue, channel)
        if key not in self._notifiers:
            notify = self.config.get(queue).notify
            spec = notify.channel(channel) if notify is not None else None
            if spec is None:
                raise NotifyError(f"queue {queue!r} has no notify.{channel} any more",
                                  retryable=False)
            self._notifiers[key] = tracing.traced(
                build_notifier(spec, os.environ), "notify", frozenset({"send"}),
                {"stovepipe.queue": queue, "stovepipe.channel": channel})
        return self._notifiers[key]


# --- loading ----------------------------------------------------------------------------


def queues_file() -> Path:
    """STOVEPIPE_QUEUES_FILE, else queues.yaml at the repository root."""
    return settings_mod.load_settings().queues_file


def load_queues(path: Path | str | None = None) -> QueuesConfig:
    """Load and validate the queue configuration (default: `queues_file()`).

    Raises QueueConfigError listing every problem found.
    """
    file = Path(path) if path is not None else queues_file()
    raw = read_yaml(file, QueueConfigError)
    if not isinstance(raw, dict):
        raise QueueConfigError(file, ["expected a mapping with 'queues' (and optionally "
                                      "'defaults' and 'webhooks')"])
    problems = Problems()
    context = {"base_dir": file.resolve().parent}
    try:
        _TopLevel.model_validate(raw)
    except ValidationError as exc:
        problems.add_validation_error(exc, _TopLevel)

    defaults = _section(raw.get("defaults"), "defaults", problems, context)
    webhooks = load_webhooks(raw.get("webhooks"), problems)
    retention = load_retention(raw.get("retention"), problems)
    queues_raw = raw.get("queues")
    if queues_raw is not None and not isinstance(queues_raw, dict):
        problems.add("queues", f"expected a mapping, got {type(queues_raw).__name__}")
    elif not queues_raw:
        problems.add("queues", "declare at least one queue, e.g. queues: {monorepo/main: "
                               "{source_control: ..., build_runner: ...}}")

    queues: dict[str, QueueConfig] = {}
    for name, body in (queues_raw or {}).items() if isinstance(queues_raw, dict) else ():
        where = f"queues.{name}"
        try:
            validate_queue_name(name)
        except InvalidQueueName as exc:
            problems.add(where, str(exc))
            continue
        entry = _section(body, where, problems, context)
        if entry is not None and defaults is not None:
            queue = _merge(name, where, entry, defaults, problems)
            if queue is not None:
                queues[name] = queue

    if problems.items:
        raise QueueConfigError(file, problems.items)
    scopes = {name: scope for queue in queues.values()
              for name, scope in scope_configs(queue).items()}
    return QueuesConfig(path=file, queues=MappingProxyType(queues), webhooks=webhooks,
                        scopes=MappingProxyType(scopes), retention=retention)


def _section(raw: Any, where: str, problems: Problems,
             context: dict[str, Any]) -> QueueFields | None:
    """The validated section (an empty one for null); None after reporting its problems."""
    try:
        return QueueFields.model_validate({} if raw is None else raw, context=context)
    except ValidationError as exc:
        problems.add_validation_error(exc, QueueFields, where)
        return None


def _merge(name: str, where: str, entry: QueueFields, defaults: QueueFields,
           problems: Problems) -> QueueConfig | None:
    """The queue: its entry over ``defaults`` over the built-in defaults."""
    def pick(field: str) -> Any:
        for layer in (entry, defaults):
            if field in layer.model_fields_set and getattr(layer, field) is not None:
                return getattr(layer, field)
        return None

    for field, example in _EXTENSIONS.items():
        if pick(field) is None:
            problems.add(where, f"missing {field!r} (set it here or in defaults), e.g. "
                                f"{example}")
    source_control, build_runner = pick("source_control"), pick("build_runner")
    if source_control is None or build_runner is None:
        return None
    if build_runner.wants_repository and build_runner.repository is None:
        # a runner that checks out the code builds the queue's repository by default
        repository = source_control.shared_repository()
        if repository is None:
            from_queue = "build_runner" in entry.model_fields_set
            problems.add(f"{where}.build_runner" if from_queue else where,
                         f"the {build_runner.kind} build_runner"
                         f"{'' if from_queue else ' (from defaults)'} has no 'repository' "
                         f"and the queue's source_control is kind {source_control.kind!r}, "
                         f"not git: set its repository, e.g. repository: /srv/git/monorepo")
            return None
        build_runner = dataclasses.replace(build_runner, repository=repository)
    knobs = {k: pick(k) for k in _KNOBS if pick(k) is not None}
    notify = _notify(pick("notify"), source_control, where, problems)
    projects = checked_projects(entry.projects or {}, source_control, where, problems)
    if projects is None or not unaffected_statuses_named(notify, projects, where, problems):
        return None
    return QueueConfig(name=name, source_control=source_control, build_runner=build_runner,
                       notify=notify, projects=MappingProxyType(projects), **knobs)


def _notify(notify: NotifySpec | None, source_control: SourceControlSpec, where: str,
            problems: Problems) -> NotifySpec | None:
    """The queue's notify section, its GitHub repository taken from the queue's git
    repository when not given."""
    if notify is None or notify.github_status is None or notify.github_status.repository:
        return notify
    repository = _github_repository(source_control.shared_repository())
    if repository is None:
        problems.add(f"{where}.notify.github_status",
                     "missing 'repository' (owner/name), and the queue's source_control is "
                     "not a github.com repository it could be taken from, e.g. "
                     "repository: acme/monorepo")
        return None
    status = dataclasses.replace(notify.github_status, repository=repository)
    return dataclasses.replace(notify, github_status=status)
