"""At-least-once across SIGKILL: nothing held, in flight or produced is ever lost."""

from __future__ import annotations

import random
import time
from pathlib import Path

import psycopg
import pytest

from tests.runtime_support import (
    RuntimeWorker,
    create_topics,
    prepare_schema,
    produce_process,
    sink_rows,
    write_test_topics,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

MESSAGES = 1000
KILLS = 3


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def test_sigkill_three_times_loses_nothing(kafka_bootstrap: str, migrated_dsn: str,
                                           topic_prefix: str, tmp_path: Path) -> None:
    """Work keeps flowing across every kill: a batch is produced before each, and stage 2
    holds every message behind a latch until the last kill, so each kill lands with
    messages in the partitions, in the delay tiers and in flight — however fast or slow
    the machine is — and only then are they let through."""
    topics = create_topics(kafka_bootstrap, write_test_topics(tmp_path / "topics.yaml"),
                           topic_prefix)
    prepare_schema(migrated_dsn)
    rng = random.Random(20261201)
    # one in five holds (for 0.3-3 s) before stage 1 publishes it to stage 2
    ids = [f"pipeholdlatch:{rng.choice([300, 1000, 3000])}:{i}" if i % 5 == 0
           else f"pipelatch:{i}" for i in range(MESSAGES)]
    batches = [ids[k::KILLS + 1] for k in range(KILLS + 1)]
    worker = RuntimeWorker(bootstrap=kafka_bootstrap, dsn=migrated_dsn,
                           topics_file=topics.path, prefix=topics.prefix, log_dir=tmp_path)
    worker.start()
    try:
        kills_at: list[int] = []
        for batch in batches[:KILLS]:
            # spread over queues, so every partition of `process` is busy
            for q in range(10):
                produce_process(kafka_bootstrap, topics, batch[q::10], queue=f"queue-{q}")
            # kill at a random moment once the (re)started worker is moving the batch
            before = _count(migrated_dsn, "runtime_arrived")
            wait_until(lambda before=before: _count(migrated_dsn, "runtime_arrived") > before,
                       timeout=90, what="the worker to make progress", interval=0.1)
            time.sleep(rng.uniform(0.0, 1.0))
            kills_at.append(_count(migrated_dsn, "runtime_arrived"))
            worker.kill()
            worker.start()
        for q in range(10):
            produce_process(kafka_bootstrap, topics, batches[KILLS][q::10], queue=f"queue-{q}")
        assert _count(migrated_dsn, "runtime_sink") == 0  # everything was held until now
        with psycopg.connect(migrated_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO runtime_latch (name) VALUES ('build')")

        def all_arrived() -> bool:
            assert worker.alive(), worker.logs()
            return len(sink_rows(migrated_dsn)) >= MESSAGES

        wait_until(all_arrived, timeout=240, what=f"all {MESSAGES} messages in the sink",
                   interval=0.5)
        rows = sink_rows(migrated_dsn)
        assert set(rows) == set(ids), f"missing: {sorted(set(ids) - set(rows))[:20]}"
        assert all(r["stage"] == "build" for r in rows.values())
        assert kills_at == sorted(kills_at), kills_at
        duplicates = sum(r["deliveries"] - 1 for r in rows.values())
        print(f"kills with {kills_at} messages arrived at stage 2 (all held); duplicate "
              f"deliveries absorbed: {duplicates}")
    finally:
        worker.stop()
