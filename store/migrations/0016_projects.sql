-- Greenness per project in a monorepo (issue 24; design §11).
--
-- Expand-only: new tables, functions and indexes, and a guard that reads the same for
-- every queue the release before knows; nothing the release before writes changes.
--
-- Scopes. A queue's project P is validated in its *scope*, a queue of its own named
-- `<queue>#<project>` ('#' is not allowed in a queue's name): its Requests (a build of P
-- for one of the queue's Requests, with the same number: `request/<queue>#P/<n>`, and
-- the culprit search's probes), builds, facts, last-green bookmark, searches and health.
-- A scope's facts carry the project: validation_fact.project = P (queue_project(queue)),
-- so a fact is keyed (scope, commit, project); the whole repository's stay project ''.
--
-- request_plan: what a Request of a queue with projects planned (streams.stages.analyze):
--   affected   the projects it builds (each a Request of its scope, same number);
--   reason     when every project is affected for a reason of the whole head (a history
--              rewrite, a base the repository lacks, the affected command failing, a diff
--              too large, a backstop), that reason; '' otherwise;
--   backstop   whether this plan was a backstop (every project validated regardless,
--              to catch wrong path rules): rules_unaffected names the projects the rules
--              would not have built;
--   completed  the Request's whole-repository outcome was decided from its projects'.
--
-- project_answer: each project's answer for a Request of its queue — its own fact (the
-- build of the project at this Request), or, unaffected, the answer inherited from the
-- project's nearest validated ancestor (`source_*` name that fact). Immutable, like facts.
-- A Request's answers are its planned facts: the Request is done when every planned
-- project has one (or could not be validated).
--
-- A project's last-green bookmark is its newest green answer (project_answer_green): the
-- newest Request of the queue at which it is green, built or inherited. Answers are only
-- ever added, so it only moves forward; reading it costs one index probe and deciding a
-- Request writes no bookmark row per project.
--
-- project_state: per queue and project, the project's promotion ref pin.

CREATE FUNCTION queue_project(queue text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT CASE WHEN strpos(queue, '#') > 0 THEN substr(queue, strpos(queue, '#') + 1)
                      ELSE '' END $$;

-- A bookmark (and a pin) names a green fact of its own Request, of the queue's project.
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
         WHERE f.queue = NEW.name AND f.uri = NEW.last_green_uri
           AND f.project = queue_project(NEW.name)
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
         WHERE f.queue = NEW.name AND f.uri = NEW.pinned_uri
           AND f.project = queue_project(NEW.name)
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

-- a scope's green facts by rank (the whole repository's have their partial index)
CREATE INDEX validation_fact_project_green_rank
    ON validation_fact (queue, project, request_rank(request_id))
    WHERE degree = 0 AND project <> '';

CREATE TABLE request_plan (
    queue      text        NOT NULL,
    request_id text        NOT NULL,
    affected   text[]      NOT NULL,
    reason     text        NOT NULL DEFAULT '',
    backstop   boolean     NOT NULL DEFAULT false,
    -- a backstop's: the projects the path rules (or the affected command) said were
    -- unaffected; one of them red at the backstop means the rules are wrong
    rules_unaffected text[] NOT NULL DEFAULT '{}',
    completed  boolean     NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, request_id),
    FOREIGN KEY (queue, request_id) REFERENCES request (queue, id)
);
-- the newest backstop of a queue
CREATE INDEX request_plan_backstop ON request_plan (queue, created_at DESC) WHERE backstop;
-- plans whose Request is not decided yet (the sweeper's liveness query)
CREATE INDEX request_plan_open ON request_plan (created_at) WHERE NOT completed;

CREATE TABLE project_answer (
    queue             text             NOT NULL,
    request_id        text             NOT NULL,
    project           text             NOT NULL,
    uri               text             NOT NULL,
    degree            double precision NOT NULL,
    inherited         boolean          NOT NULL,
    source_request_id text             NOT NULL,  -- in the project's scope
    source_uri        text             NOT NULL,
    flaky             boolean          NOT NULL DEFAULT false,
    attempts          integer          NOT NULL DEFAULT 1,
    created_at        timestamptz      NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, request_id, project),
    FOREIGN KEY (queue, request_id) REFERENCES request (queue, id),
    CONSTRAINT project_answer_degree_range CHECK (degree >= 0 AND degree <= 1)
);
-- a project's green answers, newest first: its bookmark, and `last-green` over projects
CREATE INDEX project_answer_green ON project_answer (queue, project, request_rank(request_id))
    INCLUDE (request_id) WHERE degree = 0;
-- a project's answers by commit (fact --project)
CREATE INDEX project_answer_commit ON project_answer (queue, uri, project);

CREATE TRIGGER project_answer_no_update_or_delete BEFORE UPDATE OR DELETE ON project_answer
    FOR EACH ROW EXECUTE FUNCTION validation_fact_immutable();
CREATE TRIGGER project_answer_no_truncate BEFORE TRUNCATE ON project_answer
    FOR EACH STATEMENT EXECUTE FUNCTION validation_fact_immutable();

CREATE TABLE project_state (
    queue                 text        NOT NULL,
    project               text        NOT NULL,
    pinned_uri            text,
    pinned_request_id     text,
    pinned_by             text,
    pinned_reason         text,
    pinned_at             timestamptz,
    version               integer     NOT NULL DEFAULT 1,
    updated_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, project),
    CONSTRAINT project_state_pin_whole
        CHECK ((pinned_uri IS NULL) = (pinned_request_id IS NULL))
);
