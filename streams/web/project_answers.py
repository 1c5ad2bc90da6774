"""Answers per project for deploy gates and release tooling (design §11; issue 24,
Deliver 5): is this commit green for project P, and which is the newest commit at which
every one of several projects is green — the base `nx affected --base` wants.

Project P of queue Q answers at a commit with the answer of the newest Request of Q for
the commit that has one (`project_answer`): P's own fact when that Request built P, or,
P unaffected, the answer it inherited from its nearest validated ancestor ("unaffected,
inherits green from C"). A commit only P's culprit search probed answers with the probe's
fact in P's scope (`Q#P`). No answer means not green, as for a queue.

`last_green` over projects is the newest Request of Q at which each listed project has a
green answer, built or inherited (`store.project_answers.LAST_GREEN`, one statement on the
index project_answer_green), with each project's own answer there; over no project it is
the queue's bookmark (every blocking project green).

The CLI (`stovepipe fact --project`, `stovepipe last-green`) and the HTTP API
(`/api/facts?project=`, `/api/queues/{queue}/green?project=`,
`/api/queues/{queue}/last-green`) share these reads. Projects are named as queues.yaml
names them; a name that is malformed, unknown, or asked of a queue without projects is
refused with the queue's known projects (`check_projects`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from store import NotFound, ValidationFact
from store.projects import ProjectAnswer
from streams.config.projects import scope_name, validate_project_name
from streams.config.queues import QueueConfig
from streams.extensions.sourcecontrol import commit_sha
from streams.web.gate import SEARCH_LIMIT, commit_rank, nearest_greens

if TYPE_CHECKING:
    from streams.stages.deps import Deps

KNOWN_PROJECTS_LISTED = 20  # projects an error names at most


class UnknownProject(LookupError):
    """A project the queue does not declare (or a queue that declares none): a user
    error, named with the projects it has."""


class InvalidProjectName(ValueError):
    """A project name that breaks the naming rule: a user error."""


def check_projects(config: QueueConfig, names: Sequence[str]) -> tuple[str, ...]:
    """``names`` (each once, in the order given) if each is a project of the queue
    ``config``; InvalidProjectName or UnknownProject naming the problem otherwise."""
    for name in names:
        try:
            validate_project_name(name)
        except ValueError as exc:
            raise InvalidProjectName(str(exc)) from None
    if not config.projects:
        raise UnknownProject(f"queue {config.name!r} has no projects (queues.yaml declares "
                             f"none for it): ask about the whole repository, without a "
                             f"project")
    unknown = [name for name in names if name not in config.projects]
    if unknown:
        known = sorted(config.projects)
        shown = ", ".join(known[:KNOWN_PROJECTS_LISTED]) + (
            f" and {len(known) - KNOWN_PROJECTS_LISTED} more"
            if len(known) > KNOWN_PROJECTS_LISTED else "")
        raise UnknownProject(f"queue {config.name!r} has no project "
                             f"{', '.join(repr(n) for n in unknown)}; its projects are "
                             f"{shown}")
    return tuple(dict.fromkeys(names))


def projects_param(raw: str) -> list[str]:
    """The projects of a ``projects=a,b`` query parameter (or repeated options)."""
    names = [name.strip() for name in raw.split(",")]
    if not all(names):
        raise InvalidProjectName(f"'projects' is a comma-separated list of project names, "
                                 f"e.g. projects=api,web; got {raw[:100]!r}")
    return names


@dataclass(frozen=True)
class ProjectFact:
    """A project's answer at a commit: built (``unaffected`` False: the verdict of its
    scope's Request ``source_request_id``) or inherited from the commit
    ``inherited_from`` (its sha; ``inherited_from_uri``) that P's nearest validated
    ancestor is. ``request_id``: the queue's Request whose answer it is, or the scope's
    culprit probe whose fact it is."""

    queue: str
    project: str
    uri: str
    degree: float
    request_id: str
    created_at: datetime
    attempts: int
    flaky: bool
    unaffected: bool
    inherited_from: str | None
    inherited_from_uri: str | None
    source_request_id: str

    @property
    def is_green(self) -> bool:
        return self.degree == 0


def from_answer(answer: ProjectAnswer) -> ProjectFact:
    inherited = answer.inherited
    return ProjectFact(
        queue=answer.queue, project=answer.project, uri=answer.uri, degree=answer.degree,
        request_id=answer.request_id, created_at=answer.created_at,
        attempts=answer.attempts, flaky=answer.flaky, unaffected=inherited,
        inherited_from=(commit_sha(answer.source_uri) or answer.source_uri)
        if inherited else None,
        inherited_from_uri=answer.source_uri if inherited else None,
        source_request_id=answer.source_request_id)


def _from_probe(queue: str, fact: ValidationFact) -> ProjectFact:
    return ProjectFact(queue=queue, project=fact.project, uri=fact.uri, degree=fact.degree,
                       request_id=fact.request_id, created_at=fact.created_at,
                       attempts=fact.attempts, flaky=fact.flaky, unaffected=False,
                       inherited_from=None, inherited_from_uri=None,
                       source_request_id=fact.request_id)


async def project_fact(deps: Deps, queue: str, project: str, uri: str) -> ProjectFact | None:
    """Project ``project``'s answer at commit ``uri`` of ``queue`` (None: none, which is
    not green). The caller has checked the project (`check_projects`)."""
    answer = await deps.db.project_answers.of_commit(queue, project, uri)
    if answer is not None:
        return from_answer(answer)
    try:  # a commit only the project's culprit search probed
        return _from_probe(queue, await deps.db.facts.get(scope_name(queue, project), uri))
    except NotFound:
        return None


@dataclass(frozen=True)
class ProjectGreenAnswer:
    """`GreenAnswer` for a project: its fact at the commit and, when not green, its
    nearest green answers (built or inherited) on the queue's Requests."""

    queue: str
    project: str
    uri: str
    committed_at: datetime | None  # None when the fact answered alone (green)
    fact: ProjectFact | None
    prior_green: ProjectFact | None
    next_green: ProjectFact | None
    searched: int
    complete: bool

    @property
    def green(self) -> bool:
        return self.fact is not None and self.fact.is_green


async def project_green_answer(deps: Deps, queue: str, project: str,
                               uri: str) -> ProjectGreenAnswer:
    """Whether commit ``uri`` is green for ``project`` and, if not, the project's newest
    green ancestor and oldest green descendant among its answers. Raises CommitNotFound
    when the commit is not green and the repository does not have it."""
    fact = await project_fact(deps, queue, project, uri)
    if fact is not None and fact.is_green:
        return ProjectGreenAnswer(queue, project, uri, None, fact, None, None, 0, True)
    source_control = deps.extensions.source_control(queue)
    committed_at = await source_control.commit_time(uri)
    # the scope's Requests are numbered as the queue's: their places compare
    rank = await commit_rank(deps, queue, uri, fact.request_id if fact is not None else None)
    if rank is None:
        rank = await commit_rank(deps, scope_name(queue, project), uri, None)
    answers = deps.db.project_answers
    nearest = await nearest_greens(
        source_control, uri, rank,
        lambda below: answers.green_older_than(queue, project, below, SEARCH_LIMIT),
        lambda above: answers.green_newer_than(queue, project, above, SEARCH_LIMIT))
    return ProjectGreenAnswer(
        queue, project, uri, committed_at, fact,
        from_answer(nearest.prior) if nearest.prior is not None else None,
        from_answer(nearest.following) if nearest.following is not None else None,
        nearest.searched, nearest.complete)


@dataclass(frozen=True)
class LastGreenAnswer:
    """The newest commit green for every listed project (``projects``; none listed: the
    queue's bookmark, ``fact`` its whole-repository fact) with each project's own answer
    there (``facts``), or ``found`` False and why (``reason``). ``complete`` False: the
    walk stopped at its step limit before it could tell."""

    queue: str
    projects: tuple[str, ...]
    found: bool
    uri: str | None
    sha: str | None
    request_id: str | None
    facts: dict[str, ProjectFact]
    fact: ValidationFact | None
    complete: bool
    reason: str | None


async def last_green(deps: Deps, queue: str, projects: Sequence[str]) -> LastGreenAnswer:
    """The newest commit of ``queue`` at which every one of ``projects`` is green —
    directly or by inheritance — with each one's answer there; without projects, the
    queue's bookmark. The caller has checked the projects (`check_projects`)."""
    listed = tuple(projects)
    if not listed:
        return await _bookmark(deps, queue)
    walked = await deps.db.project_answers.last_green(queue, listed)
    if walked.request_id is None or walked.uri is None:
        names = ", ".join(listed)
        reason = (f"no commit of {queue} is green for every one of {names} yet"
                  if walked.complete else
                  f"no commit green for every one of {names} was found within "
                  f"{walked.steps} steps back (their green commits alternate); ask about "
                  f"fewer projects at once")
        return LastGreenAnswer(queue, listed, False, None, None, None, {}, None,
                               walked.complete, reason)
    return LastGreenAnswer(
        queue, listed, True, walked.uri, commit_sha(walked.uri), walked.request_id,
        {p: from_answer(walked.answers[p]) for p in listed}, None, True, None)


async def _bookmark(deps: Deps, queue: str) -> LastGreenAnswer:
    try:
        row = await deps.db.queues.get(queue)
    except NotFound:
        row = None
    if row is None or row.last_green_request_id is None or row.last_green_uri is None:
        return LastGreenAnswer(queue, (), False, None, None, None, {}, None, True,
                               f"queue {queue} has no green commit yet")
    fact = await deps.db.facts.of_request(queue, row.last_green_request_id)
    return LastGreenAnswer(queue, (), True, row.last_green_uri,
                           commit_sha(row.last_green_uri), row.last_green_request_id, {},
                           fact, True, None)

