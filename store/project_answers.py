"""ProjectAnswerStore: what deploy gates and release tooling read of projects' answers
(design §11; issue 24, Deliver 5) — a project's answer at a commit, its green answers in
the queue's order, and the newest Request of the queue at which every one of several
projects is green. Nothing here writes: answers are written by `store.projects`.

Every read is a range of an index: project_answer_commit for a commit's answers,
project_answer_green (queue, project, request_rank) for green answers by rank; the
last-green walk probes project_answer_green once per project per step (`LAST_GREEN`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import LiteralString

from store._base import Row, Store
from store.entities import Order
from store.project_statements import ANSWER_COLUMNS
from store.projects import ProjectAnswer

# steps the last-green walk takes at most: each probes every listed project once
MAX_LAST_GREEN_STEPS = 200
_ABOVE_EVERY_RANK = [2**63 - 1]  # sorts after every request_rank


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


_GREEN = _sql(f"""
SELECT {ANSWER_COLUMNS} FROM project_answer
 WHERE queue = %(queue)s AND project = %(project)s AND degree = 0
""")
_BELOW_NEWEST_FIRST = (" AND request_rank(request_id) < %(rank)s::bigint[]"
                       " ORDER BY request_rank(request_id) DESC LIMIT %(limit)s")
_ABOVE_OLDEST_FIRST = (" AND request_rank(request_id) > %(rank)s::bigint[]"
                       " ORDER BY request_rank(request_id) ASC LIMIT %(limit)s")

# The newest Request of the queue at which every listed project has a green answer, as a
# merge walk on project_answer_green: from the top, each step takes each project's newest
# green rank at or below the candidate; the lowest becomes the next candidate, until all
# agree (the answer), a project has no green answer below (none), or the step limit. The
# candidate only moves down and never skips a Request at which all are green: every
# project's newest green at or below it is at or above such a Request.
LAST_GREEN = _sql(f"""
WITH RECURSIVE walk (below, high, found, step) AS (
    SELECT %(top)s::bigint[], %(top)s::bigint[], 0::bigint, 0
  UNION ALL
    SELECT s.low, s.high, s.found, w.step + 1
      FROM walk w
     CROSS JOIN LATERAL (
         SELECT min(g.rank) AS low, max(g.rank) AS high, count(g.rank) AS found
           FROM unnest(%(projects)s::text[]) AS p(project)
          CROSS JOIN LATERAL (
              SELECT request_rank(a.request_id) AS rank FROM project_answer a
               WHERE a.queue = %(queue)s AND a.project = p.project AND a.degree = 0
                 AND request_rank(a.request_id) <= w.below
               ORDER BY request_rank(a.request_id) DESC LIMIT 1) AS g) AS s
     WHERE w.step < %(max_steps)s
       AND (w.step = 0 OR (w.found = %(count)s AND w.below < w.high))
), last AS (
    SELECT below, high, found, step FROM walk ORDER BY step DESC LIMIT 1
)
SELECT l.step AS steps, (l.found = %(count)s AND l.below = l.high) AS agreed,
       (l.found < %(count)s) AS exhausted, {', '.join(
           f'a.{c.strip()}' for c in ANSWER_COLUMNS.split(','))}
  FROM last l
  LEFT JOIN project_answer a
    ON l.found = %(count)s AND l.below = l.high
   AND a.queue = %(queue)s AND a.project = ANY(%(projects)s::text[]) AND a.degree = 0
   AND request_rank(a.request_id) = l.below
""")


@dataclass(frozen=True)
class LastGreen:
    """Where the last-green walk ended: the Request at which every project is green (its
    answers by project), or none; ``complete`` False when the step limit cut it short
    before it could say (no Request found yet, the search not exhausted)."""

    request_id: str | None
    uri: str | None
    answers: dict[str, ProjectAnswer]
    steps: int
    complete: bool


def _answer(row: Row) -> ProjectAnswer:
    return ProjectAnswer(**{k: row[k] for k in ProjectAnswer.__dataclass_fields__})


class ProjectAnswerStore(Store):
    entity = "project_answer"

    async def of_commit(self, queue: str, project: str, uri: str) -> ProjectAnswer | None:
        """The project's answer at commit ``uri``: the answer of the newest Request of the
        queue for the commit that has one (None: no Request of the queue answered)."""
        row = await self._fetch_one(
            f"SELECT {ANSWER_COLUMNS} FROM project_answer"
            " WHERE queue = %(queue)s AND uri = %(uri)s AND project = %(project)s"
            " ORDER BY request_rank(request_id) DESC LIMIT 1",
            {"queue": queue, "uri": uri, "project": project},
            key={"queue": queue, "uri": uri, "project": project})
        return _answer(row) if row is not None else None

    async def of_requests(self, queue: str, project: str,
                          request_ids: Sequence[str]) -> dict[str, ProjectAnswer]:
        """The project's answers at these Requests of the queue, by request id (primary
        key; a Request without one is absent)."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            f"SELECT {ANSWER_COLUMNS} FROM project_answer WHERE queue = %(queue)s"
            " AND request_id = ANY(%(ids)s) AND project = %(project)s",
            {"queue": queue, "ids": list(request_ids), "project": project},
            key={"queue": queue})
        return {row["request_id"]: _answer(row) for row in rows}

    async def green_older_than(self, queue: str, project: str, rank: Order | None,
                               limit: int) -> list[ProjectAnswer]:
        """The project's green answers at Requests that sort before ``rank`` (None: all),
        newest first; at most ``limit``."""
        below = list(rank) if rank is not None else _ABOVE_EVERY_RANK
        rows = await self._fetch_all(
            _GREEN + _BELOW_NEWEST_FIRST,
            {"queue": queue, "project": project, "rank": below, "limit": limit},
            key={"queue": queue, "project": project})
        return [_answer(row) for row in rows]

    async def green_newer_than(self, queue: str, project: str, rank: Order,
                               limit: int) -> list[ProjectAnswer]:
        """The project's green answers at Requests that sort after ``rank``, oldest
        first; at most ``limit``."""
        rows = await self._fetch_all(
            _GREEN + _ABOVE_OLDEST_FIRST,
            {"queue": queue, "project": project, "rank": list(rank), "limit": limit},
            key={"queue": queue, "project": project})
        return [_answer(row) for row in rows]

    async def last_green(self, queue: str, projects: Sequence[str], *,
                         max_steps: int = MAX_LAST_GREEN_STEPS) -> LastGreen:
        """The newest Request of ``queue`` at which every one of ``projects`` (at least
        one, each once) has a green answer — built or inherited — with those answers, in
        one statement (`LAST_GREEN`)."""
        if not projects or len(set(projects)) != len(projects):
            raise ValueError("name each project once, and at least one")
        rows = await self._fetch_all(
            LAST_GREEN,
            {"queue": queue, "projects": list(projects), "count": len(projects),
             "top": _ABOVE_EVERY_RANK, "max_steps": max_steps},
            key={"queue": queue})
        steps = int(rows[0]["steps"])
        if not rows[0]["agreed"]:
            return LastGreen(None, None, {}, steps, bool(rows[0]["exhausted"]))
        answers = {row["project"]: _answer(row) for row in rows}
        first = next(iter(answers.values()))
        return LastGreen(first.request_id, first.uri, answers, steps, True)
