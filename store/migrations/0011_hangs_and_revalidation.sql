-- A hang is measured from the start; re-validation is bounded (issue 23; design §4, §5).
--
-- Expand-only: every column is nullable or has a default, so workers of the release
-- before keep running beside this one (they neither read nor write these columns).
--
-- build.started_at
--   when the build started running: the provider's own start time (clamped between the
--   trigger and the moment it was seen), else the first poll that saw it running. NULL:
--   not started yet (or polled only by a worker of the release before). A build is hung
--   only when it has run longer than the queue's poll deadline since then.
--
-- request.unvalidated_cause
--   for a Request that failed without a verdict: 'transient' (a lost host, a vanished
--   build, a dependency unavailable past its deadline, a build that never started in
--   time) or 'permanent' (a refused trigger, a workflow that cannot start, a checkout
--   that fails). An ingest of the head validates it again by itself only after a
--   transient cause; NULL (rows of the release before) counts as transient.
--
-- request.revalidations
--   how many times ingests validated its commit again by themselves before this Request
--   (0 for a first validation and for an explicit retry): at most the queue's
--   retry.unvalidated, each after a growing spacing from the end of the Request before.

ALTER TABLE build ADD COLUMN started_at timestamptz;

ALTER TABLE request ADD COLUMN unvalidated_cause text;
ALTER TABLE request ADD COLUMN revalidations integer NOT NULL DEFAULT 0;
