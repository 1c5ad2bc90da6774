-- Bounded history (issue 25, item 6; design §12): what `stovepipe prune` and the workers'
-- retention round need (store/retention.py, streams/stages/retention.py).
--
-- Expand-only: a function replaced so that it answers as before for everything the
-- release before does, a new table and a new index; nothing the release before reads or
-- writes changes.
--
-- Facts and project answers stay immutable. validation_fact_immutable() (the trigger
-- function of validation_fact and project_answer) still refuses every UPDATE, every
-- TRUNCATE and every DELETE — except a DELETE in a transaction that set the
-- transaction-local setting `stovepipe.pruning` to 'on' (SET LOCAL): the one deliberate
-- way to remove a fact, taken only by the retention round's batch statement, which
-- deletes a fact together with its Request once nothing a gate or a person needs names
-- it. No release before sets it, so for them nothing changes. (As before, a database
-- owner can still disable the triggers; this is a guard against mistakes, not a wall.)
CREATE OR REPLACE FUNCTION validation_fact_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('stovepipe.pruning', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'validation facts are immutable (% refused)', TG_OP
        USING ERRCODE = 'integrity_constraint_violation',
              CONSTRAINT = 'validation_fact_immutable';
END
$$;

-- retention_round: the workers' periodic pruning, one row ('prune'). A worker starts a
-- round only when the previous one started at least `retention.every` ago (a
-- compare-and-set on started_at, under the 'retention' advisory lock, so one worker at a
-- time); it writes what the round deleted and what it left past retention, by table,
-- which every worker's metrics read (stovepipe_rows_past_retention).
CREATE TABLE retention_round (
    name           text        PRIMARY KEY,
    started_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz,
    cutoff         timestamptz,
    deleted        jsonb       NOT NULL DEFAULT '{}',
    past_retention jsonb       NOT NULL DEFAULT '{}'
);

-- commit_info, oldest first: the round finds old descriptions on an index rather than a
-- scan. CREATE INDEX (not CONCURRENTLY: a migration runs in a transaction) blocks writes
-- to commit_info while it builds; commit_info is written only when a culprit search lists
-- a range or the API describes a commit, and holds one row per commit described, so the
-- build takes well under a second for a table of 100,000 rows.
CREATE INDEX commit_info_created ON commit_info (created_at);

-- project answers by their source (a project's Request): a project's Request stays while
-- an answer that stays names it. The same caveat: answers are written by the analyze and
-- record stages of queues with projects, which wait while the index builds — about a
-- second per million answers on two cores (so say so before migrating a big monorepo).
CREATE INDEX project_answer_source ON project_answer (queue, project, source_request_id);
