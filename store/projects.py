"""ProjectStore: what a queue's Requests planned for its projects, and each project's
answers (design §11). The SQL of the changes is `store.project_statements`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from store._base import Row, Store
from store.entities import Request, project_of
from store.project_statements import (
    ANSWER_COLUMNS,
    ANSWER_FROM_FACT,
    BASES,
    COMPLETE,
    PLAN,
    PREVIOUS_PLAN,
)
from store.requests import _request
from store.statements import REQUEST_KEYS


@dataclass(frozen=True)
class ProjectBase:
    """A project's newest verdict before a Request: its commit, Request and degree."""

    uri: str
    request_id: str
    degree: float


@dataclass(frozen=True)
class RequestPlan:
    queue: str
    request_id: str
    affected: tuple[str, ...]
    reason: str
    backstop: bool
    rules_unaffected: tuple[str, ...]
    completed: bool
    created_at: datetime


@dataclass(frozen=True)
class ProjectAnswer:
    """A project's answer for a Request of its queue: built (its scope's fact) or
    inherited from its nearest validated ancestor (``source_*``)."""

    queue: str
    request_id: str
    project: str
    uri: str
    degree: float
    inherited: bool
    source_request_id: str
    source_uri: str
    flaky: bool
    attempts: int
    created_at: datetime

    @property
    def is_green(self) -> bool:
        return self.degree == 0


_STATE_COLUMNS = ("s.queue, s.project, g.request_id AS last_green_request_id,"
                  " g.uri AS last_green_uri, p.pinned_uri, p.pinned_request_id, p.pinned_by,"
                  " p.pinned_reason, p.pinned_at, COALESCE(p.version, 0) AS version")
# a project's bookmark is its newest green answer (index project_answer_green), its pin is
# in project_state
_STATE = (f"SELECT {_STATE_COLUMNS}"
          " FROM unnest(%(projects)s::text[]) AS x(project)"
          " CROSS JOIN LATERAL (SELECT %(queue)s::text AS queue, x.project) AS s"
          " LEFT JOIN LATERAL (SELECT request_id, uri FROM project_answer"
          "                    WHERE queue = s.queue AND project = s.project AND degree = 0"
          "                    ORDER BY request_rank(request_id) DESC LIMIT 1) AS g ON true"
          " LEFT JOIN project_state p ON p.queue = s.queue AND p.project = s.project")


@dataclass(frozen=True)
class ProjectState:
    """A project's last-green bookmark — the newest Request of its queue at which it is
    green, built or inherited: its newest green answer, so it only moves forward — and its
    promotion ref's pin."""

    queue: str
    project: str
    last_green_request_id: str | None = None
    last_green_uri: str | None = None
    pinned_uri: str | None = None
    pinned_request_id: str | None = None
    pinned_by: str | None = None
    pinned_reason: str | None = None
    pinned_at: datetime | None = None
    version: int = 0


@dataclass(frozen=True)
class Child:
    """An affected project's Request to mint: in ``scope``, numbered as its parent."""

    scope: str
    request_id: str
    strategy: str
    base_uri: str | None


@dataclass(frozen=True)
class PreviousPlan:
    """The newest earlier planned Request of a queue: its head, and where each project's
    answer at it came from (its Request in the project's scope: the base it inherited, or
    its own build there); a project still building has none."""

    request_id: str
    uri: str
    sources: Mapping[str, str]


@dataclass(frozen=True)
class UnaffectedStatus:
    """An unaffected project's final commit status at a head: to ``channel`` of its
    scope, in ``stream`` (the id its Request would have had at that head, so its key
    never meets another's)."""

    project: str
    channel: str
    stream: str


@dataclass(frozen=True)
class Completed:
    """What completing a Request did: whether its plan is decided now (by this call or
    before, the Request ended meanwhile), and the Request if this call settled it."""

    decided: bool
    request: Request | None


def _plan(row: Row) -> RequestPlan:
    return RequestPlan(**{**row, "affected": tuple(row["affected"]),
                          "rules_unaffected": tuple(row["rules_unaffected"])})


class ProjectStore(Store):
    entity = "request_plan"

    async def bases(self, queue: str, projects: Sequence[str],
                    request_id: str) -> dict[str, ProjectBase]:
        """Each project's newest fact (in its scope) of a Request that sorts before
        ``request_id``; a project without one is absent."""
        rows = await self._fetch_all(BASES, {"queue": queue, "projects": list(projects),
                                             "request_id": request_id},
                                     key={"queue": queue})
        return {row["project"]: ProjectBase(row["uri"], row["request_id"], row["degree"])
                for row in rows}

    async def previous_plan(self, queue: str, request_id: str) -> PreviousPlan | None:
        """The newest Request sorting before ``request_id`` that has a plan (None: none)."""
        rows = await self._fetch_all(PREVIOUS_PLAN, {"queue": queue,
                                                     "request_id": request_id},
                                     key={"queue": queue})
        if not rows:
            return None
        return PreviousPlan(rows[0]["request_id"], rows[0]["uri"],
                            {row["project"]: row["source_request_id"] for row in rows
                             if row["project"] is not None})

    async def plan_of(self, queue: str, request_id: str) -> RequestPlan | None:
        row = await self._fetch_one(
            "SELECT queue, request_id, affected, reason, backstop, rules_unaffected,"
            " completed, created_at"
            " FROM request_plan WHERE queue = %(queue)s AND request_id = %(request_id)s",
            {"queue": queue, "request_id": request_id}, key={"queue": queue})
        return _plan(row) if row is not None else None

    async def last_backstop(self, queue: str) -> datetime | None:
        """When the queue's newest backstop was planned (None: never)."""
        row = await self._fetch_one(
            "SELECT created_at FROM request_plan WHERE queue = %(queue)s AND backstop"
            " ORDER BY created_at DESC LIMIT 1", {"queue": queue}, key={"queue": queue})
        return row["created_at"] if row is not None else None

    async def plan(self, request: Request, *, affected: Sequence[str], reason: str,
                   backstop: bool, rules_unaffected: Sequence[str],
                   children: Sequence[Child],
                   inherited: Mapping[str, ProjectBase],
                   status_channels: Mapping[str, Sequence[str]],
                   unaffected_statuses: Sequence[UnaffectedStatus] = ()) -> bool:
        """Write ``request``'s plan, its children (admitted, each taking its scope's slot)
        and its inherited answers, in one statement — only while the Request is
        `processing` and has no plan yet. False when it wrote nothing (another delivery
        planned first, or the Request ended). ``status_channels`` by scope: where each
        child's `pending` status goes; ``unaffected_statuses``: the final statuses saying
        what an inherited project inherits (written only with its answer)."""
        projects = list(inherited)
        status = [(scope, channel) for scope, channels in status_channels.items()
                  for channel in channels]
        unaffected = [(u.project, u.channel, u.stream) for u in unaffected_statuses]
        row = await self._fetch_one(PLAN, {
            "queue": request.queue, "request_id": request.id, "affected": list(affected),
            "reason": reason, "backstop": backstop,
            "rules_unaffected": list(rules_unaffected),
            "scopes": [c.scope for c in children],
            "child_ids": [c.request_id for c in children],
            "strategies": [c.strategy for c in children],
            "bases": [c.base_uri for c in children],
            "inherited": projects, "degrees": [inherited[p].degree for p in projects],
            "sources": [inherited[p].request_id for p in projects],
            "source_uris": [inherited[p].uri for p in projects],
            "status_scopes": [s for s, _ in status], "status_channels": [c for _, c in status],
            "unaffected_projects": [p for p, _, _ in unaffected],
            "unaffected_channels": [c for _, c, _ in unaffected],
            "unaffected_streams": [s for _, _, s in unaffected],
        }, key={"queue": request.queue, "id": request.id},
            request_key={"queue": request.queue, "id": request.id})
        assert row is not None
        return bool(row["planned"])

    async def answer_from_fact(self, queue: str, request_id: str, child: Request) -> None:
        """The answer of ``child`` (a project's Request) for its parent ``request_id``:
        its fact, once record wrote it (idempotent; nothing without a fact)."""
        await self._fetch_one(ANSWER_FROM_FACT + " RETURNING project", {
            "queue": queue, "request_id": request_id, "scope": child.queue,
            "child_id": child.id, "project": project_of(child.queue)},
            key={"queue": queue, "id": request_id})

    async def state(self, queue: str, project: str) -> ProjectState:
        """The project's last-green bookmark and pin."""
        return (await self.states(queue, [project]))[project]

    async def states(self, queue: str, projects: Sequence[str]) -> dict[str, ProjectState]:
        """Each project's last-green bookmark and pin (one index probe each)."""
        rows = await self._fetch_all(_STATE, {"queue": queue, "projects": list(projects)},
                                     key={"queue": queue})
        return {row["project"]: ProjectState(**row) for row in rows}

    async def answers(self, queue: str, request_id: str) -> dict[str, ProjectAnswer]:
        rows = await self._fetch_all(
            f"SELECT {ANSWER_COLUMNS} FROM project_answer"
            " WHERE queue = %(queue)s AND request_id = %(request_id)s",
            {"queue": queue, "request_id": request_id}, key={"queue": queue})
        return {row["project"]: ProjectAnswer(**row) for row in rows}

    async def complete(self, queue: str, request_id: str, *,
                       children: Mapping[str, str], blocking: Sequence[str],
                       status_channels: Sequence[str]) -> Completed:
        """Decide Request ``request_id`` from its projects' answers once every child
        (``children``: request id by project) ended and every one with a verdict has its
        answer: settled, its slot released, in one statement. Not decided while a child
        is still going on."""
        row = await self._fetch_one(COMPLETE, {
            "queue": queue, "request_id": request_id,
            "child_projects": list(children), "child_ids": list(children.values()),
            "blocking": list(blocking), "status_channels": list(status_channels)},
            key={"queue": queue, "id": request_id})
        assert row is not None
        settled = (_request({k: row[k] for k in REQUEST_KEYS})
                   if row["id"] is not None else None)
        return Completed(bool(row["completed"]), settled)
