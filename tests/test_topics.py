"""topics.yaml: loading and validation, and `stovepipe topics` on the real broker."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)
from hypothesis import given
from hypothesis import strategies as st

from contract import BuildSignal, ProcessRequest, TopicKey, payload_type
from streams.cli.topics import topics_group
from streams.config import settings as settings_mod
from streams.config.topics import DelayTier, RetryPolicy, TopicsConfigError, load_topics
from streams.runtime.topic_admin import TopicState, admin_conf_for, ensure_topics
from streams.schema.durations import format_duration, parse_duration
from tests.waiting import wait_until

TOPICS_YAML = settings_mod.REPO_ROOT / "topics.yaml"


@pytest.fixture
def shipped() -> dict[str, Any]:
    return yaml.safe_load(TOPICS_YAML.read_text())


def _write(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "topics.yaml"
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


# --- the shipped file -----------------------------------------------------------------


def test_shipped_file_declares_every_key_and_its_dlq() -> None:
    config = load_topics(TOPICS_YAML, prefix="p.")
    for key in TopicKey:
        stage, dead = config.stage(key), config.dead_letter(key)
        assert stage.full_name == f"p.{key.value}"
        assert dead.full_name == f"p.{key.dlq}"
        assert stage.payload is dead.payload is payload_type(key)
        assert stage.key_field == dead.key_field
        assert stage.dlq and not stage.retry.forever
        assert config.dead_letter_for(stage) is dead
        assert not dead.dlq and dead.retry.forever and dead.is_dead_letter
        assert config.dead_letter_for(dead) is None
        assert config.by_name(stage.full_name) is stage
        assert config.entry(key.dlq) is dead
    assert [t.delay for t in config.delay_tiers] == [
        timedelta(seconds=s) for s in (1, 5, 30, 120)
    ]
    assert isinstance(config.by_name("p.delay_5s"), DelayTier)
    assert len(config.all_topics()) == 2 * len(TopicKey) + 4
    with pytest.raises(KeyError):
        config.by_name("process")  # full names only


def test_shipped_retention_keeps_stage_topics_days_dead_letters_longer_tiers_short() -> None:
    config = load_topics(TOPICS_YAML, prefix="p.")
    day = 24 * 3600 * 1000
    for key in TopicKey:
        assert config.stage(key).config == {"retention.ms": str(7 * day),
                                            "cleanup.policy": "delete"}
        assert config.dead_letter(key).config == {"retention.ms": str(30 * day),
                                                  "cleanup.policy": "delete"}
    for tier in config.delay_tiers:
        assert tier.config == {"retention.ms": str(day), "segment.ms": str(3600 * 1000),
                               "cleanup.policy": "delete"}


@pytest.mark.parametrize(("written", "stored"), [
    ("7d", "604800000"), ("1h30m", "5400000"), (86400000, "86400000"), (-1, "-1"),
    ("-1", "-1")])
def test_a_ms_config_may_be_a_duration(tmp_path: Path, shipped: dict[str, Any],
                                       written: Any, stored: str) -> None:
    shipped["topics"]["build"]["config"] = {"retention.ms": written, "max.message.bytes": 1024}
    config = load_topics(_write(tmp_path, shipped), prefix="p.")
    assert config.stage("build").config["retention.ms"] == stored
    assert config.stage("build").config["max.message.bytes"] == "1024"


def test_key_fields_follow_the_design() -> None:
    config = load_topics(TOPICS_YAML, prefix="")
    assert {k.value: config.stage(k).key_field for k in TopicKey} == {
        "ingest": "queue", "process": "queue_name", "build": "id",
        "buildsignal": "id", "record": "id",
    }
    assert config.stage("process").payload is ProcessRequest
    assert config.stage(TopicKey.BUILDSIGNAL).payload is BuildSignal


def test_prefix_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings_mod.ENV_TOPIC_PREFIX, raising=False)
    assert load_topics(TOPICS_YAML).prefix == "stovepipe."
    monkeypatch.setenv(settings_mod.ENV_TOPIC_PREFIX, "env.")
    assert load_topics(TOPICS_YAML).stage("build").full_name == "env.build"
    assert load_topics(TOPICS_YAML, prefix="arg.").prefix == "arg."


def test_path_defaults_to_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                   shipped: dict[str, Any]) -> None:
    shipped["topics"]["build"]["partitions"] = 7
    monkeypatch.setenv(settings_mod.ENV_TOPICS_FILE, str(_write(tmp_path, shipped)))
    assert load_topics().stage("build").partitions == 7


# --- broken files ---------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], Any]


def _set(path: str, value: Any) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        node[last] = value
    return mutate


def _drop(path: str) -> Mutation:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            node = node[part]
        del node[last]
    return mutate


BROKEN: list[tuple[str, Mutation, str]] = [
    ("missing stage", _drop("topics.record"), "missing topic key 'record'"),
    ("missing dlq", _drop("topics.build_dlq"), "missing 'build_dlq'"),
    ("unknown key", _set("topics.procss", {}), "topics.procss: unknown topic key"),
    ("dlq dead-letters", _set("topics.process_dlq.dlq", True),
     "topics.process_dlq.dlq: a _dlq topic must not dead-letter"),
    ("dlq gives up", _set("topics.record_dlq.retry", {"max_attempts": 3}),
     "topics.record_dlq: a _dlq topic's reconciler must retry forever"),
    ("stage loses messages", _set("topics.build.dlq", False),
     "topics.build: with dlq: false, exhausted messages would be lost"),
    ("key field not on payload", _set("topics.process.key_field", "queue"),
     "topics.process.key_field: 'queue' is not a field of ProcessRequest"),
    ("dlq key differs", _set("topics.build_dlq.key_field", "queue_name"),
     "topics.build_dlq.key_field: must match build's key_field 'id'"),
    ("wrong payload", _set("topics.build.payload", "Record"),
     "topics.build.payload: topic key 'build' carries BuildRequest"),
    ("unknown payload", _set("topics.build.payload", "Nope"),
     "topics.build.payload: 'Nope' is not a contract message"),
    ("zero partitions", _set("topics.process.partitions", 0),
     "topics.process.partitions: must be a positive integer, got 0"),
    ("string partitions", _set("topics.process.partitions", "3"),
     "topics.process.partitions: must be a positive integer, got '3'"),
    ("bool replication", _set("defaults.replication_factor", True),
     "defaults.replication_factor: must be a positive integer, got True"),
    ("bad default", _set("defaults.partitions", -1),
     "defaults.partitions: must be a positive integer, got -1"),
    ("typo field", _set("topics.ingest.partitons", 3),
     "topics.ingest: unknown field 'partitons'"),
    ("bad duration", _set("defaults.retry.backoff", ["1s", "5 sec"]),
     "defaults.retry.backoff[1]: expected a duration"),
    ("unitless duration", _set("delay_tiers.delay_5s.delay", 5),
     "delay_tiers.delay_5s.delay: expected a duration"),
    ("zero duration", _set("delay_tiers.delay_5s.delay", "0s"),
     "delay_tiers.delay_5s.delay: must be longer than zero"),
    ("decreasing backoff", _set("topics.ingest.retry", {"backoff": ["5s", "1s"]}),
     "topics.ingest.retry.backoff: delays must not decrease"),
    ("empty backoff", _set("defaults.retry.backoff", []),
     "defaults.retry.backoff: expected a non-empty list"),
    ("bad attempts", _set("defaults.retry.max_attempts", "lots"),
     "defaults.retry.max_attempts: must be a positive integer or 'forever'"),
    ("same tier delay", _set("delay_tiers.delay_one_second", {"delay": "1000ms"}),
     "delay_tiers.delay_one_second: same delay as delay_1s"),
    ("no tiers", _set("delay_tiers", {}), "delay_tiers: declare at least one"),
    ("bad name", _set("topics.ingest.name", "in gest"),
     "topics.ingest.name: must be a non-empty topic name"),
    ("bad prefix", _set("prefix", "a/b"), "prefix: must be letters"),
    ("duplicate name", _set("delay_tiers.delay_5s.name", "record"),
     "delay_tiers.delay_5s: topic name 'p.record' is also used by topics.record"),
    ("topics not a mapping", _set("topics", ["ingest"]), "topics: expected a mapping"),
    ("retention not a duration", _set("dlq_defaults.config", {"retention.ms": "a month"}),
     "dlq_defaults.config: retention.ms: expected a duration such as 250ms"),
    ("unknown top level", _set("topic", {}), "(top level): unknown field 'topic'"),
]


@pytest.mark.parametrize(("mutate", "expected"), [(m, e) for _, m, e in BROKEN],
                         ids=[name for name, _, _ in BROKEN])
def test_broken_file_names_file_and_entry(tmp_path: Path, shipped: dict[str, Any],
                                          mutate: Mutation, expected: str) -> None:
    doc = copy.deepcopy(shipped)
    mutate(doc)
    path = _write(tmp_path, doc)
    prefix = None if "prefix" in expected else "p."
    with pytest.raises(TopicsConfigError) as info:
        load_topics(path, prefix=prefix)
    message = str(info.value)
    assert str(path) in message
    assert expected in message, message


def test_every_problem_is_reported_at_once(tmp_path: Path, shipped: dict[str, Any]) -> None:
    shipped["topics"]["process"]["partitions"] = 0
    del shipped["topics"]["record_dlq"]
    with pytest.raises(TopicsConfigError) as info:
        load_topics(_write(tmp_path, shipped), prefix="p.")
    assert len(info.value.problems) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("topics: [\n", "not valid YAML"),
        ("", "expected a mapping"),
        ("- a\n- b\n", "expected a mapping"),
    ],
)
def test_unparseable_file(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(TopicsConfigError, match=expected) as info:
        load_topics(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopicsConfigError, match="cannot read"):
        load_topics(tmp_path / "nope.yaml")


def test_cli_reports_bad_file_without_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path, "topics: [\n")
    result = CliRunner().invoke(topics_group, ["list", "--file", str(path)])
    assert result.exit_code == 1
    assert "not valid YAML" in result.output and "Traceback" not in result.output


def test_cli_list_shows_full_names() -> None:
    result = CliRunner().invoke(topics_group, ["list", "--file", str(TOPICS_YAML),
                                               "--prefix", "x."])
    assert result.exit_code == 0, result.output
    assert "x.process_dlq" in result.output and "x.delay_2m" in result.output


# --- durations and retry policy -------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("1s", 1), ("30s", 30), ("2m", 120), ("1h", 3600), ("1m30s", 90),
     ("1.5s", 1.5), ("180d", 180 * 86400), ("1d12h", 36 * 3600)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "1", "s", "1x", "1 s", "-1s", "1s2", "ms"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@given(st.integers(min_value=0, max_value=10**9))
def test_format_duration_round_trips(ms: int) -> None:
    delta = timedelta(milliseconds=ms)
    assert parse_duration(format_duration(delta)) == delta


def test_retry_policy_backoff_is_capped() -> None:
    policy = RetryPolicy(3, (timedelta(seconds=1), timedelta(seconds=5)))
    assert [policy.backoff_after(n) for n in (1, 2, 3, 9)] == [
        timedelta(seconds=1), timedelta(seconds=5), timedelta(seconds=5), timedelta(seconds=5)
    ]
    assert not policy.exhausted(2) and policy.exhausted(3)
    forever = RetryPolicy(None, (timedelta(seconds=1),))
    assert not forever.exhausted(10**6)


# --- on the broker --------------------------------------------------------------------


@pytest.fixture
def admin(kafka_bootstrap: str, topic_prefix: str) -> Iterator[AdminClient]:
    client = AdminClient(admin_conf_for(kafka_bootstrap))
    yield client
    # Delete by declared name: a just-created topic may not be listed yet.
    names = [t.full_name for t in load_topics(TOPICS_YAML, prefix=topic_prefix).all_topics()]
    for future in client.delete_topics(names, operation_timeout=10).values():
        try:
            future.result(timeout=15)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise


def _partitions(admin: AdminClient, name: str) -> int:
    return len(admin.list_topics(name, timeout=10).topics[name].partitions)


def _cli(kafka_bootstrap: str, topic_prefix: str, command: str) -> Any:
    return CliRunner().invoke(topics_group, [
        command, "--file", str(TOPICS_YAML), "--prefix", topic_prefix,
        "--bootstrap", kafka_bootstrap, "--timeout", "20",
    ])


@pytest.mark.kafka
def test_create_twice_is_harmless(kafka_bootstrap: str, topic_prefix: str,
                                  admin: AdminClient) -> None:
    config = load_topics(TOPICS_YAML, prefix=topic_prefix)
    count = len(config.all_topics())

    first = _cli(kafka_bootstrap, topic_prefix, "create")
    assert first.exit_code == 0, first.output
    assert first.output.count("created ") == count
    for topic in config.all_topics():
        assert _partitions(admin, topic.full_name) == topic.partitions

    second = _cli(kafka_bootstrap, topic_prefix, "create")
    assert second.exit_code == 0, second.output
    assert "created " not in second.output
    assert second.output.count("exists ") == count

    verify = _cli(kafka_bootstrap, topic_prefix, "verify")
    assert verify.exit_code == 0, verify.output


@pytest.mark.kafka
def test_partition_mismatch_is_reported_and_left_alone(
    kafka_bootstrap: str, topic_prefix: str, admin: AdminClient
) -> None:
    config = load_topics(TOPICS_YAML, prefix=topic_prefix)
    process = config.stage(TopicKey.PROCESS)
    assert process.partitions != 2
    admin.create_topics([NewTopic(process.full_name, num_partitions=2, replication_factor=1)],
                        operation_timeout=10)[process.full_name].result(timeout=15)

    result = _cli(kafka_bootstrap, topic_prefix, "create")
    assert result.exit_code == 2, result.output
    line = next(ln for ln in result.output.splitlines() if process.full_name + " " in ln)
    assert line.startswith("MISMATCH")
    assert f"topics.yaml says {process.partitions}, broker has 2" in line
    assert _partitions(admin, process.full_name) == 2  # not altered

    report = ensure_topics(admin_conf_for(kafka_bootstrap), config, timeout=20)
    assert [s.name for s in report.with_state(TopicState.MISMATCH)] == [process.full_name]
    assert len(report.with_state(TopicState.EXISTS)) == len(config.all_topics()) - 1
    assert not report.ok


def _broker_configs(admin: AdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names],
                                     request_timeout=20)
    return {resource.name: {k: e.value for k, e in future.result(timeout=30).items()}
            for resource, future in futures.items()}


@pytest.mark.kafka
def test_topics_get_their_retention_and_drift_in_it_is_reported_never_fixed(
    kafka_bootstrap: str, topic_prefix: str, admin: AdminClient
) -> None:
    config = load_topics(TOPICS_YAML, prefix=topic_prefix)
    created = _cli(kafka_bootstrap, topic_prefix, "create")
    assert created.exit_code == 0, created.output
    on_broker = _broker_configs(admin, [t.full_name for t in config.all_topics()])
    for topic in config.all_topics():
        assert topic.config, topic.entry  # every topic declares its retention
        for name, value in topic.config.items():
            assert on_broker[topic.full_name][name] == value, (topic.full_name, name)

    # an operator shortens one topic's retention on the broker behind the file's back
    process = config.stage(TopicKey.PROCESS)
    altered = admin.incremental_alter_configs([ConfigResource(
        ResourceType.TOPIC, process.full_name, incremental_configs=[ConfigEntry(
            "retention.ms", "3600000",
            incremental_operation=AlterConfigOpType.SET)])])
    altered[ConfigResource(ResourceType.TOPIC, process.full_name)].result(timeout=30)
    wait_until(lambda: _broker_configs(admin, [process.full_name])[process.full_name][
        "retention.ms"] == "3600000", timeout=30, what="the altered retention to show")

    for command in ("verify", "create"):
        result = _cli(kafka_bootstrap, topic_prefix, command)
        assert result.exit_code == 2, result.output
        [line] = [ln for ln in result.output.splitlines() if process.full_name + " " in ln]
        assert line.startswith("MISMATCH")
        assert ("retention.ms: topics.yaml says 604800000, broker has 3600000; "
                "left unchanged") in line
        assert "kafka-configs --alter" in result.output
        assert result.output.count("MISMATCH") == 1
    # reported, never "fixed"
    assert _broker_configs(admin, [process.full_name])[process.full_name][
        "retention.ms"] == "3600000"
    report = ensure_topics(admin_conf_for(kafka_bootstrap), config, create=False, timeout=20)
    assert [s.name for s in report.with_state(TopicState.MISMATCH)] == [process.full_name]


@pytest.mark.kafka
def test_verify_reports_missing_topics(kafka_bootstrap: str, topic_prefix: str,
                                       admin: AdminClient) -> None:
    result = _cli(kafka_bootstrap, topic_prefix, "verify")
    assert result.exit_code == 2
    assert "MISSING" in result.output
    assert not [t for t in admin.list_topics(timeout=10).topics if t.startswith(topic_prefix)]


def test_unreachable_broker_is_a_clear_error(topic_prefix: str) -> None:
    result = CliRunner().invoke(topics_group, [
        "create", "--file", str(TOPICS_YAML), "--prefix", topic_prefix,
        "--bootstrap", "127.0.0.1:1", "--timeout", "1",
    ])
    assert result.exit_code == 1
    assert "no answer from Kafka at 127.0.0.1:1 within 1s" in result.output
    assert "Traceback" not in result.output
