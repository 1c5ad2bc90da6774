"""Every outcome of the delivery runtime, end to end on the real broker and database.

A real worker process runs `tests.apps.runtime_worker`; the test only produces to its
topics, reads its DLQ topics and queries its tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from streams.config.topics import TopicsConfig
from streams.runtime import headers as h
from tests.runtime_support import (
    RuntimeWorker,
    create_topics,
    prepare_schema,
    produce_process,
    read_all,
    sink_rows,
    write_test_topics,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres]


@pytest.fixture
def topics(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> TopicsConfig:
    return create_topics(kafka_bootstrap, write_test_topics(tmp_path / "topics.yaml"),
                         topic_prefix)


@pytest.fixture
def worker(kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
           tmp_path: Path) -> Iterator[RuntimeWorker]:
    prepare_schema(migrated_dsn)
    w = RuntimeWorker(bootstrap=kafka_bootstrap, dsn=migrated_dsn, topics_file=topics.path,
                      prefix=topics.prefix, log_dir=tmp_path)
    w.start()
    try:
        yield w
    finally:
        w.stop()


def _wait_sink(dsn: str, worker: RuntimeWorker, ids: set[str], timeout: float = 60) -> dict:
    rows: dict = {}

    def done() -> bool:
        nonlocal rows
        assert worker.alive(), worker.logs()
        rows = sink_rows(dsn)
        return ids <= set(rows)

    wait_until(done, timeout=timeout, what=f"{sorted(ids)} in the sink")
    return rows


def test_ack(kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
             worker: RuntimeWorker) -> None:
    ids = [f"ack:{i}" for i in range(10)]
    produce_process(kafka_bootstrap, topics, ids)
    rows = _wait_sink(migrated_dsn, worker, set(ids))
    assert all(rows[i]["attempt"] == 0 and rows[i]["stage"] == "process" for i in ids)


def test_hold_comes_back_never_early_and_costs_no_attempt(
        kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
        worker: RuntimeWorker) -> None:
    ids = [f"hold:{ms}:{i}" for i, ms in enumerate([50, 300, 1200, 2500])]
    produce_process(kafka_bootstrap, topics, [*ids, "ack:behind-the-holds"])
    rows = _wait_sink(migrated_dsn, worker, {*ids, "ack:behind-the-holds"})
    with psycopg.connect(migrated_dsn) as conn:
        held = dict(conn.execute("SELECT id, held_at FROM runtime_held").fetchall())
    for ident in ids:
        delay_s = int(ident.split(":")[1]) / 1000
        waited = (rows[ident]["received_at"] - held[ident]).total_seconds()
        assert waited >= delay_s, f"{ident} came back after {waited:.3f}s, before its delay"
        assert rows[ident]["attempt"] == 0, "a hold must not count as a failed attempt"
    # a held message does not block the partition: the ack behind it went first
    assert rows["ack:behind-the-holds"]["received_at"] < rows["hold:2500:3"]["received_at"]


def test_retryable_then_success(kafka_bootstrap: str, migrated_dsn: str,
                                topics: TopicsConfig, worker: RuntimeWorker) -> None:
    produce_process(kafka_bootstrap, topics, ["retry:2:a", "ack:after-retry"])
    rows = _wait_sink(migrated_dsn, worker, {"retry:2:a", "ack:after-retry"})
    assert rows["retry:2:a"]["attempt"] == 2
    # the retrying message did not stall its partition
    assert rows["ack:after-retry"]["received_at"] < rows["retry:2:a"]["received_at"]
    assert read_all(kafka_bootstrap, topics.dead_letter("process").full_name, 0,
                    timeout=1) == []


def _dlq_headers(msg) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    return {k: v for k, v in msg.headers() or []}


def test_retryable_exhausted_goes_to_dlq_with_every_header(
        kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
        worker: RuntimeWorker) -> None:
    produce_process(kafka_bootstrap, topics, ["retryforever:x"], queue="qx")
    dlq = topics.dead_letter("process").full_name
    [msg] = read_all(kafka_bootstrap, dlq, 1, timeout=60)
    hdrs = _dlq_headers(msg)
    assert msg.key() == b"qx"
    assert b"retryforever:x" in msg.value()
    assert hdrs[h.DLQ_SOURCE_TOPIC] == topics.stage("process").full_name.encode()
    assert int(hdrs[h.DLQ_SOURCE_PARTITION]) >= 0
    assert int(hdrs[h.DLQ_SOURCE_OFFSET]) >= 0
    assert hdrs[h.DLQ_ATTEMPTS] == b"3"  # max_attempts in the test topics.yaml
    assert hdrs[h.DLQ_ERROR_CLASS].endswith(b"RetryableError")
    assert b"always fails" in hdrs[h.DLQ_ERROR_MESSAGE]
    assert hdrs[h.DLQ_TIME].startswith(b"20")


def test_non_retryable_goes_straight_to_dlq(kafka_bootstrap: str, migrated_dsn: str,
                                            topics: TopicsConfig,
                                            worker: RuntimeWorker) -> None:
    produce_process(kafka_bootstrap, topics, ["fatal:1"])
    [msg] = read_all(kafka_bootstrap, topics.dead_letter("process").full_name, 1, timeout=60)
    hdrs = _dlq_headers(msg)
    assert hdrs[h.DLQ_ATTEMPTS] == b"1"
    assert hdrs[h.DLQ_ERROR_CLASS].endswith(b"Boom")


def test_undecodable_goes_to_dlq_with_original_bytes(kafka_bootstrap: str, migrated_dsn: str,
                                                     topics: TopicsConfig,
                                                     worker: RuntimeWorker) -> None:
    garbage = b"\xff{not json"
    produce_process(kafka_bootstrap, topics, ["ack:after-garbage"], raw=[garbage])
    [msg] = read_all(kafka_bootstrap, topics.dead_letter("process").full_name, 1, timeout=60)
    assert msg.value() == garbage
    assert _dlq_headers(msg)[h.DLQ_ERROR_CLASS].endswith(b"MalformedPayload")
    _wait_sink(migrated_dsn, worker, {"ack:after-garbage"})


def test_reconciler_retries_until_success_and_never_dead_letters(
        kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
        worker: RuntimeWorker) -> None:
    dlq = topics.dead_letter("process").full_name
    produce_process(kafka_bootstrap, topics, ["recon:4:a"], topic=dlq)
    rows = _wait_sink(migrated_dsn, worker, {"recon:4:a"})
    assert rows["recon:4:a"]["stage"] == "process_dlq"
    assert rows["recon:4:a"]["attempt"] == 4  # failed 4 times (more than park_after), then won
    assert not [t for t in topics.all_topics() if t.full_name.endswith("_dlq_dlq")]


def test_reconciler_parks_what_fails_for_good_after_park_after_attempts(
        kafka_bootstrap: str, migrated_dsn: str, topics: TopicsConfig,
        worker: RuntimeWorker) -> None:
    dlq = topics.dead_letter("process").full_name
    produce_process(kafka_bootstrap, topics, ["reconfatal:x"], topic=dlq)
    produce_process(kafka_bootstrap, topics, ["recon:0:after"], topic=dlq)
    _wait_sink(migrated_dsn, worker, {"recon:0:after"})

    def parked() -> list[tuple[str, str]]:
        with psycopg.connect(migrated_dsn) as conn:
            return conn.execute("SELECT topic, error FROM parked_message").fetchall()

    wait_until(lambda: len(parked()) == 1, timeout=60, what="the message parked")
    [(topic, error)] = parked()
    assert topic == dlq
    assert error == "after 3 attempt(s): Boom: reconciler attempt 2 fails for good"


def test_reconciler_parks_undecodable_and_goes_on(kafka_bootstrap: str, migrated_dsn: str,
                                                  topics: TopicsConfig,
                                                  worker: RuntimeWorker) -> None:
    dlq = topics.dead_letter("process").full_name
    produce_process(kafka_bootstrap, topics, [], raw=[b"[1,2,3]"], topic=dlq)
    produce_process(kafka_bootstrap, topics, ["recon:0:next"], topic=dlq)
    _wait_sink(migrated_dsn, worker, {"recon:0:next"})
    with psycopg.connect(migrated_dsn) as conn:
        parked = conn.execute("SELECT topic, value, error FROM parked_message").fetchall()
    assert [(t, bytes(v)) for t, v, _ in parked] == [(dlq, b"[1,2,3]")]
    assert "MalformedPayload" in parked[0][2]
