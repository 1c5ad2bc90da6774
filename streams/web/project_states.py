"""Each project's state at the queue's head (design §11; issue 24, Deliver 5):
`GET /api/queues/{queue}/projects` and `GET /api/queues/{queue}/projects/{project}`.

At the queue's newest head (its latest Request) a project is:

- ``green`` / ``red``: the head's Request built it (its scope's Request of the same
  number) and that build gave the verdict;
- ``unaffected``: the head did not touch it, so it inherits its nearest validated
  ancestor's answer, green or red (``green`` says which, ``fact.inherited_from`` from
  where);
- ``pending``: its answer is not known yet (the head waits for the queue's slot or is
  being planned, the project's build is under way, or the project was added after the
  head was planned);
- ``unvalidated``: its build could not validate the head (the reason is given), or was
  cancelled, or the head's Request ended before it planned its projects.

The state is the dashboard grid's cell of the head (`streams.web.grid.cell`) in those five
words (`head_state`, pure); the rest is the grid's column of the project
(`streams.web.grid.project_column`): its greenness and red streak, its last-green
bookmark (its newest green answer, built or inherited), the heads since, while it is
red its culprit or the search for one, and where its own promotion ref belongs (its pin,
else its bookmark) with the last failed move's reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from store import NotFound, Request
from store.projects import ProjectAnswer, RequestPlan
from streams.config.projects import scope_name
from streams.stages.analyze import child_id
from streams.web.grid import Bookmark, CellState, GridCell, cell, project_column
from streams.web.history import BuildLink, build_linker
from streams.web.project_answers import ProjectFact, from_answer
from streams.web.story import CulpritView, Descriptions, SearchView

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
    if head is None:
        return HeadState(PENDING, None, "nothing was ingested yet")
    return state_of(cell(head, plan, project, answer, child, None))


def state_of(at_head: GridCell) -> HeadState:
    """The grid's cell of the head in the five words of a project's state."""
    colour = at_head.state.value
    match at_head.state:
        case CellState.GREEN | CellState.RED if at_head.inherited:
            source = (at_head.source_sha or at_head.source_uri or "?")[:12]
            return HeadState(UNAFFECTED, at_head.state is CellState.GREEN,
                             f"unaffected, inherits {colour} from {source}")
        case CellState.GREEN | CellState.RED:
            flaky = " (flaky: green on a re-run)" if at_head.flaky else ""
            return HeadState(GREEN if at_head.state is CellState.GREEN else RED,
                             at_head.state is CellState.GREEN,
                             f"{colour}{flaky}: built at this head")
        case CellState.PENDING if at_head.request_id is not None:
            return HeadState(PENDING, None, f"being validated: {at_head.request_id}")
        case CellState.PENDING:
            return HeadState(PENDING, None, "the head's projects are being planned")
        case CellState.WAITING:
            return HeadState(PENDING, None, "the head waits for the queue's slot: its "
                                            "projects are not planned yet")
        case CellState.UNVALIDATED:
            reason = at_head.reason or "no reason recorded"
            if not reason.startswith("could not be validated"):
                reason = f"could not be validated: {reason}"
            return HeadState(UNVALIDATED, None, reason)
        case CellState.CANCELLED:
            what = at_head.request_id or "the head's Request"
            why = f": {at_head.reason}" if at_head.reason else ""
            return HeadState(UNVALIDATED, None,
                             f"could not be validated: {what} was cancelled{why}")
    # superseded, or not planned at this head: nothing known here until the next head
    return HeadState(PENDING, None, at_head.reason or f"no answer at this head ({colour})")


@dataclass(frozen=True)
class ProjectView:
    project: str
    blocking: bool
    head_request_id: str | None  # the queue's newest Request; None: nothing ingested
    state: str
    green: bool | None
    words: str
    request_id: str | None  # the project's Request that answers (built here, or the source)
    fact: ProjectFact | None  # its answer at the head
    build: BuildLink | None  # built at the head: its latest build there
    greenness: str | None  # its newest build's verdict (None before one)
    red_streak_s: float | None  # None: not red
    bookmark: Bookmark | None  # its last green commit; None: never green yet
    heads_since_green: int
    culprit: CulpritView | None
    search: SearchView | None
    promotion: ProjectPromotion | None  # None: the project has no promotion ref


@dataclass(frozen=True)
class ProjectPromotion:
    """Where a project's own promotion ref belongs: its pin (during an incident), else its
    bookmark; and why it is not there, when the last move failed."""

    ref: str
    wanted_uri: str | None
    pinned_uri: str | None
    pinned_by: str | None
    pinned_reason: str | None
    pinned_at: datetime | None
    problem: str | None


async def _promotions(deps: Deps, queue: str,
                      projects: Sequence[str]) -> dict[str, ProjectPromotion]:
    config = deps.queue_config(queue)
    refs = {p: config.projects[p].promotion_ref for p in projects
            if config.projects[p].promotion_ref}
    if not refs:
        return {}
    states = await deps.db.projects.states(queue, list(refs))
    problems = await deps.db.pins.problems([scope_name(queue, p) for p in refs])
    promotions = {}
    for project, ref in refs.items():
        state = states[project]
        problem = problems.get(scope_name(queue, project))
        promotions[project] = ProjectPromotion(
            ref=str(ref), wanted_uri=state.pinned_uri or state.last_green_uri,
            pinned_uri=state.pinned_uri, pinned_by=state.pinned_by,
            pinned_reason=state.pinned_reason, pinned_at=state.pinned_at,
            problem=problem.reason if problem is not None else None)
    return promotions


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
    standings = await db.project_views.standings(queue, projects)
    config = deps.queue_config(queue)
    promotions = await _promotions(deps, queue, projects)
    views = []
    for project in projects:
        child = build = None
        if head is not None and plan is not None and project in plan.affected:
            scope, own = scope_name(queue, project), child_id(head.id, project)
            child = (await db.requests.get_many(scope, [own])).get(own)
            built = (await db.builds.latest_of_requests(scope, [own])).get(own)
            build = build_linker(deps, scope)(built) if built is not None else None
        answer = answers.get(project)
        at_head = (cell(head, plan, project, answer, child, build)
                   if head is not None else None)
        state = state_of(at_head) if at_head is not None else head_state(
            None, None, project, None, None)
        column = await project_column(deps, queue, project, config.projects[project].blocking,
                                      standings.get(project), descriptions)
        views.append(ProjectView(
            project=project, blocking=column.blocking,
            head_request_id=head.id if head is not None else None, state=state.state,
            green=state.green, words=state.words,
            request_id=at_head.request_id if at_head is not None else None,
            fact=from_answer(answer) if answer is not None else None, build=build,
            greenness=column.greenness, red_streak_s=column.red_streak_s,
            bookmark=column.bookmark, heads_since_green=column.heads_since_green,
            culprit=column.culprit, search=column.search,
            promotion=promotions.get(project)))
    return views
