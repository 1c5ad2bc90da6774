"""At-least-once across SIGKILL: nothing held, in flight or produced is ever lost."""

from __future__ import annotations

import random
import time
from pathlib import Path

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


def test_sigkill_three_times_loses_nothing(kafka_bootstrap: str, migrated_dsn: str,
                                           topic_prefix: str, tmp_path: Path) -> None:
    topics = create_topics(kafka_bootstrap, write_test_topics(tmp_path / "topics.yaml"),
                           topic_prefix)
    prepare_schema(migrated_dsn)
    rng = random.Random(20261201)
    # one in five holds (for 0.3-3 s) before stage 1 publishes it to stage 2
    ids = [f"pipehold:{rng.choice([300, 1000, 3000])}:{i}" if i % 5 == 0 else f"pipe:{i}"
           for i in range(MESSAGES)]
    worker = RuntimeWorker(bootstrap=kafka_bootstrap, dsn=migrated_dsn,
                           topics_file=topics.path, prefix=topics.prefix, log_dir=tmp_path)
    worker.start()
    try:
        # spread over queues, so every partition of `process` is busy
        for q in range(10):
            produce_process(kafka_bootstrap, topics, ids[q::10], queue=f"queue-{q}")
        kills_at_rows: list[int] = []
        for _ in range(KILLS):
            # kill at a random moment once the (re)started worker is making progress
            before = len(sink_rows(migrated_dsn))
            wait_until(lambda before=before: len(sink_rows(migrated_dsn)) > before,
                       timeout=90, what="the worker to make progress", interval=0.1)
            time.sleep(rng.uniform(0.0, 1.0))
            kills_at_rows.append(len(sink_rows(migrated_dsn)))
            worker.kill()
            worker.start()

        def all_arrived() -> bool:
            assert worker.alive(), worker.logs()
            return len(sink_rows(migrated_dsn)) >= MESSAGES

        wait_until(all_arrived, timeout=240, what=f"all {MESSAGES} messages in the sink",
                   interval=0.5)
        rows = sink_rows(migrated_dsn)
        assert set(rows) == set(ids), f"missing: {sorted(set(ids) - set(rows))[:20]}"
        assert all(r["stage"] == "build" for r in rows.values())
        # the kills really hit work in progress (otherwise this proves nothing)
        assert kills_at_rows == sorted(set(kills_at_rows)), kills_at_rows
        assert kills_at_rows[-1] < MESSAGES, kills_at_rows
        duplicates = sum(r["deliveries"] - 1 for r in rows.values())
        print(f"kills at sink sizes {kills_at_rows}; duplicate deliveries absorbed: "
              f"{duplicates}")
    finally:
        worker.stop()
