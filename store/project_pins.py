"""ProjectPinStore: a project's promotion ref held at a commit green for the project
during an incident (design §11; issue 24, Deliver 4) — pins per project as for the queue
(`store.pins`).

A project's pin is kept in ``project_state`` (which commit, the Request of the queue whose
green answer for the project it is, who, when, why), so the stages read it with the
project's bookmark (`store.projects.ProjectStore.state`); its history is in
``promotion_pin`` and its promotion problem in ``promotion_problem``, both under the
project's scope name ``<queue>#<project>``. A pin names a green answer of the project:
the statement writes nothing otherwise (built or inherited, an answer is green only
where the project was).
"""

from __future__ import annotations

from typing import LiteralString

from store._base import Store
from store.entities import SCOPE_SEPARATOR
from store.projects import ProjectState


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


_PIN_RETURNING = ("queue, project, pinned_uri, pinned_request_id, pinned_by, pinned_reason,"
                  " pinned_at, version")

# Pin: close the open pin of the scope's history, write the project's pin (its version
# +1), log it — only when the named answer is the project's green answer at that commit.
PIN = _sql(f"""
WITH answer AS (
    SELECT 1 FROM project_answer
     WHERE queue = %(queue)s AND request_id = %(request_id)s AND project = %(project)s
       AND uri = %(uri)s AND degree = 0
), closed AS (
    UPDATE promotion_pin SET unpinned_by = %(by)s, unpinned_at = now()
     WHERE queue = %(scope)s AND unpinned_at IS NULL AND EXISTS (SELECT 1 FROM answer)
    RETURNING id
), pinned AS (
    INSERT INTO project_state (queue, project, pinned_uri, pinned_request_id, pinned_by,
                               pinned_reason, pinned_at)
    SELECT %(queue)s, %(project)s, %(uri)s, %(request_id)s, %(by)s, %(reason)s, now()
      FROM answer
    ON CONFLICT (queue, project) DO UPDATE
       SET pinned_uri = EXCLUDED.pinned_uri, pinned_request_id = EXCLUDED.pinned_request_id,
           pinned_by = EXCLUDED.pinned_by, pinned_reason = EXCLUDED.pinned_reason,
           pinned_at = EXCLUDED.pinned_at, version = project_state.version + 1,
           updated_at = now()
    RETURNING {_PIN_RETURNING}
), logged AS (
    INSERT INTO promotion_pin (queue, uri, request_id, pinned_by, reason)
    SELECT %(scope)s, %(uri)s, %(request_id)s, %(by)s, %(reason)s FROM pinned
    RETURNING id
)
SELECT {_PIN_RETURNING} FROM pinned
""")

UNPIN = _sql(f"""
WITH before AS (
    SELECT pinned_uri FROM project_state
     WHERE queue = %(queue)s AND project = %(project)s FOR UPDATE
), closed AS (
    UPDATE promotion_pin SET unpinned_by = %(by)s, unpinned_at = now()
     WHERE queue = %(scope)s AND unpinned_at IS NULL
    RETURNING id
), cleared AS (
    UPDATE project_state SET pinned_uri = NULL, pinned_request_id = NULL, pinned_by = NULL,
           pinned_reason = NULL, pinned_at = NULL, version = version + 1, updated_at = now()
     WHERE queue = %(queue)s AND project = %(project)s AND pinned_uri IS NOT NULL
    RETURNING {_PIN_RETURNING}
)
SELECT (SELECT pinned_uri FROM before) AS was_pinned, (SELECT count(*) FROM cleared) AS n
""")

# Roll back the pin of %(failed)s whose ref did not move, while it is still the project's
# pin: the pin is again the one before (none, or the pin it replaced, whose history row is
# open again), and the failed pin's history row says why.
ROLL_BACK = _sql(f"""
WITH failed AS (
    UPDATE promotion_pin SET unpinned_at = now(), unpinned_by = 'rolled back',
           rolled_back_reason = %(reason)s
     WHERE queue = %(scope)s AND unpinned_at IS NULL AND uri = %(failed)s
       AND EXISTS (SELECT 1 FROM project_state WHERE queue = %(queue)s
                   AND project = %(project)s AND pinned_uri = %(failed)s)
    RETURNING id
), reopened AS (
    UPDATE promotion_pin SET unpinned_at = NULL, unpinned_by = NULL
     WHERE id = (SELECT max(p.id) FROM promotion_pin p, failed f
                  WHERE p.queue = %(scope)s AND p.id < f.id
                    AND p.uri = %(previous)s::text)
    RETURNING id
), restored AS (
    UPDATE project_state SET pinned_uri = %(previous)s, pinned_request_id = %(request_id)s,
           pinned_by = %(by)s, pinned_reason = %(why)s, pinned_at = %(at)s,
           version = version + 1, updated_at = now()
     WHERE queue = %(queue)s AND project = %(project)s AND pinned_uri = %(failed)s
       AND EXISTS (SELECT 1 FROM failed)
    RETURNING {_PIN_RETURNING}
)
SELECT count(*) AS n FROM restored
""")

# the pinned projects, and the scopes with a promotion problem, for the sweeper
TO_SETTLE = _sql(f"""
SELECT queue, project FROM project_state WHERE pinned_uri IS NOT NULL
UNION
SELECT split_part(queue, '{SCOPE_SEPARATOR}', 1), queue_project(queue)
  FROM promotion_problem WHERE strpos(queue, '{SCOPE_SEPARATOR}') > 0
""")


def _scope(queue: str, project: str) -> str:
    return f"{queue}{SCOPE_SEPARATOR}{project}"


class ProjectPinStore(Store):
    entity = "project_state"

    async def pin(self, queue: str, project: str, uri: str, request_id: str, *, by: str,
                  reason: str) -> bool:
        """Hold the project's promotion ref at ``uri``, whose green answer for the project
        is ``request_id``'s (a Request of ``queue``), replacing any earlier pin (closed in
        the history). False, and nothing written, when that answer is not green there."""
        key = {"queue": queue, "project": project}
        row = await self._fetch_one(PIN, {
            **key, "scope": _scope(queue, project), "uri": uri, "request_id": request_id,
            "by": by, "reason": reason}, key=key)
        return row is not None

    async def unpin(self, queue: str, project: str, *, by: str) -> str | None:
        """Let the project's promotion ref follow its bookmark again; the commit that was
        pinned (None: nothing was)."""
        key = {"queue": queue, "project": project}
        row = await self._fetch_one(UNPIN, {**key, "scope": _scope(queue, project),
                                            "by": by}, key=key)
        return row["was_pinned"] if row is not None else None

    async def roll_back(self, queue: str, project: str, failed_uri: str,
                        before: ProjectState, *, reason: str) -> bool:
        """Undo the pin of ``failed_uri`` whose ref could not be moved (the pin is
        ``before``'s again); False when a pin or unpin since replaced it (it stays)."""
        key = {"queue": queue, "project": project}
        row = await self._fetch_one(ROLL_BACK, {
            **key, "scope": _scope(queue, project), "failed": failed_uri,
            "reason": reason, "previous": before.pinned_uri,
            "request_id": before.pinned_request_id, "by": before.pinned_by,
            "why": before.pinned_reason, "at": before.pinned_at}, key=key)
        return bool(row and row["n"])

    async def to_settle(self) -> list[tuple[str, str]]:
        """(queue, project) of every pinned project and every project whose promotion ref
        has a problem: the ones the sweeper keeps settling."""
        rows = await self._fetch_all(TO_SETTLE, {}, key={"queue": "*"})
        return sorted((row["queue"], row["project"]) for row in rows)
