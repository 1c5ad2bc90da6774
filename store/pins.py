"""PinStore: the promotion ref held at a green commit during an incident (migration 0010).

A pin is kept on the queue's row (`Queue.pinned_*`: which commit, who, when, why), so the
record stage reads it with the bookmark, and in `promotion_pin`, every pin and unpin
ever made. The database refuses a pin that names no green fact of the queue.

A pin is taken under its queue's pin lock (`PIN_LOCK`, a transaction-level advisory lock
per queue and its projects' scopes), which a retention batch deleting that queue's old
facts tries first (`PIN_LOCK_TRY`, store.retention): a pin never names a fact deleted
while it was being taken (the pin waits for the batch and then finds its fact gone, or
the batch leaves the queue for its next round).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from store._base import Store
from store.entities import Queue, split_scope
from store.errors import NotFound
from store.queues import _COLUMNS as _QUEUE_COLUMNS
from store.queues import _queue


@dataclass(frozen=True, slots=True)
class Pin:
    """One pin of a queue's promotion ref, and its unpin once there was one."""

    id: int
    queue: str
    uri: str
    request_id: str
    pinned_by: str
    reason: str
    pinned_at: datetime
    unpinned_by: str | None
    unpinned_at: datetime | None
    rolled_back_reason: str | None = None  # the ref could not be moved: it never held


@dataclass(frozen=True, slots=True)
class PromotionProblem:
    """Why a queue's promotion ref is not where the queue says it belongs (the last
    failed move), and since when."""

    queue: str
    reason: str
    at: datetime


# First half of the advisory lock key ("STVK"); the second hashes the schema and the
# queue's name (a scope's queue, for a project's pin).
_PIN_LOCK_NAMESPACE = 0x5354564B
_PIN_LOCK_KEY = (f"{_PIN_LOCK_NAMESPACE}, hashtext(current_schema() || '/' ||"
                 " %(family)s::text)")
PIN_LOCK = f"SELECT pg_advisory_xact_lock({_PIN_LOCK_KEY})"
PIN_LOCK_TRY = f"SELECT pg_try_advisory_xact_lock({_PIN_LOCK_KEY})"

_PIN_COLUMNS = ("id, queue, uri, request_id, pinned_by, reason, pinned_at, unpinned_by,"
                " unpinned_at, rolled_back_reason")


class PinStore(Store):
    entity = "promotion_pin"

    async def pin(self, queue: str, uri: str, request_id: str, *, by: str,
                  reason: str) -> Queue:
        """Hold the promotion ref at ``uri`` (whose green fact is ``request_id``'s): the
        queue's pin, replacing any earlier one (closed in the history). NotFound for a
        queue without a row; InvariantViolation for a commit without that green fact."""
        key = {"queue": queue}
        # the lock is taken (`held`, named by both updates) before any row is written, and
        # the guard trigger's check of the green fact reads after it (a fresh snapshot)
        row = await self._fetch_one(
            f"WITH held AS ({PIN_LOCK}"
            "), closed AS ("
            " UPDATE promotion_pin SET unpinned_by = %(by)s, unpinned_at = now()"
            " WHERE queue = %(queue)s AND unpinned_at IS NULL AND EXISTS (SELECT 1 FROM held)"
            " RETURNING id"
            "), pinned AS ("
            " UPDATE queue SET pinned_uri = %(uri)s, pinned_request_id = %(request_id)s,"
            " pinned_by = %(by)s, pinned_reason = %(reason)s, pinned_at = now(),"
            " version = version + 1, updated_at = now()"
            f" WHERE name = %(queue)s AND EXISTS (SELECT 1 FROM held)"
            f" RETURNING {_QUEUE_COLUMNS}"
            "), logged AS ("
            " INSERT INTO promotion_pin (queue, uri, request_id, pinned_by, reason)"
            " SELECT %(queue)s, %(uri)s, %(request_id)s, %(by)s, %(reason)s FROM pinned"
            " RETURNING id"
            f") SELECT {_QUEUE_COLUMNS} FROM pinned",
            {**key, "uri": uri, "request_id": request_id, "by": by, "reason": reason,
             "family": split_scope(queue)[0]},
            key=key)
        if row is None:
            raise NotFound("queue", {"name": queue})
        return _queue(row)

    async def unpin(self, queue: str, *, by: str) -> tuple[Queue, str | None]:
        """Let the promotion ref follow the bookmark again; the commit that was pinned
        (None: nothing was). NotFound for a queue without a row."""
        key = {"queue": queue}
        row = await self._fetch_one(
            "WITH before AS ("
            " SELECT pinned_uri FROM queue WHERE name = %(queue)s FOR UPDATE"
            "), closed AS ("
            " UPDATE promotion_pin SET unpinned_by = %(by)s, unpinned_at = now()"
            " WHERE queue = %(queue)s AND unpinned_at IS NULL RETURNING id"
            "), cleared AS ("
            " UPDATE queue SET pinned_uri = NULL, pinned_request_id = NULL,"
            " pinned_by = NULL, pinned_reason = NULL, pinned_at = NULL,"
            " version = version + 1, updated_at = now()"
            " WHERE name = %(queue)s AND EXISTS (SELECT 1 FROM before)"
            f" RETURNING {_QUEUE_COLUMNS}"
            ") SELECT c.*, (SELECT pinned_uri FROM before) AS was_pinned FROM cleared c",
            {**key, "by": by}, key=key)
        if row is None:
            raise NotFound("queue", {"name": queue})
        was = row.pop("was_pinned")
        return _queue(row), was

    async def roll_back(self, queue: str, failed_uri: str, before: Queue, *,
                        reason: str) -> Queue | None:
        """Undo the pin of ``failed_uri`` whose ref could not be moved: the queue's pin is
        again ``before``'s (none, or the pin it replaced, whose history row is open
        again), and the failed pin's row says why. Only while the queue is still pinned
        at ``failed_uri`` (a pin or unpin since stays); None then."""
        key = {"queue": queue}
        row = await self._fetch_one(
            "WITH failed AS ("
            " UPDATE promotion_pin SET unpinned_at = now(), unpinned_by = 'rolled back',"
            " rolled_back_reason = %(reason)s"
            " WHERE queue = %(queue)s AND unpinned_at IS NULL AND uri = %(failed)s"
            " AND EXISTS (SELECT 1 FROM queue WHERE name = %(queue)s"
            "             AND pinned_uri = %(failed)s)"
            " RETURNING id"
            "), reopened AS ("
            " UPDATE promotion_pin SET unpinned_at = NULL, unpinned_by = NULL"
            " WHERE id = (SELECT max(p.id) FROM promotion_pin p, failed f"
            "             WHERE p.queue = %(queue)s AND p.id < f.id"
            "               AND p.uri = %(previous)s::text)"
            " RETURNING id"
            "), restored AS ("
            " UPDATE queue SET pinned_uri = %(previous)s, pinned_request_id = %(request_id)s,"
            " pinned_by = %(by)s, pinned_reason = %(why)s, pinned_at = %(at)s,"
            " version = version + 1, updated_at = now()"
            " WHERE name = %(queue)s AND pinned_uri = %(failed)s"
            " AND EXISTS (SELECT 1 FROM failed)"
            f" RETURNING {_QUEUE_COLUMNS}"
            f") SELECT {_QUEUE_COLUMNS} FROM restored",
            {**key, "failed": failed_uri, "reason": reason, "previous": before.pinned_uri,
             "request_id": before.pinned_request_id, "by": before.pinned_by,
             "why": before.pinned_reason, "at": before.pinned_at}, key=key)
        return _queue(row) if row is not None else None

    async def problem(self, queue: str) -> PromotionProblem | None:
        row = await self._fetch_one(
            "SELECT queue, reason, at FROM promotion_problem WHERE queue = %(queue)s",
            {"queue": queue}, key={"queue": queue})
        return PromotionProblem(**row) if row is not None else None

    async def problems(self, queues: list[str]) -> dict[str, PromotionProblem]:
        """The promotion problems of these queues (or scopes), by name."""
        rows = await self._fetch_all(
            "SELECT queue, reason, at FROM promotion_problem WHERE queue = ANY(%(queues)s)",
            {"queues": queues}, key={"queue": "*"})
        return {row["queue"]: PromotionProblem(**row) for row in rows}

    async def set_problem(self, queue: str, reason: str) -> None:
        """Say why the queue's promotion ref is not where it belongs (kept until cleared;
        its time is the first failure's while the reason stays the same)."""
        await self._fetch_one(
            "INSERT INTO promotion_problem (queue, reason) VALUES (%(queue)s, %(reason)s)"
            " ON CONFLICT (queue) DO UPDATE SET reason = EXCLUDED.reason,"
            " at = CASE WHEN promotion_problem.reason = EXCLUDED.reason"
            "           THEN promotion_problem.at ELSE now() END RETURNING queue",
            {"queue": queue, "reason": reason[:2000]}, key={"queue": queue})

    async def clear_problem(self, queue: str) -> None:
        await self._fetch_one(
            "DELETE FROM promotion_problem WHERE queue = %(queue)s RETURNING queue",
            {"queue": queue}, key={"queue": queue})

    async def to_settle(self) -> list[str]:
        """The queues whose promotion ref the sweeper keeps settling: every pinned one,
        and every one with a promotion problem (two small indexed reads)."""
        rows = await self._fetch_all(
            "SELECT name AS queue FROM queue WHERE pinned_uri IS NOT NULL"
            " UNION SELECT queue FROM promotion_problem", {}, key={"queue": "*"})
        return [row["queue"] for row in rows]

    async def history(self, queue: str, limit: int = 20) -> list[Pin]:
        """The queue's pins, newest first."""
        rows = await self._fetch_all(
            f"SELECT {_PIN_COLUMNS} FROM promotion_pin WHERE queue = %(queue)s"
            " ORDER BY id DESC LIMIT %(limit)s", {"queue": queue, "limit": limit},
            key={"queue": queue})
        return [Pin(**row) for row in rows]
