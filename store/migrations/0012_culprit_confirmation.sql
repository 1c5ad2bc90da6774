-- A culprit is confirmed as the head's break, or said not to be; culprit searches wait
-- out outages (issue 23, items 2 and 3; design §5, "backfill").
--
-- Expand-only: every column is nullable, so workers of the release before keep running
-- beside this one (they neither read nor write these columns), and rows they write are
-- read by this release (a NULL `confirmed` on a found search: see below).
--
-- culprit_search.confirmed
--   for a found search: true when every commit from the culprit to the red head is known
--   red (so the culprit is the newest break of the range: the one the head is red for),
--   false when the culprit is a break that is not confirmed as the head's (commits
--   between it and the head were not built, or could not be validated, or the branch
--   went green first). NULL: not found, or found by the release before, which did not
--   confirm (read as not confirmed, unless the culprit is the red commit itself).
-- culprit_search.unconfirmed_reason
--   why a found culprit is not confirmed, in words; NULL otherwise.
-- culprit_search.candidate_uri
--   while bisecting: a break found (a red commit whose first parent is green) whose
--   commits up to the head are being built to confirm it; NULL otherwise.
-- culprit_search.wake_at
--   while bisecting: when a commit whose probe could not validate is due to be probed
--   again (the sweeper advances the search then); NULL when nothing waits.

ALTER TABLE culprit_search
    ADD COLUMN confirmed boolean,
    ADD COLUMN unconfirmed_reason text,
    ADD COLUMN candidate_uri text,
    ADD COLUMN wake_at timestamptz;

-- searches waiting to probe a commit again, for the sweeper
CREATE INDEX culprit_search_wake ON culprit_search (wake_at)
    WHERE state = 'bisecting' AND wake_at IS NOT NULL;
