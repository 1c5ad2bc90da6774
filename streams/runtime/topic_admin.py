"""Creating and verifying the topics of topics.yaml on a broker (confluent-kafka's
AdminClient). `ensure_topics()` creates missing topics (with their `config`) and reports,
never changes, existing ones that differ from the file: in partitions, replication factor
or a config the file sets (`retention.ms`, `cleanup.policy`, ..., read with
`describe_configs`). The CLI (`stovepipe topics`) is a thin shell over it; the devstack,
the demo and the tests call it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from streams.config.kafka_security import KafkaSecurity, librdkafka_conf
from streams.config.topics import DelayTier, TopicsConfig, TopicSpec

DEFAULT_ADMIN_TIMEOUT = 5.0  # seconds; every admin call is bounded, so is every command

# librdkafka's own log lines (e.g. one per failed connect) go here rather than straight to
# stderr; an application that configures logging sees them, a CLI user sees our message.
_kafka_log = logging.getLogger("stovepipe.kafka.admin")
_kafka_log.addHandler(logging.NullHandler())


WATERMARK_ATTEMPTS = 5
# a partition's leader that just moved or is not elected yet (a topic created a moment ago,
# a busy broker): asked again, the client refreshing its metadata in between
_LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                  KafkaError.REQUEST_TIMED_OUT, KafkaError._TIMED_OUT, KafkaError._TRANSPORT}


def read_watermarks(consumer: Any, topic: str, partition: int,
                    timeout: float) -> tuple[int, int]:
    """(earliest retained offset, end offset) of a partition, asked again a few times
    while its leader moves; blocking (call it in a thread from a loop). KafkaException
    for anything else, or when the leader never settles."""
    for attempt in range(WATERMARK_ATTEMPTS):
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                       timeout=timeout)
            return int(low), int(high)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            again = isinstance(error, KafkaError) and (
                error.retriable() or error.code() in _LEADER_MOVING)
            if not again or attempt == WATERMARK_ATTEMPTS - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


# --- creating and verifying on the broker ---------------------------------------------


class TopicState(StrEnum):
    CREATED = "created"
    EXISTS = "exists"  # present and matching topics.yaml
    MISMATCH = "mismatch"  # present, differs from topics.yaml; left unchanged
    MISSING = "missing"  # absent (verify only)
    FAILED = "failed"  # the broker refused to create it


@dataclass(frozen=True)
class TopicStatus:
    topic: TopicSpec | DelayTier
    state: TopicState
    detail: str = ""

    @property
    def name(self) -> str:
        return self.topic.full_name

    @property
    def ok(self) -> bool:
        """The topic exists as topics.yaml says."""
        return self.state in (TopicState.CREATED, TopicState.EXISTS)


@dataclass(frozen=True)
class TopicsReport:
    statuses: tuple[TopicStatus, ...]

    def __iter__(self) -> Iterator[TopicStatus]:
        return iter(self.statuses)

    def with_state(self, state: TopicState) -> tuple[TopicStatus, ...]:
        return tuple(s for s in self.statuses if s.state is state)

    @property
    def ok(self) -> bool:
        """Every topic exists as topics.yaml says."""
        return all(s.ok for s in self.statuses)


class TopicsAdminError(RuntimeError):
    """The broker could not be reached or did not answer in time."""


def _reason(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    return err.str() if isinstance(err, KafkaError) else str(err)


def _admin(admin_conf: Mapping[str, Any]) -> Any:
    conf = {"logger": _kafka_log, **admin_conf}
    try:
        return AdminClient(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        raise TopicsAdminError(f"bad Kafka admin configuration: {_reason(exc)}") from None


def _describe(admin: Any, bootstrap: str, timeout: float) -> dict[str, tuple[int, int]]:
    """Topic name → (partitions, replication factor) for every topic on the cluster."""
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicsAdminError(
            f"no answer from Kafka at {bootstrap} within {timeout:g}s ({_reason(exc)}); "
            f"is the broker running? (`stovepipe dev up` starts a local one)"
        ) from None
    out = {}
    for name, topic in metadata.topics.items():
        if topic.error is not None:
            continue
        replicas = max((len(p.replicas) for p in topic.partitions.values()), default=0)
        out[name] = (len(topic.partitions), replicas)
    return out


def _await_visible(admin: Any, bootstrap: str, names: list[str],
                   timeout: float) -> dict[str, tuple[int, int]]:
    """`_describe`, polled until every one of `names` is listed or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        existing = _describe(admin, bootstrap, timeout)
        if all(n in existing for n in names) or time.monotonic() >= deadline:
            return existing
        time.sleep(0.1)


def _configs(admin: Any, bootstrap: str, topics: Iterable[TopicSpec | DelayTier],
             timeout: float) -> dict[str, dict[str, str]]:
    """Topic name → the broker's value of each config its topics.yaml entry sets."""
    wanted = [t for t in topics if t.config]
    if not wanted:
        return {}
    futures = admin.describe_configs(
        [ConfigResource(ResourceType.TOPIC, t.full_name) for t in wanted],
        request_timeout=timeout)
    found: dict[str, dict[str, str]] = {}
    for resource, future in futures.items():
        try:
            entries = future.result(timeout=timeout + 5)
        except (KafkaException, TimeoutError) as exc:
            raise TopicsAdminError(
                f"Kafka at {bootstrap} did not describe the configs of {resource.name} "
                f"within {timeout:g}s ({_reason(exc)})") from None
        found[resource.name] = {name: entry.value for name, entry in entries.items()}
    return found


def _same_config(declared: str, actual: str | None) -> bool:
    if actual is None:
        return False
    if "," in declared or "," in actual:  # a list, e.g. cleanup.policy: compact,delete
        return sorted(declared.split(",")) == sorted(actual.split(","))
    return declared == actual


def _compare(topic: TopicSpec | DelayTier, actual: tuple[int, int],
             configs: Mapping[str, str]) -> TopicStatus:
    partitions, replicas = actual
    drift = []
    if partitions != topic.partitions:
        drift.append(f"partitions: topics.yaml says {topic.partitions}, broker has {partitions}")
    if replicas != topic.replication_factor:
        drift.append(f"replication factor: topics.yaml says {topic.replication_factor}, "
                     f"broker has {replicas}")
    for name, declared in topic.config.items():
        if not _same_config(declared, configs.get(name)):
            drift.append(f"{name}: topics.yaml says {declared}, broker has "
                         f"{configs.get(name, 'no such config')}")
    if drift:
        return TopicStatus(topic, TopicState.MISMATCH, "; ".join(drift))
    return TopicStatus(topic, TopicState.EXISTS, f"{partitions} partitions")


def ensure_topics(
    admin_conf: Mapping[str, Any],
    config: TopicsConfig,
    *,
    create: bool = True,
    timeout: float = DEFAULT_ADMIN_TIMEOUT,
    topics: Iterable[TopicSpec | DelayTier] | None = None,
) -> TopicsReport:
    """Create the missing topics of `config` (all, or just `topics`) and report on each.

    Idempotent. An existing topic is never altered: one whose partition count,
    replication factor or a config topics.yaml sets differs is reported as MISMATCH. With
    `create=False` nothing is created and absent topics are MISSING. Every admin call is
    bounded by `timeout` seconds; no answer raises TopicsAdminError.
    """
    bootstrap = str(admin_conf.get("bootstrap.servers", "?"))
    admin = _admin(admin_conf)
    wanted = tuple(topics) if topics is not None else config.all_topics()
    existing = _describe(admin, bootstrap, timeout)

    statuses: dict[str, TopicStatus] = {}
    to_create = []
    configs = _configs(admin, bootstrap, [t for t in wanted if t.full_name in existing],
                       timeout)
    for topic in wanted:
        if topic.full_name in existing:
            statuses[topic.full_name] = _compare(topic, existing[topic.full_name],
                                                 configs.get(topic.full_name, {}))
        elif create:
            to_create.append(topic)
        else:
            statuses[topic.full_name] = TopicStatus(topic, TopicState.MISSING, "not on broker")

    if to_create:
        futures = admin.create_topics(
            [NewTopic(t.full_name, num_partitions=t.partitions,
                      replication_factor=t.replication_factor, config=dict(t.config))
             for t in to_create],
            operation_timeout=timeout,
            request_timeout=timeout,
        )
        created, raced = [], []
        for topic in to_create:
            try:
                futures[topic.full_name].result(timeout=timeout + 5)
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    raced.append(topic)  # created by someone else since we listed: check it
                    continue
                statuses[topic.full_name] = TopicStatus(topic, TopicState.FAILED, _reason(exc))
            except TimeoutError:
                statuses[topic.full_name] = TopicStatus(
                    topic, TopicState.FAILED, f"no answer within {timeout:g}s")
            else:
                created.append(topic)
        # The controller acknowledges a creation before every broker's metadata shows the
        # topic; wait (bounded) so that "created" means a consumer can use it now.
        visible = _await_visible(admin, bootstrap, [t.full_name for t in created + raced],
                                 timeout)
        for topic in created:
            detail = f"{topic.partitions} partitions, replication {topic.replication_factor}"
            if topic.full_name not in visible:
                detail += f" (not yet in the broker's metadata after {timeout:g}s)"
            statuses[topic.full_name] = TopicStatus(topic, TopicState.CREATED, detail)
        raced_configs = _configs(admin, bootstrap,
                                 [t for t in raced if t.full_name in visible], timeout)
        for topic in raced:
            actual = visible.get(topic.full_name)
            statuses[topic.full_name] = _compare(
                topic, actual, raced_configs.get(topic.full_name, {})) if actual else TopicStatus(
                topic, TopicState.FAILED,
                f"the broker says it exists but did not list it within {timeout:g}s")
    return TopicsReport(tuple(statuses[t.full_name] for t in wanted))


def admin_conf_for(bootstrap: str, security: KafkaSecurity | None = None) -> dict[str, Any]:
    """An AdminClient configuration for `bootstrap`, with the environment's TLS and SASL
    settings (or `security`)."""
    return librdkafka_conf(bootstrap, security)
