"""FactStore: immutable validation facts, first fact wins (design §2)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from store._base import Row, Store
from store.entities import Order, ValidationFact, check_degree, project_of

_COLUMNS = "queue, uri, project, degree, request_id, created_at, attempts, flaky"
# first fact wins: one per Request, and one green per commit
_INSERT = (
    "INSERT INTO validation_fact (queue, uri, project, degree, request_id)"
    " VALUES (%(queue)s, %(uri)s, %(project)s, %(degree)s, %(request_id)s)"
    f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}"
)
# a commit's answer: the fact of its newest Request that has one
_NEWEST_OF_COMMIT = (
    f"SELECT {_COLUMNS} FROM validation_fact"
    " WHERE queue = %(queue)s AND uri = %(uri)s AND project = %(project)s"
    " ORDER BY request_rank(request_id) DESC LIMIT 1"
)

# the green facts of a queue (or a project's scope) by their Requests' order (request_rank:
# ingest order, then the place of a backfilled commit after its head), on index
# validation_fact_green_rank for a queue, validation_fact_project_green_rank for a scope
# (each query names its project's predicate literally, so a prepared plan still uses it)
_GREEN = f"SELECT {_COLUMNS} FROM validation_fact WHERE queue = %(queue)s AND degree = 0"
_OF_QUEUE = " AND project = ''"
_OF_SCOPE = " AND project <> '' AND project = %(project)s"
_NEWEST_FIRST = " ORDER BY request_rank(request_id) DESC LIMIT %(limit)s"
_BELOW_NEWEST_FIRST = (" AND request_rank(request_id) < %(rank)s::bigint[]"
                       " ORDER BY request_rank(request_id) DESC LIMIT %(limit)s")
_ABOVE_OLDEST_FIRST = (" AND request_rank(request_id) > %(rank)s::bigint[]"
                       " ORDER BY request_rank(request_id) ASC LIMIT %(limit)s")
_GREEN_QUERIES = {
    (scope, order): _GREEN + (_OF_SCOPE if scope else _OF_QUEUE) + order
    for scope in (False, True)
    for order in (_NEWEST_FIRST, _BELOW_NEWEST_FIRST, _ABOVE_OLDEST_FIRST)
}


def _fact(row: Row) -> ValidationFact:
    return ValidationFact(**row)


def _project(queue: str, project: str | None) -> str:
    """The facts' project: as given, else the queue's (a scope's project; '' for a
    queue)."""
    return project_of(queue) if project is None else project


class FactStore(Store):
    """Facts are only ever inserted; the database refuses UPDATE, DELETE and TRUNCATE."""

    entity = "validation_fact"

    async def get(self, queue: str, uri: str, project: str | None = None) -> ValidationFact:
        """The commit's answer: the fact of its newest Request that has one (a commit
        validated again keeps every earlier fact). NotFound means "not validated", which
        is never green."""
        key = {"queue": queue, "uri": uri, "project": _project(queue, project)}
        return _fact(await self._get_row(_NEWEST_OF_COMMIT, key, key=key))

    async def of_request(self, queue: str, request_id: str,
                         project: str | None = None) -> ValidationFact | None:
        """The fact a Request recorded; None when it has none."""
        key = {"queue": queue, "request_id": request_id,
               "project": _project(queue, project)}
        row = await self._fetch_one(
            f"SELECT {_COLUMNS} FROM validation_fact WHERE queue = %(queue)s"
            " AND request_id = %(request_id)s AND project = %(project)s", key, key=key)
        return _fact(row) if row is not None else None

    async def of_commit(self, queue: str, uri: str,
                        project: str | None = None) -> list[ValidationFact]:
        """Every fact of the commit, newest Request first."""
        key = {"queue": queue, "uri": uri, "project": _project(queue, project)}
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM validation_fact"
            " WHERE queue = %(queue)s AND uri = %(uri)s AND project = %(project)s"
            " ORDER BY request_rank(request_id) DESC",
            key, key=key)
        return [_fact(row) for row in rows]

    async def create(
        self, queue: str, uri: str, *, degree: float, request_id: str,
        project: str | None = None
    ) -> ValidationFact:
        """Record a fact; AlreadyExists if one is present (it stays as it is), NotFound if
        the request does not exist, ValueError for a degree outside [0, 1]."""
        key = {"queue": queue, "uri": uri, "project": _project(queue, project)}
        return _fact(
            await self._insert(
                _INSERT,
                {**key, "degree": check_degree(degree), "request_id": request_id},
                key=key,
                request_key={"queue": queue, "id": request_id},
            )
        )

    async def get_or_create(
        self, queue: str, uri: str, *, degree: float, request_id: str,
        project: str | None = None
    ) -> ValidationFact:
        """The stored fact, recording this one first if there is none. The caller compares
        the returned fact's request id with its own: a fact is never overwritten (the
        Request's own fact, else the commit's green fact that refused this one)."""
        key = {"queue": queue, "uri": uri, "project": _project(queue, project)}
        row = await self._fetch_one(
            _INSERT,
            {**key, "degree": check_degree(degree), "request_id": request_id},
            key=key,
            request_key={"queue": queue, "id": request_id},
        )
        if row is not None:
            return _fact(row)
        return await self.of_request(queue, request_id, project) or await self.get(
            queue, uri, project)

    async def green_older_than(self, queue: str, rank: Order | None,
                               limit: int) -> list[ValidationFact]:
        """The queue's green facts whose Request sorts before ``rank`` (a
        `store.request_order`; None: all), newest first; at most ``limit``."""
        project = project_of(queue)
        params = {"queue": queue, "rank": list(rank) if rank else None, "limit": limit,
                  "project": project}
        rows = await self._fetch_all(
            _GREEN_QUERIES[bool(project),
                           _NEWEST_FIRST if rank is None else _BELOW_NEWEST_FIRST],
            params, key={"queue": queue})
        return [_fact(row) for row in rows]

    async def green_newer_than(self, queue: str, rank: Order,
                               limit: int) -> list[ValidationFact]:
        """The queue's green facts whose Request sorts after ``rank``, oldest first (the
        branch's history order); at most ``limit``."""
        project = project_of(queue)
        rows = await self._fetch_all(_GREEN_QUERIES[bool(project), _ABOVE_OLDEST_FIRST],
                                     {"queue": queue, "rank": list(rank), "limit": limit,
                                      "project": project},
                                     key={"queue": queue})
        return [_fact(row) for row in rows]

    async def of_requests(self, queue: str, request_ids: Sequence[str],
                          project: str | None = None) -> dict[str, ValidationFact]:
        """The facts these Requests recorded, by request id (one read of the primary
        key; a Request without a fact is absent)."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM validation_fact WHERE queue = %(queue)s"
            " AND request_id = ANY(%(ids)s) AND project = %(project)s",
            {"queue": queue, "ids": list(request_ids), "project": _project(queue, project)},
            key={"queue": queue})
        return {row["request_id"]: _fact(row) for row in rows}

    async def signal_times(self, queue: str, window_s: float, limit: int) -> list[float]:
        """Seconds from ingest to fact (the Request's creation to its fact's) of the queue's
        whole-repo facts recorded in the last ``window_s`` seconds for heads and commits
        validated again — what a person waits for; a backfill is not — newest ``limit``
        (index validation_fact_recent, then each Request by its primary key)."""
        rows = await self._fetch_all(
            "SELECT EXTRACT(EPOCH FROM f.created_at - r.created_at)::float8 AS seconds"
            " FROM validation_fact f JOIN request r ON r.queue = f.queue AND r.id = f.request_id"
            " WHERE f.queue = %(queue)s AND f.project = queue_project(f.queue)"
            " AND f.created_at >= now() - make_interval(secs => %(window)s)"
            " AND r.kind IN ('head', 'retry')"
            " ORDER BY f.created_at DESC LIMIT %(limit)s",
            {"queue": queue, "window": window_s, "limit": limit}, key={"queue": queue})
        return [max(0.0, float(row["seconds"])) for row in rows]

    async def flaky_counts(self, queue: str, window_s: float,
                           since: datetime) -> tuple[int, int, datetime]:
        """Flaky facts of the queue recorded in the last ``window_s`` seconds and since
        ``since``, and the database's time now (one range of validation_fact_recent)."""
        row = await self._fetch_one(
            "SELECT count(*) FILTER (WHERE flaky"
            "        AND created_at >= now() - make_interval(secs => %(window)s)) AS recent,"
            " count(*) FILTER (WHERE flaky AND created_at >= %(since)s) AS since, now() AS now"
            " FROM validation_fact WHERE queue = %(queue)s AND created_at >= LEAST("
            " %(since)s::timestamptz, now() - make_interval(secs => %(window)s))",
            {"queue": queue, "window": window_s, "since": since}, key={"queue": queue})
        assert row is not None
        return int(row["recent"]), int(row["since"]), row["now"]

    async def flaky_before(self, queue: str, margin_s: float) -> tuple[datetime, int]:
        """A time ``margin_s`` seconds ago and the flaky facts of the queue recorded before
        it: the settled part of a running total (a fact's time is its transaction's start,
        so with a margin longer than any transaction none is still to come before it).
        Reads every fact of the queue before then: call it rarely."""
        row = await self._fetch_one(
            "SELECT now() - make_interval(secs => %(margin)s) AS cutoff,"
            " (SELECT count(*) FROM validation_fact WHERE queue = %(queue)s AND flaky"
            "   AND created_at < now() - make_interval(secs => %(margin)s)) AS flaky",
            {"queue": queue, "margin": margin_s}, key={"queue": queue})
        assert row is not None
        return row["cutoff"], int(row["flaky"])
