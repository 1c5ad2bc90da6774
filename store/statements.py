"""The SQL of the pipeline's state changes (`store.steps`): one statement each, which
checks its own conditions as it writes. Several entities change in one statement through
data-modifying WITH clauses; a clause that must not run unless another did names that
clause in its WHERE (``EXISTS (SELECT 1 FROM x)``), which also orders them. The order of
two Requests is request_rank (migration 0010).
"""

from __future__ import annotations

from typing import LiteralString

REQUEST_COLUMNS = (
    "r.queue, r.id, r.uri, r.state, r.build_strategy, r.base_uri, r.version, r.created_at,"
    " r.updated_at, r.kind, r.attempt, r.verdict, r.reason, r.unvalidated_retries,"
    " r.red_reruns, r.loop_token,"
    " EXTRACT(EPOCH FROM now() - r.loop_seen_at)::float8 AS loop_age, r.nonce,"
    " COALESCE(EXTRACT(EPOCH FROM r.attempt_due_at - now())::float8, 0) AS attempt_due_in,"
    " r.recorded, r.unvalidated_cause, r.revalidations"
)
QUEUE_COLUMNS = (
    "q.name AS q_name, q.last_green_uri AS q_last_green_uri,"
    " q.last_green_request_id AS q_last_green_request_id,"
    " q.in_flight_count AS q_in_flight_count, q.latest_request_id AS q_latest_request_id,"
    " q.version AS q_version, q.created_at AS q_created_at, q.updated_at AS q_updated_at,"
    " q.backfill_in_flight AS q_backfill_in_flight, q.pinned_uri AS q_pinned_uri,"
    " q.pinned_request_id AS q_pinned_request_id, q.pinned_by AS q_pinned_by,"
    " q.pinned_reason AS q_pinned_reason, q.pinned_at AS q_pinned_at"
)
BUILD_COLUMNS = (
    "b.queue AS b_queue, b.id AS b_id, b.request_id AS b_request_id, b.status AS b_status,"
    " b.version AS b_version, b.created_at AS b_created_at, b.updated_at AS b_updated_at,"
    " b.attempt AS b_attempt, b.verdict AS b_verdict, b.reason AS b_reason,"
    " b.loop_token AS b_loop_token,"
    " EXTRACT(EPOCH FROM now() - b.loop_seen_at)::float8 AS b_loop_age,"
    " EXTRACT(EPOCH FROM now() - b.created_at)::float8 AS b_age, b.started_at AS b_started_at,"
    " EXTRACT(EPOCH FROM now() - b.started_at)::float8 AS b_run_age"
)
FACT_COLUMNS = "queue, uri, project, degree, request_id, created_at, attempts, flaky"

REQUEST_KEYS = ("queue", "id", "uri", "state", "build_strategy", "base_uri", "version",
                 "created_at", "updated_at", "kind", "attempt", "verdict", "reason",
                 "unvalidated_retries", "red_reruns", "loop_token", "loop_age", "nonce",
                 "attempt_due_in", "recorded", "unvalidated_cause", "revalidations")


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


# The commit's lock: FIND_OR_MINT, VALIDATE_AGAIN and MINT_BACKFILL each take it, in a
# statement of its own in the same transaction, *before* they read the commit's newest
# Request. So the statement's snapshot starts after the previous holder committed: it
# never re-checks a row a concurrent writer moved against a row it read before (which
# made a second retry see no Request at all, and a probe mint a second live Request).
# Lock order everywhere: the commit's lock, then the ingest lease, the mapping and
# Request rows, then the queue row. The second half of the key hashes the schema, the
# queue and the commit, so deployments sharing a server never wait for each other.
COMMIT_LOCK_NAMESPACE = 0x53545643  # "STVC"
LOCK_COMMIT = _sql("""
SELECT pg_advisory_xact_lock(%(namespace)s,
                             hashtext(current_schema() || '/' || %(queue)s || chr(31) || %(uri)s))
""")

FIND_OR_MINT = _sql("""
WITH lease AS (
    SELECT 1 FROM ingest_lease
     WHERE queue = %(queue)s AND holder = %(holder)s::text
       FOR UPDATE
), held AS (
    SELECT 1 FROM lease
    UNION ALL
    SELECT 1 WHERE %(holder)s::text IS NULL
), mapped AS (
    SELECT m.request_id, r.state, r.verdict, r.nonce, r.unvalidated_cause, r.revalidations,
           r.updated_at
      FROM request_uri m LEFT JOIN request r ON r.queue = m.queue AND r.id = m.request_id
     WHERE m.queue = %(queue)s AND m.uri = %(uri)s AND EXISTS (SELECT 1 FROM held)
), revalidate AS (
    /* its newest Request could not validate it, for a cause that looks transient (none
       recorded: a release before causes were): validated again by itself, at most
       retry.unvalidated times, each after a growing spacing from that Request's end */
    SELECT request_id, revalidations FROM mapped
     WHERE state = 'failed' AND verdict IS NULL
       AND COALESCE(unvalidated_cause, 'transient') = 'transient'
       AND revalidations < %(max_revalidations)s
       AND updated_at + make_interval(secs => LEAST(%(spacing)s::float8 * 2 ^ revalidations,
                                                    %(spacing_cap)s::float8)) <= now()
), reused AS (
    SELECT request_id AS id, state, nonce FROM mapped
     WHERE state IS NOT NULL AND state <> 'superseded'
       AND NOT EXISTS (SELECT 1 FROM revalidate)
), again AS (
    /* sorting where its commit was first ingested — unless a newer head was ingested
       since (the branch came back to it): then it is drawn anew below, the newest head */
    SELECT request_again_id(v.request_id) AS id, v.revalidations + 1 AS revalidations
      FROM revalidate v
     WHERE NOT EXISTS (SELECT 1 FROM queue q
                        WHERE q.name = %(queue)s
                          AND request_rank(q.latest_request_id)
                              > request_rank(request_again_id(v.request_id)))
), drawn AS (
    INSERT INTO queue_counter (queue, value)
    SELECT %(queue)s, 1 WHERE EXISTS (SELECT 1 FROM held)
       AND NOT EXISTS (SELECT 1 FROM reused) AND NOT EXISTS (SELECT 1 FROM again)
    ON CONFLICT (queue) DO UPDATE SET value = queue_counter.value + 1
    RETURNING value
), minted AS (
    INSERT INTO request (queue, id, uri, revalidations)
    SELECT %(queue)s, %(prefix)s || value, %(uri)s,
           COALESCE((SELECT revalidations + 1 FROM revalidate), 0) FROM drawn
    UNION ALL
    SELECT %(queue)s, id, %(uri)s, revalidations FROM again
    ON CONFLICT (queue, id) DO NOTHING
    RETURNING id, state, nonce
), mapping AS (
    INSERT INTO request_uri (queue, uri, request_id)
    SELECT %(queue)s, %(uri)s, id FROM minted
    ON CONFLICT (queue, uri) DO UPDATE SET request_id = EXCLUDED.request_id
    RETURNING request_id
), chosen AS (
    SELECT id, state, nonce, true AS minted FROM minted
    UNION ALL
    SELECT id, state, nonce, false FROM reused
), latest AS (
    INSERT INTO queue (name, latest_request_id)
    SELECT %(queue)s, id FROM chosen
    ON CONFLICT (name) DO UPDATE
       SET latest_request_id = EXCLUDED.latest_request_id,
           version = queue.version + 1, updated_at = now()
     WHERE queue.latest_request_id IS NULL
        OR request_rank(queue.latest_request_id) < request_rank(EXCLUDED.latest_request_id)
    RETURNING name
), released AS (
    /* given back whenever this statement held it, also when it chose nothing (an id
       taken meanwhile): the caller tries again, and no other ingest waits for a lease
       nobody holds any more */
    UPDATE ingest_lease
       SET holder = NULL, lease_until = now(), finished = started,
           finished_request_id = (SELECT id FROM chosen LIMIT 1)
     WHERE queue = %(queue)s AND holder = %(holder)s::text AND EXISTS (SELECT 1 FROM lease)
    RETURNING queue
)
SELECT id, state, nonce, minted FROM chosen
""")

VALIDATE_AGAIN = _sql("""
WITH newest AS (
    SELECT r.id, r.state
      FROM request_uri m JOIN request r ON r.queue = m.queue AND r.id = m.request_id
     WHERE m.queue = %(queue)s AND m.uri = %(uri)s
       FOR UPDATE OF m
), again AS (
    SELECT request_again_id(id) AS id
      FROM newest WHERE state IN ('failed', 'cancelled', 'superseded')
), minted AS (
    INSERT INTO request (queue, id, uri, kind)
    SELECT %(queue)s, id, %(uri)s, 'retry' FROM again
    ON CONFLICT (queue, id) DO NOTHING
    RETURNING id
), mapping AS (
    UPDATE request_uri SET request_id = m.id
      FROM minted m WHERE queue = %(queue)s AND uri = %(uri)s
    RETURNING request_id
), latest AS (
    UPDATE queue SET latest_request_id = m.id, version = version + 1, updated_at = now()
      FROM minted m
     WHERE name = %(queue)s
       AND (latest_request_id IS NULL
            OR request_rank(latest_request_id) < request_rank(m.id))
    RETURNING name
)
SELECT n.id AS newest_id, n.state AS newest_state, (SELECT id FROM minted) AS minted_id
  FROM newest n
""")

MINT_BACKFILL = _sql("""
WITH newest AS (
    SELECT r.id, r.state, r.verdict
      FROM request_uri m JOIN request r ON r.queue = m.queue AND r.id = m.request_id
     WHERE m.queue = %(queue)s AND m.uri = %(uri)s
       FOR UPDATE OF m
), again AS (
    SELECT request_again_id(id) AS id FROM newest
     WHERE state IN ('superseded', 'cancelled') OR (state = 'failed' AND verdict IS NULL)
), fresh AS (
    SELECT %(fresh_id)s::text AS id WHERE NOT EXISTS (SELECT 1 FROM newest)
), minted AS (
    INSERT INTO request (queue, id, uri, kind)
    SELECT %(queue)s, id, %(uri)s, 'backfill' FROM (SELECT id FROM again
                                                    UNION ALL SELECT id FROM fresh) AS c
    ON CONFLICT (queue, id) DO NOTHING
    RETURNING id, nonce
), mapping AS (
    INSERT INTO request_uri (queue, uri, request_id)
    SELECT %(queue)s, %(uri)s, id FROM minted
    ON CONFLICT (queue, uri) DO UPDATE SET request_id = EXCLUDED.request_id
    RETURNING request_id
)
SELECT (SELECT id FROM newest) AS newest_id, (SELECT state FROM newest) AS newest_state,
       (SELECT verdict FROM newest) AS newest_verdict, m.id AS minted_id, m.nonce
  FROM (SELECT 1) AS one LEFT JOIN minted m ON true
""")

ADMIT = _sql(f"""
WITH candidate AS (
    SELECT id FROM request
     WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s
       AND state = 'accepted'
       FOR UPDATE
), slot AS (
    UPDATE queue SET in_flight_count = in_flight_count
                         + CASE WHEN %(kind)s = 'backfill' THEN 0 ELSE 1 END,
                     backfill_in_flight = backfill_in_flight
                         + CASE WHEN %(kind)s = 'backfill' THEN 1 ELSE 0 END,
                     version = version + 1, updated_at = now()
     WHERE name = %(queue)s
       AND EXISTS (SELECT 1 FROM candidate)
       AND in_flight_count < %(max)s
       AND (%(kind)s <> 'backfill' OR backfill_in_flight < %(backfill_max)s)
       AND (%(kind)s <> 'head' OR latest_request_id IS NULL
            OR request_rank(latest_request_id) <= request_rank(%(id)s))
       AND last_green_request_id IS NOT DISTINCT FROM %(last_green)s
    RETURNING name
), admitted AS (
    UPDATE request r SET state = 'processing', build_strategy = %(strategy)s,
                         base_uri = %(base_uri)s, attempt = 1, attempt_due_at = now(),
                         version = r.version + 1, updated_at = now()
     WHERE r.queue = %(queue)s AND r.id = %(id)s AND EXISTS (SELECT 1 FROM slot)
    RETURNING {REQUEST_COLUMNS}
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

END_ATTEMPT = _sql(f"""
WITH stamped AS (
    UPDATE build SET status = %(status)s, verdict = %(b_verdict)s, reason = %(b_reason)s,
                     version = version + 1, updated_at = now()
     WHERE queue = %(queue)s AND id = %(build_id)s::text
       AND status IN ('accepted', 'running')
    RETURNING status, verdict, reason
), stored AS (
    SELECT status, verdict, reason FROM stamped
    UNION ALL
    SELECT status, verdict, reason FROM build
     WHERE queue = %(queue)s AND id = %(build_id)s::text
       AND NOT EXISTS (SELECT 1 FROM stamped)
), agreed AS (
    SELECT 1 AS yes WHERE %(build_id)s::text IS NULL
        OR EXISTS (SELECT 1 FROM stored WHERE status = %(status)s
                                          AND verdict IS NOT DISTINCT FROM %(b_verdict)s)
), settled AS (
    UPDATE request r SET state = %(outcome)s, verdict = %(r_verdict)s,
                         reason = %(r_reason)s, unvalidated_cause = %(cause)s::text,
                         version = r.version + 1, updated_at = now()
     WHERE r.queue = %(queue)s AND r.id = %(request_id)s AND r.version = %(version)s
       AND r.state = 'processing' AND r.attempt = %(attempt)s
       AND %(settle)s AND EXISTS (SELECT 1 FROM agreed)
    RETURNING {REQUEST_COLUMNS}
), again AS (
    UPDATE request r SET attempt = r.attempt + 1,
                         unvalidated_retries = r.unvalidated_retries + %(unvalidated)s,
                         red_reruns = r.red_reruns + %(red)s,
                         attempt_due_at = now() + make_interval(secs => %(backoff)s),
                         loop_seen_at = now() + make_interval(secs => %(backoff)s),
                         version = r.version + 1, updated_at = now()
     WHERE r.queue = %(queue)s AND r.id = %(request_id)s AND r.version = %(version)s
       AND r.state = 'processing' AND r.attempt = %(attempt)s
       AND NOT %(settle)s AND EXISTS (SELECT 1 FROM agreed)
    RETURNING {REQUEST_COLUMNS}
), released AS (
    UPDATE queue q SET in_flight_count = q.in_flight_count
                           - CASE WHEN s.kind = 'backfill' THEN 0 ELSE 1 END,
                       backfill_in_flight = q.backfill_in_flight
                           - CASE WHEN s.kind = 'backfill' THEN 1 ELSE 0 END,
                       version = q.version + 1, updated_at = now()
      FROM settled s
     WHERE q.name = %(queue)s
    RETURNING q.name
), ended_without_fact AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT s.queue, 'status:' || ch || ':' || s.id || ':final', ch, s.id,
           jsonb_build_object('kind', 'status', 'state', 'error', 'request_id', s.id,
                              'uri', s.uri, 'description', s.reason, 'at', now())
      FROM settled s CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
     WHERE s.verdict IS NULL
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT (SELECT status FROM stored) AS build_status,
       (SELECT verdict FROM stored) AS build_verdict,
       (SELECT reason FROM stored) AS build_reason,
       (SELECT count(*) FROM released) AS slots_released, r.*
  FROM (SELECT 1) AS one
  LEFT JOIN (SELECT 'settled' AS ended, * FROM settled
             UNION ALL SELECT 'again', * FROM again) r ON true
""")

RECORD_FACT = _sql(f"""
WITH inserted AS (
    INSERT INTO validation_fact (queue, uri, project, degree, request_id, attempts, flaky)
    VALUES (%(queue)s, %(uri)s, %(project)s, %(degree)s, %(request_id)s, %(attempts)s,
            %(flaky)s)
    ON CONFLICT DO NOTHING
    RETURNING {FACT_COLUMNS}
), own AS (
    SELECT {FACT_COLUMNS} FROM validation_fact
     WHERE queue = %(queue)s AND request_id = %(request_id)s AND project = %(project)s
       AND NOT EXISTS (SELECT 1 FROM inserted)
), fact AS (
    SELECT {FACT_COLUMNS} FROM inserted
    UNION ALL
    SELECT {FACT_COLUMNS} FROM own
    UNION ALL
    SELECT {FACT_COLUMNS} FROM validation_fact
     WHERE queue = %(queue)s AND uri = %(uri)s AND project = %(project)s AND degree = 0
       AND NOT EXISTS (SELECT 1 FROM inserted) AND NOT EXISTS (SELECT 1 FROM own)
), moved AS (
    UPDATE queue SET last_green_uri = %(uri)s, last_green_request_id = %(request_id)s,
                     version = version + 1, updated_at = now()
     WHERE name = %(queue)s
       AND EXISTS (SELECT 1 FROM fact WHERE request_id = %(request_id)s AND degree = 0)
       AND %(may_move)s
       AND (last_green_request_id IS NULL
            OR request_rank(last_green_request_id) < request_rank(%(request_id)s))
       AND (NOT %(checked)s
            OR last_green_request_id IS NOT DISTINCT FROM %(checked_bookmark)s::text)
    RETURNING last_green_request_id
), marked AS (
    UPDATE request SET recorded = true
     WHERE queue = %(queue)s AND id = %(request_id)s AND NOT recorded
       AND EXISTS (SELECT 1 FROM fact WHERE request_id = %(request_id)s)
    RETURNING id
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
        OR request_rank(h.decided_request_id) < request_rank(EXCLUDED.decided_request_id)
    RETURNING greenness, previous_greenness, transitions, decided_request_id
), changed AS (
    INSERT INTO greenness_change (queue, greenness, request_id)
    SELECT %(queue)s, greenness, decided_request_id FROM health
     WHERE greenness IS DISTINCT FROM previous_greenness
    ON CONFLICT DO NOTHING
), final_status AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT i.queue, 'status:' || ch || ':' || i.request_id || ':final', ch, i.request_id,
           jsonb_build_object('kind', 'status',
                              'state', CASE WHEN i.degree = 0 THEN 'success' ELSE 'failure' END,
                              'request_id', i.request_id, 'uri', i.uri,
                              'degree', i.degree, 'flaky', i.flaky, 'attempts', i.attempts,
                              'at', i.created_at)
      FROM inserted i CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
    ON CONFLICT (queue, key) DO NOTHING
), alert AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT i.queue, 'alert:' || ch || ':greenness:' || h.transitions, ch, 'alerts',
           jsonb_build_object('kind', 'alert', 'event', h.greenness, 'queue', i.queue,
                              'request_id', i.request_id, 'uri', i.uri,
                              'previous', h.previous_greenness, 'flaky', i.flaky,
                              'attempts', i.attempts, 'at', i.created_at)
      FROM inserted i CROSS JOIN health h CROSS JOIN unnest(%(alert_channels)s::text[]) AS ch
     WHERE h.greenness IS DISTINCT FROM h.previous_greenness
       AND (h.previous_greenness IS NOT NULL OR h.greenness = 'red')
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT f.*, (SELECT last_green_request_id FROM moved) AS moved_to,
       (SELECT last_green_request_id FROM queue WHERE name = %(queue)s) AS holder_before,
       (SELECT pinned_uri FROM queue WHERE name = %(queue)s) AS pinned_uri
  FROM fact f
 ORDER BY (f.request_id = %(request_id)s) DESC
 LIMIT 1
""")
