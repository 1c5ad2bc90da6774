-- Stovepipe schema, version 1 (design §7).
--
-- Every table lives in the connection's search_path schema: nothing here is
-- schema-qualified. Primary keys lead with the queue so the data can be sharded by
-- queue. Mutable rows carry `version`, bumped by every compare-and-set UPDATE.
-- Invariants that must never break are enforced here, not only by the stores:
-- the request state machine, write-once terminal build status, immutable facts, and a
-- bookmark that always names a green fact.

CREATE TABLE queue (
    name                  text        PRIMARY KEY,
    last_green_uri        text,
    last_green_request_id text,
    in_flight_count       integer     NOT NULL DEFAULT 0,
    latest_request_id     text,
    version               bigint      NOT NULL DEFAULT 1,
    created_at            timestamptz NOT NULL DEFAULT now(),
    updated_at            timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queue_in_flight_count_nonnegative CHECK (in_flight_count >= 0),
    CONSTRAINT queue_bookmark_complete
        CHECK ((last_green_uri IS NULL) = (last_green_request_id IS NULL))
);

CREATE TABLE request (
    queue          text        NOT NULL,
    id             text        NOT NULL,
    uri            text        NOT NULL,
    state          text        NOT NULL DEFAULT 'accepted',
    build_strategy text,
    base_uri       text,
    version        bigint      NOT NULL DEFAULT 1,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, id),
    CONSTRAINT request_state_known CHECK (
        state IN ('accepted', 'processing', 'superseded', 'succeeded', 'failed', 'cancelled')),
    CONSTRAINT request_build_strategy_known CHECK (
        build_strategy IS NULL OR build_strategy IN ('incremental', 'full')),
    -- An incremental build needs its base; a full build (or none yet) has none.
    CONSTRAINT request_base_uri_matches_strategy CHECK (
        CASE build_strategy WHEN 'incremental' THEN base_uri IS NOT NULL
                            ELSE base_uri IS NULL END),
    CONSTRAINT request_processing_has_strategy CHECK (
        state <> 'processing' OR build_strategy IS NOT NULL)
);

CREATE FUNCTION request_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.queue <> OLD.queue OR NEW.id <> OLD.id OR NEW.uri <> OLD.uri THEN
        RAISE EXCEPTION 'request %: queue, id and uri are immutable', OLD.id
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
    RETURN NEW;
END
$$;

CREATE TRIGGER request_guard BEFORE UPDATE ON request
    FOR EACH ROW EXECUTE FUNCTION request_guard();

-- Dedup of ingest: one request per (queue, uri). Written before its request exists, so
-- no foreign key.
CREATE TABLE request_uri (
    queue      text        NOT NULL,
    uri        text        NOT NULL,
    request_id text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, uri)
);

-- Build ids are minted by the queue's runner, so they are unique per queue only. The
-- index on id alone serves buildsignal and its reconciler, which may know only the id.
CREATE TABLE build (
    queue      text        NOT NULL,
    id         text        NOT NULL,
    request_id text        NOT NULL,
    status     text        NOT NULL DEFAULT 'accepted',
    version    bigint      NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, id),
    FOREIGN KEY (queue, request_id) REFERENCES request (queue, id),
    CONSTRAINT build_status_known CHECK (
        status IN ('accepted', 'running', 'succeeded', 'failed', 'cancelled'))
);
CREATE INDEX build_id_idx ON build (id);
CREATE INDEX build_request_idx ON build (queue, request_id);

CREATE FUNCTION build_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.queue <> OLD.queue OR NEW.id <> OLD.id OR NEW.request_id <> OLD.request_id THEN
        RAISE EXCEPTION 'build %: queue, id and request_id are immutable', OLD.id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'build_identity_immutable';
    END IF;
    IF OLD.status IN ('succeeded', 'failed', 'cancelled') AND NEW.status <> OLD.status THEN
        RAISE EXCEPTION 'build %: terminal status % is write-once (got %)',
                        OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'build_status_write_once';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER build_guard BEFORE UPDATE ON build
    FOR EACH ROW EXECUTE FUNCTION build_guard();

CREATE TABLE validation_fact (
    queue      text             NOT NULL,
    uri        text             NOT NULL,
    project    text             NOT NULL DEFAULT '',
    degree     double precision NOT NULL,
    request_id text             NOT NULL,
    created_at timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, uri, project),
    FOREIGN KEY (queue, request_id) REFERENCES request (queue, id),
    -- NaN compares greater than every number, so this refuses NaN too.
    CONSTRAINT validation_fact_degree_range CHECK (degree >= 0 AND degree <= 1)
);

-- Facts are immutable (first fact wins, forever). An operator who truly must remove one
-- has to disable these triggers explicitly.
CREATE FUNCTION validation_fact_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'validation facts are immutable (% refused)', TG_OP
        USING ERRCODE = 'integrity_constraint_violation',
              CONSTRAINT = 'validation_fact_immutable';
END
$$;

CREATE TRIGGER validation_fact_no_update_or_delete BEFORE UPDATE OR DELETE ON validation_fact
    FOR EACH ROW EXECUTE FUNCTION validation_fact_immutable();
CREATE TRIGGER validation_fact_no_truncate BEFORE TRUNCATE ON validation_fact
    FOR EACH STATEMENT EXECUTE FUNCTION validation_fact_immutable();

-- The bookmark is never cleared and always names a green whole-repo fact of its own
-- request: the last line of defence against reporting an unvalidated commit green.
-- (Forward-only by ingest order is checked by QueueStore.advance_bookmark.)
CREATE FUNCTION queue_bookmark_guard() RETURNS trigger LANGUAGE plpgsql
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

CREATE TRIGGER queue_bookmark_guard
    BEFORE INSERT OR UPDATE OF name, last_green_uri, last_green_request_id ON queue
    FOR EACH ROW EXECUTE FUNCTION queue_bookmark_guard();

-- Per-queue request counter: the ingest order.
CREATE TABLE queue_counter (
    queue text   PRIMARY KEY,
    value bigint NOT NULL,
    CONSTRAINT queue_counter_positive CHECK (value >= 1)
);

-- Dead-letter messages no reconciler can handle. Unique on the message's coordinates so
-- parking the same message again (a redelivery) changes nothing.
CREATE TABLE parked_message (
    id          bigserial   PRIMARY KEY,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    "offset"    bigint      NOT NULL,
    key         bytea,
    value       bytea,
    headers     jsonb       NOT NULL DEFAULT '[]',
    error       text        NOT NULL DEFAULT '',
    parked_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT parked_message_coordinates UNIQUE (topic, "partition", "offset")
);
