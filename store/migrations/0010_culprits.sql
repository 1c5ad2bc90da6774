-- Culprit finding, the branch's story, health figures and pinning the promotion ref
-- (issue 18; design §2, §4, §5).
--
-- Request ids and their order. A commit that was never ingested as a head but is
-- validated to find a culprit (a backfill) is `request/<queue>/<n>~<p>`: `n` is the
-- Request of the nearest ingested head at or before it on the branch's first-parent
-- history and `p` how many first-parent commits after that head it is; validated again
-- it is `request/<queue>/<n>~<p>.<k>`. The total order of a queue's Requests is
-- request_rank(id) = ARRAY[n, p, k] (p = 0 for heads, k = 1 for a first validation), so a
-- backfilled commit sorts by its place in the branch's history: after the head it follows
-- and before the next head. request_seq and request_validation read the new shape too.
--
-- request.kind 'backfill': a Request validating a commit to find a culprit. Like 'retry'
-- it supersedes nothing and nothing supersedes it; it never becomes the queue's latest;
-- it is admitted only while the queue has a free slot for its heads, and holds a slot of
-- the queue's backfill capacity (queue.backfill_in_flight), never one of the heads'.
--
-- culprit_search: one per red streak of a queue, opened by the red verdict that follows
-- the queue's last green commit. `commits` is the first-parent history from that green
-- commit (index 0) to the red commit (the last index); `lo` is the newest index known
-- green and `hi` the oldest index above it known red, so the culprit (a red commit whose
-- first parent is green) lies in lo+1..hi and is found when hi = lo + 1. `probes` are the
-- backfill Requests it started, `skipped` the indexes whose probe could not be validated.
-- state: bisecting | found | fixed (the branch went green again first) | budget_spent |
-- inconclusive (every commit left could not be validated) | no_range (no green ancestor
-- on the first-parent history to search from).
--
-- commit_info: what a person recognises a commit by (subject, author, time), filled when
-- a search lists a range and when the API shows a commit it has not described yet.
--
-- greenness_change: every change of a queue's greenness (the newest verdict's colour),
-- for the share of time red and the red streak's length.
--
-- queue.pinned_*: the promotion ref held at a green commit during an incident (who, when,
-- why); promotion_pin keeps every pin and unpin.

CREATE FUNCTION request_rank(request_id text) RETURNS bigint[]
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT ARRAY[x[1]::bigint, COALESCE(x[2]::bigint, 0), COALESCE(x[3]::bigint, 1)]
            FROM (SELECT regexp_match(request_id, '/([0-9]+)(?:~([0-9]+))?(?:\.([0-9]+))?$')
                         AS x) AS m $$;

-- the id of a commit's next validation: `…/<n>[~<p>]` or `…/<n>[~<p>].<k>` → `….<k+1>`
CREATE FUNCTION request_again_id(request_id text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT regexp_replace(request_id, '\.[0-9]+$', '') || '.'
                 || ((request_rank(request_id))[3] + 1) $$;

-- the old expression indexes read request_seq, whose body changes: replaced by rank ones
DROP INDEX validation_fact_green_order;
DROP INDEX request_order_idx;

CREATE OR REPLACE FUNCTION request_seq(request_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (request_rank(request_id))[1] $$;

CREATE OR REPLACE FUNCTION request_validation(request_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT (request_rank(request_id))[3] $$;

CREATE INDEX request_rank_idx ON request (queue, request_rank(id) DESC);
CREATE INDEX validation_fact_green_rank ON validation_fact (queue, request_rank(request_id))
    WHERE degree = 0 AND project = '';
-- time to signal and flakes over a window
CREATE INDEX validation_fact_recent ON validation_fact (queue, created_at);

ALTER TABLE request DROP CONSTRAINT request_kind_known;
ALTER TABLE request ADD CONSTRAINT request_kind_known
    CHECK (kind IN ('head', 'retry', 'backfill'));

ALTER TABLE queue
    ADD COLUMN backfill_in_flight integer NOT NULL DEFAULT 0,
    ADD COLUMN pinned_uri text,
    ADD COLUMN pinned_request_id text,
    ADD COLUMN pinned_by text,
    ADD COLUMN pinned_reason text,
    ADD COLUMN pinned_at timestamptz,
    ADD CONSTRAINT queue_backfill_in_flight_nonnegative CHECK (backfill_in_flight >= 0),
    ADD CONSTRAINT queue_pin_complete CHECK (
        (pinned_uri IS NULL) = (pinned_request_id IS NULL)
        AND (pinned_uri IS NULL) = (pinned_at IS NULL));

-- The bookmark only moves forward by request_rank: to a head ingested later or to a
-- backfilled commit after it (the record stage moves it to a backfilled commit only when
-- that commit descends from the bookmark: ancestry is the repository's to say).
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
           AND request_rank(NEW.last_green_request_id)
               <= request_rank(OLD.last_green_request_id) THEN
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
    IF NEW.pinned_request_id IS NOT NULL
       AND NEW.pinned_request_id IS DISTINCT FROM OLD.pinned_request_id AND NOT EXISTS (
        SELECT 1 FROM validation_fact f
         WHERE f.queue = NEW.name AND f.uri = NEW.pinned_uri AND f.project = ''
           AND f.degree = 0 AND f.request_id = NEW.pinned_request_id
    ) THEN
        RAISE EXCEPTION 'queue %: pin % (%) names no green fact',
                        NEW.name, NEW.pinned_uri, NEW.pinned_request_id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'queue_pin_names_green_fact';
    END IF;
    RETURN NEW;
END
$$;

CREATE TABLE culprit_search (
    queue              text        NOT NULL,
    red_request_id     text        NOT NULL,
    red_uri            text        NOT NULL,
    green_request_id   text,
    green_uri          text,
    commits            text[]      NOT NULL DEFAULT '{}',
    lo                 integer     NOT NULL DEFAULT 0,
    hi                 integer     NOT NULL DEFAULT 0,
    skipped            integer[]   NOT NULL DEFAULT '{}',
    probes             text[]      NOT NULL DEFAULT '{}',
    builds             integer     NOT NULL DEFAULT 0,
    max_builds         integer     NOT NULL,
    state              text        NOT NULL DEFAULT 'bisecting',
    detail             text        NOT NULL DEFAULT '',
    culprit_uri        text,
    culprit_request_id text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    ended_at           timestamptz,
    version            bigint      NOT NULL DEFAULT 1,
    PRIMARY KEY (queue, red_request_id),
    CONSTRAINT culprit_search_state_known CHECK (
        state IN ('bisecting', 'found', 'fixed', 'budget_spent', 'inconclusive', 'no_range')),
    CONSTRAINT culprit_search_bounds CHECK (
        0 <= lo AND lo <= hi AND hi <= greatest(cardinality(commits) - 1, 0)),
    CONSTRAINT culprit_search_found_names_culprit CHECK (
        (state = 'found') = (culprit_uri IS NOT NULL)),
    CONSTRAINT culprit_search_ended CHECK ((state = 'bisecting') = (ended_at IS NULL))
);
-- a queue's searches, newest red streak first
CREATE INDEX culprit_search_order ON culprit_search (queue, request_rank(red_request_id) DESC);
-- searches still bisecting, for the sweeper (a search whose probe ended unseen)
CREATE INDEX culprit_search_open ON culprit_search (updated_at) WHERE state = 'bisecting';

-- a search ended is final: its state, culprit and range never change again
CREATE FUNCTION culprit_search_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.queue <> OLD.queue OR NEW.red_request_id <> OLD.red_request_id
       OR NEW.commits <> OLD.commits OR NEW.red_uri <> OLD.red_uri
       OR NEW.green_uri IS DISTINCT FROM OLD.green_uri THEN
        RAISE EXCEPTION 'culprit search %/%: its range is immutable', OLD.queue,
                        OLD.red_request_id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'culprit_search_range_immutable';
    END IF;
    IF OLD.state <> 'bisecting' AND (NEW.state <> OLD.state OR NEW.lo <> OLD.lo
            OR NEW.hi <> OLD.hi OR NEW.culprit_uri IS DISTINCT FROM OLD.culprit_uri) THEN
        RAISE EXCEPTION 'culprit search %/%: ended %, which is final', OLD.queue,
                        OLD.red_request_id, OLD.state
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'culprit_search_final';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER culprit_search_guard BEFORE UPDATE ON culprit_search
    FOR EACH ROW EXECUTE FUNCTION culprit_search_guard();

CREATE TABLE commit_info (
    queue        text        NOT NULL,
    uri          text        NOT NULL,
    sha          text        NOT NULL,
    subject      text        NOT NULL,
    author       text        NOT NULL,
    committed_at timestamptz,
    parent_uri   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, uri)
);

CREATE TABLE greenness_change (
    queue      text        NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    greenness  text        NOT NULL,
    request_id text        NOT NULL,
    PRIMARY KEY (queue, at, request_id),
    CONSTRAINT greenness_change_known CHECK (greenness IN ('green', 'red'))
);
-- what the queues were before this migration: their greenness since it was last decided
INSERT INTO greenness_change (queue, at, greenness, request_id)
SELECT queue, updated_at, greenness, decided_request_id FROM queue_health
 WHERE greenness IS NOT NULL AND decided_request_id IS NOT NULL;

CREATE TABLE promotion_pin (
    id           bigserial   PRIMARY KEY,
    queue        text        NOT NULL,
    uri          text        NOT NULL,
    request_id   text        NOT NULL,
    pinned_by    text        NOT NULL,
    reason       text        NOT NULL,
    pinned_at    timestamptz NOT NULL DEFAULT now(),
    unpinned_by  text,
    unpinned_at  timestamptz
);
CREATE INDEX promotion_pin_queue ON promotion_pin (queue, id DESC);
