"""Old history for the retention tests and `bench/prune_bench.py`: rows as the pipeline
writes them, made in bulk by the database (INSERT … SELECT over generate_series), dated
``age`` ago and one second apart.

`old_history(conn, queue, first, count, age)` writes Requests ``first``..``first+count-1``
of ``queue`` (`request/<queue>/<k>`): every tenth superseded (no build, no fact), every
tenth after it failed red, the rest green; each with its ingest mapping, and each built
one with its build, its fact, a sent commit status and, for one in five, a command build.
About 4.9 rows per Request. It sets the queue's counter, latest head and bookmark (the
newest green one) only where they are behind, so live traffic continues after it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

ROWS_PER_REQUEST = 4.9  # request, mapping, and for 9 in 10: build, fact, notification


def old_history(conn: psycopg.Connection[Any], queue: str, *, first: int, count: int,
                age: timedelta) -> dict[str, int]:
    """Write the history (see the module); the rows written, by table."""
    params = {"queue": queue, "first": first, "last": first + count - 1,
              "age": age, "tag": f"{queue}/{first}"}
    written: dict[str, int] = {}
    for table, statement in _STATEMENTS:
        written[table] = conn.execute(statement, params).rowcount  # type: ignore[arg-type]
    for statement in _QUEUE:
        conn.execute(statement, params)  # type: ignore[arg-type]
    return written


_SERIES = """
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS k,
       LATERAL (SELECT now() - %(age)s::interval
                       - (%(last)s::bigint - k) * interval '1 second' AS t,
                       CASE k %% 10 WHEN 0 THEN 'superseded' WHEN 1 THEN 'failed'
                                   ELSE 'succeeded' END AS state,
                       'request/' || %(queue)s || '/' || k AS id,
                       'fake://old/' || %(tag)s || '/' || k AS uri) AS x
"""
_BUILT = " WHERE x.state <> 'superseded'"
_STATEMENTS: tuple[tuple[str, Any], ...] = (
    ("request", """
INSERT INTO request (queue, id, uri, state, build_strategy, verdict, recorded, created_at,
                     updated_at, kind, attempt, loop_seen_at)
SELECT %(queue)s, x.id, x.uri, x.state,
       CASE WHEN x.state = 'superseded' THEN NULL ELSE 'full' END,
       CASE x.state WHEN 'superseded' THEN NULL WHEN 'failed' THEN 'red' ELSE 'green' END,
       true, x.t, x.t, 'head', CASE WHEN x.state = 'superseded' THEN 0 ELSE 1 END, x.t
""" + _SERIES),
    ("request_uri", """
INSERT INTO request_uri (queue, uri, request_id, created_at)
SELECT %(queue)s, x.uri, x.id, x.t""" + _SERIES),
    ("build", """
INSERT INTO build (queue, id, request_id, status, verdict, created_at, updated_at,
                   loop_seen_at, attempt)
SELECT %(queue)s, 'old-' || md5(x.id), x.id, x.state,
       CASE x.state WHEN 'failed' THEN 'red' ELSE 'green' END, x.t, x.t, x.t, 1
""" + _SERIES + _BUILT),
    ("validation_fact", """
INSERT INTO validation_fact (queue, uri, project, degree, request_id, created_at)
SELECT %(queue)s, x.uri, '', CASE x.state WHEN 'failed' THEN 1 ELSE 0 END, x.id, x.t
""" + _SERIES + _BUILT),
    ("notification", """
INSERT INTO notification (queue, key, channel, stream, event, created_at, due_at, done_at,
                          outcome, attempts)
SELECT %(queue)s, 'status:github_status:' || x.id || ':final', 'github_status', x.id,
       jsonb_build_object('kind', 'status', 'request_id', x.id), x.t, x.t, x.t, 'sent', 1
""" + _SERIES + _BUILT),
    ("command_build", """
INSERT INTO command_build (build_id, queue, request_id, trigger_key, host, work_dir,
                           status, reason, created_at, heartbeat_at, finished_at)
SELECT 'old-' || md5(x.id), %(queue)s, x.id, x.id || '#1@old', 'old-host', '/old/builds',
       x.state, 'exit_code', x.t, x.t, x.t
""" + _SERIES + _BUILT + " AND k %% 5 = 2"),
)
_QUEUE = ("""
INSERT INTO queue_counter (queue, value) VALUES (%(queue)s, %(last)s)
    ON CONFLICT (queue) DO UPDATE SET value = GREATEST(queue_counter.value, EXCLUDED.value)
""", "INSERT INTO queue (name) VALUES (%(queue)s) ON CONFLICT (name) DO NOTHING", """
UPDATE queue q SET latest_request_id = 'request/' || %(queue)s || '/' || %(last)s
 WHERE q.name = %(queue)s AND (q.latest_request_id IS NULL
       OR request_rank(q.latest_request_id) < request_rank('request/' || %(queue)s || '/'
                                                          || %(last)s))
""", """
UPDATE queue q SET last_green_request_id = f.request_id, last_green_uri = f.uri
  FROM (SELECT request_id, uri FROM validation_fact
         WHERE queue = %(queue)s AND project = '' AND degree = 0
           AND request_rank(request_id) BETWEEN ARRAY[%(first)s::bigint, 0, 1]
                                            AND ARRAY[%(last)s::bigint, 0, 1]
         ORDER BY request_rank(request_id) DESC LIMIT 1) AS f
 WHERE q.name = %(queue)s AND (q.last_green_request_id IS NULL
       OR request_rank(q.last_green_request_id) < request_rank(f.request_id))
""")
