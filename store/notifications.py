"""NotificationStore: the outbox of commit statuses and transition alerts, and the queues'
staleness (migration 0006).

Rows are inserted by the pipeline's own state changes (`store.steps`: admission, settling
a cancelled build, a fact and the greenness it decides) and here (a reconciler's failure,
staleness), always ON CONFLICT DO NOTHING on a key naming the cause, so a redelivery adds
nothing. The sender claims due rows with a lease (`claim_due`), posts them and records
the result; rows of one (queue, channel, stream) go out in the order they were written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, LiteralString

from psycopg.types.json import Jsonb

from store._base import Store
from store.entities import REQUEST_ID_PREFIX

ERROR_LIMIT = 500  # characters of a delivery error kept on the row


@dataclass(frozen=True)
class Notification:
    """One row of the outbox: ``event`` is what the state change wrote (see the keys in
    `store.steps`), ``attempts`` counts claims including the current one."""

    id: int
    queue: str
    key: str
    channel: str
    stream: str
    event: dict[str, Any]
    attempts: int
    created_at: datetime
    outcome: str | None = None
    last_error: str = ""


@dataclass(frozen=True)
class StaleRule:
    """A queue judged for staleness: ``threshold`` seconds, alerts to ``channels``."""

    queue: str
    threshold: float
    channels: Sequence[str]


@dataclass(frozen=True)
class QueueLag:
    """What the gauges show for one queue."""

    queue: str
    bookmark_age: float | None  # seconds since the bookmarked fact; None: never green
    heads_since_green: int  # Requests ingested after the bookmarked one


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


_COLUMNS = "id, queue, key, channel, stream, event, attempts, created_at, outcome, last_error"

# a reconciler failed an admitted Request: its pending status must not stay pending
_ADD_STATUS = _sql("""
INSERT INTO notification (queue, key, channel, stream, event)
SELECT %(queue)s, 'status:' || ch || ':' || %(request_id)s || ':final', ch, %(request_id)s,
       jsonb_build_object('kind', 'status', 'state', %(state)s::text,
                          'request_id', %(request_id)s::text, 'uri', %(uri)s::text,
                          'description', %(description)s::text, 'at', now())
  FROM unnest(%(channels)s::text[]) AS ch
ON CONFLICT (queue, key) DO NOTHING
""")

_CLAIM = _sql("""
WITH due AS (
    SELECT n.queue, n.key FROM notification n
     WHERE n.done_at IS NULL AND n.due_at <= now()
       AND NOT EXISTS (SELECT 1 FROM notification e
                        WHERE e.queue = n.queue AND e.channel = n.channel
                          AND e.stream = n.stream AND e.id < n.id AND e.done_at IS NULL)
     ORDER BY n.due_at, n.id
     LIMIT %(limit)s
       FOR UPDATE OF n SKIP LOCKED
)
UPDATE notification n
   SET due_at = now() + %(lease)s * interval '1 second', attempts = n.attempts + 1
  FROM due WHERE n.queue = due.queue AND n.key = due.key
RETURNING n.id, n.queue, n.key, n.channel, n.stream, n.event, n.attempts, n.created_at,
          n.outcome, n.last_error
""")

_POSTPONE = _sql("""
UPDATE notification n
   SET due_at = now() + p.delay * interval '1 second', attempts = n.attempts - 1
  FROM unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(delays)s::float8[])
       AS p(id, attempts, delay)
 WHERE n.id = p.id AND n.attempts = p.attempts AND n.attempts > 0 AND n.done_at IS NULL
RETURNING n.id
""")

# Judged per configured queue. The bookmark is behind the branch from when both a newer
# head (the Request right after the bookmarked one: ids are consecutive per queue) and
# the bookmark's fact existed; stale once that is longer ago than the threshold. Going
# stale and the alert are one statement: a queue already stale at this bookmark changes
# nothing, so concurrent judges and restarts alert once. A moved bookmark resets it.
_JUDGE_STALENESS = _sql("""
WITH rule AS (
    SELECT * FROM unnest(%(queues)s::text[], %(thresholds)s::float8[]) AS r(queue, threshold)
), judged AS (
    SELECT q.name AS queue, q.last_green_request_id AS bookmark,
           q.last_green_uri AS bookmark_uri, q.latest_request_id AS latest,
           GREATEST(n.created_at, f.created_at) AS behind_since,
           n.id IS NOT NULL AND now() - GREATEST(n.created_at, f.created_at)
               > r.threshold * interval '1 second' AS stale
      FROM rule r JOIN queue q ON q.name = r.queue
      LEFT JOIN validation_fact f
             ON f.queue = q.name AND f.uri = q.last_green_uri
            AND f.project = queue_project(q.name)
      LEFT JOIN request n
             ON n.queue = q.name
            AND n.id = %(prefix)s || q.name || '/'
                       || (COALESCE(request_seq(q.last_green_request_id), 0) + 1)
), freshened AS (
    UPDATE queue_health h SET stale = false, updated_at = now()
      FROM judged j
     WHERE h.queue = j.queue AND h.stale AND NOT j.stale
    RETURNING h.queue
), went_stale AS (
    INSERT INTO queue_health AS h (queue, stale, stale_bookmark, stale_count)
    SELECT queue, true, bookmark, 1 FROM judged WHERE stale
    ON CONFLICT (queue) DO UPDATE
       SET stale = true, stale_bookmark = EXCLUDED.stale_bookmark,
           stale_count = h.stale_count + 1, updated_at = now()
     WHERE NOT h.stale OR h.stale_bookmark IS DISTINCT FROM EXCLUDED.stale_bookmark
    RETURNING queue, stale_count
), alerts AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT w.queue, 'alert:' || c.channel || ':stale:' || w.stale_count, c.channel, 'alerts',
           jsonb_build_object('kind', 'alert', 'event', 'stale', 'queue', w.queue,
                              'request_id', j.bookmark, 'uri', j.bookmark_uri,
                              'latest_request_id', j.latest,
                              'behind_since', j.behind_since, 'at', now())
      FROM went_stale w JOIN judged j ON j.queue = w.queue
      JOIN unnest(%(alert_queues)s::text[], %(alert_channels)s::text[]) AS c(queue, channel)
        ON c.queue = w.queue
    ON CONFLICT (queue, key) DO NOTHING
    RETURNING queue
)
SELECT (SELECT count(*) FROM went_stale) AS went_stale,
       (SELECT count(*) FROM freshened) AS freshened
""")

_LAGS = _sql("""
SELECT q.name AS queue,
       EXTRACT(EPOCH FROM now() - f.created_at)::float8 AS bookmark_age,
       COALESCE(request_seq(q.latest_request_id), 0)
           - COALESCE(request_seq(q.last_green_request_id), 0) AS heads_since_green
  FROM queue q
  LEFT JOIN validation_fact f
         ON f.queue = q.name AND f.uri = q.last_green_uri
            AND f.project = queue_project(q.name)
 WHERE q.name = ANY(%(queues)s::text[])
""")


class NotificationStore(Store):
    entity = "notification"

    async def add_status(self, queue: str, request_id: str, uri: str, *, state: str,
                         description: str, channels: Sequence[str]) -> None:
        """The final commit status of a Request that ends without a fact (once: a later
        fact's status for the same Request is the same key and adds nothing)."""
        if not channels:
            return
        await self._fetch_all(_ADD_STATUS + " RETURNING 1", {
            "queue": queue, "request_id": request_id, "uri": uri, "state": state,
            "description": description, "channels": list(channels)},
            key={"queue": queue, "request_id": request_id})

    async def add_alert(self, queue: str, key: str, event: Mapping[str, object], *,
                        channels: Sequence[str]) -> None:
        """An alert to each of ``channels``, once per ``key`` (a second call with the same
        key adds nothing)."""
        if not channels:
            return
        await self._fetch_all(
            "INSERT INTO notification (queue, key, channel, stream, event)"
            " SELECT %(queue)s, 'alert:' || ch || ':' || %(key)s, ch, 'alerts',"
            " %(event)s::jsonb || jsonb_build_object('at', now())"
            " FROM unnest(%(channels)s::text[]) AS ch"
            " ON CONFLICT (queue, key) DO NOTHING RETURNING 1",
            {"queue": queue, "key": key, "event": Jsonb(dict(event)),
             "channels": list(channels)}, key={"queue": queue, "key": key})

    async def claim_due(self, limit: int, lease: float) -> list[Notification]:
        """Up to ``limit`` rows due now whose stream has nothing earlier unsent, leased for
        ``lease`` seconds (another sender sees them again only after that)."""
        rows = await self._fetch_all(_CLAIM, {"limit": limit, "lease": lease}, key={})
        return sorted((Notification(**row) for row in rows), key=lambda n: n.id)

    async def mark_sent(self, notification: Notification) -> None:
        await self._fetch_all(
            "UPDATE notification SET done_at = now(), outcome = 'sent'"
            " WHERE queue = %(queue)s AND key = %(key)s AND done_at IS NULL RETURNING 1",
            {"queue": notification.queue, "key": notification.key},
            key={"queue": notification.queue, "key": notification.key})

    async def retry_later(self, notification: Notification, delay: float,
                          error: str) -> None:
        """Due again in ``delay`` seconds — unless another sender claimed it since (its
        lease ran out), whose result then counts."""
        await self._fetch_all(
            "UPDATE notification SET due_at = now() + %(delay)s * interval '1 second',"
            " last_error = %(error)s"
            " WHERE queue = %(queue)s AND key = %(key)s AND attempts = %(attempts)s"
            " AND done_at IS NULL RETURNING 1",
            {"queue": notification.queue, "key": notification.key, "delay": delay,
             "error": error[:ERROR_LIMIT], "attempts": notification.attempts},
            key={"queue": notification.queue, "key": notification.key})

    async def postpone(self, rows: Sequence[tuple[Notification, float]]) -> None:
        """Hand claimed rows back, each due again after its delay (seconds), as if never
        claimed: the claim's attempt is not counted — unless another sender claimed the
        row since (its lease ran out). One statement."""
        if not rows:
            return
        await self._fetch_all(_POSTPONE, {
            "ids": [row.id for row, _ in rows], "attempts": [row.attempts for row, _ in rows],
            "delays": [delay for _, delay in rows]}, key={})

    async def give_up(self, notification: Notification, error: str) -> None:
        await self._fetch_all(
            "UPDATE notification SET done_at = now(), outcome = 'given_up',"
            " last_error = %(error)s"
            " WHERE queue = %(queue)s AND key = %(key)s AND done_at IS NULL RETURNING 1",
            {"queue": notification.queue, "key": notification.key,
             "error": error[:ERROR_LIMIT]},
            key={"queue": notification.queue, "key": notification.key})

    async def list_for_queue(self, queue: str) -> list[Notification]:
        """Every row of ``queue``, oldest first (operators, tests)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM notification WHERE queue = %(queue)s ORDER BY id",
            {"queue": queue}, key={"queue": queue})
        return [Notification(**row) for row in rows]

    async def judge_staleness(self, rules: Sequence[StaleRule]) -> tuple[int, int]:
        """Mark the queues of ``rules`` stale (with one alert per channel) or fresh again;
        returns how many went stale and how many fresh."""
        if not rules:
            return 0, 0
        pairs = [(rule.queue, channel) for rule in rules for channel in rule.channels]
        row = await self._fetch_one(_JUDGE_STALENESS, {
            "queues": [r.queue for r in rules], "thresholds": [r.threshold for r in rules],
            "alert_queues": [q for q, _ in pairs], "alert_channels": [c for _, c in pairs],
            "prefix": REQUEST_ID_PREFIX}, key={})
        assert row is not None
        return int(row["went_stale"]), int(row["freshened"])

    async def lags(self, queues: Sequence[str]) -> list[QueueLag]:
        """Bookmark age and heads since green of ``queues`` (those with a row)."""
        rows = await self._fetch_all(_LAGS, {"queues": list(queues)}, key={})
        return [QueueLag(**row) for row in rows]

    async def greenness_window(self, queue: str, window_s: float,
                               limit: int = 10_000) -> GreennessWindow:
        """The queue's greenness over the last ``window_s`` seconds: what it was when the
        window began and how it changed since (the greenness_change primary key)."""
        rows = await self._fetch_all(_GREENNESS_WINDOW,
                                     {"queue": queue, "window": window_s, "limit": limit},
                                     key={"queue": queue})
        before = next((row["greenness"] for row in rows if row["before"]), None)
        return GreennessWindow(window_s, before, [(row["offset_s"], row["greenness"])
                                                  for row in rows if not row["before"]])

    async def red_streak(self, queue: str) -> tuple[datetime, float] | None:
        """When the queue's current red streak began and how many seconds ago, by the
        database's clock; None while it is green (or was never judged)."""
        row = await self._fetch_one(_RED_STREAK, {"queue": queue}, key={"queue": queue})
        if row is None or row["since"] is None:
            return None
        return row["since"], max(0.0, float(row["seconds"]))


@dataclass(frozen=True)
class GreennessWindow:
    """A queue's greenness over a window of ``window_s`` seconds."""

    window_s: float
    before: str | None  # green or red when the window began; None: not judged yet
    changes: list[tuple[float, str]]  # (seconds after the window began, greenness)


_GREENNESS_WINDOW = _sql("""
(SELECT 0::float8 AS offset_s, greenness, true AS before FROM greenness_change
  WHERE queue = %(queue)s AND at < now() - make_interval(secs => %(window)s)
  ORDER BY at DESC LIMIT 1)
UNION ALL
(SELECT EXTRACT(EPOCH FROM at - (now() - make_interval(secs => %(window)s)))::float8,
        greenness, false FROM greenness_change
  WHERE queue = %(queue)s AND at >= now() - make_interval(secs => %(window)s)
  ORDER BY at LIMIT %(limit)s)
""")

# the first red change after the newest green one: a red streak's start
_RED_STREAK = _sql("""
SELECT min(at) AS since, EXTRACT(EPOCH FROM now() - min(at))::float8 AS seconds
  FROM greenness_change
 WHERE queue = %(queue)s AND greenness = 'red'
   AND at > COALESCE((SELECT at FROM greenness_change
                       WHERE queue = %(queue)s AND greenness = 'green'
                       ORDER BY at DESC LIMIT 1), '-infinity')
""")
