-- A trace per Request (issue 25; design §12): the id of the trace its ingest began (32 hex
-- digits, W3C trace context), so `stovepipe request` can name it. NULL when tracing was
-- off, or for a Request of the release before. Expand-only.
ALTER TABLE request ADD COLUMN trace_id text;
