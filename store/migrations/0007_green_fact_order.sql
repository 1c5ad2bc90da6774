-- A deploy gate asks for the green commits of a queue nearest a given one (the newest
-- green ancestor, the oldest green descendant): walk the queue's green facts by ingest
-- order, in either direction, on an index rather than a scan of the facts.
CREATE INDEX validation_fact_green_order ON validation_fact (queue, request_seq(request_id))
    WHERE degree = 0 AND project = '';
