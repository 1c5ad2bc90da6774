-- Pins that hold or say so (issue 23, item 7). Expand-only.
--
-- promotion_problem: per queue, why the promotion ref is not where the queue says it
-- belongs (the pin, else the bookmark) — the last failed move, with when — until a move
-- succeeds. `stovepipe queue` and the API show it beside the ref's actual target, and the
-- sweeper keeps settling such a queue (and every pinned one) by compare-and-set.
--
-- promotion_pin.rolled_back_reason: a pin whose ref could not be moved is rolled back
-- (the queue's pin is what it was before), and its history row says why.

CREATE TABLE promotion_problem (
    queue  text        PRIMARY KEY,
    reason text        NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE promotion_pin ADD COLUMN rolled_back_reason text;

-- the pinned queues, for the sweeper (never a scan of every queue)
CREATE INDEX queue_pinned ON queue (name) WHERE pinned_uri IS NOT NULL;
