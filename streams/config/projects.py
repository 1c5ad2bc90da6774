"""A queue's projects: named slices of a monorepo validated on their own (design §11).

```yaml
queues:
  mono/main:
    projects:
      api:  {paths: ["services/api/**", "libs/common/**"]}
      web:  {paths: ["web/**", "libs/common/**", "!web/docs/**"], promotion_ref: verified/web}
      docs: {paths: ["docs/**"], blocking: false}
    affected: {command: "bazel-diff ...", timeout: 5m}   # optional
    backstop: 24h                                        # optional
```

Each project is validated in its own **scope**, named ``<queue>#<project>`` — a queue of
its own to the pipeline (its Requests, builds, facts, last-green bookmark, culprit
searches, greenness and alerts), never named by a person and never ingested: the queue's
Requests plan which projects to build (`streams.stages.analyze`). ``#`` is not allowed in a
queue name, so a scope's name never clashes with a queue's.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator
from pydantic.dataclasses import dataclass as spec_dataclass

from store.entities import SCOPE_SEPARATOR
from streams.extensions.buildrunner import BuildRunnerSpec
from streams.extensions.notify import NotifySpec, SlackSpec, WebhookSpec
from streams.extensions.sourcecontrol import SourceControlSpec
from streams.extensions.sourcecontrol.gitvalues import BranchName
from streams.schema.fields import SPEC, Duration, KindInfo, PositiveInt, Problems

MAX_PROJECT_NAME_LENGTH = 100
MAX_PROJECTS = 1000
_PROJECT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DEFAULT_AFFECTED_TIMEOUT = timedelta(minutes=5)
# changed paths one diff may list before the affected set is not worth computing: every
# project is affected (a diff that large touches most of the repository anyway)
DEFAULT_MAX_CHANGED_PATHS = 20000


def validate_project_name(name: object) -> str:
    """``name`` if it is a valid project name (1-100 of letters, digits, '.', '_', '-',
    starting with a letter or digit), else ValueError saying why."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a project name is a non-empty string, got {name!r}")
    if len(name) > MAX_PROJECT_NAME_LENGTH or not _PROJECT_NAME.fullmatch(name):
        raise ValueError(f"invalid project name {name[:60]!r}: 1-{MAX_PROJECT_NAME_LENGTH} "
                         f"ASCII letters, digits, '.', '_' and '-', starting with a letter "
                         f"or digit")
    return name


def scope_name(queue: str, project: str) -> str:
    """The scope validating ``project`` of ``queue``: ``<queue>#<project>``."""
    return f"{queue}{SCOPE_SEPARATOR}{project}"


def _check_path_rule(rule: object) -> str:
    if not isinstance(rule, str) or not rule.removeprefix("!").strip("/"):
        raise ValueError(f"a path rule is a non-empty glob such as 'services/api/**' or an "
                         f"exclusion such as '!services/api/docs/**', got {rule!r}")
    if rule.startswith(("/", "!/")) or "\\" in rule or "\0" in rule:
        raise ValueError(f"path rules are relative to the repository's root, with '/': "
                         f"{rule!r}")
    return rule


PathRule = Annotated[str, BeforeValidator(_check_path_rule)]


@spec_dataclass(frozen=True, config=SPEC)
class AlertsSpec:
    """A project's own alert channels (its owners'), instead of the queue's."""

    webhook: WebhookSpec | None = None
    slack: SlackSpec | None = None


@spec_dataclass(frozen=True, config=SPEC)
class ProjectSpec:
    """One project: the paths it is made of (git pathspec-style globs, ``!`` excluding),
    whether its red makes the whole repository red (``blocking: false`` — a project being
    brought up — is validated and reported, never part of the queue's answer), its own
    promotion ref, build runner and alert channels."""

    paths: tuple[PathRule, ...] = Field(min_length=1)
    blocking: bool = True
    promotion_ref: BranchName | None = None
    build_runner: Annotated[
        BuildRunnerSpec,
        Field(discriminator="kind"),
        KindInfo("build_runner", "{kind: command, command: make -C services/api test}"),
    ] | None = None
    alerts: AlertsSpec | None = None

    @field_validator("paths")
    @classmethod
    def _includes_something(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        if all(p.startswith("!") for p in paths):
            raise ValueError("at least one path rule must include paths (not start with '!')")
        return paths


@spec_dataclass(frozen=True, config=SPEC)
class AffectedSpec:
    """How a queue tells which projects a change affects. ``command`` (optional) replaces
    the projects' path rules: it runs in a checkout-free shell with STOVEPIPE_BASE_SHA and
    STOVEPIPE_HEAD_SHA (and their URIs) set, in the repository's directory when it is a
    local one, and prints the affected projects' names, one per line (or separated by
    spaces or commas). It must answer within ``timeout``; a failure, a timeout or an
    unknown name makes every project affected, with the reason recorded. A diff listing
    more than ``max_changed_paths`` paths makes every project affected too."""

    command: str | None = None
    timeout: Duration = DEFAULT_AFFECTED_TIMEOUT
    max_changed_paths: PositiveInt = DEFAULT_MAX_CHANGED_PATHS


# --- loading (streams.config.queues) -----------------------------------------------


def checked_projects(projects: dict[str, ProjectSpec], source_control: SourceControlSpec,
              where: str, problems: Problems) -> dict[str, ProjectSpec] | None:
    """The queue's projects, each build runner given the queue's repository when it checks
    out code and names none; None after reporting a problem."""
    if len(projects) > MAX_PROJECTS:
        problems.add(f"{where}.projects", f"at most {MAX_PROJECTS} projects, got "
                                          f"{len(projects)}")
        return None
    checked: dict[str, ProjectSpec] = {}
    for name, spec in projects.items():
        try:
            validate_project_name(name)
        except ValueError as exc:
            problems.add(f"{where}.projects", str(exc))
            return None
        runner: Any = spec.build_runner  # the kinds that check out code have a repository
        if runner is not None and runner.wants_repository and runner.repository is None:
            repository = source_control.shared_repository()
            if repository is None:
                problems.add(f"{where}.projects.{name}.build_runner",
                             "has no 'repository' and the queue's source_control is not git")
                return None
            spec = dataclasses.replace(
                spec, build_runner=dataclasses.replace(runner, repository=repository))
        checked[name] = spec
    return checked


def unaffected_statuses_named(notify: NotifySpec | None, projects: Mapping[str, ProjectSpec],
                               where: str, problems: Problems) -> bool:
    """Whether ``notify.github_status.unaffected`` names only the queue's projects (a
    queue without projects has none to name: the setting means nothing there)."""
    status = notify.github_status if notify is not None else None
    if status is None or not projects or not isinstance(status.unaffected, tuple):
        return True
    unknown = [name for name in status.unaffected if name not in projects]
    if unknown:
        problems.add(f"{where}.notify.github_status.unaffected",
                     f"names no project of this queue: {', '.join(unknown[:5])}; its "
                     f"projects are {', '.join(list(projects)[:10])}"
                     f"{' …' if len(projects) > 10 else ''}")
    return not unknown


def scope_configs(queue: Any) -> dict[str, Any]:
    """The scope of each project of ``queue``, by name: the queue's knobs, its repository
    with the project's promotion ref (none unless the project has one), the project's
    build runner (else the queue's, shared), commit statuses named ``stovepipe/<project>``
    and the project's alert channels (else the queue's). ``queue`` is a
    `streams.config.queues.QueueConfig` (which imports this module), and so is each
    scope's config."""
    scopes: dict[str, Any] = {}
    for project, spec in queue.projects.items():
        source_control = queue.source_control
        if hasattr(source_control, "promotion_ref"):
            source_control = dataclasses.replace(source_control,
                                                 promotion_ref=spec.promotion_ref)
        notify = queue.notify
        if notify is not None and notify.github_status is not None:
            notify = dataclasses.replace(notify, github_status=dataclasses.replace(
                notify.github_status, context=f"stovepipe/{project}"))
        if spec.alerts is not None:
            notify = dataclasses.replace(notify or NotifySpec(), webhook=spec.alerts.webhook,
                                         slack=spec.alerts.slack)
        name = scope_name(queue.name, project)
        scopes[name] = dataclasses.replace(
            queue, name=name, source_control=source_control,
            build_runner=spec.build_runner or queue.build_runner, notify=notify,
            projects=MappingProxyType({}), backstop=None, scope_of=(queue.name, project),
            shares_runner_of=None if spec.build_runner is not None else queue.name)
    return scopes
