-- Push webhook deliveries already ingested, so a delivery the provider sends again (a
-- retry, a manual redelivery, two at once) ingests nothing more.
--
-- A delivery is claimed by inserting its row ('ingesting', with the claimant's token);
-- the claimant marks it 'ingested' with the Request ids, or deletes it when the ingest
-- failed, so the provider's retry may try again. A claim whose claimant died is taken
-- over once `claimed_at` is old (the handler's own deadline is far shorter). Rows are
-- kept for a week (GitHub lets a delivery be redelivered for 3 days), deleted a few at a
-- time by later claims through the `received_at` index.
CREATE TABLE webhook_delivery (
    provider    text        NOT NULL,
    delivery_id text        NOT NULL,
    state       text        NOT NULL DEFAULT 'ingesting',
    claim       uuid        NOT NULL,
    request_ids text[]      NOT NULL DEFAULT '{}',
    received_at timestamptz NOT NULL DEFAULT now(),
    claimed_at  timestamptz NOT NULL DEFAULT now(),
    ingested_at timestamptz,
    PRIMARY KEY (provider, delivery_id),
    CONSTRAINT webhook_delivery_provider_known CHECK (provider IN ('github', 'gitlab')),
    CONSTRAINT webhook_delivery_state_known CHECK (state IN ('ingesting', 'ingested')),
    CONSTRAINT webhook_delivery_ingested_when CHECK (
        (state = 'ingested') = (ingested_at IS NOT NULL))
);

CREATE INDEX webhook_delivery_received_at ON webhook_delivery (received_at);
