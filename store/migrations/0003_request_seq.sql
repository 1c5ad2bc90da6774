-- The ingest order of a request id (`request/<queue>/<n>` -> n), so that the pipeline's
-- state changes can check "newer than" inside the statement that writes (design §5):
-- admission (no newer Request is the queue's latest), the latest pointer and the
-- bookmark (each only moves forward). Mirrors store.entities.request_seq.
CREATE FUNCTION request_seq(request_id text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$ SELECT substring(request_id FROM '/([0-9]+)$')::bigint $$;

-- The bookmark only moves forward by ingest order: enforced here as well, since a single
-- statement now checks and moves it.
CREATE OR REPLACE FUNCTION queue_bookmark_guard() RETURNS trigger LANGUAGE plpgsql
    SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.name <> OLD.name THEN
            RAISE EXCEPTION 'queue %: name is immutable', OLD.name
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_identity_immutable';
        END IF;
        IF NEW.last_green_request_id IS NOT DISTINCT FROM OLD.last_green_request_id
           AND NEW.last_green_uri IS NOT DISTINCT FROM OLD.last_green_uri THEN
            RETURN NEW;
        END IF;
        IF NEW.last_green_request_id IS NULL THEN
            RAISE EXCEPTION 'queue %: the last-green bookmark cannot be cleared', OLD.name
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_bookmark_names_green_fact';
        END IF;
        IF OLD.last_green_request_id IS NOT NULL
           AND request_seq(NEW.last_green_request_id)
               <= request_seq(OLD.last_green_request_id) THEN
            RAISE EXCEPTION 'queue %: the bookmark only moves forward (% is not newer than %)',
                            OLD.name, NEW.last_green_request_id, OLD.last_green_request_id
                USING ERRCODE = 'integrity_constraint_violation',
                      CONSTRAINT = 'queue_bookmark_forward_only';
        END IF;
    END IF;
    IF NEW.last_green_request_id IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM validation_fact f
         WHERE f.queue = NEW.name AND f.uri = NEW.last_green_uri AND f.project = ''
           AND f.degree = 0 AND f.request_id = NEW.last_green_request_id
    ) THEN
        RAISE EXCEPTION 'queue %: bookmark % (%) names no green fact',
                        NEW.name, NEW.last_green_uri, NEW.last_green_request_id
            USING ERRCODE = 'integrity_constraint_violation',
                  CONSTRAINT = 'queue_bookmark_names_green_fact';
    END IF;
    RETURN NEW;
END
$$;
