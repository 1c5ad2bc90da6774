"""What the operator commands (`topics`, `replay`, `dlq`, `parked`) share: their options,
topic resolution against topics.yaml, and one bounded wrapper over Kafka's admin calls.

Kafka admin work goes through confluent-kafka (AdminClient, a Consumer that never
subscribes, a Producer from `producer_conf`, so keys land on the workers' partitions),
every client with the TLS and SASL settings of `streams.config.kafka_security`.
Every failure a user can cause — unknown topic, unreachable broker or database, an active
group — is a `click.ClickException`, never a traceback.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click
from confluent_kafka import (
    Consumer,
    ConsumerGroupState,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from contract import TopicKey
from streams.config import settings as settings_mod
from streams.config.kafka_access import check_librdkafka_access
from streams.config.kafka_security import (
    KafkaAccessError,
    KafkaSecurity,
    KafkaSecurityError,
    librdkafka_conf,
)
from streams.config.settings import DEFAULT_APP_ID, ENV_APP_ID
from streams.config.topics import (
    DelayTier,
    TopicsConfig,
    TopicsConfigError,
    TopicSpec,
    load_topics,
)
from streams.runtime.topic_admin import DEFAULT_ADMIN_TIMEOUT, read_watermarks

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# librdkafka logs (one line per failed connect, ...) go here, not to the terminal: the
# user gets one message from us instead.
KAFKA_LOG = logging.getLogger("stovepipe.operator.kafka")
KAFKA_LOG.addHandler(logging.NullHandler())


# Broker answers to an offset change while the group has members (classic and KIP-848).
_ACTIVE_GROUP_ERRORS = frozenset({
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION, KafkaError.STALE_MEMBER_EPOCH,
    KafkaError.FENCED_MEMBER_EPOCH, KafkaError.NON_EMPTY_GROUP,
})
_IDLE_STATES = (ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD)
_NO_OFFSET = -1001  # librdkafka's OFFSET_INVALID: the group never committed here


# --- options and topic resolution -------------------------------------------------------


def topics_options(func: F) -> F:
    func = click.option(
        "--prefix", default=None, metavar="PREFIX",
        help="Topic name prefix [default: $STOVEPIPE_TOPIC_PREFIX, else the file's prefix].",
    )(func)
    return click.option(
        "--file", "topics_file", type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="topics.yaml to use [default: $STOVEPIPE_TOPICS_FILE, else the repo's].",
    )(func)


def broker_options(func: F) -> F:
    func = click.option(
        "--timeout", type=click.FloatRange(min=0.1), default=DEFAULT_ADMIN_TIMEOUT,
        show_default=True, help="Seconds to wait for each broker call.",
    )(func)
    return click.option(
        "--bootstrap", default=None, metavar="HOST:PORT",
        help="Kafka bootstrap servers [default: $STOVEPIPE_KAFKA_BOOTSTRAP, else the local "
             "stack].",
    )(func)


app_id_option = click.option(
    "--app-id", envvar=ENV_APP_ID, default=DEFAULT_APP_ID, show_default=True,
    help=f"The workers' application id, which is their consumer group "
         f"[env {ENV_APP_ID}].")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
yes_option = click.option("--yes", "-y", is_flag=True,
                           help="Do not ask for confirmation (for scripts and CI).")


def load_topics_or_fail(topics_file: Path | None, prefix: str | None) -> TopicsConfig:
    try:
        return load_topics(topics_file, prefix)
    except TopicsConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _unknown_topic(config: TopicsConfig, name: str, wanted: str = "topic") -> click.ClickException:
    entries = ", ".join(t.entry for t in config.all_topics())
    return click.ClickException(
        f"unknown {wanted} {name!r}: expected a topics.yaml entry ({entries}) or a full "
        f"Kafka topic name such as {config.stage(TopicKey.PROCESS).full_name!r} "
        f"(topics from {config.path}, prefix {config.prefix!r}; see `stovepipe topics list`)")


def resolve_topic(config: TopicsConfig, name: str) -> TopicSpec | DelayTier:
    """A topics.yaml entry (``process``, ``process_dlq``, ``delay_1s``) or full name."""
    for lookup in (config.entry, config.by_name):
        try:
            return lookup(name)
        except KeyError:
            continue
    raise _unknown_topic(config, name)


def resolve_dead_letter(config: TopicsConfig, name: str) -> TopicSpec:
    """The `_dlq` topic meant by ``name``: itself, or the dead-letter topic of a stage."""
    try:
        topic = resolve_topic(config, name)
    except click.ClickException:
        raise _unknown_topic(config, name, "dead-letter topic") from None
    if isinstance(topic, DelayTier):
        raise click.ClickException(
            f"{name!r} is a delay tier; it has no dead-letter topic. Name a stage "
            f"(e.g. process) or its _dlq topic (e.g. process_dlq).")
    return topic if topic.is_dead_letter else config.dead_letter(topic.topic_key)


def consumer_group_of(topic: TopicSpec | DelayTier, app_id: str) -> str:
    """The group that consumes ``topic``: the workers' for stage and `_dlq` topics, their
    delay scheduler's for delay tiers (see streams.runtime.worker)."""
    return f"{app_id}-delay" if isinstance(topic, DelayTier) else app_id


# --- Kafka -------------------------------------------------------------------------------


def _reason(exc: BaseException) -> str:
    err = exc.args[0] if exc.args else exc
    return err.str() if isinstance(err, KafkaError) else str(err) or type(exc).__name__


@dataclass(frozen=True)
class GroupInfo:
    group: str
    state: str
    members: tuple[str, ...]  # "client-id@host" of each live member
    live: bool


class Kafka:
    """The admin calls the operator commands need, each bounded by ``timeout`` seconds;
    a broker that does not answer or refuses us becomes one ClickException naming it."""

    def __init__(self, bootstrap: str, timeout: float) -> None:
        self.bootstrap = bootstrap
        self.timeout = timeout
        self.security = kafka_security_or_fail()
        try:
            self.admin = AdminClient(self.client_conf())
        except (KafkaException, ValueError, TypeError) as exc:
            raise click.ClickException(
                f"bad Kafka bootstrap {bootstrap!r}: {_reason(exc)}") from None
        # never subscribes: it reads watermarks and times, and joins no group
        self._consumer: Consumer | None = None
        fail_when_nothing_listens(bootstrap, timeout)
        fail_when_refused(bootstrap, self.security, timeout)

    def client_conf(self, **extra: Any) -> dict[str, Any]:
        """A confluent-kafka configuration for this broker (its TLS and SASL included)."""
        return librdkafka_conf(self.bootstrap, self.security, logger=KAFKA_LOG, **extra)

    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(self.client_conf(**{
                "group.id": f"stovepipe-operator-{uuid.uuid4().hex}",
                "enable.auto.commit": False}))
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def __enter__(self) -> Kafka:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def unreachable(self, what: str, exc: BaseException) -> click.ClickException:
        return click.ClickException(
            f"no answer from Kafka at {self.bootstrap} while {what} within "
            f"{self.timeout:g}s ({_reason(exc)}); is the broker running? (`stovepipe dev "
            f"up` starts a local one; {settings_mod.ENV_KAFKA_BOOTSTRAP} or --bootstrap "
            f"point elsewhere)")

    def partitions(self, topic: str) -> list[int]:
        """The partitions of ``topic``; a clear error when the broker lacks it."""
        try:
            metadata = self.admin.list_topics(timeout=self.timeout)
        except KafkaException as exc:
            raise self.unreachable("listing topics", exc) from None
        found = metadata.topics.get(topic)
        if found is None or found.error is not None:
            raise click.ClickException(
                f"topic {topic!r} does not exist on the broker at {self.bootstrap}; "
                f"create it with `stovepipe topics create`")
        return sorted(found.partitions)

    def group(self, group: str) -> GroupInfo:
        try:
            future = self.admin.describe_consumer_groups(
                [group], request_timeout=self.timeout)[group]
            described = future.result(timeout=self.timeout + 5)
        except KafkaException as exc:
            if exc.args and isinstance(exc.args[0], KafkaError) \
                    and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
                return GroupInfo(group, "Dead", (), live=False)
            raise self.unreachable(f"describing consumer group {group!r}", exc) from None
        except TimeoutError as exc:
            raise self.unreachable(f"describing consumer group {group!r}", exc) from None
        state = described.state
        members = tuple(f"{m.client_id}@{m.host}" for m in described.members)
        name = state.name.title().replace("_", "") if isinstance(state, ConsumerGroupState) \
            else str(state)
        return GroupInfo(group, name, members, live=state not in _IDLE_STATES or bool(members))

    def committed(self, group: str, topic: str, partitions: Sequence[int]) -> dict[int, int | None]:
        """The group's committed offset per partition; None where it never committed."""
        request = ConsumerGroupTopicPartitions(
            group, [TopicPartition(topic, p) for p in partitions])
        try:
            future = self.admin.list_consumer_group_offsets(
                [request], request_timeout=self.timeout)[group]
            result = future.result(timeout=self.timeout + 5)
        except (KafkaException, TimeoutError) as exc:
            raise self.unreachable(f"reading the offsets of group {group!r}", exc) from None
        out: dict[int, int | None] = {}
        for tp in result.topic_partitions or ():
            out[tp.partition] = tp.offset if tp.offset >= 0 else None
        return out

    def watermarks(self, topic: str, partitions: Sequence[int]) -> dict[int, tuple[int, int]]:
        """(earliest retained offset, end offset) per partition."""
        out = {}
        for p in partitions:
            try:
                out[p] = read_watermarks(self.consumer(), topic, p, self.timeout)
            except KafkaException as exc:
                raise self.unreachable(f"reading the offsets of {topic} [{p}]", exc) from None
        return out

    def offsets_at(self, topic: str, partitions: Sequence[int], when: datetime
                   ) -> dict[int, int | None]:
        """The first offset at or after ``when`` per partition; None if no such message."""
        ms = int(when.timestamp() * 1000)
        try:
            found = self.consumer().offsets_for_times(
                [TopicPartition(topic, p, ms) for p in partitions], timeout=self.timeout)
        except KafkaException as exc:
            raise self.unreachable(f"looking up offsets by time in {topic}", exc) from None
        return {tp.partition: tp.offset if tp.offset >= 0 else None for tp in found}

    def alter_offsets(self, group: str, topic: str, offsets: dict[int, int]
                      ) -> dict[int, KafkaError | None]:
        """Commit ``offsets`` for ``group`` in one request; the broker's error per
        partition (None where it took the new offset)."""
        request = ConsumerGroupTopicPartitions(
            group, [TopicPartition(topic, p, o) for p, o in sorted(offsets.items())])
        try:
            future = self.admin.alter_consumer_group_offsets(
                [request], request_timeout=self.timeout)[group]
            result = future.result(timeout=self.timeout + 5)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() in _ACTIVE_GROUP_ERRORS:
                return dict.fromkeys(offsets, err)
            raise self.unreachable(f"resetting the offsets of group {group!r}", exc) from None
        except TimeoutError as exc:
            raise self.unreachable(f"resetting the offsets of group {group!r}", exc) from None
        return {tp.partition: tp.error for tp in result.topic_partitions or ()}


def fail_when_nothing_listens(bootstrap: str, timeout: float) -> None:
    """A ClickException naming the broker when no bootstrap server accepts a connection."""
    refused = refused_bootstrap(bootstrap, timeout)
    if refused is not None:
        raise click.ClickException(
            f"no answer from Kafka at {bootstrap} within {timeout:g}s "
            f"({refused.strerror or refused}); is the broker running? (`stovepipe dev up` "
            f"starts a local one; {settings_mod.ENV_KAFKA_BOOTSTRAP} or --bootstrap point "
            f"elsewhere)")


def kafka_security_or_fail() -> KafkaSecurity:
    """The environment's TLS and SASL settings; a ClickException naming a bad variable."""
    try:
        return KafkaSecurity.from_env()
    except KafkaSecurityError as exc:
        raise click.ClickException(str(exc)) from None


def fail_when_refused(bootstrap: str, security: KafkaSecurity, timeout: float) -> None:
    """A ClickException naming the cause when the broker refuses us (authentication, TLS)
    or does not answer within `timeout`; librdkafka alone would retry a wrong password
    until each call's timeout and then say only "timed out"."""
    try:
        check_librdkafka_access(bootstrap, security, timeout=timeout)
    except KafkaAccessError as exc:
        raise click.ClickException(str(exc)) from None
    except TimeoutError as exc:
        raise click.ClickException(
            f"no answer from Kafka at {bootstrap} ({exc}); is the broker running, and does "
            f"that port speak {security.protocol}? ({settings_mod.ENV_KAFKA_BOOTSTRAP} or "
            f"--bootstrap point elsewhere)") from None


def refused_bootstrap(bootstrap: str, timeout: float) -> OSError | None:
    """The error of the last bootstrap server when none of them accepts a TCP connection,
    else None. librdkafka retries a refused connection until the call's timeout; a
    command answers at once instead when nothing listens (a slow broker still gets the
    whole timeout)."""
    error: OSError | None = None
    for server in filter(None, (s.strip() for s in bootstrap.split(","))):
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or server, int(port or 9092)),
                                          timeout=timeout):
                return None
        except ValueError:
            return None  # not host:port: librdkafka reports it in its own words
        except OSError as exc:
            error = exc
    return error


def open_kafka(bootstrap: str | None, timeout: float) -> Kafka:
    return Kafka(bootstrap or settings_mod.load_settings().kafka_bootstrap, timeout)


def active_group_message(info: GroupInfo, topic: str) -> str:
    who = ", ".join(info.members[:5]) + (" …" if len(info.members) > 5 else "")
    return (f"consumer group {info.group!r} has {len(info.members)} live member(s) "
            f"(state {info.state}{': ' + who if who else ''}). Stop the workers consuming "
            f"{topic} first: Kafka refuses to change the offsets of an active group, and a "
            f"live member would overwrite the reset with its own position at its next "
            f"commit. A worker killed without leaving stays a member until its session "
            f"times out (about 10 s).")
