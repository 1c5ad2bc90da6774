-- The command build runner's shared state (streams/extensions/buildrunner/command.py):
-- one row per build, so any worker on any machine answers its status and cancel, while
-- the build itself runs on the host that triggered it.
--
-- host                 the owning host's id: only it launches, watches and stops the
--                      process, and only it writes the columns below `work_dir`
--                      (other hosts write `cancel_requested_at`, and `status` when the
--                      owner stopped heartbeating).
-- trigger_key          the trigger's key (the Request id): a trigger repeated after a
--                      crash, on any host, returns the build already started for it.
-- pid, pgid, proc_start_time
--                      the build's wrapper shell, its process group and its start time
--                      (clock ticks since the owner's boot): facts of the owner's machine.
-- heartbeat_at         the database's time of the owner's last sign of life for this
--                      build: renewed every few seconds while it is not terminal. A
--                      build whose heartbeat is older than its runner's host_timeout is
--                      failed (reason 'host_lost') by whichever host asks about it.
-- log_tail             the end of the build's log (a few KiB), as the owner last saw it.
-- status               write-once once terminal, like build.status.

CREATE TABLE command_build (
    build_id            text        PRIMARY KEY,
    queue               text        NOT NULL,
    request_id          text        NOT NULL DEFAULT '',
    trigger_key         text,
    host                text        NOT NULL,
    work_dir            text        NOT NULL,
    status              text        NOT NULL DEFAULT 'accepted',
    reason              text        NOT NULL DEFAULT 'queued',
    detail              text        NOT NULL DEFAULT '',
    pid                 integer,
    pgid                integer,
    proc_start_time     bigint,
    exit_code           integer,
    log_tail            text        NOT NULL DEFAULT '',
    created_at          timestamptz NOT NULL DEFAULT now(),
    started_at          timestamptz,
    heartbeat_at        timestamptz NOT NULL DEFAULT now(),
    cancel_requested_at timestamptz,
    finished_at         timestamptz,
    CONSTRAINT command_build_trigger_key_unique UNIQUE (trigger_key),
    CONSTRAINT command_build_status_known CHECK (
        status IN ('accepted', 'running', 'succeeded', 'failed', 'cancelled'))
);

-- Each owner's tend reads and heartbeats only its own live rows: never a scan of history.
CREATE INDEX command_build_live_idx ON command_build (host, work_dir)
    WHERE status IN ('accepted', 'running');

CREATE FUNCTION command_build_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.build_id <> OLD.build_id OR NEW.host <> OLD.host
       OR NEW.work_dir <> OLD.work_dir THEN
        RAISE EXCEPTION 'command build %: build_id, host and work_dir are immutable',
                        OLD.build_id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'command_build_identity_immutable';
    END IF;
    IF OLD.status IN ('succeeded', 'failed', 'cancelled') AND NEW.status <> OLD.status THEN
        RAISE EXCEPTION 'command build %: terminal status % is write-once (got %)',
                        OLD.build_id, OLD.status, NEW.status
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'command_build_status_write_once';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER command_build_guard BEFORE UPDATE ON command_build
    FOR EACH ROW EXECUTE FUNCTION command_build_guard();
