"""`stovepipe replay | dlq | parked` on a real broker and database, and `stovepipe request
| queue | fact | retry` against a real worker.

Each test has its own topics (prefix), consumer groups (app id) and schema. Offsets are
checked with a Consumer's `committed`, the way a worker would see them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from contract import ProcessRequest, marshal
from store import Database
from streams.cli import main
from streams.config.topics import TopicsConfig
from streams.runtime import headers as h
from streams.runtime.kafka import producer_conf
from tests.pipeline_support import Pipeline
from tests.runtime_support import create_topics, read_all, write_test_topics
from tests.shared_worker import Lane, lane_queue
from tests.waiting import wait_until

BOOM = "streams.stages.process.Boom"


@dataclass
class Stack:
    bootstrap: str
    config: TopicsConfig
    topics_file: Path
    prefix: str
    app_id: str

    def run(self, *args: str, dsn: str | None = None) -> Result:
        env = {"STOVEPIPE_KAFKA_BOOTSTRAP": self.bootstrap,
               "STOVEPIPE_TOPICS_FILE": str(self.topics_file),
               "STOVEPIPE_TOPIC_PREFIX": self.prefix, "STOVEPIPE_APP_ID": self.app_id}
        if dsn is not None:
            env["STOVEPIPE_POSTGRES_DSN"] = dsn
        result = CliRunner().invoke(main, list(args), env=env)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        assert "Traceback" not in result.output
        return result

    def ok(self, *args: str, dsn: str | None = None) -> Result:
        result = self.run(*args, dsn=dsn)
        assert result.exit_code == 0, result.output
        return result

    def topic(self, entry: str) -> str:
        return self.config.entry(entry).full_name

    def produce(self, entry: str, messages: list[dict[str, Any]]) -> None:
        producer = Producer(producer_conf(self.bootstrap))
        for m in messages:
            producer.produce(self.topic(entry), **m)
        assert producer.flush(30) == 0

    def commit(self, group: str, entry: str, offsets: dict[int, int]) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        request = ConsumerGroupTopicPartitions(
            group, [TopicPartition(self.topic(entry), p, o) for p, o in offsets.items()])
        result = admin.alter_consumer_group_offsets([request])[group].result(timeout=30)
        assert all(tp.error is None for tp in result.topic_partitions or ())

    def committed(self, group: str, entry: str) -> dict[int, int | None]:
        name = self.topic(entry)
        partitions = self.config.entry(entry).partitions
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group,
                             "enable.auto.commit": False})
        try:
            found = consumer.committed([TopicPartition(name, p) for p in range(partitions)],
                                       timeout=10)
        finally:
            consumer.close()
        return {tp.partition: tp.offset if tp.offset >= 0 else None for tp in found}


@pytest.fixture
def stack(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> Stack:
    topics_file = write_test_topics(tmp_path / "topics.yaml", partitions=3)
    config = create_topics(kafka_bootstrap, topics_file, topic_prefix)
    return Stack(kafka_bootstrap, config, topics_file, topic_prefix,
                 app_id=f"{topic_prefix}app-{uuid.uuid4().hex[:6]}")


def _values(n: int, partition: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"key": b"q", "value": marshal(ProcessRequest(id=f"request/q/{partition}-{i}",
                                                          queue_name="q")),
             "partition": partition, **extra} for i in range(n)]


def _dlq_headers(stack: Stack, offset: int, message: str = "boom") -> list[tuple[str, bytes]]:
    return [(h.DLQ_SOURCE_TOPIC, stack.topic("process").encode()),
            (h.DLQ_SOURCE_PARTITION, b"1"), (h.DLQ_SOURCE_OFFSET, str(offset).encode()),
            (h.DLQ_ATTEMPTS, b"3"), (h.DLQ_ERROR_CLASS, BOOM.encode()),
            (h.DLQ_ERROR_MESSAGE, message.encode()),
            (h.DLQ_TIME, b"2025-06-01T12:00:00.000+00:00"), (h.ATTEMPT, b"0")]


@pytest.fixture
def live_member(stack: Stack) -> Iterator[Consumer]:
    """A member of the workers' group that owns `process` partitions (state Stable)."""
    consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": stack.app_id,
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "session.timeout.ms": 10_000})
    consumer.subscribe([stack.topic("process")])

    def assigned() -> bool:
        consumer.poll(0.1)
        return bool(consumer.assignment())

    wait_until(assigned, timeout=30, what="the consumer to join its group")
    yield consumer
    consumer.close()


# --- no broker needed -------------------------------------------------------------------


def test_every_command_has_help() -> None:
    for args in (["replay"], ["dlq"], ["dlq", "list"], ["dlq", "redrive"], ["parked"],
                 ["parked", "list"], ["parked", "delete"], ["parked", "redrive"]):
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage:" in result.output


def test_unknown_topics_are_clear_errors(tmp_path: Path) -> None:
    env = {"STOVEPIPE_TOPICS_FILE": str(write_test_topics(tmp_path / "topics.yaml")),
           "STOVEPIPE_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    runner = CliRunner()
    result = runner.invoke(main, ["replay", "procss", "--to-beginning"], env=env)
    assert result.exit_code == 1
    assert "unknown topic 'procss'" in result.output
    assert "process_dlq" in result.output  # names what is known
    result = runner.invoke(main, ["dlq", "list", "delay_1s"], env=env)
    assert result.exit_code == 1
    assert "delay tier" in result.output
    result = runner.invoke(main, ["replay", "process"], env=env)
    assert result.exit_code == 2
    assert "exactly one of" in result.output
    result = runner.invoke(main, ["replay", "process", "--to-time", "yesterday"], env=env)
    assert result.exit_code == 2
    assert "neither an ISO-8601 time" in result.output


def test_unreachable_broker_is_a_clear_error(tmp_path: Path) -> None:
    env = {"STOVEPIPE_TOPICS_FILE": str(write_test_topics(tmp_path / "topics.yaml"))}
    for args in (["replay", "process", "--to-beginning", "--dry-run"],
                 ["dlq", "list", "process"], ["dlq", "redrive", "process", "--yes"]):
        result = CliRunner().invoke(main, [*args, "--bootstrap", "127.0.0.1:1",
                                           "--timeout", "1"], env=env)
        assert result.exit_code == 1, result.output
        assert "no answer from Kafka at 127.0.0.1:1" in result.output
        assert "Traceback" not in result.output


def test_unreachable_database_is_a_clear_error() -> None:
    result = CliRunner().invoke(main, ["parked", "--dsn",
                                       "postgresql://stovepipe@127.0.0.1:1/stovepipe"])
    assert result.exit_code == 1
    assert "cannot reach PostgreSQL" in result.output
    assert "Traceback" not in result.output


# --- replay -----------------------------------------------------------------------------


@pytest.mark.kafka
def test_replay_dry_run_reports_counts_and_changes_nothing(stack: Stack) -> None:
    stack.produce("process", _values(5, 0) + _values(3, 1))
    stack.commit(stack.app_id, "process", {0: 5, 1: 2})

    result = stack.ok("replay", "process", "--to-beginning", "--dry-run", "--json")
    plan = json.loads(result.stdout)
    assert plan["group"] == stack.app_id
    assert plan["dry_run"] is True
    by_partition = {p["partition"]: p for p in plan["partitions"]}
    assert (by_partition[0]["committed"], by_partition[0]["new"],
            by_partition[0]["replayed"]) == (5, 0, 5)
    assert (by_partition[1]["committed"], by_partition[1]["new"],
            by_partition[1]["replayed"]) == (2, 0, 2)
    assert (by_partition[2]["committed"], by_partition[2]["new"]) == (None, 0)
    assert plan["replayed"] == 7

    text = stack.ok("replay", stack.topic("process"), "--to-offset", "4", "--dry-run")
    assert "replays 1" in text.output  # partition 0: 5 → 4
    assert "skips 1" in text.output  # partition 1: 2 → 3 (kept to its end)
    assert stack.committed(stack.app_id, "process") == {0: 5, 1: 2, 2: None}

    tier = json.loads(stack.ok("replay", "delay_1s", "--to-beginning", "--dry-run",
                               "--json").stdout)
    assert tier["group"] == f"{stack.app_id}-delay"


@pytest.mark.kafka
def test_replay_to_beginning_and_to_offset_move_committed_offsets(stack: Stack) -> None:
    stack.produce("process", _values(5, 0) + _values(3, 1))
    stack.commit(stack.app_id, "process", {0: 5, 1: 3})

    aborted = stack.run("replay", "process", "--to-beginning")  # no --yes, no stdin
    assert aborted.exit_code == 1
    assert stack.committed(stack.app_id, "process") == {0: 5, 1: 3, 2: None}

    result = stack.ok("replay", "process", "--to-beginning", "--yes")
    assert "8 message(s) consumed again" in result.output
    assert stack.committed(stack.app_id, "process") == {0: 0, 1: 0, 2: 0}

    applied = json.loads(stack.ok("replay", "process", "--to-offset", "4", "--yes",
                                  "--json").stdout)
    assert (applied["applied"], applied["replayed"], applied["skipped"]) == (True, 0, 7)
    assert stack.committed(stack.app_id, "process") == {0: 4, 1: 3, 2: 0}  # kept to the end

    stack.ok("replay", "process", "--to-offset", "1", "--partition", "1", "--yes")
    assert stack.committed(stack.app_id, "process") == {0: 4, 1: 1, 2: 0}

    other = f"{stack.app_id}-other"
    stack.ok("replay", "process_dlq", "--to-beginning", "--group", other, "--yes")
    assert stack.committed(other, "process_dlq") == {0: 0, 1: 0}


@pytest.mark.kafka
def test_replay_to_time_iso_and_relative(stack: Stack) -> None:
    now = datetime.now(UTC)
    stamps = [now - timedelta(hours=3), now - timedelta(hours=2), now - timedelta(hours=1),
              now - timedelta(minutes=5)]
    stack.produce("process", [{**_values(1, 0)[0], "timestamp": int(t.timestamp() * 1000)}
                              for t in stamps])
    stack.commit(stack.app_id, "process", {0: 4, 1: 0, 2: 0})

    stack.ok("replay", "process", "--to-time", "-90m", "--yes")
    assert stack.committed(stack.app_id, "process") == {0: 2, 1: 0, 2: 0}

    iso = (now - timedelta(hours=2, minutes=30)).isoformat()
    stack.ok("replay", "process", "--to-time", iso, "--yes")
    assert stack.committed(stack.app_id, "process")[0] == 1

    result = stack.ok("replay", "process", "--to-time", "2999-01-01T00:00:00Z", "--yes")
    assert "no message at or after the time" in result.output
    assert stack.committed(stack.app_id, "process")[0] == 4


@pytest.mark.kafka
def test_replay_refuses_a_group_with_live_members(stack: Stack, live_member: Consumer) -> None:
    stack.produce("process", _values(2, 0))
    before = stack.committed(stack.app_id, "process")

    refused = stack.run("replay", "process", "--to-beginning", "--yes")
    assert refused.exit_code == 1
    assert "1 live member(s)" in refused.output
    assert "would overwrite the reset" in refused.output
    assert "--force" in refused.output

    dry = stack.run("replay", "process", "--to-beginning", "--dry-run")
    assert dry.exit_code == 0
    assert "live member" in dry.output

    forced = stack.run("replay", "process", "--to-beginning", "--force", "--yes")
    assert forced.exit_code == 1
    assert "Kafka refused the reset" in forced.output
    assert "active members" in forced.output
    assert stack.committed(stack.app_id, "process") == before

    live_member.close()  # leaves the group: now the reset goes through
    stack.ok("replay", "process", "--to-beginning", "--yes")
    assert stack.committed(stack.app_id, "process") == {0: 0, 1: 0, 2: 0}


@pytest.mark.kafka
def test_replay_wait_follows_the_group_until_caught_up(stack: Stack) -> None:
    stack.produce("process", _values(4, 0) + _values(2, 2))
    stack.commit(stack.app_id, "process", {0: 4, 1: 0, 2: 2})
    stop = threading.Event()

    def worker() -> None:
        # a stand-in for the workers: joins once the reset is visible, consumes, commits
        wait_until(lambda: stack.committed(stack.app_id, "process")[0] == 0, timeout=30,
                   what="the reset")
        consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": stack.app_id,
                             "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        consumer.subscribe([stack.topic("process")])
        try:
            while not stop.is_set():
                msg = consumer.poll(0.1)
                if msg is not None and msg.error() is None:
                    consumer.commit(message=msg, asynchronous=False)
        finally:
            consumer.close()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        result = stack.ok("replay", "process", "--to-beginning", "--yes", "--wait",
                          "--wait-timeout", "60")
        assert "consumed" in result.output and "to the end" in result.output
        assert time.monotonic() - started < 60
        assert stack.committed(stack.app_id, "process") == {0: 4, 1: 0, 2: 2}
    finally:
        stop.set()
        thread.join(timeout=30)


# --- dlq --------------------------------------------------------------------------------


@pytest.mark.kafka
def test_dlq_list_shows_payload_and_failure_headers(stack: Stack) -> None:
    stack.produce("process_dlq", [
        {"key": b"q", "partition": 0, "headers": _dlq_headers(stack, 7, "boom\nsecond line"),
         "value": marshal(ProcessRequest(id="request/q/7", queue_name="q"))},
        {"key": b"q", "partition": 0, "headers": _dlq_headers(stack, 8),
         "value": b"\xff\x00 not json"},
    ])

    listed = json.loads(stack.ok("dlq", "list", "process", "--json").stdout)
    assert listed["topic"] == stack.topic("process_dlq")
    assert (listed["total"], listed["shown"]) == (2, 2)
    good, bad = listed["messages"]
    assert (good["partition"], good["offset"], good["key"]) == (0, 0, {"text": "q"})
    assert good["payload"] == {"id": "request/q/7", "queue_name": "q"}
    assert good["failure"] == {
        "source_topic": stack.topic("process"), "source_partition": 1, "source_offset": 7,
        "attempts": 3, "error_class": BOOM, "error_message": "boom\nsecond line",
        "time": "2025-06-01T12:00:00.000+00:00"}
    assert bad["payload"] is None
    assert "malformed" in bad["decode_error"]
    assert bad["value"] == {"base64": "/wAgbm90IGpzb24="}

    text = stack.ok("dlq", "list", stack.topic("process_dlq")).output
    assert f"source    {stack.topic('process')} [1] @7, 3 attempt(s)" in text
    assert f"{BOOM}: boom\\nsecond line" in text  # control characters escaped
    assert "undecodable" in text and "b'\\xff\\x00 not json'" in text
    assert "2 of 2 message(s)" in text

    limited = stack.ok("dlq", "list", "process_dlq", "--limit", "1").output
    assert "1 of 2 message(s)" in limited and "1 more" in limited
    # a throwaway reader: the reconciler's group has not moved
    assert stack.committed(stack.app_id, "process_dlq") == {0: None, 1: None}


@pytest.mark.kafka
def test_dlq_redrive_reproduces_to_the_source_topic_with_the_original_key(
        stack: Stack) -> None:
    payloads = [marshal(ProcessRequest(id=f"request/{q}/1", queue_name=q))
                for q in ("qa", "qb", "qc")]
    stack.produce("process_dlq", [
        {"key": b"qa", "value": payloads[0], "partition": 0, "headers": _dlq_headers(stack, 1)},
        {"key": b"qb", "value": payloads[1], "partition": 0, "headers": _dlq_headers(stack, 2)},
        {"key": b"qx", "value": b"garbage", "partition": 0, "headers": _dlq_headers(stack, 3)},
        {"key": b"qc", "value": payloads[2], "partition": 0, "headers": _dlq_headers(stack, 4)},
    ])

    dry = stack.ok("dlq", "redrive", "process", "--dry-run")
    assert "3 would redrive, 1 skipped" in dry.output
    assert "not yet handled by the reconciler" in dry.output
    assert read_all(stack.bootstrap, stack.topic("process"), expect=0, timeout=1) == []

    report = json.loads(stack.ok("dlq", "redrive", "process", "--yes", "--json").stdout)
    assert report["redriven"] == 3
    assert [s["offset"] for s in report["skipped"]] == [2]
    assert report["not_yet_reconciled"] == 3

    redriven = read_all(stack.bootstrap, stack.topic("process"), expect=3)
    assert sorted((m.key(), m.value()) for m in redriven) == list(
        zip((b"qa", b"qb", b"qc"), payloads, strict=True))
    reference = Producer(producer_conf(stack.bootstrap))
    for m in redriven:
        headers = dict(m.headers())
        assert headers[h.ATTEMPT] == b"0"
        assert headers["redriven-from-topic"] == stack.topic("process_dlq").encode()
        assert headers["redriven-from-error-class"] == BOOM.encode()
        assert not [k for k in headers if k.startswith("dlq-")]
        # the partition the workers' murmur2 partitioner picks for that key
        reference.produce(stack.topic("process"), key=m.key(), value=b"ref")
    assert reference.flush(30) == 0
    refs = read_all(stack.bootstrap, stack.topic("process"), expect=6)
    where = {m.key(): m.partition() for m in refs if m.value() == b"ref"}
    assert all(m.partition() == where[m.key()] for m in redriven)


@pytest.mark.kafka
def test_dlq_redrive_skip_reconciler_moves_its_group_up_to_the_first_skipped(
        stack: Stack) -> None:
    good = marshal(ProcessRequest(id="request/q/1", queue_name="q"))
    stack.produce("process_dlq", [
        {"key": b"q", "value": good, "partition": 0},  # no headers: the DLQ's stage topic
        {"key": b"q", "value": good, "partition": 0},
        {"key": b"q", "value": b"{", "partition": 0},
        {"key": b"q", "value": good, "partition": 0},
    ])
    result = stack.ok("dlq", "redrive", "process_dlq", "--yes", "--skip-reconciler")
    assert "3 redriven, 1 skipped" in result.output
    assert stack.committed(stack.app_id, "process_dlq") == {0: 2, 1: None}
    assert len(read_all(stack.bootstrap, stack.topic("process"), expect=3)) == 3


@pytest.mark.kafka
def test_dlq_redrive_skip_reconciler_refuses_a_live_group(stack: Stack) -> None:
    stack.produce("process_dlq", _values(1, 0))
    consumer = Consumer({"bootstrap.servers": stack.bootstrap, "group.id": stack.app_id,
                         "enable.auto.commit": False})
    consumer.subscribe([stack.topic("process_dlq")])
    try:
        def assigned() -> bool:
            consumer.poll(0.1)
            return bool(consumer.assignment())

        wait_until(assigned, timeout=30, what="the consumer to join its group")
        result = stack.run("dlq", "redrive", "process", "--yes", "--skip-reconciler")
        assert result.exit_code == 1
        assert "live member" in result.output and "Nothing was redriven" in result.output
    finally:
        consumer.close()
    assert read_all(stack.bootstrap, stack.topic("process"), expect=0, timeout=1) == []


# --- parked -----------------------------------------------------------------------------


def _park(dsn: str, rows: list[dict[str, Any]]) -> list[int]:
    async def run() -> list[int]:
        db = await Database.open(dsn, max_size=1)
        try:
            return [(await db.parked.park(**row)).id for row in rows]
        finally:
            await db.close()

    return asyncio.run(run())


@pytest.mark.kafka
@pytest.mark.postgres
def test_parked_list_delete_and_redrive(stack: Stack, migrated_dsn: str) -> None:
    dlq = stack.topic("process_dlq")
    first, second, other = _park(migrated_dsn, [
        {"topic": dlq, "partition": 0, "offset": 3, "key": b"q", "value": b"\xff{",
         "headers": [(h.DLQ_ERROR_CLASS, BOOM.encode()), (h.ATTEMPT, b"4")],
         "error": "MalformedPayload: malformed ProcessRequest payload: not UTF-8"},
        {"topic": dlq, "partition": 1, "offset": 9, "key": b"q2", "value": b"nope",
         "error": "MalformedPayload: not JSON"},
        {"topic": stack.topic("build_dlq"), "partition": 0, "offset": 1, "key": b"r",
         "value": b"x", "error": "MalformedPayload"},
    ])

    listed = json.loads(stack.ok("parked", "--json", dsn=migrated_dsn).stdout)
    assert [m["id"] for m in listed["messages"]] == [first, second, other]
    assert listed["messages"][0]["value"] == {"base64": "/3s="}
    assert listed["messages"][0]["error"].startswith("MalformedPayload")

    only = json.loads(stack.ok("parked", "list", "--topic", "process", "--json",
                               dsn=migrated_dsn).stdout)
    assert (only["topic"], only["total"]) == (dlq, 2)
    text = stack.ok("parked", "--limit", "1", dsn=migrated_dsn).output
    assert f"#{first}" in text and "not UTF-8" in text and f"--after-id {first}" in text

    stack.ok("parked", "delete", str(other), "--yes", dsn=migrated_dsn)
    gone = stack.run("parked", "delete", str(other), "--yes", dsn=migrated_dsn)
    assert gone.exit_code == 1 and f"no parked message #{other}" in gone.output

    stack.ok("parked", "redrive", str(first), "--yes", dsn=migrated_dsn)
    [msg] = read_all(stack.bootstrap, dlq, expect=1)
    assert (msg.partition() in (0, 1), msg.key(), msg.value()) == (True, b"q", b"\xff{")
    headers = dict(msg.headers())
    assert headers[h.ATTEMPT] == b"0"
    assert headers[h.DLQ_ERROR_CLASS] == BOOM.encode()  # still says why it failed
    assert headers["redriven-from-parked-id"] == str(first).encode()
    remaining = json.loads(stack.ok("parked", "--json", dsn=migrated_dsn).stdout)
    assert [m["id"] for m in remaining["messages"]] == [second]


@pytest.mark.postgres
def test_parked_on_an_unmigrated_database_says_what_to_run(schema_dsn: str) -> None:
    result = CliRunner().invoke(main, ["parked", "--dsn", schema_dsn])
    assert result.exit_code == 1
    assert "stovepipe db migrate" in result.output


# --- request, queue, fact, retry --------------------------------------------------------

SHORT = "cli/main"  # a poll deadline of 2 s, and no re-attempt of an unvalidated attempt
SLOW = "cli/slow"


def _wait_fact(pipeline: Pipeline, request_id: str) -> None:
    pipeline.wait_terminal([request_id])
    wait_until(lambda: bool(pipeline.query(
        "SELECT 1 FROM validation_fact WHERE request_id = %s", request_id)),
        timeout=60, what=f"the fact of {request_id}")


def _lines(pipeline: Pipeline, *args: str) -> list[str]:
    return pipeline.cli(*args).stdout.splitlines()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
@lane_queue(SHORT, poll_deadline="2s", retry={"unvalidated": 0})
def test_a_failure_says_whether_it_is_a_red_verdict_and_a_commit_can_be_validated_again(
        lane: Lane) -> None:
    short, ref = lane.name(SHORT), lane.ref(SHORT)

    def uri(sha: str) -> str:
        return f"fake://r/{ref}/{sha}"

    lane.repo.push(ref, "a1")
    assert lane.ingest(short) == f"request/{short}/1"
    lane.wait_quiet()

    # never started within the poll deadline: it could not be validated, no fact
    lane.repo.push(ref, "b2-queued100")
    unvalidated = lane.ingest(short)
    lane.wait_terminal([unvalidated])
    why = ("at the start deadline (2s since its trigger, never started) it was queued for "
           "an agent")
    reason = f"could not be validated (1 attempt): {why}"
    shown = lane.request(unvalidated)
    assert (shown["request"]["state"], shown["request"]["verdict"],
            shown["request"]["reason"], shown["request"]["attempt"]) == (
        "failed", None, reason, 1)
    assert (shown["fact"], shown["commit_fact"], shown["green"]) == (None, None, False)
    [build] = shown["builds"]
    assert (build["attempt"], build["status"], build["verdict"]) == (1, "failed", None)
    text = _lines(lane, "request", unvalidated)
    assert text[0] == f"{unvalidated}  failed — {reason}"
    assert f"  attempt 1  {build['id']}  failed  could not validate: {why}" in text
    assert "  fact      none" in text and "  attempts  1" in text
    assert _lines(lane, "queue", short)[-1] == (
        f"  latest      {unvalidated}  failed — {reason}")
    queue = json.loads(lane.cli("queue", short, "--json").stdout)
    assert (queue["latest_request"]["id"], queue["latest_request"]["reason"]) == (
        unvalidated, reason)
    answer = lane.cli("fact", short, "b2", check=False)
    assert answer.returncode == 3
    assert f"  newest request {unvalidated}: {reason}" in answer.stdout.splitlines()

    # ran past the poll deadline: a red verdict
    lane.repo.push(ref, "c3-latchC3")
    red = lane.ingest(short)
    _wait_fact(lane, red)
    text = _lines(lane, "request", red)
    assert text[0] == f"{red}  failed (red verdict)"
    assert "  verdict   red" in text and "  kind      head" in text
    assert "  reason    it ran past the poll deadline (2s since it started)" in text
    assert f"  fact      degree 1 (red) by {red}" in text

    # validated again once the build can finish: green, the red fact still readable
    lane.release("C3")
    assert lane.cli("retry", short, "c3").stdout == f"request/{short}/3.2\n"
    _wait_fact(lane, f"request/{short}/3.2")
    first = lane.request(red)
    assert (first["fact"]["request_id"], first["fact"]["degree"]) == (red, 1)
    assert (first["commit_fact"]["request_id"], first["commit_fact"]["degree"]) == (
        f"request/{short}/3.2", 0)
    assert first["green"] is True
    text = _lines(lane, "request", red)
    assert f"  answer    degree 0 (green) by request/{short}/3.2 (the commit's answer now)" \
        in text
    assert f"  newest    request/{short}/3.2  succeeded" in text
    again = lane.request(f"request/{short}/3.2")
    assert (again["request"]["kind"], again["request"]["verdict"],
            again["fact"]["request_id"]) == ("retry", "green", f"request/{short}/3.2")
    assert lane.cli("fact", short, "c3").returncode == 0

    refused = lane.cli("retry", short, "c3", check=False)
    assert refused.returncode == 4, refused.stderr
    assert refused.stdout == "" and f"fact of request/{short}/3.2" in refused.stderr
    assert "never validated again" in refused.stderr and "Traceback" not in refused.stderr
    refused = lane.cli("retry", short, uri("c3-latchC3"), "--json", check=False)
    assert refused.returncode == 4
    assert json.loads(refused.stdout)["fact"]["request_id"] == f"request/{short}/3.2"

    # the commit that could not be validated, validated again
    retried = json.loads(lane.cli("retry", short, "b2", "--json").stdout)
    assert retried == {"queue": short, "uri": uri("b2-queued100"),
                       "request_id": f"request/{short}/2.2", "new": True,
                       "previous_id": unvalidated}
    lane.wait_terminal([f"request/{short}/2.2"])

    lane.repo.push(ref, "d4")  # never ingested
    for args, message in ((("zz",), "has no commit 'zz'"), (("a b",), "not a fake sha"),
                          (("d4",), "never ingested")):
        result = lane.cli("retry", short, *args, check=False)
        assert result.returncode == 1, result
        assert message in result.stderr and "Traceback" not in result.stderr
    result = lane.cli("retry", "no/such", check=False)
    assert result.returncode == 1 and "unknown queue" in result.stderr


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
@lane_queue(SLOW)
def test_retry_of_a_commit_being_validated_names_that_request(lane: Lane) -> None:
    slow, ref = lane.name(SLOW), lane.ref(SLOW)
    lane.repo.push(ref, "s1-latchS1")
    nothing = lane.cli("retry", slow, check=False)
    assert nothing.returncode == 1 and "has no head yet" in nothing.stderr
    building = lane.ingest(slow)
    wait_until(lambda: lane.states().get(building) == "processing", timeout=60,
               what=f"{building} to be building")
    same = lane.cli("retry", slow)
    assert same.stdout == f"{building}\n"
    assert f"{building} is validating fake://r/{ref}/s1-latchS1 now" in same.stderr
    lane.release("S1")
    lane.wait_quiet()
    assert lane.cli("retry", slow, check=False).returncode == 4  # the head is green
    assert lane.states() == {building: "succeeded"}
