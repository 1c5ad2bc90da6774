"""The pipeline's state changes of design §5, each one statement that checks its own
conditions as it writes, plus the joined reads the stages start from.

Each change used to be a read, a decision in Python and a compare-and-set on the version
read, often in a transaction of several statements. Here the conditions the decision
relied on are part of the write, so a change that still holds commits in one round trip,
and one that no longer holds writes nothing and says so (the caller re-reads and decides
again, exactly as after a lost compare-and-set). Under READ COMMITTED an UPDATE that waits
for a concurrent writer re-checks its WHERE clause against the row that writer committed,
which is what makes a condition in the WHERE clause as strong as a compare-and-set.

Several entities change in one statement through data-modifying WITH clauses; a clause
that must not run unless another did names that clause in its WHERE (``EXISTS (SELECT 1
FROM x)``), which also orders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import LiteralString

from store._base import Row, Store
from store.builds import _build
from store.entities import (
    REQUEST_ID_PREFIX,
    Build,
    BuildStatus,
    BuildStrategy,
    Queue,
    Request,
    RequestState,
    ValidationFact,
    check_degree,
)
from store.requests import _request

_REQUEST = (
    "r.queue, r.id, r.uri, r.state, r.build_strategy, r.base_uri, r.version, r.created_at,"
    " r.updated_at, r.loop_token,"
    " EXTRACT(EPOCH FROM now() - r.loop_seen_at)::float8 AS loop_age"
)
_QUEUE = (
    "q.name AS q_name, q.last_green_uri AS q_last_green_uri,"
    " q.last_green_request_id AS q_last_green_request_id,"
    " q.in_flight_count AS q_in_flight_count, q.latest_request_id AS q_latest_request_id,"
    " q.version AS q_version, q.created_at AS q_created_at, q.updated_at AS q_updated_at"
)
_BUILD = (
    "b.queue AS b_queue, b.id AS b_id, b.request_id AS b_request_id, b.status AS b_status,"
    " b.version AS b_version, b.created_at AS b_created_at, b.updated_at AS b_updated_at,"
    " b.loop_token AS b_loop_token,"
    " EXTRACT(EPOCH FROM now() - b.loop_seen_at)::float8 AS b_loop_age,"
    " EXTRACT(EPOCH FROM now() - b.created_at)::float8 AS b_age"
)
_FACT = "queue, uri, project, degree, request_id, created_at"

_REQUEST_KEYS = ("queue", "id", "uri", "state", "build_strategy", "base_uri", "version",
                 "created_at", "updated_at", "loop_token", "loop_age")


def _prefixed(row: Row, prefix: str) -> Row | None:
    """The columns of ``row`` named ``prefix``+name, by name; None for a missed join."""
    picked = {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
    return None if all(v is None for v in picked.values()) else picked


def _request_of(row: Row) -> Request:
    return _request({k: row[k] for k in _REQUEST_KEYS})


@dataclass(frozen=True)
class Minted:
    """What ingest's find-or-mint did for one head."""

    request_id: str
    state: RequestState  # the Request's state when the statement ran
    minted: bool  # a new Request was created for the head by this call


@dataclass(frozen=True)
class Settled:
    """What settling a build did: the build's stored (write-once) status, and the Request
    if this call stamped its outcome (None: another build or a reconciler did first, or
    the stored status is not terminal yet)."""

    build_status: BuildStatus
    request: Request | None


@dataclass(frozen=True)
class Recorded:
    """What recording a fact did: the stored fact (first fact wins, so it may be another
    Request's) and whether this fact's Request holds the bookmark now."""

    fact: ValidationFact | None  # None: a concurrent writer's fact is not visible yet
    holds_bookmark: bool


class StepStore(Store):
    entity = "request"

    # --- joined reads ----------------------------------------------------------------

    async def request_with_queue(self, queue: str, request_id: str) -> tuple[Request,
                                                                            Queue | None]:
        """The Request and its queue's row (None if the queue has no row yet), in one
        read. NotFound if the Request is absent."""
        row = await self._get_row(
            f"SELECT {_REQUEST}, {_QUEUE} FROM request r"
            " LEFT JOIN queue q ON q.name = r.queue"
            " WHERE r.queue = %(queue)s AND r.id = %(id)s",
            {"queue": queue, "id": request_id},
            key={"queue": queue, "id": request_id},
        )
        fields = _prefixed(row, "q_")
        return _request_of(row), Queue(**fields) if fields is not None else None

    async def request_with_first_build(self, queue: str,
                                       request_id: str) -> tuple[Request, str | None]:
        """The Request and the id of its first build (None if it has none), in one read.
        NotFound if the Request is absent."""
        row = await self._get_row(
            f"SELECT {_REQUEST}, (SELECT b.id FROM build b"
            "  WHERE b.queue = r.queue AND b.request_id = r.id"
            "  ORDER BY b.created_at, b.id LIMIT 1) AS first_build_id"
            " FROM request r WHERE r.queue = %(queue)s AND r.id = %(id)s",
            {"queue": queue, "id": request_id},
            key={"queue": queue, "id": request_id},
        )
        return _request_of(row), row["first_build_id"]

    async def build_with_request(self, queue: str, build_id: str) -> tuple[Build, Request]:
        """The build and its Request, in one read. NotFound if the build is absent."""
        row = await self._get_row(
            f"SELECT {_REQUEST}, {_BUILD} FROM build b"
            " JOIN request r ON r.queue = b.queue AND r.id = b.request_id"
            " WHERE b.queue = %(queue)s AND b.id = %(id)s",
            {"queue": queue, "id": build_id},
            key={"queue": queue, "id": build_id},
        )
        build = _prefixed(row, "b_")
        assert build is not None
        return _build(build), _request_of(row)

    # --- state changes ---------------------------------------------------------------

    async def find_or_mint(self, queue: str, uri: str) -> Minted:
        """ingest: the Request of head ``uri``, minting one when the head has none (or
        only a superseded one, or a mapping whose Request was never written: a head the
        branch came back to must be validated after all), and the queue's latest pointer
        moved forward to it. One statement: counter, Request, mapping and latest commit
        together. The caller holds the queue's lock (`Transaction.lock_queue`), so no two
        of these run at once for a queue, and the statement's snapshot, taken after the
        lock, sees every earlier one."""
        row = await self._fetch_one(_FIND_OR_MINT, {
            "queue": queue, "uri": uri, "prefix": f"{REQUEST_ID_PREFIX}{queue}/"},
            key={"queue": queue, "uri": uri})
        assert row is not None  # either the head's Request or a new one
        return Minted(row["id"], RequestState(row["state"]), row["minted"])

    async def admit(self, request: Request, *, strategy: BuildStrategy,
                    base_uri: str | None, max_concurrent: int,
                    last_green_request_id: str | None,
                    status_channels: Sequence[str] = ()) -> Request | None:
        """process: take a slot of the Request's queue and move the Request to
        `processing` with its build strategy, in one statement — only if the Request is
        still the one read (same version, `accepted`), the queue has a free slot, no newer
        Request is the queue's latest, and the bookmark the strategy was decided from
        (``last_green_request_id``) has not moved. None when any of that no longer holds:
        nothing was written; read again and decide again. With ``status_channels`` the
        Request's `pending` commit status joins the outbox in the same statement."""
        if (strategy is BuildStrategy.INCREMENTAL) != (base_uri is not None):
            raise ValueError(f"an incremental build needs a base URI and a full one takes "
                             f"none (got {strategy}, base_uri={base_uri!r})")
        row = await self._fetch_one(_ADMIT, {
            "queue": request.queue, "id": request.id, "version": request.version,
            "seq": request.seq, "max": max_concurrent, "last_green": last_green_request_id,
            "strategy": strategy.value, "base_uri": base_uri,
            "status_channels": list(status_channels)},
            key={"queue": request.queue, "id": request.id})
        return _request(row) if row is not None else None

    async def settle(self, build: Build, status: BuildStatus,
                     status_channels: Sequence[str] = ()) -> Settled:
        """buildsignal: store a terminal ``status`` on the build (write-once: a terminal
        status stored first stays), and if the build's Request is still `processing`,
        stamp the outcome the stored status projects to and release the queue's slot —
        one statement, so the first terminal build of a Request settles it and every later
        one finds it settled. A Request settled `cancelled` gets no fact: with
        ``status_channels`` its final commit status (`error`) joins the outbox here."""
        if not status.is_terminal:
            raise ValueError(f"settling needs a terminal status, got {status}")
        row = await self._fetch_one(_SETTLE, {
            "queue": build.queue, "id": build.id, "request_id": build.request_id,
            "status": status.value, "status_channels": list(status_channels)},
            key={"queue": build.queue, "id": build.id})
        assert row is not None
        settled = _request_of(row) if row["id"] is not None else None
        return Settled(BuildStatus(row["build_status"]), settled)

    async def record_fact(self, queue: str, uri: str, *, request_id: str,
                          degree: float, status_channels: Sequence[str] = (),
                          alert_channels: Sequence[str] = ()) -> Recorded:
        """record: write the fact for ``uri`` (first fact wins: an existing one stays) and,
        when the stored fact is this Request's and green, move the bookmark to it unless
        it already names a newer Request — one statement. ``holds_bookmark`` is whether
        this Request holds the bookmark afterwards (moved now or by an earlier delivery).

        A newly written fact also decides the queue's greenness, if its Request is the
        newest (by ingest order) with a fact — a late fact of an older commit changes
        nothing — and puts in the outbox, in the same statement, the Request's final
        commit status (``status_channels``) and, when the greenness changed, an alert
        (``alert_channels``): red on any change to red, including a queue's first fact;
        green on a change from red. A redelivery writes no fact, so it adds nothing."""
        row = await self._fetch_one(_RECORD_FACT, {
            "queue": queue, "uri": uri, "project": "", "degree": check_degree(degree),
            "request_id": request_id, "status_channels": list(status_channels),
            "alert_channels": list(alert_channels)},
            key={"queue": queue, "uri": uri, "project": ""},
            request_key={"queue": queue, "id": request_id})
        if row is None:
            return Recorded(None, False)
        fact = ValidationFact(**{k: row[k] for k in _FACT.split(", ")})
        holder = row["moved_to"] or row["holder_before"]
        return Recorded(fact, holder == request_id)


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


_FIND_OR_MINT = _sql("""
WITH mapped AS (
    SELECT m.request_id, r.state
      FROM request_uri m LEFT JOIN request r ON r.queue = m.queue AND r.id = m.request_id
     WHERE m.queue = %(queue)s AND m.uri = %(uri)s
), reused AS (
    SELECT request_id AS id, state FROM mapped
     WHERE state IS NOT NULL AND state <> 'superseded'
), drawn AS (
    INSERT INTO queue_counter (queue, value)
    SELECT %(queue)s, 1 WHERE NOT EXISTS (SELECT 1 FROM reused)
    ON CONFLICT (queue) DO UPDATE SET value = queue_counter.value + 1
    RETURNING value
), minted AS (
    INSERT INTO request (queue, id, uri)
    SELECT %(queue)s, %(prefix)s || value, %(uri)s FROM drawn
    RETURNING id, state
), mapping AS (
    INSERT INTO request_uri (queue, uri, request_id)
    SELECT %(queue)s, %(uri)s, id FROM minted
    ON CONFLICT (queue, uri) DO UPDATE SET request_id = EXCLUDED.request_id
    RETURNING request_id
), chosen AS (
    SELECT id, state, true AS minted FROM minted
    UNION ALL
    SELECT id, state, false FROM reused
), latest AS (
    INSERT INTO queue (name, latest_request_id)
    SELECT %(queue)s, id FROM chosen
    ON CONFLICT (name) DO UPDATE
       SET latest_request_id = EXCLUDED.latest_request_id,
           version = queue.version + 1, updated_at = now()
     WHERE queue.latest_request_id IS NULL
        OR request_seq(queue.latest_request_id) < request_seq(EXCLUDED.latest_request_id)
    RETURNING name
)
SELECT id, state, minted FROM chosen
""")

_ADMIT = _sql(f"""
WITH candidate AS (
    SELECT id FROM request
     WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s
       AND state = 'accepted'
       FOR UPDATE
), slot AS (
    UPDATE queue SET in_flight_count = in_flight_count + 1,
                     version = version + 1, updated_at = now()
     WHERE name = %(queue)s
       AND EXISTS (SELECT 1 FROM candidate)
       AND in_flight_count < %(max)s
       AND (latest_request_id IS NULL OR request_seq(latest_request_id) <= %(seq)s)
       AND last_green_request_id IS NOT DISTINCT FROM %(last_green)s
    RETURNING name
), admitted AS (
    UPDATE request r SET state = 'processing', build_strategy = %(strategy)s,
                         base_uri = %(base_uri)s, version = r.version + 1,
                         updated_at = now()
     WHERE r.queue = %(queue)s AND r.id = %(id)s AND EXISTS (SELECT 1 FROM slot)
    RETURNING {_REQUEST}
), pending AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT a.queue, 'status:' || ch || ':' || a.id || ':pending', ch, a.id,
           jsonb_build_object('kind', 'status', 'state', 'pending', 'request_id', a.id,
                              'uri', a.uri, 'at', now())
      FROM admitted a CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT * FROM admitted
""")

_SETTLE = _sql(f"""
WITH stamped AS (
    UPDATE build SET status = %(status)s, version = version + 1, updated_at = now()
     WHERE queue = %(queue)s AND id = %(id)s AND status IN ('accepted', 'running')
    RETURNING status
), stored AS (
    SELECT status FROM stamped
    UNION ALL
    SELECT status FROM build
     WHERE queue = %(queue)s AND id = %(id)s AND NOT EXISTS (SELECT 1 FROM stamped)
), settled AS (
    UPDATE request r SET state = s.status, version = r.version + 1, updated_at = now()
      FROM stored s
     WHERE r.queue = %(queue)s AND r.id = %(request_id)s AND r.state = 'processing'
       AND s.status IN ('succeeded', 'failed', 'cancelled')
    RETURNING {_REQUEST}
), released AS (
    UPDATE queue SET in_flight_count = in_flight_count - 1,
                     version = version + 1, updated_at = now()
     WHERE name = %(queue)s AND EXISTS (SELECT 1 FROM settled)
    RETURNING name
), ended_without_fact AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT s.queue, 'status:' || ch || ':' || s.id || ':final', ch, s.id,
           jsonb_build_object('kind', 'status', 'state', 'error', 'request_id', s.id,
                              'uri', s.uri, 'description', 'its build was cancelled',
                              'at', now())
      FROM settled s CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
     WHERE s.state = 'cancelled'
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT (SELECT status FROM stored) AS build_status,
       (SELECT count(*) FROM released) AS slots_released, r.*
  FROM (SELECT 1) AS one LEFT JOIN settled r ON true
""")

_RECORD_FACT = _sql(f"""
WITH inserted AS (
    INSERT INTO validation_fact (queue, uri, project, degree, request_id)
    VALUES (%(queue)s, %(uri)s, %(project)s, %(degree)s, %(request_id)s)
    ON CONFLICT (queue, uri, project) DO NOTHING
    RETURNING {_FACT}
), fact AS (
    SELECT {_FACT} FROM inserted
    UNION ALL
    SELECT {_FACT} FROM validation_fact
     WHERE queue = %(queue)s AND uri = %(uri)s AND project = %(project)s
       AND NOT EXISTS (SELECT 1 FROM inserted)
), moved AS (
    UPDATE queue SET last_green_uri = %(uri)s, last_green_request_id = %(request_id)s,
                     version = version + 1, updated_at = now()
     WHERE name = %(queue)s
       AND EXISTS (SELECT 1 FROM fact WHERE request_id = %(request_id)s AND degree = 0)
       AND (last_green_request_id IS NULL
            OR request_seq(last_green_request_id) < request_seq(%(request_id)s))
    RETURNING last_green_request_id
), health AS (
    INSERT INTO queue_health AS h (queue, greenness, decided_request_id, transitions)
    SELECT queue, CASE WHEN degree = 0 THEN 'green' ELSE 'red' END, request_id, 1
      FROM inserted
    ON CONFLICT (queue) DO UPDATE
       SET previous_greenness = h.greenness, greenness = EXCLUDED.greenness,
           decided_request_id = EXCLUDED.decided_request_id,
           transitions = h.transitions
               + CASE WHEN h.greenness IS DISTINCT FROM EXCLUDED.greenness THEN 1 ELSE 0 END,
           updated_at = now()
     WHERE h.decided_request_id IS NULL
        OR request_seq(h.decided_request_id) < request_seq(EXCLUDED.decided_request_id)
    RETURNING greenness, previous_greenness, transitions
), final_status AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT i.queue, 'status:' || ch || ':' || i.request_id || ':final', ch, i.request_id,
           jsonb_build_object('kind', 'status',
                              'state', CASE WHEN i.degree = 0 THEN 'success' ELSE 'failure' END,
                              'request_id', i.request_id, 'uri', i.uri,
                              'degree', i.degree, 'at', i.created_at)
      FROM inserted i CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
    ON CONFLICT (queue, key) DO NOTHING
), alert AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT i.queue, 'alert:' || ch || ':greenness:' || h.transitions, ch, 'alerts',
           jsonb_build_object('kind', 'alert', 'event', h.greenness, 'queue', i.queue,
                              'request_id', i.request_id, 'uri', i.uri,
                              'previous', h.previous_greenness, 'at', i.created_at)
      FROM inserted i CROSS JOIN health h CROSS JOIN unnest(%(alert_channels)s::text[]) AS ch
     WHERE h.greenness IS DISTINCT FROM h.previous_greenness
       AND (h.previous_greenness IS NOT NULL OR h.greenness = 'red')
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT f.*, (SELECT last_green_request_id FROM moved) AS moved_to,
       (SELECT last_green_request_id FROM queue WHERE name = %(queue)s) AS holder_before
  FROM fact f
""")
