-- Budgets that hold across processes (issue 23): the hosted APIs' budgets are divided among
-- the live worker *processes*, and a rate limit one of them is answered pauses the
-- credential for all of them. Expand-only: two new tables; workers of earlier versions
-- neither read nor write them (they keep counting `worker_host` rows).
--
-- worker_process    one row per running worker process (an id minted when it starts: its
--                   host id, pid and a random part), heartbeaten every tend. The live
--                   processes are those heartbeaten within the last two heartbeat gaps;
--                   rows of processes long gone are deleted by the heartbeat itself.
-- credential_pause  a credential (a budget's key: provider, API and a hash of the token or
--                   the organization; never a secret) that answered a rate limit, and
--                   until when nobody may call it (by the database's clock).

CREATE TABLE worker_process (
    id           text        PRIMARY KEY,
    host         text        NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX worker_process_heartbeat_idx ON worker_process (heartbeat_at);

CREATE TABLE credential_pause (
    credential text        PRIMARY KEY,
    until      timestamptz NOT NULL
);
