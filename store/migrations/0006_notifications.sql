-- Commit statuses and transition alerts (issue 11): a transactional outbox of
-- notifications, and each queue's greenness and staleness.
--
-- notification   one row per thing to tell the outside world, keyed (queue, key) where the
--                key names the cause, e.g. `status:github_status:<request id>:pending`,
--                `alert:slack:greenness:<transition>`. A row is inserted by the very
--                statement that makes the state change causing it (admission, a fact, a
--                greenness or staleness change) with ON CONFLICT DO NOTHING, so a crash can
--                neither lose nor duplicate the intent and a redelivery adds nothing. The
--                sender (streams/stages/notify.py) claims due rows, posts them and marks
--                them done. Rows of one (queue, channel, stream) are sent in id order: a
--                commit's `pending` before its `success`, a queue's alerts in the order of
--                its transitions. Holds no secret: tokens and webhook URLs stay in the
--                workers' environment.
-- queue_health   per queue: the greenness of its newest validated head (by ingest order)
--                and a transition counter (alert keys), and whether it is stale (its
--                bookmark behind the branch's head for longer than the queue allows).

CREATE TABLE notification (
    id          bigserial   NOT NULL UNIQUE,
    queue       text        NOT NULL,
    key         text        NOT NULL,
    channel     text        NOT NULL,
    stream      text        NOT NULL,
    event       jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    due_at      timestamptz NOT NULL DEFAULT now(),
    attempts    integer     NOT NULL DEFAULT 0,
    done_at     timestamptz,
    outcome     text,
    last_error  text        NOT NULL DEFAULT '',
    PRIMARY KEY (queue, key),
    CONSTRAINT notification_outcome_known CHECK (outcome IS NULL OR outcome IN ('sent', 'given_up')),
    CONSTRAINT notification_done_has_outcome CHECK ((done_at IS NULL) = (outcome IS NULL))
);
-- Only rows still to send are indexed: the sender never reads history.
CREATE INDEX notification_due_idx ON notification (due_at) WHERE done_at IS NULL;
CREATE INDEX notification_stream_idx ON notification (queue, channel, stream, id)
    WHERE done_at IS NULL;

CREATE TABLE queue_health (
    queue              text        PRIMARY KEY,
    greenness          text,
    previous_greenness text,
    decided_request_id text,
    transitions        bigint      NOT NULL DEFAULT 0,
    stale              boolean     NOT NULL DEFAULT false,
    stale_bookmark     text,
    stale_count        bigint      NOT NULL DEFAULT 0,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT queue_health_greenness_known CHECK (
        (greenness IS NULL OR greenness IN ('green', 'red'))
        AND (previous_greenness IS NULL OR previous_greenness IN ('green', 'red')))
);
