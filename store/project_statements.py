"""The SQL of projects' state changes (`store.projects`; design §11): one statement each,
checking its own conditions as it writes, like `store.statements`.

A Request R of a queue with projects plans its projects once (PLAN): for each affected
project a Request of the project's scope, numbered as R (`request/<queue>#<p>/<n>`),
admitted at once (it takes its scope's slot, so the scope's culprit probes wait for it as
a queue's wait for its heads), with its `pending` commit status; for each unaffected
project its inherited answer, and — for the projects configured so — a final commit
status saying what it inherits, keyed as the project's Request would have been. R is
decided from its projects' answers once every planned project has one or ended without a
verdict (COMPLETE): R settles as one statement settles a build's Request (its slot
released).
"""

from __future__ import annotations

from typing import LiteralString

from store.statements import REQUEST_COLUMNS


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


ANSWER_COLUMNS = ("queue, request_id, project, uri, degree, inherited, source_request_id,"
                  " source_uri, flaky, attempts, created_at")

# each project's nearest validated ancestor candidate: the newest fact of its scope that
# sorts before the Request (one index probe per project)
BASES = _sql("""
SELECT s.project, f.uri, f.request_id, f.degree
  FROM unnest(%(projects)s::text[]) AS s(project)
  CROSS JOIN LATERAL (
      SELECT uri, request_id, degree FROM validation_fact
       WHERE queue = %(queue)s || '#' || s.project AND project = s.project
         AND request_rank(request_id) < request_rank(%(request_id)s)
       ORDER BY request_rank(request_id) DESC LIMIT 1) AS f
""")

# the newest Request before this one whose projects were planned, with the source of each
# project's answer there (none yet for a project still building): walked backwards on
# request_rank_idx, usually one step
PREVIOUS_PLAN = _sql("""
WITH prev AS (
    SELECT r.id, r.uri FROM request r
     WHERE r.queue = %(queue)s AND request_rank(r.id) < request_rank(%(request_id)s)
       AND EXISTS (SELECT 1 FROM request_plan p
                    WHERE p.queue = r.queue AND p.request_id = r.id)
     ORDER BY request_rank(r.id) DESC LIMIT 1
)
SELECT prev.id AS request_id, prev.uri, a.project, a.source_request_id
  FROM prev LEFT JOIN project_answer a ON a.queue = %(queue)s AND a.request_id = prev.id
""")

PLAN = _sql("""
WITH parent AS (
    SELECT id, uri, trace_id FROM request
     WHERE queue = %(queue)s AND id = %(request_id)s AND state = 'processing'
), plan AS (
    INSERT INTO request_plan (queue, request_id, affected, reason, backstop,
                              rules_unaffected)
    SELECT %(queue)s, id, %(affected)s::text[], %(reason)s, %(backstop)s,
           %(rules_unaffected)s::text[] FROM parent
    ON CONFLICT (queue, request_id) DO NOTHING
    RETURNING request_id
), child AS (
    SELECT c.scope, c.id, c.strategy, c.base
      FROM unnest(%(scopes)s::text[], %(child_ids)s::text[], %(strategies)s::text[],
                  %(bases)s::text[]) AS c(scope, id, strategy, base)
     WHERE EXISTS (SELECT 1 FROM plan)
), children AS (
    INSERT INTO request (queue, id, uri, kind, state, build_strategy, base_uri, attempt,
                         attempt_due_at, trace_id)
    SELECT c.scope, c.id, p.uri, 'head', 'processing', c.strategy, c.base, 1, now(),
           p.trace_id
      FROM child c CROSS JOIN parent p
    RETURNING queue, id, uri, nonce
), slots AS (
    INSERT INTO queue AS q (name, in_flight_count, latest_request_id)
    SELECT queue, 1, id FROM children
    ON CONFLICT (name) DO UPDATE
       SET in_flight_count = q.in_flight_count + 1,
           latest_request_id = CASE
               WHEN q.latest_request_id IS NULL
                 OR request_rank(q.latest_request_id) < request_rank(EXCLUDED.latest_request_id)
               THEN EXCLUDED.latest_request_id ELSE q.latest_request_id END,
           version = q.version + 1, updated_at = now()
    RETURNING name
), mapped AS (
    INSERT INTO request_uri (queue, uri, request_id)
    SELECT queue, uri, id FROM children
    ON CONFLICT (queue, uri) DO UPDATE SET request_id = EXCLUDED.request_id
    RETURNING request_id
), inherited AS (
    INSERT INTO project_answer (queue, request_id, project, uri, degree, inherited,
                                source_request_id, source_uri, flaky, attempts)
    SELECT %(queue)s, p.id, i.project, p.uri, i.degree, true, i.source_request_id,
           i.source_uri, false, 0
      FROM unnest(%(inherited)s::text[], %(degrees)s::float8[], %(sources)s::text[],
                  %(source_uris)s::text[]) AS i(project, degree, source_request_id, source_uri)
      CROSS JOIN parent p
     WHERE EXISTS (SELECT 1 FROM plan)
    RETURNING project, uri, degree, source_request_id, source_uri
), unaffected_statuses AS (  /* what an unaffected project inherits, as its final status */
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT %(queue)s || '#' || i.project, 'status:' || s.channel || ':' || s.stream || ':final',
           s.channel, s.stream,
           jsonb_build_object('kind', 'status',
                              'state', CASE WHEN i.degree = 0 THEN 'success' ELSE 'failure' END,
                              'request_id', i.source_request_id, 'uri', i.uri,
                              'inherited_from', i.source_uri, 'head_request_id', p.id,
                              'at', now())
      FROM inherited i CROSS JOIN parent p
      JOIN unnest(%(unaffected_projects)s::text[], %(unaffected_channels)s::text[],
                  %(unaffected_streams)s::text[]) AS s(project, channel, stream)
        ON s.project = i.project
    ON CONFLICT (queue, key) DO NOTHING
), pending AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT c.queue, 'status:' || s.channel || ':' || c.id || ':pending', s.channel, c.id,
           jsonb_build_object('kind', 'status', 'state', 'pending', 'request_id', c.id,
                              'uri', c.uri, 'at', now())
      FROM children c
      JOIN unnest(%(status_scopes)s::text[], %(status_channels)s::text[]) AS s(scope, channel)
        ON s.scope = c.queue
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT (SELECT count(*) FROM plan) AS planned,
       (SELECT count(*) FROM children) AS children,
       (SELECT count(*) FROM inherited) AS inherited
""")

# a child's answer: its own fact (after record wrote it; idempotent)
ANSWER_FROM_FACT = _sql("""
INSERT INTO project_answer (queue, request_id, project, uri, degree, inherited,
                            source_request_id, source_uri, flaky, attempts)
SELECT %(queue)s, %(request_id)s, f.project, f.uri, f.degree, false, f.request_id, f.uri,
       f.flaky, f.attempts
  FROM validation_fact f
 WHERE f.queue = %(scope)s AND f.request_id = %(child_id)s AND f.project = %(project)s
   AND EXISTS (SELECT 1 FROM request_plan WHERE queue = %(queue)s
                                           AND request_id = %(request_id)s)
ON CONFLICT (queue, request_id, project) DO NOTHING
""")

# R is decided once each planned project has an answer or its Request ended without a
# verdict: red when a blocking project is red; without a verdict when a blocking project
# has no answer; green otherwise (every blocking project green, built or inherited)
COMPLETE = _sql(f"""
WITH plan AS (
    SELECT affected FROM request_plan
     WHERE queue = %(queue)s AND request_id = %(request_id)s AND NOT completed
       FOR UPDATE
), child AS (
    SELECT c.project, c.id, r.state, r.verdict, r.reason, r.unvalidated_cause
      FROM unnest(%(child_projects)s::text[], %(child_ids)s::text[]) AS c(project, id)
      LEFT JOIN request r ON r.queue = %(queue)s || '#' || c.project AND r.id = c.id
), answer AS (
    SELECT project, degree FROM project_answer
     WHERE queue = %(queue)s AND request_id = %(request_id)s
), ready AS (
    SELECT 1 WHERE EXISTS (SELECT 1 FROM plan)
       AND NOT EXISTS (SELECT 1 FROM child c
                        WHERE c.state IS NULL OR c.state IN ('accepted', 'processing')
                           OR (c.verdict IS NOT NULL
                               AND NOT EXISTS (SELECT 1 FROM answer a
                                                WHERE a.project = c.project)))
), judged AS (
    SELECT CASE
             WHEN EXISTS (SELECT 1 FROM answer a
                           WHERE a.project = ANY(%(blocking)s::text[]) AND a.degree > 0)
             THEN 'red'
             WHEN EXISTS (SELECT 1 FROM unnest(%(blocking)s::text[]) AS b(project)
                           WHERE NOT EXISTS (SELECT 1 FROM answer a
                                              WHERE a.project = b.project))
             THEN 'none'
             ELSE 'green' END AS verdict
      FROM ready
), unanswered AS (
    SELECT string_agg(c.project || ': ' || COALESCE(NULLIF(c.reason, ''), c.state), '; '
                      ORDER BY c.project) AS why,
           bool_and(COALESCE(c.unvalidated_cause, 'transient') = 'permanent') AS permanent
      FROM child c
     WHERE c.project = ANY(%(blocking)s::text[]) AND c.verdict IS NULL
), red AS (
    SELECT string_agg(a.project, ', ' ORDER BY a.project) AS projects FROM answer a
     WHERE a.project = ANY(%(blocking)s::text[]) AND a.degree > 0
), settled AS (
    UPDATE request r
       SET state = CASE j.verdict WHEN 'green' THEN 'succeeded' ELSE 'failed' END,
           verdict = CASE j.verdict WHEN 'none' THEN NULL ELSE j.verdict END,
           reason = CASE j.verdict
                      WHEN 'red' THEN 'red: ' || (SELECT projects FROM red)
                      WHEN 'none' THEN 'could not be validated: '
                                       || COALESCE((SELECT why FROM unanswered), '')
                      ELSE '' END,
           unvalidated_cause = CASE WHEN j.verdict <> 'none' THEN NULL
                                    WHEN (SELECT permanent FROM unanswered) THEN 'permanent'
                                    ELSE 'transient' END,
           version = r.version + 1, updated_at = now()
      FROM judged j
     WHERE r.queue = %(queue)s AND r.id = %(request_id)s AND r.state = 'processing'
    RETURNING {REQUEST_COLUMNS}
), released AS (
    UPDATE queue q SET in_flight_count = q.in_flight_count - 1,
                       version = q.version + 1, updated_at = now()
      FROM settled s WHERE q.name = %(queue)s
    RETURNING q.name
), completed AS (
    UPDATE request_plan SET completed = true
     WHERE queue = %(queue)s AND request_id = %(request_id)s
       AND EXISTS (SELECT 1 FROM judged)
    RETURNING request_id
), ended_without_fact AS (
    INSERT INTO notification (queue, key, channel, stream, event)
    SELECT s.queue, 'status:' || ch || ':' || s.id || ':final', ch, s.id,
           jsonb_build_object('kind', 'status', 'state', 'error', 'request_id', s.id,
                              'uri', s.uri, 'description', s.reason, 'at', now())
      FROM settled s CROSS JOIN unnest(%(status_channels)s::text[]) AS ch
     WHERE s.verdict IS NULL
    ON CONFLICT (queue, key) DO NOTHING
)
SELECT (SELECT count(*) FROM completed) AS completed, s.* FROM (SELECT 1) AS one
  LEFT JOIN settled s ON true
""")
