-- Verdicts, attempts and validating a commit again (issue 16; design §4–§6).
--
-- request
--   nonce      random, minted with the row: every message about a Request carries it, so
--              a message acts only on the Request it was about, even when a database
--              restore hands the same id to another Request (design §10).
--   kind       'head': a head ingested from the branch (superseded by a newer head);
--              'retry': a commit validated again on request, which supersedes nothing
--              and is superseded by nothing.
--   attempt    the current attempt (build) of a `processing` Request, from 1; 0 before
--              admission. An attempt that could not validate (or a red one, where the
--              queue re-runs red builds) starts the next attempt; the Request keeps its
--              slot meanwhile.
--   unvalidated_retries, red_reruns
--              attempts started again so far, by why.
--   attempt_due_at
--              when the current attempt may trigger its build (a re-attempt's backoff).
--   verdict    what the build that settled the Request said: 'green' (succeeded),
--              'red' (failed: a red fact), NULL (no verdict: superseded, cancelled, or
--              failed because it could not be validated).
--   reason     why the Request ended as it did, in words (always set when it failed
--              without a verdict).
--   recorded   record has written the Request's fact and considered the bookmark; the
--              sweeper finds settled verdicts that were not recorded (a lost `record`).
--
-- Request ids: a Request validating a commit again is `request/<queue>/<n>.<k>`, where
-- `n` is the number of the Request that first ingested the commit and `k` (from 2) counts
-- its validations, so it sorts where its commit was first ingested (design §4). Order is
-- (request_seq, request_validation).
--
-- build: `attempt` (which attempt of its Request it is), `verdict` and `reason` as for
-- the request; a build `failed` without a verdict could not validate (its host was lost,
-- it never started before its deadline, its polls kept failing).
--
-- validation_fact: one per Request (and project), no longer one per commit; a commit's
-- answer is the fact of its newest Request that has one, and a commit has at most one
-- green fact (a green commit is never validated again). `attempts` and `flaky` say how
-- the verdict was reached (green on a re-run of a red build is flaky).
--
-- worker_host: each worker's own heartbeat and since when it has been heartbeating without
-- a gap. A host may declare another host's command build lost only when it has itself seen
-- the database for at least the build's host_timeout (design §6: a database outage is
-- never evidence that a host died).
--
-- ingest_lease: one ingest of a queue at a time resolves its head and mints its Request,
-- holding no database connection while git runs; `started`/`finished` count resolves so
-- an ingest that arrived before a finished resolve began can take its answer.

CREATE OR REPLACE FUNCTION request_seq(request_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT substring(request_id FROM '/([0-9]+)(\.[0-9]+)?$')::bigint $$;

CREATE FUNCTION request_validation(request_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT COALESCE(substring(request_id FROM '/[0-9]+\.([0-9]+)$')::bigint, 1) $$;

-- the function's results did not change for any id already stored; rebuild all the same
REINDEX INDEX validation_fact_green_order;

ALTER TABLE request
    ADD COLUMN nonce text NOT NULL
        DEFAULT substr(md5(random()::text || clock_timestamp()::text), 1, 16),
    ADD COLUMN kind text NOT NULL DEFAULT 'head',
    ADD COLUMN attempt integer NOT NULL DEFAULT 0,
    ADD COLUMN unvalidated_retries integer NOT NULL DEFAULT 0,
    ADD COLUMN red_reruns integer NOT NULL DEFAULT 0,
    ADD COLUMN attempt_due_at timestamptz,
    ADD COLUMN verdict text,
    ADD COLUMN reason text NOT NULL DEFAULT '',
    ADD COLUMN recorded boolean NOT NULL DEFAULT false;

ALTER TABLE build
    ADD COLUMN attempt integer NOT NULL DEFAULT 1,
    ADD COLUMN verdict text,
    ADD COLUMN reason text NOT NULL DEFAULT '';

-- what the Requests and builds settled before this migration said
UPDATE build SET verdict = CASE status WHEN 'succeeded' THEN 'green' ELSE 'red' END
 WHERE status IN ('succeeded', 'failed');
UPDATE request r SET attempt = 1
 WHERE r.state IN ('processing', 'succeeded', 'failed', 'cancelled')
   AND EXISTS (SELECT 1 FROM build b WHERE b.queue = r.queue AND b.request_id = r.id);
UPDATE request SET verdict = 'green' WHERE state = 'succeeded';
UPDATE request r SET verdict = 'red'
 WHERE r.state = 'failed'
   AND EXISTS (SELECT 1 FROM build b WHERE b.queue = r.queue AND b.request_id = r.id
                                       AND b.status = 'failed');
UPDATE request SET reason = 'could not be validated (failed before this version recorded why)'
 WHERE state = 'failed' AND verdict IS NULL;
UPDATE request r SET recorded = true
 WHERE r.state IN ('superseded', 'cancelled')
    OR (r.state = 'failed' AND r.verdict IS NULL)
    OR EXISTS (SELECT 1 FROM validation_fact f WHERE f.queue = r.queue AND f.request_id = r.id);

ALTER TABLE request
    ADD CONSTRAINT request_kind_known CHECK (kind IN ('head', 'retry')),
    ADD CONSTRAINT request_verdict_matches_state CHECK (
        CASE state WHEN 'succeeded' THEN verdict IS NOT DISTINCT FROM 'green'
                   WHEN 'failed' THEN verdict IS NULL OR verdict = 'red'
                   ELSE verdict IS NULL END),
    ADD CONSTRAINT request_attempts_nonnegative CHECK (
        attempt >= 0 AND unvalidated_retries >= 0 AND red_reruns >= 0);
ALTER TABLE build
    ADD CONSTRAINT build_verdict_matches_status CHECK (
        CASE status WHEN 'succeeded' THEN verdict IS NOT DISTINCT FROM 'green'
                    WHEN 'failed' THEN verdict IS NULL OR verdict = 'red'
                    ELSE verdict IS NULL END),
    ADD CONSTRAINT build_attempt_positive CHECK (attempt >= 1);

-- once terminal, a Request's verdict, reason and nonce never change (nor does the nonce
-- ever): mirrors the state machine's "terminal is final"
CREATE OR REPLACE FUNCTION request_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.queue <> OLD.queue OR NEW.id <> OLD.id OR NEW.uri <> OLD.uri
       OR NEW.nonce <> OLD.nonce OR NEW.kind <> OLD.kind THEN
        RAISE EXCEPTION 'request %: queue, id, uri, nonce and kind are immutable', OLD.id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'request_identity_immutable';
    END IF;
    IF OLD.build_strategy IS NOT NULL
       AND (NEW.build_strategy IS DISTINCT FROM OLD.build_strategy
            OR NEW.base_uri IS DISTINCT FROM OLD.base_uri) THEN
        RAISE EXCEPTION 'request %: build strategy and base are immutable once set', OLD.id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'request_strategy_immutable';
    END IF;
    -- Mirrors RequestState.can_become in store/entities.py.
    IF NEW.state <> OLD.state AND NOT (
           (OLD.state = 'accepted' AND NEW.state IN ('processing', 'superseded', 'failed'))
        OR (OLD.state = 'processing' AND NEW.state IN ('succeeded', 'failed', 'cancelled'))
    ) THEN
        RAISE EXCEPTION 'request %: illegal transition % -> %', OLD.id, OLD.state, NEW.state
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'request_state_transition';
    END IF;
    IF OLD.state IN ('superseded', 'succeeded', 'failed', 'cancelled')
       AND (NEW.verdict IS DISTINCT FROM OLD.verdict OR NEW.reason <> OLD.reason
            OR NEW.attempt <> OLD.attempt) THEN
        RAISE EXCEPTION 'request %: a terminal request''s verdict, reason and attempts are '
                        'final', OLD.id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'request_outcome_final';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION build_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.queue <> OLD.queue OR NEW.id <> OLD.id OR NEW.request_id <> OLD.request_id
       OR NEW.attempt <> OLD.attempt THEN
        RAISE EXCEPTION 'build %: queue, id, request_id and attempt are immutable', OLD.id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'build_identity_immutable';
    END IF;
    IF OLD.status IN ('succeeded', 'failed', 'cancelled')
       AND (NEW.status <> OLD.status OR NEW.verdict IS DISTINCT FROM OLD.verdict
            OR NEW.reason <> OLD.reason) THEN
        RAISE EXCEPTION 'build %: terminal status % is write-once (got %)',
                        OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'build_status_write_once';
    END IF;
    RETURN NEW;
END
$$;

CREATE INDEX build_attempt_idx ON build (queue, request_id, attempt);
-- the queue's Requests newest first (dashboards, the API), validations of a commit together
CREATE INDEX request_order_idx
    ON request (queue, request_seq(id) DESC, request_validation(id) DESC);
-- settled verdicts whose fact was not recorded yet: only those rows are indexed
CREATE INDEX request_unrecorded_idx ON request (updated_at)
    WHERE verdict IS NOT NULL AND NOT recorded;

-- facts: one per Request; a commit's facts found by its URI
ALTER TABLE validation_fact DROP CONSTRAINT validation_fact_pkey;
ALTER TABLE validation_fact ADD PRIMARY KEY (queue, request_id, project);
CREATE INDEX validation_fact_commit ON validation_fact (queue, uri, project);
CREATE UNIQUE INDEX validation_fact_one_green ON validation_fact (queue, uri, project)
    WHERE degree = 0;
ALTER TABLE validation_fact
    ADD COLUMN attempts integer NOT NULL DEFAULT 1,
    ADD COLUMN flaky boolean NOT NULL DEFAULT false;

-- The bookmark only moves forward by ingest order: (request_seq, request_validation).
CREATE OR REPLACE FUNCTION queue_bookmark_guard() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.name <> OLD.name THEN
            RAISE EXCEPTION 'queue %: name is immutable', OLD.name
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_identity_immutable';
        END IF;
        IF NEW.last_green_request_id IS NOT DISTINCT FROM OLD.last_green_request_id
           AND NEW.last_green_uri IS NOT DISTINCT FROM OLD.last_green_uri THEN
            RETURN NEW;
        END IF;
        IF NEW.last_green_request_id IS NULL THEN
            RAISE EXCEPTION 'queue %: the last-green bookmark cannot be cleared', OLD.name
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_bookmark_names_green_fact';
        END IF;
        IF OLD.last_green_request_id IS NOT NULL
           AND (request_seq(NEW.last_green_request_id),
                request_validation(NEW.last_green_request_id))
               <= (request_seq(OLD.last_green_request_id),
                   request_validation(OLD.last_green_request_id)) THEN
            RAISE EXCEPTION 'queue %: the bookmark only moves forward (% is not newer than %)',
                            OLD.name, NEW.last_green_request_id, OLD.last_green_request_id
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_bookmark_forward_only';
        END IF;
    END IF;
    IF NEW.last_green_request_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM validation_fact f
         WHERE f.queue = NEW.name AND f.uri = NEW.last_green_uri AND f.project = ''
           AND f.degree = 0 AND f.request_id = NEW.last_green_request_id
    ) THEN
        RAISE EXCEPTION 'queue %: bookmark % (%) names no green fact',
                        NEW.name, NEW.last_green_uri, NEW.last_green_request_id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'queue_bookmark_names_green_fact';
    END IF;
    RETURN NEW;
END
$$;

CREATE TABLE worker_host (
    host         text        PRIMARY KEY,
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    up_since     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE ingest_lease (
    queue              text        PRIMARY KEY,
    holder             text,
    lease_until        timestamptz NOT NULL DEFAULT now(),
    started            bigint      NOT NULL DEFAULT 0,
    finished           bigint      NOT NULL DEFAULT 0,
    finished_request_id text
);
