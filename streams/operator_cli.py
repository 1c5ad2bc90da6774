"""`stovepipe replay | dlq | parked`: an operator's recovery tools (design §9, §10).

- `replay` moves the committed offsets of the consumer group that consumes a topic
  (to the beginning, an offset or a time), so the pipeline processes that range again.
  Safe because every stage is idempotent; refused while the group has live members.
- `dlq list` / `dlq redrive` read a `<key>_dlq` topic with a throwaway reader (it joins no
  group and commits nothing) and show, or re-produce to their stage, its messages.
- `parked` lists, deletes and redrives the messages a reconciler parked in PostgreSQL.

Kafka admin work goes through confluent-kafka (AdminClient, a Consumer that never
subscribes, a Producer from `producer_conf`, so keys land on the workers' partitions).
Every failure a user can cause — unknown topic, unreachable broker or database, an active
group — is a `click.ClickException`, never a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click
import psycopg
from confluent_kafka import (
    Consumer,
    ConsumerGroupState,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from google.protobuf import json_format

from contract import MalformedPayload, TopicKey, unmarshal
from store import NotFound, ParkedMessage, StoreError, Stores
from store.cli import dsn_option
from store.parked import ParkedStore
from streams import settings as settings_mod
from streams.commands import DEFAULT_APP_ID, ENV_APP_ID
from streams.kafka_clients import producer_conf
from streams.runtime import headers as h
from streams.topics import (
    DEFAULT_ADMIN_TIMEOUT,
    DelayTier,
    TopicsConfig,
    TopicsConfigError,
    TopicSpec,
    load_topics,
    parse_duration,
)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# librdkafka logs (one line per failed connect, ...) go here, not to the terminal: the
# user gets one message from us instead.
_kafka_log = logging.getLogger("stovepipe.operator.kafka")
_kafka_log.addHandler(logging.NullHandler())

FAILURE_HEADERS = (h.DLQ_SOURCE_TOPIC, h.DLQ_SOURCE_PARTITION, h.DLQ_SOURCE_OFFSET,
                   h.DLQ_ATTEMPTS, h.DLQ_ERROR_CLASS, h.DLQ_ERROR_MESSAGE, h.DLQ_TIME)
REDRIVEN_FROM_TOPIC = "redriven-from-topic"
REDRIVEN_FROM_PARTITION = "redriven-from-partition"
REDRIVEN_FROM_OFFSET = "redriven-from-offset"
REDRIVEN_FROM_ERROR = "redriven-from-error-class"
REDRIVEN_FROM_PARKED_ID = "redriven-from-parked-id"
REDRIVEN_AT = "redriven-at"
REDRIVEN_PREFIX = "redriven-"

# Broker answers to an offset change while the group has members (classic and KIP-848).
_ACTIVE_GROUP_ERRORS = frozenset({
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION, KafkaError.STALE_MEMBER_EPOCH,
    KafkaError.FENCED_MEMBER_EPOCH, KafkaError.NON_EMPTY_GROUP,
})
_IDLE_STATES = (ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD)
_NO_OFFSET = -1001  # librdkafka's OFFSET_INVALID: the group never committed here
_PREVIEW_LIMIT = 300


# --- options and topic resolution -------------------------------------------------------


def _topics_options(func: F) -> F:
    func = click.option(
        "--prefix", default=None, metavar="PREFIX",
        help="Topic name prefix [default: $STOVEPIPE_TOPIC_PREFIX, else the file's prefix].",
    )(func)
    return click.option(
        "--file", "topics_file", type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="topics.yaml to use [default: $STOVEPIPE_TOPICS_FILE, else the repo's].",
    )(func)


def _broker_options(func: F) -> F:
    func = click.option(
        "--timeout", type=click.FloatRange(min=0.1), default=DEFAULT_ADMIN_TIMEOUT,
        show_default=True, help="Seconds to wait for each broker call.",
    )(func)
    return click.option(
        "--bootstrap", default=None, metavar="HOST:PORT",
        help="Kafka bootstrap servers [default: $STOVEPIPE_KAFKA_BOOTSTRAP, else the local "
             "stack].",
    )(func)


_app_id_option = click.option(
    "--app-id", envvar=ENV_APP_ID, default=DEFAULT_APP_ID, show_default=True,
    help=f"The workers' application id, which is their consumer group "
         f"[env {ENV_APP_ID}].")
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
_yes_option = click.option("--yes", "-y", is_flag=True,
                           help="Do not ask for confirmation (for scripts and CI).")


def _load_config(topics_file: Path | None, prefix: str | None) -> TopicsConfig:
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
    a broker that does not answer becomes one ClickException naming it."""

    def __init__(self, bootstrap: str, timeout: float) -> None:
        self.bootstrap = bootstrap
        self.timeout = timeout
        try:
            conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _kafka_log}
            self.admin = AdminClient(conf)
        except (KafkaException, ValueError, TypeError) as exc:
            raise click.ClickException(
                f"bad Kafka bootstrap {bootstrap!r}: {_reason(exc)}") from None
        # never subscribes: it reads watermarks and times, and joins no group
        self._consumer: Consumer | None = None

    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer({
                "bootstrap.servers": self.bootstrap,
                "group.id": f"stovepipe-operator-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "logger": _kafka_log})
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
                out[p] = self.consumer().get_watermark_offsets(
                    TopicPartition(topic, p), timeout=self.timeout)
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


def _kafka(bootstrap: str | None, timeout: float) -> Kafka:
    return Kafka(bootstrap or settings_mod.load_settings().kafka_bootstrap, timeout)


def _active_group_message(info: GroupInfo, topic: str) -> str:
    who = ", ".join(info.members[:5]) + (" …" if len(info.members) > 5 else "")
    return (f"consumer group {info.group!r} has {len(info.members)} live member(s) "
            f"(state {info.state}{': ' + who if who else ''}). Stop the workers consuming "
            f"{topic} first: Kafka refuses to change the offsets of an active group, and a "
            f"live member would overwrite the reset with its own position at its next "
            f"commit. A worker killed without leaving stays a member until its session "
            f"times out (about 10 s).")


# --- replay ------------------------------------------------------------------------------


class _TimeParam(click.ParamType):
    """ISO-8601 (``2025-06-01T12:00:00Z``; no zone means local time) or relative to now
    (``-15m``, ``-1h30m``, ``-90s``)."""

    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        text = str(value).strip()
        if text.startswith("-"):
            try:
                return datetime.now(UTC) - parse_duration(text[1:])
            except ValueError as exc:
                self.fail(f"{text!r}: {exc}, after the '-'", param, ctx)
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{text!r} is neither an ISO-8601 time (2025-06-01T12:00:00Z) nor "
                      f"relative to now (-15m, -2h)", param, ctx)
        return when if when.tzinfo is not None else when.astimezone()


@dataclass(frozen=True)
class PartitionReset:
    """One partition of a replay: where the group is, where it will be."""

    partition: int
    committed: int | None  # None: the group never committed here
    earliest: int  # first retained offset
    end: int  # offset of the next message to be written
    new: int
    note: str = ""

    @property
    def position(self) -> int:
        """Where the group resumes today (workers start at the earliest offset when they
        have no commit)."""
        return self.earliest if self.committed is None else max(self.committed, self.earliest)

    @property
    def replayed(self) -> int:
        """Messages already consumed that the group will consume again."""
        return max(0, min(self.position, self.end) - self.new)

    @property
    def skipped(self) -> int:
        """Messages not yet consumed that the group will never see."""
        return max(0, self.new - self.position)

    @property
    def effect(self) -> str:
        if self.replayed:
            return f"replays {self.replayed}"
        if self.skipped:
            return f"skips {self.skipped}"
        return "no change"


def plan_replay(kafka: Kafka, group: str, topic: str, partitions: Sequence[int], *,
                to_offset: int | None, to_time: datetime | None) -> list[PartitionReset]:
    """The new offset of every partition: the earliest retained offset (neither target),
    ``to_offset`` (kept within the retained range) or the first message at ``to_time``."""
    committed = kafka.committed(group, topic, partitions)
    marks = kafka.watermarks(topic, partitions)
    at_time = kafka.offsets_at(topic, partitions, to_time) if to_time is not None else {}
    plan = []
    for p in partitions:
        earliest, end = marks[p]
        note = ""
        if to_time is not None:
            found = at_time.get(p)
            new = end if found is None else found
            if found is None:
                note = "no message at or after the time: the end"
        elif to_offset is not None:
            new = min(max(to_offset, earliest), end)
            if to_offset < earliest:
                note = f"{to_offset} is no longer retained: earliest"
            elif to_offset > end:
                note = f"{to_offset} is past the end: the end"
        else:
            new = earliest
        plan.append(PartitionReset(p, committed.get(p), earliest, end, new, note))
    return plan


def _plan_lines(plan: Sequence[PartitionReset]) -> list[str]:
    rows = [("PARTITION", "COMMITTED", "", "NEW", "END", "EFFECT")]
    for r in plan:
        rows.append((str(r.partition), "-" if r.committed is None else str(r.committed), "→",
                     str(r.new), str(r.end), r.effect + (f" ({r.note})" if r.note else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])
            for row in rows]


def _group_lag(kafka: Kafka, group: str, topic: str, partitions: Sequence[int]) -> int:
    committed = kafka.committed(group, topic, partitions)
    lag = 0
    for p, (earliest, end) in kafka.watermarks(topic, partitions).items():
        position = committed.get(p)
        lag += max(0, end - (earliest if position is None else max(position, earliest)))
    return lag


def _confirm_reset(kafka: Kafka, group: str, topic: str, plan: Sequence[PartitionReset],
                   timeout: float) -> None:
    """Read the offsets back until each partition shows its new offset."""
    wanted = {r.partition: r.new for r in plan}
    confirmed: set[int] = set()
    deadline = time.monotonic() + timeout
    with click.progressbar(length=len(wanted), label="confirming the reset",
                           file=sys.stderr) as bar:
        while True:
            committed = kafka.committed(group, topic, list(wanted))
            now_ok = {p for p, o in wanted.items() if committed.get(p) == o}
            bar.update(len(now_ok - confirmed))
            confirmed |= now_ok
            if confirmed == set(wanted):
                return
            if time.monotonic() > deadline:
                off = {p: committed.get(p) for p in set(wanted) - confirmed}
                raise click.ClickException(
                    f"the broker accepted the reset but group {group!r} reads back {off} on "
                    f"{topic}: a member may have committed over it; check with --dry-run")
            time.sleep(0.2)


def _follow_replay(kafka: Kafka, group: str, topic: str, partitions: Sequence[int],
                   timeout: float) -> None:
    """Wait, with a progress bar, until the group has consumed every message of the
    partitions (its lag is zero), or ``timeout`` seconds."""
    start = _group_lag(kafka, group, topic, partitions)
    deadline = time.monotonic() + timeout
    done = 0
    with click.progressbar(length=max(start, 1), label=f"replaying {topic}",
                           file=sys.stderr) as bar:
        while True:
            lag = _group_lag(kafka, group, topic, partitions)
            progress = max(0, start - lag)
            if progress > done:
                bar.update(progress - done)
                done = progress
            if lag == 0:
                bar.update(max(start, 1) - done)
                return
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"the reset was applied, but group {group!r} still has {lag} message(s) "
                    f"of {topic} to consume after {timeout:g}s; are the workers running?")
            time.sleep(0.5)


@click.command("replay")
@click.argument("topic")
@click.option("--to-beginning", is_flag=True,
              help="Reset to the earliest retained offset of each partition.")
@click.option("--to-offset", type=click.IntRange(min=0), metavar="N",
              help="Reset every selected partition to offset N (kept within the retained "
                   "range).")
@click.option("--to-time", type=_TimeParam(), metavar="TIME",
              help="Reset to the first message at or after TIME: ISO-8601 "
                   "(2025-06-01T12:00:00Z; no zone means local time) or relative (-15m, "
                   "-2h).")
@click.option("--group", metavar="ID",
              help="Consumer group to reset [default: the group consuming TOPIC: the app "
                   "id for stage and _dlq topics, <app id>-delay for delay tiers].")
@_app_id_option
@click.option("--partition", "only", type=click.IntRange(min=0), multiple=True, metavar="P",
              help="Only partition P (repeatable) [default: every partition].")
@click.option("--dry-run", is_flag=True,
              help="Show each partition's committed → new offset and what would be "
                   "replayed; change nothing.")
@click.option("--force", is_flag=True,
              help="Try even though the group has live members (Kafka normally refuses).")
@_yes_option
@click.option("--wait", is_flag=True,
              help="After the reset, follow the replay until the group's lag is zero "
                   "(the workers must be running).")
@click.option("--wait-timeout", type=click.FloatRange(min=1), default=600.0, metavar="SECONDS",
              show_default=True, help="Seconds --wait waits at most.")
@_json_option
@_topics_options
@_broker_options
def replay_command(topic: str, to_beginning: bool, to_offset: int | None,
                   to_time: datetime | None, group: str | None, app_id: str,
                   only: tuple[int, ...], dry_run: bool, force: bool, yes: bool, wait: bool,
                   wait_timeout: float, as_json: bool, topics_file: Path | None,
                   prefix: str | None, bootstrap: str | None, timeout: float) -> None:
    """Make the pipeline process TOPIC again from a point: reset the committed offsets
    of the consumer group that consumes it.

    TOPIC is a topics.yaml entry (process, process_dlq, delay_1s, ...) or a full Kafka
    topic name. Exactly one of --to-beginning, --to-offset, --to-time.

    Replaying is safe because every stage is idempotent (design §6, §10): a message
    handled twice changes nothing the first delivery did not. Stop the workers first:
    Kafka refuses to move the offsets of a group with live members. Moving an offset
    forward skips messages for good; the dry run shows it as "skips".

    \b
    Exit status: 0 reset applied (or nothing to do, or --dry-run), 1 refused or failed.
    """
    if sum((to_beginning, to_offset is not None, to_time is not None)) != 1:
        raise click.UsageError("give exactly one of --to-beginning, --to-offset N, "
                               "--to-time TIME")
    target = (f"offset {to_offset}" if to_offset is not None else
              to_time.isoformat() if to_time is not None else "the beginning")
    config = _load_config(topics_file, prefix)
    spec = resolve_topic(config, topic)
    group = group or consumer_group_of(spec, app_id)
    with _kafka(bootstrap, timeout) as kafka:
        existing = kafka.partitions(spec.full_name)
        missing = sorted(set(only) - set(existing))
        if missing:
            raise click.ClickException(
                f"{spec.full_name} has no partition {missing}; it has {existing}")
        partitions = sorted(set(only)) if only else existing
        info = kafka.group(group)
        plan = plan_replay(kafka, group, spec.full_name, partitions,
                           to_offset=to_offset, to_time=to_time)
        report = _ReplayReport(spec, info, target, plan)
        if not as_json:
            report.echo_plan()
        if all(r.committed is None for r in plan) and not info.members:
            click.echo(f"note: group {group!r} has never committed on {spec.full_name}; if "
                       f"the workers run under another app id, pass --app-id (or set "
                       f"{ENV_APP_ID}) or --group", err=True)
        if dry_run or all(r.committed == r.new for r in plan):
            if info.live:
                click.echo(f"note: {_active_group_message(info, spec.full_name)}", err=True)
            if not dry_run:
                click.echo("nothing to do: the group is already there", err=True)
            if as_json:
                report.echo_json(applied=False, dry_run=dry_run)
            return
        if info.live:
            if not force:
                raise click.ClickException(_active_group_message(info, spec.full_name)
                                           + " (--force tries anyway.)")
            click.echo(f"warning: --force: {_active_group_message(info, spec.full_name)}",
                       err=True)
        if not yes:
            click.confirm(f"Reset group {group!r} on {spec.full_name} "
                          f"({len(plan)} partition(s))?", abort=True, err=True)
        _reset_offsets(kafka, group, spec.full_name, plan)
        _confirm_reset(kafka, group, spec.full_name, plan, timeout)
        if as_json:
            report.echo_json(applied=True, dry_run=False)
        else:
            click.echo(f"reset group {group!r} on {spec.full_name}: {report.summary}")
        if wait:
            _follow_replay(kafka, group, spec.full_name, partitions, wait_timeout)
            click.echo(f"group {group!r} has consumed {spec.full_name} to the end",
                       err=as_json)


@dataclass(frozen=True)
class _ReplayReport:
    spec: TopicSpec | DelayTier
    info: GroupInfo
    target: str
    plan: Sequence[PartitionReset]

    @property
    def summary(self) -> str:
        return (f"{sum(r.replayed for r in self.plan)} message(s) consumed again, "
                f"{sum(r.skipped for r in self.plan)} skipped, "
                f"{sum(r.end - r.new for r in self.plan)} to consume from the new offsets")

    def echo_plan(self) -> None:
        click.echo(f"replay {self.spec.full_name} ({self.spec.entry}) for group "
                   f"{self.info.group!r} (state {self.info.state}) to {self.target}")
        for line in _plan_lines(self.plan):
            click.echo(f"  {line}")
        click.echo(f"  {self.summary}")

    def echo_json(self, *, applied: bool, dry_run: bool) -> None:
        click.echo(json.dumps({
            "topic": self.spec.full_name, "entry": self.spec.entry, "group": self.info.group,
            "group_state": self.info.state, "live_members": list(self.info.members),
            "target": self.target, "dry_run": dry_run, "applied": applied,
            "replayed": sum(r.replayed for r in self.plan),
            "skipped": sum(r.skipped for r in self.plan),
            "partitions": [{"partition": r.partition, "committed": r.committed, "new": r.new,
                            "earliest": r.earliest, "end": r.end, "replayed": r.replayed,
                            "skipped": r.skipped, "note": r.note} for r in self.plan],
        }, indent=2))


def _reset_offsets(kafka: Kafka, group: str, topic: str,
                   plan: Sequence[PartitionReset]) -> None:
    """Commit the plan's offsets in one request; the broker's refusal as a message."""
    errors = kafka.alter_offsets(group, topic, {r.partition: r.new for r in plan})
    refused = {p: e for p, e in errors.items() if e is not None}
    if not refused:
        return
    first = next(iter(refused.values()))
    assert first is not None
    if first.code() in _ACTIVE_GROUP_ERRORS:
        raise click.ClickException(
            f"Kafka refused the reset of group {group!r} ({first.str()}): the group has "
            f"active members, so nothing was changed on partitions {sorted(refused)}. Stop "
            f"every worker of the group (a crashed one leaves when its session times out, "
            f"about 10 s) and run replay again.")
    raise click.ClickException(f"Kafka refused the reset of group {group!r} on partitions "
                               f"{sorted(refused)}: {first.str()}")


# --- reading a topic ---------------------------------------------------------------------


@dataclass(frozen=True)
class TopicMessage:
    """One message read from a topic."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]

    def header(self, name: str) -> str | None:
        found = h.get([(k, v) for k, v in self.headers if v is not None], name)
        return found.decode("utf-8", "replace") if found is not None else None


def read_topic(kafka: Kafka, topic: str, partitions: Sequence[int], *, from_offset: int = 0,
               limit: int | None = None) -> tuple[list[TopicMessage], int]:
    """The messages of ``partitions`` present now, in partition then offset order, at
    most ``limit``; and how many there are in all (from ``from_offset``). A throwaway
    reader: assigned partitions, no group membership, no commits."""
    marks = kafka.watermarks(topic, partitions)
    ranges = {p: (max(earliest, from_offset), end) for p, (earliest, end) in marks.items()}
    total = sum(max(0, end - start) for start, end in ranges.values())
    out: list[TopicMessage] = []
    reader = Consumer({
        "bootstrap.servers": kafka.bootstrap, "group.id": f"stovepipe-reader-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "enable.auto.offset.store": False,
        "enable.partition.eof": True, "logger": _kafka_log})
    try:
        for p in partitions:
            start, end = ranges[p]
            if start >= end or (limit is not None and len(out) >= limit):
                continue
            reader.assign([TopicPartition(topic, p, start)])
            deadline = time.monotonic() + kafka.timeout
            while limit is None or len(out) < limit:
                msg = reader.poll(0.2)
                if msg is None:
                    if time.monotonic() > deadline:
                        raise click.ClickException(
                            f"no messages from {topic} [{p}] for {kafka.timeout:g}s while "
                            f"reading offsets {start}..{end - 1} from {kafka.bootstrap}")
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        break
                    raise click.ClickException(f"reading {topic} [{p}]: {err.str()}")
                offset = msg.offset() or 0
                if offset >= end:
                    break
                stamp_type, stamp = msg.timestamp()
                out.append(TopicMessage(topic, p, offset, stamp if stamp_type else None,
                                  msg.key(), msg.value(), _headers_of(msg.headers())))
                deadline = time.monotonic() + kafka.timeout
                if offset >= end - 1:
                    break
            reader.unassign()
    finally:
        reader.close()
    return out, total


def _headers_of(raw: Any) -> tuple[tuple[str, bytes | None], ...]:
    out = []
    for name, value in raw or ():
        out.append((str(name), value.encode() if isinstance(value, str) else value))
    return tuple(out)


def _safe_text(data: bytes | str | None, limit: int = _PREVIEW_LIMIT) -> str:
    """Printable in any terminal: control characters escaped, long text cut."""
    if data is None:
        return "(null)"
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            shown = repr(data[:limit])
            return shown + (f"… ({len(data)} bytes)" if len(data) > limit else "")
    else:
        text = data
    cut = text[:limit]
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return escaped + (f"… ({len(text)} chars)" if len(text) > limit else "")


def _blob(data: bytes | None) -> dict[str, str] | None:
    """Bytes for JSON, like the parked store keeps headers: text when UTF-8, else base64."""
    if data is None:
        return None
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def _decode(spec: TopicSpec, value: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
    """(the payload as protojson fields, None) or (None, why it does not decode)."""
    try:
        payload = unmarshal(value or b"", spec.payload)
    except MalformedPayload as exc:
        return None, str(exc)
    return json_format.MessageToDict(payload, preserving_proto_field_name=True), None


def _failure(record: TopicMessage) -> dict[str, Any]:
    def number(name: str) -> int | str | None:
        raw = record.header(name)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return raw

    return {"source_topic": record.header(h.DLQ_SOURCE_TOPIC),
            "source_partition": number(h.DLQ_SOURCE_PARTITION),
            "source_offset": number(h.DLQ_SOURCE_OFFSET),
            "attempts": number(h.DLQ_ATTEMPTS),
            "error_class": record.header(h.DLQ_ERROR_CLASS),
            "error_message": record.header(h.DLQ_ERROR_MESSAGE),
            "time": record.header(h.DLQ_TIME)}


def _record_json(spec: TopicSpec, record: TopicMessage) -> dict[str, Any]:
    payload, error = _decode(spec, record.value)
    return {
        "topic": record.topic, "partition": record.partition, "offset": record.offset,
        "timestamp": (datetime.fromtimestamp(record.timestamp_ms / 1000, UTC).isoformat()
                      if record.timestamp_ms is not None else None),
        "key": _blob(record.key), "payload": payload, "decode_error": error,
        "value": None if payload is not None else _blob(record.value),
        "failure": _failure(record),
        "headers": [{"key": k, "value": _blob(v)} for k, v in record.headers],
    }


def _record_lines(spec: TopicSpec, record: TopicMessage) -> list[str]:
    payload, error = _decode(spec, record.value)
    fail = _failure(record)
    lines = [f"{record.topic} [{record.partition}] @{record.offset}  "
             f"key {_safe_text(record.key)}"]
    if payload is not None:
        lines.append(f"  payload   {_safe_text(json.dumps(payload, ensure_ascii=False))}")
    else:
        lines.append(f"  payload   undecodable ({_safe_text(error)}); raw "
                     f"{_safe_text(record.value)}")
    if fail["source_topic"] is not None:
        lines.append(f"  source    {fail['source_topic']} [{fail['source_partition']}] "
                     f"@{fail['source_offset']}, {fail['attempts']} attempt(s)")
    lines.append(f"  error     {_safe_text(fail['error_class'] or '-')}: "
                 f"{_safe_text(fail['error_message'] or '-')}")
    lines.append(f"  failed at {_safe_text(fail['time'] or '-')}")
    other = [(k, v) for k, v in record.headers if k not in FAILURE_HEADERS]
    if other:
        lines.append("  headers   " + ", ".join(f"{k}={_safe_text(v, 80)}" for k, v in other))
    return lines


def _reading_options(func: F) -> F:
    func = click.option("--from-offset", type=click.IntRange(min=0), default=0,
                        metavar="N", help="Start at offset N of each partition.")(func)
    return click.option("--partition", "only", type=click.IntRange(min=0), multiple=True,
                        metavar="P", help="Only partition P (repeatable).")(func)


def _dlq_partitions(kafka: Kafka, spec: TopicSpec, only: Sequence[int]) -> list[int]:
    existing = kafka.partitions(spec.full_name)
    missing = sorted(set(only) - set(existing))
    if missing:
        raise click.ClickException(f"{spec.full_name} has no partition {missing}; "
                                   f"it has {existing}")
    return sorted(set(only)) if only else existing


# --- dlq ---------------------------------------------------------------------------------


@click.group("dlq")
def dlq_group() -> None:
    """Inspect and redrive the dead-letter (`<key>_dlq`) topics."""


@dlq_group.command("list")
@click.argument("topic")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, metavar="N",
              help="Show at most this many messages.")
@_reading_options
@_json_option
@_topics_options
@_broker_options
def dlq_list_command(topic: str, limit: int, only: tuple[int, ...], from_offset: int,
                     as_json: bool, topics_file: Path | None, prefix: str | None,
                     bootstrap: str | None, timeout: float) -> None:
    """Show the messages of a dead-letter topic, oldest first per partition: the decoded
    payload and why it failed (source topic, partition and offset, attempts, error, time).

    TOPIC is a stage (process) or its dead-letter topic (process_dlq), by topics.yaml
    entry or full Kafka name. Reads without a consumer group: nothing is committed, the
    reconciler's position is untouched.
    """
    config = _load_config(topics_file, prefix)
    spec = resolve_dead_letter(config, topic)
    with _kafka(bootstrap, timeout) as kafka:
        partitions = _dlq_partitions(kafka, spec, only)
        records, total = read_topic(kafka, spec.full_name, partitions,
                                    from_offset=from_offset, limit=limit)
    if as_json:
        click.echo(json.dumps({"topic": spec.full_name, "entry": spec.entry, "total": total,
                               "shown": len(records),
                               "messages": [_record_json(spec, r) for r in records]},
                              indent=2, ensure_ascii=False))
        return
    for record in records:
        for line in _record_lines(spec, record):
            click.echo(line)
    more = f" (--limit {limit}; {total - len(records)} more)" if total > len(records) else ""
    click.echo(f"{len(records)} of {total} message(s) in {spec.full_name}{more}")


@dataclass(frozen=True)
class _Redrive:
    record: TopicMessage
    target: str | None  # None: skipped
    reason: str = ""


def _plan_redrive(config: TopicsConfig, spec: TopicSpec, records: Iterable[TopicMessage]
                  ) -> list[_Redrive]:
    stage = config.stage(spec.topic_key)
    plan = []
    for record in records:
        source = record.header(h.DLQ_SOURCE_TOPIC) or stage.full_name
        _, error = _decode(spec, record.value)
        if error is not None:
            plan.append(_Redrive(record, None, f"undecodable ({error}): it would only come "
                                               f"back; the reconciler parks it"))
        elif source != stage.full_name:
            plan.append(_Redrive(record, None, f"its source topic {source!r} is not "
                                               f"{stage.full_name}, the stage of {spec.entry}"))
        else:
            plan.append(_Redrive(record, source))
    return plan


def _redrive_headers(record: TopicMessage, extra: dict[str, str | int], *,
                     keep_failure: bool = False) -> list[tuple[str, Any]]:
    """The original headers without runtime headers, failure headers (unless
    ``keep_failure``) and older redrive provenance; attempt reset to 0, ``extra`` and
    the redrive time added."""
    dropped = {*h.RUNTIME_HEADERS, *(() if keep_failure else FAILURE_HEADERS)}
    kept: list[tuple[str, Any]] = [(k, v) for k, v in record.headers
                                   if k not in dropped and not k.startswith(REDRIVEN_PREFIX)]
    provenance = {**extra, REDRIVEN_AT: datetime.now(UTC).isoformat(timespec="milliseconds"),
                  h.ATTEMPT: 0}
    return kept + [(k, str(v).encode()) for k, v in provenance.items()]


def _produce_all(kafka: Kafka, messages: Sequence[tuple[str, bytes | None, bytes | None,
                                                          list[tuple[str, Any]]]],
                 label: str) -> int:
    """Produce (topic, key, value, headers) in order and wait for every ack; the number
    acknowledged. A producer from `producer_conf`: keys land where the workers put them."""
    failures: list[str] = []
    acked = 0
    producer = Producer(producer_conf(
        kafka.bootstrap, logger=_kafka_log,
        **{"message.timeout.ms": int(max(30.0, kafka.timeout * 3) * 1000)}))
    with click.progressbar(length=len(messages), label=label, file=sys.stderr) as bar:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            nonlocal acked
            if err is not None:
                failures.append(err.str())
            else:
                acked += 1
            bar.update(1)

        for topic, key, value, headers in messages:
            while True:
                try:
                    producer.produce(topic, key=key, value=value, headers=headers,
                                     on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.5)
            producer.poll(0)
        left = producer.flush(max(30.0, kafka.timeout * 3) + 5)
    if failures or left:
        raise click.ClickException(
            f"{acked} of {len(messages)} message(s) acknowledged by {kafka.bootstrap}; "
            f"{len(failures) + left} failed ({'; '.join(sorted(set(failures))) or 'timed out'}"
            f"). Redriving again is safe: stages are idempotent.")
    return acked


@dlq_group.command("redrive")
@click.argument("topic")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
              help="Redrive at most this many messages [default: all].")
@_reading_options
@click.option("--dry-run", is_flag=True, help="Show what would be redriven; produce nothing.")
@click.option("--skip-reconciler", is_flag=True,
              help="Also move the reconciler's committed offset past the redriven messages "
                   "it has not handled yet, so it does not fail their Requests first. Needs "
                   "the workers stopped.")
@_app_id_option
@_yes_option
@_json_option
@_topics_options
@_broker_options
def dlq_redrive_command(topic: str, limit: int | None, only: tuple[int, ...],
                        from_offset: int, dry_run: bool, skip_reconciler: bool, app_id: str,
                        yes: bool, as_json: bool, topics_file: Path | None,
                        prefix: str | None, bootstrap: str | None, timeout: float) -> None:
    """Give dead-lettered messages a fresh pipeline run: re-produce each message of a
    dead-letter topic to its stage topic, with its original key and value.

    The target is the stage of TOPIC (a message whose dlq-source-topic header names
    another topic is skipped, as is an undecodable one: it would only fail again).
    Headers are reset: attempt 0, the dlq-* failure headers dropped; redriven-from-* and
    redriven-at headers record where it came from. The dead-letter topic is not changed
    (Kafka topics are append-only): redriving twice sends the messages twice, which is
    harmless.

    What it can and cannot do: stages are idempotent, so a redrive is always safe, but
    the reconciler consuming TOPIC (the workers' group) has usually already handled
    these messages: it drives their Request to `failed` (fail-closed), and a `failed`
    Request stays failed — the redriven message then changes nothing. A redrive helps
    where the failure left nothing terminal behind: an ingest that minted no Request, a
    record whose fact, bookmark or promotion was not written, or messages the reconciler
    has not reached yet (workers stopped; see --skip-reconciler). A redriven message
    that fails again goes back to the dead-letter topic and is reconciled as usual.
    """
    config = _load_config(topics_file, prefix)
    spec = resolve_dead_letter(config, topic)
    group = app_id
    with _kafka(bootstrap, timeout) as kafka:
        partitions = _dlq_partitions(kafka, spec, only)
        records, total = read_topic(kafka, spec.full_name, partitions,
                                    from_offset=from_offset, limit=limit)
        plan = _plan_redrive(config, spec, records)
        chosen = [r for r in plan if r.target is not None]
        targets = sorted({r.target for r in chosen if r.target is not None})
        for target in targets:
            kafka.partitions(target)  # exists? (never let the broker auto-create it)
        committed = kafka.committed(group, spec.full_name, partitions)
        marks = kafka.watermarks(spec.full_name, partitions)
        unreconciled = [r for r in chosen
                        if r.record.offset >= _position(committed, marks, r.record.partition)]
        if not as_json:
            _echo_redrive_plan(plan, dry_run=dry_run)
        if dry_run or not chosen:
            _redrive_report(as_json, spec, total, plan, redriven=0, dry_run=dry_run,
                            group=group, unreconciled=len(unreconciled), moved={})
            return
        if skip_reconciler:
            info = kafka.group(group)
            if info.live:
                raise click.ClickException(
                    "--skip-reconciler: " + _active_group_message(info, spec.full_name)
                    + " Nothing was redriven.")
        if not yes:
            click.confirm(f"Redrive {len(chosen)} message(s) from {spec.full_name} to "
                          f"{', '.join(targets)}?", abort=True, err=True)
        messages = [(item.target or "", item.record.key, item.record.value,
                     _redrive_headers(item.record, {
                         REDRIVEN_FROM_TOPIC: item.record.topic,
                         REDRIVEN_FROM_PARTITION: item.record.partition,
                         REDRIVEN_FROM_OFFSET: item.record.offset,
                         REDRIVEN_FROM_ERROR: item.record.header(h.DLQ_ERROR_CLASS) or "",
                     })) for item in chosen]
        redriven = _produce_all(kafka, messages, f"redriving to {', '.join(targets)}")
        moved: dict[int, int] = {}
        if skip_reconciler:
            moved = _skip_reconciler(kafka, group, spec, plan, committed, marks, from_offset)
    _redrive_report(as_json, spec, total, plan, redriven=redriven, dry_run=False, group=group,
                    unreconciled=len(unreconciled), moved=moved)


def _echo_redrive_plan(plan: Sequence[_Redrive], *, dry_run: bool, shown: int = 20) -> None:
    """Every skipped message with its reason; the first ``shown`` redriven ones."""
    listed = 0
    for item in plan:
        rec = item.record
        where = f"[{rec.partition}] @{rec.offset} key {_safe_text(rec.key, 80)}"
        if item.target is None:
            click.echo(f"skip     {where}: {item.reason}")
        elif listed < shown:
            listed += 1
            click.echo(f"{'would ' if dry_run else ''}redrive {where} → {item.target}")
    more = sum(1 for item in plan if item.target is not None) - listed
    if more:
        click.echo(f"… and {more} more to redrive")


def _position(committed: dict[int, int | None], marks: dict[int, tuple[int, int]],
              partition: int) -> int:
    earliest = marks[partition][0]
    offset = committed.get(partition)
    return earliest if offset is None else max(offset, earliest)


def _skip_reconciler(kafka: Kafka, group: str, spec: TopicSpec, plan: Sequence[_Redrive],
                     committed: dict[int, int | None], marks: dict[int, tuple[int, int]],
                     from_offset: int) -> dict[int, int]:
    """Move the group's offset on each partition past the redriven messages that follow
    its position without a gap: a skipped (not redriven) or unread message stops it, so
    nothing is hidden from the reconciler that was not redriven."""
    moves: dict[int, int] = {}
    for partition in sorted({item.record.partition for item in plan}):
        position = _position(committed, marks, partition)
        if max(from_offset, marks[partition][0]) > position:
            continue  # messages between the position and what we read were not redriven
        new = position
        for item in sorted((i for i in plan if i.record.partition == partition),
                           key=lambda i: i.record.offset):
            if item.record.offset < new:
                continue
            if item.target is None:
                break
            new = item.record.offset + 1
        if new > position:
            moves[partition] = new
    if moves:
        errors = kafka.alter_offsets(group, spec.full_name, moves)
        refused = sorted(p for p, e in errors.items() if e is not None)
        if refused:
            raise click.ClickException(
                f"the messages were redriven, but Kafka refused to move group {group!r} on "
                f"{spec.full_name} partitions {refused} (is a worker running?); the "
                f"reconciler will still handle those messages")
    return moves


def _redrive_report(as_json: bool, spec: TopicSpec, total: int, plan: Sequence[_Redrive], *,
                    redriven: int, dry_run: bool, group: str, unreconciled: int,
                    moved: dict[int, int]) -> None:
    chosen = sum(1 for item in plan if item.target is not None)
    skipped = len(plan) - chosen
    if as_json:
        click.echo(json.dumps({
            "topic": spec.full_name, "entry": spec.entry, "total": total, "read": len(plan),
            "dry_run": dry_run, "would_redrive" if dry_run else "redriven":
                chosen if dry_run else redriven,
            "skipped": [{"partition": i.record.partition, "offset": i.record.offset,
                         "reason": i.reason} for i in plan if i.target is None],
            "reconciler_group": group, "not_yet_reconciled": unreconciled,
            "reconciler_moved_to": {str(p): o for p, o in moved.items()},
        }, indent=2))
        return
    verb = "would redrive" if dry_run else "redriven"
    click.echo(f"{spec.full_name}: {len(plan)} of {total} message(s) read, "
               f"{chosen if dry_run else redriven} {verb}, {skipped} skipped")
    if moved:
        click.echo(f"group {group!r} moved past the redriven messages on {spec.full_name}: "
                   + ", ".join(f"[{p}] → {o}" for p, o in sorted(moved.items())))
    elif unreconciled:
        click.echo(f"note: {unreconciled} of them are not yet handled by the reconciler "
                   f"(group {group!r}); when it runs it fails their Requests (fail-closed), "
                   f"and a failed Request stays failed. To let the redriven copies decide "
                   f"instead, stop the workers and redrive with --skip-reconciler.")


# --- parked ------------------------------------------------------------------------------


class _OneConnection:
    """A store connection source over one autocommit connection: a CLI needs no pool,
    and an unreachable database then fails at once with the driver's reason."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        yield self._conn


def _with_parked(dsn: str | None, action: Callable[[ParkedStore], Awaitable[T]]) -> T:
    """Run ``action`` on the parked-message store; database failures become messages."""
    resolved = dsn or settings_mod.load_settings().postgres_dsn

    async def run() -> T:
        conn = await psycopg.AsyncConnection.connect(resolved, autocommit=True,
                                                     connect_timeout=10)
        async with conn:
            return await action(Stores(_OneConnection(conn)).parked)

    try:
        return asyncio.run(run())
    except psycopg.errors.UndefinedTable:
        raise click.ClickException(
            "the database has no parked_message table: run `stovepipe db migrate`") from None
    except psycopg.OperationalError as exc:
        raise click.ClickException(
            f"cannot reach PostgreSQL: {str(exc).strip() or type(exc).__name__}\nStart the "
            f"local stack with `stovepipe dev up`, or set {settings_mod.ENV_POSTGRES_DSN} "
            f"or --dsn.") from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _parked_json(msg: ParkedMessage) -> dict[str, Any]:
    return {"id": msg.id, "topic": msg.topic, "partition": msg.partition,
            "offset": msg.offset, "key": _blob(msg.key), "value": _blob(msg.value),
            "headers": [{"key": k, "value": _blob(v)} for k, v in msg.headers],
            "error": msg.error, "parked_at": msg.parked_at.isoformat()}


def _parked_lines(msg: ParkedMessage) -> list[str]:
    lines = [f"#{msg.id}  {msg.topic} [{msg.partition}] @{msg.offset}  parked "
             f"{msg.parked_at.isoformat(timespec='seconds')}  key {_safe_text(msg.key, 80)}",
             f"  error   {_safe_text(msg.error)}",
             f"  value   {_safe_text(msg.value)}"]
    if msg.headers:
        lines.append("  headers " + ", ".join(f"{k}={_safe_text(v, 80)}"
                                              for k, v in msg.headers))
    return lines


def _parked_topic(topic: str | None, topics_file: Path | None, prefix: str | None
                  ) -> str | None:
    """The dead-letter topic name to filter on: topics.yaml names resolved, other text
    taken as a full Kafka name (rows parked under an older prefix stay reachable)."""
    if topic is None:
        return None
    config = _load_config(topics_file, prefix)
    try:
        return resolve_dead_letter(config, topic).full_name
    except click.ClickException:
        return topic


def _list_parked(topic: str | None, limit: int, after_id: int, as_json: bool,
                 topics_file: Path | None, prefix: str | None, dsn: str | None) -> None:
    name = _parked_topic(topic, topics_file, prefix)

    async def fetch(store: ParkedStore) -> tuple[list[ParkedMessage], int]:
        return (await store.list_messages(topic=name, after_id=after_id, limit=limit),
                await store.count(topic=name))

    rows, total = _with_parked(dsn, fetch)
    if as_json:
        click.echo(json.dumps({"topic": name, "total": total, "shown": len(rows),
                               "messages": [_parked_json(m) for m in rows]},
                              indent=2, ensure_ascii=False))
        return
    for msg in rows:
        for line in _parked_lines(msg):
            click.echo(line)
    more = ""
    if rows and len(rows) == limit:
        more = f" (next page: --after-id {rows[-1].id})"
    click.echo(f"{len(rows)} shown, {total} parked{' in ' + name if name else ''}{more}")


def _parked_list_options(func: F) -> F:
    for option in reversed((
        click.option("--topic", metavar="TOPIC",
                     help="Only messages parked from this dead-letter topic (process, "
                          "process_dlq or a full name)."),
        click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
                     metavar="N",
                     help="Show at most this many."),
        click.option("--after-id", type=click.IntRange(min=0), default=0, metavar="ID",
                     help="Show messages with an id above this (the next page)."),
        _json_option, _topics_options, dsn_option,
    )):
        func = option(func)
    return func


@click.group("parked", invoke_without_command=True)
@_parked_list_options
@click.pass_context
def parked_group(ctx: click.Context, topic: str | None, limit: int, after_id: int,
                 as_json: bool, topics_file: Path | None, prefix: str | None,
                 dsn: str | None) -> None:
    """Messages a reconciler parked in PostgreSQL because it could not decode them.

    Without a subcommand, lists them (like `parked list`).
    """
    if ctx.invoked_subcommand is None:
        _list_parked(topic, limit, after_id, as_json, topics_file, prefix, dsn)


@parked_group.command("list")
@_parked_list_options
def parked_list_command(topic: str | None, limit: int, after_id: int, as_json: bool,
                        topics_file: Path | None, prefix: str | None,
                        dsn: str | None) -> None:
    """List parked messages, oldest first, with the error that parked them."""
    _list_parked(topic, limit, after_id, as_json, topics_file, prefix, dsn)


def _get_parked(parked_id: int, dsn: str | None) -> ParkedMessage:
    async def get(store: ParkedStore) -> ParkedMessage | None:
        try:
            return await store.get(parked_id)
        except NotFound:
            return None

    msg = _with_parked(dsn, get)
    if msg is None:
        raise click.ClickException(f"no parked message #{parked_id} (see `stovepipe parked`)")
    return msg


@parked_group.command("delete")
@click.argument("parked_id", metavar="ID", type=click.IntRange(min=1))
@_yes_option
@dsn_option
def parked_delete_command(parked_id: int, yes: bool, dsn: str | None) -> None:
    """Forget parked message ID once you have dealt with it."""
    msg = _get_parked(parked_id, dsn)
    for line in _parked_lines(msg):
        click.echo(line)
    if not yes:
        click.confirm(f"Delete parked message #{parked_id}?", abort=True, err=True)

    async def delete(store: ParkedStore) -> bool:
        return await store.delete(parked_id)

    if not _with_parked(dsn, delete):
        raise click.ClickException(f"parked message #{parked_id} was deleted meanwhile")
    click.echo(f"deleted parked message #{parked_id}")


@parked_group.command("redrive")
@click.argument("parked_id", metavar="ID", type=click.IntRange(min=1))
@_yes_option
@dsn_option
@_broker_options
def parked_redrive_command(parked_id: int, yes: bool, dsn: str | None,
                           bootstrap: str | None, timeout: float) -> None:
    """Re-produce parked message ID to the topic it was parked from (its dead-letter
    topic), with its key, value and headers (attempt reset to 0), then delete it.

    Useful once the workers can read it (e.g. after a contract fix): the reconciler then
    handles it. Still undecodable, it is parked again under a new id.
    """
    msg = _get_parked(parked_id, dsn)
    for line in _parked_lines(msg):
        click.echo(line)
    with _kafka(bootstrap, timeout) as kafka:
        kafka.partitions(msg.topic)
        if not yes:
            click.confirm(f"Redrive parked message #{parked_id} to {msg.topic}?",
                          abort=True, err=True)
        record = TopicMessage(msg.topic, msg.partition, msg.offset, None, msg.key, msg.value,
                        msg.headers)
        # back to its dead-letter topic: it keeps the headers saying why it failed
        headers = _redrive_headers(record, {REDRIVEN_FROM_PARKED_ID: msg.id},
                                   keep_failure=True)
        _produce_all(kafka, [(msg.topic, msg.key, msg.value, headers)],
                     f"redriving #{parked_id}")

    async def delete(store: ParkedStore) -> bool:
        return await store.delete(parked_id)

    deleted = _with_parked(dsn, delete)
    click.echo(f"redriven parked message #{parked_id} to {msg.topic}"
               + ("; deleted it" if deleted else "; it was already deleted"))
