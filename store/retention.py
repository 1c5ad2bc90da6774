"""RetentionStore: the reads and deletes of bounded history (issue 25; design §12).

What to keep is decided by `streams.stages.retention_rules` (pure) for the Requests and
everything deleted with them; this store reads what that choice needs and deletes what it
chose. For the other tables the rule is the WHERE clause of one statement (below). Every
read is an index range or a key lookup, never a scan holding locks; every delete is one
batch of keys found by a read, in one statement and one short transaction
(`lock_timeout` `LOCK_TIMEOUT`, so it neither waits long for the pipeline's locks nor
keeps the pipeline waiting behind it), whose WHERE re-checks what must still hold. A
batch that meets a lock is skipped (None) and found again by the next round.

The Requests of a queue are walked by request_rank (index request_rank_idx), oldest
first; a batch deletes its Requests with their facts, project answers, plans, builds,
command builds and ingest mappings in one statement (children and parents together, so
no foreign key is ever left dangling). Facts and answers are deleted under the
transaction-local `stovepipe.pruning` setting, the one way past their immutability
trigger (migration 0019).

What each of the other tables' rule deletes (all older than the cutoff):

- notification (walked by id): sent or given up before the cutoff;
- parked_message (by id): parked before the cutoff;
- promotion_pin (by id): unpinned before the cutoff (the current pin stays);
- webhook_delivery (by its received_at index): received before the cutoff;
- commit_info (by its created_at index, migration 0019): described before the cutoff,
  and neither a Request's ingest mapping nor a culprit search names the commit;
- culprit_search (per queue): as the rules choose (ended before the cutoff, and not the
  queue's newest), re-checked;
- greenness_change (per queue): before the bound the rules give.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, LiteralString

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from store._base import Row, Store
from store.entities import Request, split_scope
from store.pins import PIN_LOCK_TRY
from store.requests import _COLUMNS as _REQUEST_COLUMNS
from store.requests import _request

LOCK_TIMEOUT = "1s"  # how long a batch waits for a row lock before it is skipped
TERMINAL = ("superseded", "succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Family:
    """A queue and the scopes of its projects (`<queue>#<project>`): what refers across
    queues (a Request's project answers and its projects' Requests) stays in one."""

    queue: str
    scopes: tuple[str, ...] = ()

    @property
    def members(self) -> tuple[str, ...]:
        return (self.queue, *self.scopes)

    @property
    def projects(self) -> tuple[str, ...]:
        return tuple(split_scope(scope)[1] or "" for scope in self.scopes)


@dataclass(frozen=True)
class QueueRefs:
    name: str
    last_green_request_id: str | None
    latest_request_id: str | None
    pinned_request_id: str | None


@dataclass(frozen=True)
class SearchRefs:
    queue: str
    red_request_id: str
    green_request_id: str | None
    culprit_request_id: str | None
    probes: tuple[str, ...]
    state: str
    ended_at: datetime | None
    newest: bool  # the queue's newest search (its red Request sorts last)


@dataclass(frozen=True)
class Holdings:
    """The rows of a family that name Requests (by id) a gate or a person may still need
    (the project answers naming their sources are read per batch: `answered`)."""

    queues: tuple[QueueRefs, ...] = ()
    project_pins: tuple[str, ...] = ()
    newest_facts: tuple[str, ...] = ()  # the newest N facts of each member queue
    searches: tuple[SearchRefs, ...] = ()
    open_plans: tuple[str, ...] = ()  # Requests whose project plan is not decided
    project_bookmarks: tuple[str, ...] = ()  # each project's newest green answer's Request
    streaks: tuple[str, ...] = ()  # each member queue's newest greenness change's Request


@dataclass(frozen=True)
class WalkRow:
    key: tuple[Any, ...]  # where the next read starts after it
    at: datetime  # the time the walk goes by: past the cutoff, the walk ends
    doomed: bool  # the table's rule says it goes


# --- the Requests' batch ---------------------------------------------------------------

_DOOMED = """
WITH doomed AS (
    SELECT r.queue, r.id, r.uri FROM request r
     WHERE r.queue = %(queue)s AND r.id = ANY(%(ids)s)
       AND r.state IN ('superseded', 'succeeded', 'failed', 'cancelled')
       AND (r.verdict IS NULL OR r.recorded)
       AND r.created_at < %(cutoff)s AND r.updated_at < %(cutoff)s
       AND NOT EXISTS (SELECT 1 FROM queue q WHERE q.name = r.queue
                        AND r.id IN (q.last_green_request_id, q.latest_request_id,
                                     q.pinned_request_id))
       AND NOT EXISTS (SELECT 1 FROM project_state p WHERE p.pinned_request_id = r.id)
"""
# (a dry run deletes no answer, so only the delete re-checks that none names the Request)
_DELETE_REQUESTS = _DOOMED + """
       AND NOT EXISTS (SELECT 1 FROM project_answer a
                        WHERE a.queue = split_part(r.queue, '#', 1)
                          AND a.project = queue_project(r.queue)
                          AND a.source_request_id = r.id)
     FOR UPDATE OF r SKIP LOCKED
), facts AS (
    DELETE FROM validation_fact f USING doomed d
     WHERE f.queue = d.queue AND f.request_id = d.id RETURNING 1
), answers AS (
    DELETE FROM project_answer a USING doomed d
     WHERE a.queue = d.queue AND a.request_id = d.id RETURNING 1
), plans AS (
    DELETE FROM request_plan p USING doomed d
     WHERE p.queue = d.queue AND p.request_id = d.id RETURNING 1
), builds AS (
    DELETE FROM build b USING doomed d
     WHERE b.queue = d.queue AND b.request_id = d.id RETURNING b.id
), command_builds AS (
    DELETE FROM command_build c USING builds b
     WHERE c.build_id = b.id AND c.status IN ('succeeded', 'failed', 'cancelled') RETURNING 1
), uris AS (
    DELETE FROM request_uri u USING doomed d
     WHERE u.queue = d.queue AND u.uri = d.uri AND u.request_id = d.id RETURNING 1
), requests AS (
    DELETE FROM request r USING doomed d WHERE r.queue = d.queue AND r.id = d.id RETURNING 1
)
SELECT (SELECT count(*) FROM requests) AS request,
       (SELECT count(*) FROM facts) AS validation_fact,
       (SELECT count(*) FROM answers) AS project_answer,
       (SELECT count(*) FROM plans) AS request_plan,
       (SELECT count(*) FROM builds) AS build,
       (SELECT count(*) FROM command_builds) AS command_build,
       (SELECT count(*) FROM uris) AS request_uri
"""
_COUNT_REQUESTS = _DOOMED + """
)
SELECT (SELECT count(*) FROM doomed) AS request,
       (SELECT count(*) FROM validation_fact f JOIN doomed d
         ON f.queue = d.queue AND f.request_id = d.id) AS validation_fact,
       (SELECT count(*) FROM project_answer a JOIN doomed d
         ON a.queue = d.queue AND a.request_id = d.id) AS project_answer,
       (SELECT count(*) FROM request_plan p JOIN doomed d
         ON p.queue = d.queue AND p.request_id = d.id) AS request_plan,
       (SELECT count(*) FROM build b JOIN doomed d
         ON b.queue = d.queue AND b.request_id = d.id) AS build,
       (SELECT count(*) FROM command_build c JOIN build b ON c.build_id = b.id
         JOIN doomed d ON b.queue = d.queue AND b.request_id = d.id
         WHERE c.status IN ('succeeded', 'failed', 'cancelled')) AS command_build,
       (SELECT count(*) FROM request_uri u JOIN doomed d
         ON u.queue = d.queue AND u.uri = d.uri AND u.request_id = d.id) AS request_uri
"""

# --- the other tables: (walk, delete, count), each rule in its WHERE ----------------------

_WALKS: dict[str, tuple[LiteralString, LiteralString, LiteralString]] = {
    "notification": (
        "SELECT id, created_at AS at, (done_at < %(cutoff)s) IS TRUE AS doomed"
        " FROM notification WHERE id > %(k0)s ORDER BY id LIMIT %(limit)s",
        "DELETE FROM notification WHERE id = ANY(%(k0)s) AND done_at < %(cutoff)s",
        "SELECT count(*) FROM notification WHERE id = ANY(%(k0)s) AND done_at < %(cutoff)s"),
    "parked_message": (
        "SELECT id, parked_at AS at, parked_at < %(cutoff)s AS doomed"
        " FROM parked_message WHERE id > %(k0)s ORDER BY id LIMIT %(limit)s",
        "DELETE FROM parked_message WHERE id = ANY(%(k0)s) AND parked_at < %(cutoff)s",
        "SELECT count(*) FROM parked_message WHERE id = ANY(%(k0)s)"
        " AND parked_at < %(cutoff)s"),
    "promotion_pin": (
        "SELECT id, pinned_at AS at, (unpinned_at < %(cutoff)s) IS TRUE AS doomed"
        " FROM promotion_pin WHERE id > %(k0)s ORDER BY id LIMIT %(limit)s",
        "DELETE FROM promotion_pin WHERE id = ANY(%(k0)s) AND unpinned_at < %(cutoff)s",
        "SELECT count(*) FROM promotion_pin WHERE id = ANY(%(k0)s)"
        " AND unpinned_at < %(cutoff)s"),
    "webhook_delivery": (
        "SELECT received_at, provider, delivery_id, received_at AS at,"
        " received_at < %(cutoff)s AS doomed FROM webhook_delivery"
        " WHERE (received_at, provider, delivery_id) > (%(k0)s, %(k1)s, %(k2)s)"
        " ORDER BY received_at, provider, delivery_id LIMIT %(limit)s",
        "DELETE FROM webhook_delivery WHERE (provider, delivery_id) IN"
        " (SELECT * FROM unnest(%(k1)s::text[], %(k2)s::text[]))"
        " AND received_at < %(cutoff)s",
        "SELECT count(*) FROM webhook_delivery WHERE (provider, delivery_id) IN"
        " (SELECT * FROM unnest(%(k1)s::text[], %(k2)s::text[]))"
        " AND received_at < %(cutoff)s"),
    "commit_info": (
        "SELECT created_at, queue, uri, created_at AS at, created_at < %(cutoff)s AS doomed"
        " FROM commit_info WHERE (created_at, queue, uri) > (%(k0)s, %(k1)s, %(k2)s)"
        " ORDER BY created_at, queue, uri LIMIT %(limit)s",
        "DELETE FROM commit_info c WHERE (c.queue, c.uri) IN"
        " (SELECT * FROM unnest(%(k1)s::text[], %(k2)s::text[]))" + """
           AND c.created_at < %(cutoff)s
           AND NOT EXISTS (SELECT 1 FROM request_uri u
                            WHERE u.queue = c.queue AND u.uri = c.uri)
           AND NOT EXISTS (SELECT 1 FROM culprit_search s
                            WHERE s.queue = c.queue AND c.uri = ANY(s.commits))""",
        "SELECT count(*) FROM commit_info c WHERE (c.queue, c.uri) IN"
        " (SELECT * FROM unnest(%(k1)s::text[], %(k2)s::text[]))" + """
           AND c.created_at < %(cutoff)s
           AND NOT EXISTS (SELECT 1 FROM request_uri u
                            WHERE u.queue = c.queue AND u.uri = c.uri)
           AND NOT EXISTS (SELECT 1 FROM culprit_search s
                            WHERE s.queue = c.queue AND c.uri = ANY(s.commits))"""),
}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# where each walk starts: before every key
_WALK_START: dict[str, tuple[Any, ...]] = {
    "notification": (0,), "parked_message": (0,), "promotion_pin": (0,),
    "webhook_delivery": (_EPOCH, "", ""), "commit_info": (_EPOCH, "", ""),
}
WALKED_TABLES = tuple(_WALKS)

_SEARCHES_DOOMED = """
 WHERE s.queue = %(queue)s AND s.red_request_id = ANY(%(ids)s)
   AND s.state <> 'bisecting' AND s.ended_at < %(cutoff)s
   AND s.red_request_id <> (SELECT red_request_id FROM culprit_search
                             WHERE queue = %(queue)s
                             ORDER BY request_rank(red_request_id) DESC LIMIT 1)
"""
_DELETE_SEARCHES = "DELETE FROM culprit_search s" + _SEARCHES_DOOMED
_COUNT_SEARCHES = "SELECT count(*) AS n FROM culprit_search s" + _SEARCHES_DOOMED
_DELETE_GREENNESS = """
DELETE FROM greenness_change g
 WHERE (g.queue, g.at, g.request_id) IN (
       SELECT queue, at, request_id FROM greenness_change
        WHERE queue = %(queue)s AND at < %(before)s ORDER BY at LIMIT %(limit)s)
"""


class RetentionStore(Store):
    entity = "retention"

    async def now(self) -> datetime:
        """The database's time: every cutoff is taken on its clock."""
        row = await self._fetch_one("SELECT now() AS now", {}, key={})
        assert row is not None
        return row["now"]  # type: ignore[no-any-return]

    async def families(self) -> list[Family]:
        """Every queue that has a row, with its projects' scopes, by name."""
        rows = await self._fetch_all("SELECT name FROM queue ORDER BY name", {}, key={})
        scopes: dict[str, list[str]] = {}
        for row in rows:
            queue, project = split_scope(row["name"])
            members = scopes.setdefault(queue, [])
            if project is not None:
                members.append(row["name"])
        return [Family(queue, tuple(members)) for queue, members in scopes.items()]

    async def open_plans(self) -> dict[str, tuple[str, ...]]:
        """The Requests whose project plan is not decided yet, by queue (index
        request_plan_open: only those rows)."""
        rows = await self._fetch_all(
            "SELECT queue, request_id FROM request_plan WHERE NOT completed", {}, key={})
        found: dict[str, list[str]] = {}
        for row in rows:
            found.setdefault(row["queue"], []).append(row["request_id"])
        return {queue: tuple(ids) for queue, ids in found.items()}

    async def holdings(self, family: Family, *, keep_newest: int,
                       open_plans: Sequence[str] = ()) -> Holdings:
        """What the family's rows name (one index read or key lookup per kind)."""
        members = list(family.members)
        params = {"queue": family.queue, "members": members, "n": keep_newest,
                  "projects": list(family.projects)}
        key = {"queue": family.queue}
        queues = await self._fetch_all(
            "SELECT name, last_green_request_id, latest_request_id, pinned_request_id"
            " FROM queue WHERE name = ANY(%(members)s)", params, key=key)
        pins = await self._fetch_all(
            "SELECT pinned_request_id FROM project_state WHERE queue = %(queue)s"
            " AND pinned_request_id IS NOT NULL", params, key=key)
        newest = await self._fetch_all(
            "SELECT f.request_id FROM unnest(%(members)s::text[]) AS m(queue)"
            " CROSS JOIN LATERAL (SELECT request_id FROM validation_fact"
            "   WHERE queue = m.queue ORDER BY created_at DESC LIMIT %(n)s) AS f",
            params, key=key)
        searches = await self._fetch_all(
            "SELECT s.queue, s.red_request_id, s.green_request_id, s.culprit_request_id,"
            " s.probes, s.state, s.ended_at, s.red_request_id = n.red AS newest"
            " FROM culprit_search s CROSS JOIN LATERAL ("
            "   SELECT red_request_id AS red FROM culprit_search WHERE queue = s.queue"
            "   ORDER BY request_rank(red_request_id) DESC LIMIT 1) AS n"
            " WHERE s.queue = ANY(%(members)s)", params, key=key)
        bookmarks = await self._fetch_all(
            "SELECT g.request_id FROM unnest(%(projects)s::text[]) AS x(project)"
            " CROSS JOIN LATERAL (SELECT request_id FROM project_answer"
            "   WHERE queue = %(queue)s AND project = x.project AND degree = 0"
            "   ORDER BY request_rank(request_id) DESC LIMIT 1) AS g", params, key=key)
        streaks = await self._fetch_all(
            "SELECT g.request_id FROM unnest(%(members)s::text[]) AS m(queue)"
            " CROSS JOIN LATERAL (SELECT request_id FROM greenness_change"
            "   WHERE queue = m.queue ORDER BY at DESC LIMIT 1) AS g", params, key=key)
        return Holdings(
            queues=tuple(QueueRefs(**row) for row in queues),
            project_pins=tuple(row["pinned_request_id"] for row in pins),
            newest_facts=tuple(row["request_id"] for row in newest),
            searches=tuple(SearchRefs(**{**row, "probes": tuple(row["probes"])})
                           for row in searches),
            open_plans=tuple(open_plans),
            project_bookmarks=tuple(row["request_id"] for row in bookmarks),
            streaks=tuple(row["request_id"] for row in streaks))

    async def answered(self, scope: str, request_ids: Sequence[str]) -> list[tuple[str, str]]:
        """(source, Request) of every project answer naming one of these Requests of the
        project's ``scope`` as its source (index project_answer_source)."""
        queue, project = split_scope(scope)
        if project is None or not request_ids:
            return []
        rows = await self._fetch_all(
            "SELECT source_request_id, request_id FROM project_answer"
            " WHERE queue = %(queue)s AND project = %(project)s"
            " AND source_request_id = ANY(%(ids)s)",
            {"queue": queue, "project": project, "ids": list(request_ids)},
            key={"queue": queue})
        return [(row["source_request_id"], row["request_id"]) for row in rows]

    async def requests_after(self, queue: str, rank: Sequence[int] | None,
                             limit: int) -> list[tuple[Request, list[int]]]:
        """The queue's Requests that sort after ``rank`` (None: from the first), in
        request_rank order, with their ranks; at most ``limit``."""
        rows = await self._fetch_all(
            f"SELECT {_REQUEST_COLUMNS}, request_rank(id) AS rank FROM request"
            " WHERE queue = %(queue)s AND request_rank(id) > %(rank)s::bigint[]"
            " ORDER BY request_rank(id) LIMIT %(limit)s",
            {"queue": queue, "rank": list(rank or (0, 0, 0)), "limit": limit},
            key={"queue": queue})
        return [(_request({k: v for k, v in row.items() if k != "rank"}), list(row["rank"]))
                for row in rows]

    async def delete_requests(self, family: Family, queue: str, ids: Sequence[str],
                              cutoff: datetime, *, dry_run: bool = False
                              ) -> dict[str, int] | None:
        """Delete (or count, ``dry_run``) these Requests of ``queue`` with everything
        deleted with them, by table — those that still hold as old, settled and named by
        no bookmark, latest head or pin when the statement runs. None: skipped, a pin of
        the family being taken, or a lock met."""
        params = {"queue": queue, "ids": list(ids), "cutoff": cutoff}
        if dry_run:
            row = await self._fetch_one(_COUNT_REQUESTS, params, key={"queue": queue})
            assert row is not None
            return {table: int(n) for table, n in row.items()}
        async with self._source.connection() as conn:
            try:
                async with conn.transaction():
                    await _batch_settings(conn, pruning=True)
                    # a pin is taken under this lock (store.pins): while one is, its
                    # fact may be the one it names, so the batch waits for the next round
                    cursor = await conn.execute(PIN_LOCK_TRY, {"family": family.queue})
                    taken = await cursor.fetchone()
                    if not (taken and taken[0]):
                        return None
                    async with conn.cursor(row_factory=dict_row) as cur:
                        await cur.execute(_DELETE_REQUESTS, params)
                        counts = await cur.fetchone()
            except psycopg.errors.LockNotAvailable:
                return None
        assert counts is not None
        return {table: int(n) for table, n in counts.items()}

    async def delete_searches(self, queue: str, red_ids: Sequence[str], cutoff: datetime,
                              *, dry_run: bool = False) -> int | None:
        """Delete (or count) these ended searches of ``queue`` that still ended before the
        cutoff and are not its newest."""
        params = {"queue": queue, "ids": list(red_ids), "cutoff": cutoff}
        if dry_run:
            row = await self._fetch_one(_COUNT_SEARCHES, params, key={"queue": queue})
            assert row is not None
            return int(row["n"])
        return await self._delete(_DELETE_SEARCHES, params)

    async def greenness_bounds(self, queue: str,
                               before: datetime) -> tuple[datetime | None, datetime | None]:
        """(the newest change of ``queue`` before ``before``, its newest green change)."""
        row = await self._fetch_one(
            "SELECT (SELECT max(at) FROM greenness_change WHERE queue = %(queue)s"
            "        AND at < %(before)s) AS newest_before,"
            " (SELECT max(at) FROM greenness_change WHERE queue = %(queue)s"
            "        AND greenness = 'green') AS newest_green",
            {"queue": queue, "before": before}, key={"queue": queue})
        assert row is not None
        return row["newest_before"], row["newest_green"]

    async def delete_greenness(self, queue: str, before: datetime, limit: int, *,
                               dry_run: bool = False) -> int | None:
        """Delete (or count, all of them) up to ``limit`` of the queue's greenness changes
        before ``before``."""
        params = {"queue": queue, "before": before, "limit": limit}
        if dry_run:
            row = await self._fetch_one(
                "SELECT count(*) AS n FROM greenness_change WHERE queue = %(queue)s"
                " AND at < %(before)s", params, key={"queue": queue})
            assert row is not None
            return int(row["n"])
        return await self._delete(_DELETE_GREENNESS, params)

    async def walk(self, table: str, after: tuple[Any, ...] | None, cutoff: datetime,
                   limit: int) -> list[WalkRow]:
        """The next rows of one of `WALKED_TABLES` after ``after`` (None: from the
        start), with whether its rule dooms each."""
        read = _WALKS[table][0]
        start = after if after is not None else _WALK_START[table]
        params: dict[str, Any] = {"cutoff": cutoff, "limit": limit,
                                  **{f"k{i}": v for i, v in enumerate(start)}}
        rows = await self._fetch_all(read, params, key={"table": table})
        width = len(start)
        return [WalkRow(tuple(list(row.values())[:width]), row["at"], bool(row["doomed"]))
                for row in rows]

    async def delete_walked(self, table: str, keys: Sequence[tuple[Any, ...]],
                            cutoff: datetime, *, dry_run: bool = False) -> int | None:
        """Delete (or count) these rows of ``table`` (keys from `walk`) that its rule
        still dooms."""
        if not keys:
            return 0
        columns = list(zip(*keys, strict=True))
        params: dict[str, Any] = {"cutoff": cutoff,
                                  **{f"k{i}": list(c) for i, c in enumerate(columns)}}
        _, delete, count = _WALKS[table]
        if dry_run:
            row = await self._fetch_one(count, params, key={"table": table})
            assert row is not None
            return int(next(iter(row.values())))
        return await self._delete(delete, params)

    async def _delete(self, statement: LiteralString,
                      params: Mapping[str, Any]) -> int | None:
        async with self._source.connection() as conn:
            try:
                async with conn.transaction():
                    await _batch_settings(conn, pruning=False)
                    cursor = await conn.execute(statement, params)
                    return cursor.rowcount
            except psycopg.errors.LockNotAvailable:
                return None

    # --- the workers' rounds -----------------------------------------------------------

    async def claim_round(self, every_s: float) -> datetime | None:
        """Start a round if the last one started at least ``every_s`` seconds ago (or none
        ever did): its start time; None when it is not due."""
        row = await self._fetch_one(
            "INSERT INTO retention_round AS r (name) VALUES ('prune')"
            " ON CONFLICT (name) DO UPDATE SET started_at = now(), finished_at = NULL"
            "  WHERE r.started_at <= now() - make_interval(secs => %(every)s)"
            " RETURNING started_at", {"every": every_s}, key={"name": "prune"})
        return row["started_at"] if row is not None else None

    async def finish_round(self, cutoff: datetime, deleted: Mapping[str, int],
                           past_retention: Mapping[str, int]) -> None:
        await self._fetch_one(
            "UPDATE retention_round SET finished_at = now(), cutoff = %(cutoff)s,"
            " deleted = %(deleted)s, past_retention = %(past)s WHERE name = 'prune'"
            " RETURNING name",
            {"cutoff": cutoff, "deleted": Jsonb(dict(deleted)),
             "past": Jsonb(dict(past_retention))}, key={"name": "prune"})

    async def last_round(self) -> Row | None:
        """The newest round: started_at, finished_at (None while it runs), cutoff, deleted
        and past_retention by table."""
        return await self._fetch_one(
            "SELECT started_at, finished_at, cutoff, deleted, past_retention"
            " FROM retention_round WHERE name = 'prune'", {}, key={"name": "prune"})


async def _batch_settings(conn: AsyncConnection[Any], *, pruning: bool) -> None:
    """This transaction's: a short lock wait, and (only for the Requests' batch, which
    deletes facts and answers) the setting their immutability trigger lets through."""
    await conn.execute("SELECT set_config('lock_timeout', %(t)s, true)"
                       + (", set_config('stovepipe.pruning', 'on', true)" if pruning else ""),
                       {"t": LOCK_TIMEOUT})
