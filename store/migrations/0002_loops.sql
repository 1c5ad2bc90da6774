-- Liveness (design §6): which chain of held messages is a Request's gate loop or a
-- Build's poll loop is recorded on the row, never decided from clocks or memory.
--
-- loop_token   the token the live loop's messages carry; a message with another token
--              belongs to a duplicate loop and ends. A loop takes a new token (its
--              heartbeat) every few seconds, so duplicates of one token die out too.
-- loop_seen_at the database's time of the last take-over or heartbeat: the sweeper
--              re-publishes a non-terminal row whose loop has not been seen for longer
--              than its queue's delays allow. Written without bumping `version`, so a
--              heartbeat never makes a state change's compare-and-set fail.
--
-- The partial indexes hold only the live rows, so the sweeper's queries never read
-- history however long it grows.

ALTER TABLE request
    ADD COLUMN loop_token   text        NOT NULL DEFAULT '',
    ADD COLUMN loop_seen_at timestamptz NOT NULL DEFAULT now();

ALTER TABLE build
    ADD COLUMN loop_token   text        NOT NULL DEFAULT '',
    ADD COLUMN loop_seen_at timestamptz NOT NULL DEFAULT now();

CREATE INDEX request_live_idx ON request (loop_seen_at)
    WHERE state IN ('accepted', 'processing');
CREATE INDEX build_live_idx ON build (loop_seen_at)
    WHERE status IN ('accepted', 'running');
