"""A queue's projects commit by commit (issue 24, "Where people look"; design §11): the
dashboard's grid — one row per head of the queue (its Requests, newest first), one column
per project, each cell that project's answer at that head — and, above it, each project's
greenness, bookmark and culprit. `GET /api/queues/{queue}/grid?limit=N` answers it.

A cell is what the project's answer says, or why there is none yet:

- ``green`` / ``red``: the project's answer — built at this head (``inherited`` false, with
  the project's Request and its build's link), or, the head not affecting it, inherited
  from its nearest validated ancestor (``inherited`` true, with that commit's ``source_*``
  and its Request);
- ``pending``: the project's build at this head runs (or the head is being planned);
- ``unvalidated``: its build could not validate the commit (``reason``: why);
- ``cancelled``: its build was cancelled;
- ``waiting`` / ``superseded``: the head itself waits for the queue's slot, or a newer head
  came first and it was never validated;
- ``none``: no answer and none coming (the project was not planned at this head: it was
  added to the queue later).

Reads: the queue's newest Requests (request_rank_idx), their plans and answers (primary
keys), the affected projects' Requests and latest builds (one read each per project with
one in the window), each project's standing (`store.project_views`), the commits'
descriptions as the history has them, and a red project's culprit as its scope's story
tells it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from store import Build, Request, RequestState, Verdict
from store.culprits import CommitRecord
from store.project_views import ProjectStanding
from store.projects import ProjectAnswer, RequestPlan
from streams.config.projects import scope_name
from streams.extensions.sourcecontrol import commit_sha
from streams.stages.analyze import child_id
from streams.web import story
from streams.web.history import BuildLink, build_linker, outcome_of
from streams.web.story_words import CulpritView, SearchView

if TYPE_CHECKING:
    from streams.stages.deps import Deps

DEFAULT_LIMIT = 15
MAX_LIMIT = 100


class CellState(StrEnum):
    GREEN = "green"
    RED = "red"
    PENDING = "pending"
    UNVALIDATED = "unvalidated"
    CANCELLED = "cancelled"
    WAITING = "waiting"
    SUPERSEDED = "superseded"
    NONE = "none"


@dataclass(frozen=True)
class GridCell:
    state: CellState
    inherited: bool  # the answer of the project's nearest validated ancestor
    request_id: str | None  # the project's Request that answers (built here, or the source)
    source_uri: str | None  # inherited: the commit whose answer it is
    source_sha: str | None
    build: BuildLink | None  # built here: the project's latest build at this head
    reason: str  # why it has no answer (could not validate, cancelled), when it says
    flaky: bool = False  # green on a re-run of a red build


@dataclass(frozen=True)
class GridRow:
    request_id: str
    kind: str  # head or retry
    state: str
    outcome: str  # the whole repository's, as the history says it
    reason: str
    uri: str
    sha: str
    subject: str | None
    author: str | None
    ingested_at: datetime
    everything: str  # why every project was affected at this head ('' when the rules chose)
    backstop: bool
    cells: dict[str, GridCell]


@dataclass(frozen=True)
class Bookmark:
    """A project's last green commit: its newest green answer."""

    request_id: str
    uri: str
    sha: str
    inherited: bool
    source_sha: str | None  # inherited: the commit it was built green at


@dataclass(frozen=True)
class ProjectColumn:
    project: str
    blocking: bool
    greenness: str | None  # green or red: its newest build's verdict; None before one
    red_streak_s: float | None
    heads_since_green: int
    bookmark: Bookmark | None
    culprit: CulpritView | None  # while red: the commit its culprit search named
    search: SearchView | None


@dataclass(frozen=True)
class ProjectGrid:
    queue: str
    order: str  # always "newest first"
    projects: list[ProjectColumn]
    rows: list[GridRow]
    described: bool  # every row's commit has its subject and author


async def project_grid(deps: Deps, queue: str, limit: int,
                       descriptions: story.Descriptions) -> ProjectGrid:
    """The grid of the queue's last ``limit`` Requests (a queue without projects has an
    empty one). The caller has checked the queue is configured; ValueError for a limit out
    of range."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    config = deps.queue_config(queue)
    projects = list(config.projects)
    if not projects:
        return ProjectGrid(queue, "newest first", [], [], True)
    db = deps.db
    requests = await db.requests.recent(queue, limit)
    ids = [r.id for r in requests]
    plans = await db.project_views.plans_of(queue, ids)
    answers = await db.project_views.answers_of(queue, ids)
    children, builds = await _children(deps, queue, plans)
    standings = await db.project_views.standings(queue, projects)

    uris = [r.uri for r in requests]
    described = await descriptions.of(db, queue, uris,
                                      lambda: deps.extensions.source_control(queue))
    links = {p: build_linker(deps, scope_name(queue, p)) for p in projects}
    rows = [_row(r, plans.get(r.id), answers.get(r.id, {}), projects, children, builds,
                 links, described.get(r.uri)) for r in requests]
    columns = [await project_column(deps, queue, p, config.projects[p].blocking, standings.get(p),
                             descriptions) for p in projects]
    return ProjectGrid(queue, "newest first", columns, rows,
                       all(row.subject is not None for row in rows))


async def _children(deps: Deps, queue: str, plans: Mapping[str, RequestPlan]
                    ) -> tuple[dict[str, Request], dict[str, Build]]:
    """The affected projects' Requests of the window and their latest builds, by id."""
    wanted: dict[str, list[str]] = {}
    for request_id, plan in plans.items():
        for project in plan.affected:
            wanted.setdefault(project, []).append(child_id(request_id, project))
    children: dict[str, Request] = {}
    builds: dict[str, Build] = {}
    for project, ids in wanted.items():
        scope = scope_name(queue, project)
        children.update(await deps.db.requests.get_many(scope, ids))
        builds.update(await deps.db.builds.latest_of_requests(scope, ids))
    return children, builds


def _row(request: Request, plan: RequestPlan | None, answers: Mapping[str, ProjectAnswer],
         projects: Sequence[str], children: Mapping[str, Request],
         builds: Mapping[str, Build], links: Mapping[str, Callable[[Build], BuildLink]],
         commit: CommitRecord | None) -> GridRow:
    cells = {}
    for project in projects:
        own = child_id(request.id, project)
        build = builds.get(own)
        cells[project] = cell(request, plan, project, answers.get(project), children.get(own),
                              links[project](build) if build is not None else None)
    return GridRow(
        request_id=request.id, kind=request.kind.value, state=request.state.value,
        outcome=outcome_of(request).value, reason=request.reason, uri=request.uri,
        sha=commit.sha if commit else _sha(request.uri),
        subject=commit.subject if commit else None,
        author=commit.author if commit else None, ingested_at=request.created_at,
        everything=plan.reason if plan else "", backstop=plan.backstop if plan else False,
        cells=cells)


def cell(request: Request, plan: RequestPlan | None, project: str,
         answer: ProjectAnswer | None, child: Request | None,
         build: BuildLink | None) -> GridCell:
    """What ``project`` says at the head of ``request``: its answer, or why it has none."""
    if answer is not None:
        state = CellState.GREEN if answer.is_green else CellState.RED
        if answer.inherited:
            return GridCell(state, True, answer.source_request_id, answer.source_uri,
                            _sha(answer.source_uri), None, "")
        return GridCell(state, False, answer.source_request_id, None, None, build, "",
                        flaky=answer.flaky)
    if plan is not None and project in plan.affected:
        own = child_id(request.id, project)
        if child is None:
            return GridCell(CellState.PENDING, False, own, None, None, build, "")
        return GridCell(_child_state(child), False, own, None, None, build, child.reason)
    if plan is not None:
        return GridCell(CellState.NONE, False, None, None, None, None,
                        "not planned at this head (the project was added later)")
    return GridCell(_unplanned_state(request), False, None, None, None, None, request.reason)


def _child_state(child: Request) -> CellState:
    """A project's Request without its answer yet."""
    match child.state:
        case RequestState.SUCCEEDED:
            return CellState.GREEN  # its answer is being written
        case RequestState.FAILED:
            return CellState.RED if child.verdict is Verdict.RED else CellState.UNVALIDATED
        case RequestState.CANCELLED:
            return CellState.CANCELLED
        case RequestState.SUPERSEDED:
            return CellState.SUPERSEDED
    return CellState.PENDING


def _unplanned_state(request: Request) -> CellState:
    """A head without a plan: not planned yet, or never to be."""
    match request.state:
        case RequestState.ACCEPTED:
            return CellState.WAITING
        case RequestState.PROCESSING:
            return CellState.PENDING
        case RequestState.SUPERSEDED:
            return CellState.SUPERSEDED
        case RequestState.CANCELLED:
            return CellState.CANCELLED
        case RequestState.FAILED if request.verdict is None:
            return CellState.UNVALIDATED
    return CellState.NONE  # decided before the queue had projects


async def project_column(deps: Deps, queue: str, project: str, blocking: bool,
                         standing: ProjectStanding | None,
                         descriptions: story.Descriptions) -> ProjectColumn:
    """A project's column head: its greenness, bookmark and, while red, its culprit
    (`GET /api/queues/{queue}/projects` shows it too)."""
    if standing is None:
        return ProjectColumn(project, blocking, None, None, 0, None, None, None)
    bookmark = None
    if standing.last_green_request_id is not None and standing.last_green_uri is not None:
        source = standing.last_green_source_uri
        inherited = bool(standing.last_green_inherited)
        bookmark = Bookmark(standing.last_green_request_id, standing.last_green_uri,
                            _sha(standing.last_green_uri), inherited,
                            _sha(source) if inherited and source else None)
    culprit = search = None
    if standing.greenness == "red":  # only a red project has a culprit to name
        culprit, search = await story.red_since(deps, scope_name(queue, project), descriptions)
    return ProjectColumn(project, blocking, standing.greenness, standing.red_streak_s,
                         standing.heads_since_green, bookmark, culprit, search)


def _sha(uri: str) -> str:
    return commit_sha(uri) or uri
