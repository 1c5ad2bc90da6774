"""ProjectViewStore: the reads that show a queue's projects to people (issue 24, "Where
people look"; design §11) — each project's greenness and bookmark for the gauges and the
dashboard's header, and the plans and answers of a window of the queue's Requests for the
dashboard's grid of commits by projects. Reads only; the writes are `store.projects`.

Every read is a key or an index range: a project's greenness is its scope's queue_health
row (its newest build's verdict, as its alerts judge it) and its newest greenness_change;
its bookmark the newest green answer (project_answer_green); a window's plans and answers
the primary keys of request_plan and project_answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import LiteralString

from store._base import Store
from store.project_statements import ANSWER_COLUMNS
from store.projects import ProjectAnswer, RequestPlan


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


# per project: its scope's greenness and when it last changed, and its newest green answer
# (its bookmark) with the heads of the queue ingested after it
_STANDINGS = _sql("""
SELECT s.project, h.greenness,
       EXTRACT(EPOCH FROM now() - c.at)::float8 AS changed_s,
       g.request_id AS last_green_request_id, g.uri AS last_green_uri,
       g.inherited AS last_green_inherited, g.source_uri AS last_green_source_uri,
       EXTRACT(EPOCH FROM now() - g.created_at)::float8 AS last_green_age_s,
       COALESCE(request_seq(q.latest_request_id), 0)
           - COALESCE(request_seq(g.request_id), 0) AS heads_since_green
  FROM unnest(%(projects)s::text[]) AS s(project)
  LEFT JOIN queue q ON q.name = %(queue)s
  LEFT JOIN queue_health h ON h.queue = %(queue)s || '#' || s.project
  LEFT JOIN LATERAL (
      SELECT at FROM greenness_change
       WHERE queue = %(queue)s || '#' || s.project
       ORDER BY at DESC LIMIT 1) AS c ON true
  LEFT JOIN LATERAL (
      SELECT request_id, uri, inherited, source_uri, created_at FROM project_answer
       WHERE queue = %(queue)s AND project = s.project AND degree = 0
       ORDER BY request_rank(request_id) DESC LIMIT 1) AS g ON true
""")


@dataclass(frozen=True)
class ProjectStanding:
    """A project's greenness — its newest build's verdict, ``green`` or ``red`` (None
    before its first) — and how long it has been so, and its bookmark: its newest green
    answer (built, or inherited from ``last_green_source_uri``), its age and the heads
    of the queue ingested after it."""

    project: str
    greenness: str | None
    changed_s: float | None  # seconds since its greenness last changed
    last_green_request_id: str | None
    last_green_uri: str | None
    last_green_inherited: bool | None
    last_green_source_uri: str | None
    last_green_age_s: float | None
    heads_since_green: int

    @property
    def red_streak_s(self) -> float | None:
        """Seconds it has been red; None while it is not red."""
        return self.changed_s if self.greenness == "red" else None


class ProjectViewStore(Store):
    entity = "project_answer"

    async def standings(self, queue: str,
                        projects: Sequence[str]) -> dict[str, ProjectStanding]:
        """Each project's greenness and bookmark (a few index probes each)."""
        if not projects:
            return {}
        rows = await self._fetch_all(_STANDINGS, {"queue": queue, "projects": list(projects)},
                                     key={"queue": queue})
        return {row["project"]: ProjectStanding(**row) for row in rows}

    async def plans_of(self, queue: str, request_ids: Sequence[str]) -> dict[str, RequestPlan]:
        """The plans of those of ``request_ids`` that have one, by request id."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            "SELECT queue, request_id, affected, reason, backstop, rules_unaffected,"
            " completed, created_at FROM request_plan"
            " WHERE queue = %(queue)s AND request_id = ANY(%(ids)s)",
            {"queue": queue, "ids": list(request_ids)}, key={"queue": queue})
        return {row["request_id"]: RequestPlan(**{
            **row, "affected": tuple(row["affected"]),
            "rules_unaffected": tuple(row["rules_unaffected"])}) for row in rows}

    async def answers_of(self, queue: str, request_ids: Sequence[str]
                         ) -> dict[str, dict[str, ProjectAnswer]]:
        """The projects' answers of each of ``request_ids``: request id → project →
        answer (a Request without answers is absent)."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            f"SELECT {ANSWER_COLUMNS} FROM project_answer"
            " WHERE queue = %(queue)s AND request_id = ANY(%(ids)s)",
            {"queue": queue, "ids": list(request_ids)}, key={"queue": queue})
        found: dict[str, dict[str, ProjectAnswer]] = {}
        for row in rows:
            found.setdefault(row["request_id"], {})[row["project"]] = ProjectAnswer(**row)
        return found
