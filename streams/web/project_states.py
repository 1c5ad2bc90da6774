"""Each project's state at the queue's head (design §11; issue 24, Deliver 5):
`GET /api/queues/{queue}/projects` and `GET /api/queues/{queue}/projects/{project}`.

At the queue's newest head (its latest Request) a project is:

- ``green`` / ``red``: the head's Request built it (its scope's Request of the same
  number) and that build gave the verdict;
- ``unaffected``: the head did not touch it, so it inherits its nearest validated
  ancestor's answer, green or red (``green`` says which, ``fact.inherited_from`` from
  where);
- ``pending``: its answer is not known yet (the head is waiting or being planned, or the
  project's build is under way);
- ``unvalidated``: its build could not validate the head (the reason is given), or the
  head's Request ended before it planned its projects.

With it: the project's last-green bookmark (its newest green answer, built or inherited:
`store.projects.ProjectStore.states`) and pin, its red streak (its scope's greenness:
built verdicts), and while it is red its culprit or the search for one (its scope's,
`streams.web.story.red_since`). The state itself is a pure function of what the reads
found (`head_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from store import NotFound, Request, RequestState
from store.projects import ProjectAnswer, ProjectState, RequestPlan
from streams.config.projects import scope_name
from streams.extensions.sourcecontrol import commit_sha
from streams.stages.analyze import child_id
from streams.web.project_answers import ProjectFact, from_answer
from streams.web.story import CulpritView, Descriptions, SearchView, red_since

if TYPE_CHECKING:
    from streams.stages.deps import Deps

GREEN, RED, PENDING, UNVALIDATED, UNAFFECTED = (
    "green", "red", "pending", "unvalidated", "unaffected")


@dataclass(frozen=True)
class HeadState:
    state: str  # green, red, pending, unvalidated, unaffected
    green: bool | None  # None: not known (pending, unvalidated)
    words: str


def head_state(head: Request | None, plan: RequestPlan | None, project: str,
               answer: ProjectAnswer | None, child: Request | None) -> HeadState:
    """The project's state at the queue's newest Request ``head`` (None: nothing
    ingested), from the head's ``plan``, the project's ``answer`` at the head and, when
    the head built it, its scope's Request ``child``."""
    if answer is not None:
        colour = "green" if answer.degree == 0 else "red"
        if answer.inherited:
            source = commit_sha(answer.source_uri) or answer.source_uri
            return HeadState(UNAFFECTED, answer.degree == 0,
                             f"unaffected, inherits {colour} from {source[:12]}")
        flaky = " (flaky: green on a re-run)" if answer.flaky and answer.degree == 0 else ""
        return HeadState(GREEN if answer.degree == 0 else RED, answer.degree == 0,
                         f"{colour}{flaky}: built at this head")
    if head is None:
        return HeadState(PENDING, None, "nothing was ingested yet")
    if plan is None:
        if head.state.is_terminal:
            why = head.reason or str(head.state)
            return HeadState(UNVALIDATED, None, f"could not be validated: the head's "
                                                f"Request ended before it planned its "
                                                f"projects ({why})")
        return HeadState(PENDING, None, f"the head is {head.state}: its projects are not "
                                        f"planned yet")
    if project not in plan.affected:
        return HeadState(PENDING, None, "not planned at this head (the project was added "
                                        "after it was planned)")
    if child is None or not child.state.is_terminal:
        shown = f"{child.id} ({child.state})" if child is not None else "its build"
        return HeadState(PENDING, None, f"being validated: {shown}")
    if child.verdict is not None:  # record writes the answer right after the fact
        return HeadState(PENDING, None, f"{child.id} ended {child.verdict}; its answer is "
                                        f"being recorded")
    if child.state is RequestState.CANCELLED:
        why = f": {child.reason}" if child.reason else ""
        return HeadState(UNVALIDATED, None,
                         f"could not be validated: {child.id} was cancelled{why}")
    reason = child.reason or "no reason recorded"
    if not reason.startswith("could not be validated"):
        reason = f"could not be validated: {reason}"
    return HeadState(UNVALIDATED, None, reason)


@dataclass(frozen=True)
class Bookmark:
    """A project's last green commit: its newest green answer."""

    uri: str
    sha: str | None
    request_id: str


@dataclass(frozen=True)
class RedStreak:
    since: datetime
    seconds: float


@dataclass(frozen=True)
class ProjectView:
    project: str
    blocking: bool
    head_request_id: str | None  # the queue's newest Request; None: nothing ingested
    state: str
    green: bool | None
    words: str
    request_id: str | None  # the project's Request of its scope at the head, if built
    fact: ProjectFact | None  # its answer at the head
    bookmark: Bookmark | None  # None: never green yet
    pinned_uri: str | None  # its promotion ref held there (None: it follows the bookmark)
    red_streak: RedStreak | None  # None: not red (its newest verdict is green, or none)
    culprit: CulpritView | None
    search: SearchView | None


async def project_views(deps: Deps, queue: str, projects: Sequence[str],
                        descriptions: Descriptions) -> list[ProjectView]:
    """Each project of ``projects`` (checked by the caller) at the queue's head, in the
    order given."""
    db = deps.db
    try:
        row = await db.queues.get(queue)
    except NotFound:
        row = None
    head = None
    if row is not None and row.latest_request_id is not None:
        head = (await db.requests.get_many(queue, [row.latest_request_id])).get(
            row.latest_request_id)
    plan = await db.projects.plan_of(queue, head.id) if head is not None else None
    answers = await db.projects.answers(queue, plan.request_id) if plan is not None else {}
    bookmarks = await db.projects.states(queue, projects)
    config = deps.queue_config(queue)
    views = []
    for project in projects:
        scope = scope_name(queue, project)
        child = None
        if head is not None and plan is not None and project in plan.affected:
            child_request = child_id(head.id, project)
            child = (await db.requests.get_many(scope, [child_request])).get(child_request)
        answer = answers.get(project)
        state = head_state(head, plan, project, answer, child)
        streak = await db.notifications.red_streak(scope)
        culprit, search = (await red_since(deps, scope, descriptions)
                           if streak is not None or state.green is False else (None, None))
        views.append(ProjectView(
            project=project, blocking=config.projects[project].blocking,
            head_request_id=head.id if head is not None else None, state=state.state,
            green=state.green, words=state.words,
            request_id=child.id if child is not None else None,
            fact=from_answer(answer) if answer is not None else None,
            bookmark=_bookmark(bookmarks.get(project)),
            pinned_uri=(bookmarks[project].pinned_uri if project in bookmarks else None),
            red_streak=RedStreak(*streak) if streak is not None else None,
            culprit=culprit, search=search))
    return views


def _bookmark(state: ProjectState | None) -> Bookmark | None:
    if state is None or state.last_green_uri is None or state.last_green_request_id is None:
        return None
    return Bookmark(state.last_green_uri, commit_sha(state.last_green_uri),
                    state.last_green_request_id)
