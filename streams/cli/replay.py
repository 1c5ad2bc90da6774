"""`stovepipe replay`: move the committed offsets of the consumer group that consumes a
topic (to the beginning, an offset or a time), so the pipeline processes that range
again. Safe because every stage is idempotent; refused while the group has live members.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click
from confluent_kafka import (
    ConsumerGroupState,
    KafkaError,
)

from streams.cli.kafka import (
    GroupInfo,
    Kafka,
    active_group_message,
    app_id_option,
    broker_options,
    consumer_group_of,
    json_option,
    load_topics_or_fail,
    open_kafka,
    resolve_topic,
    topics_options,
    yes_option,
)
from streams.config.settings import ENV_APP_ID
from streams.config.topics import DelayTier, TopicSpec
from streams.runtime import headers as h
from streams.schema.durations import parse_duration

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
@app_id_option
@click.option("--partition", "only", type=click.IntRange(min=0), multiple=True, metavar="P",
              help="Only partition P (repeatable) [default: every partition].")
@click.option("--dry-run", is_flag=True,
              help="Show each partition's committed → new offset and what would be "
                   "replayed; change nothing.")
@click.option("--force", is_flag=True,
              help="Try even though the group has live members (Kafka normally refuses).")
@yes_option
@click.option("--wait", is_flag=True,
              help="After the reset, follow the replay until the group's lag is zero "
                   "(the workers must be running).")
@click.option("--wait-timeout", type=click.FloatRange(min=1), default=600.0, metavar="SECONDS",
              show_default=True, help="Seconds --wait waits at most.")
@json_option
@topics_options
@broker_options
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
    config = load_topics_or_fail(topics_file, prefix)
    spec = resolve_topic(config, topic)
    group = group or consumer_group_of(spec, app_id)
    with open_kafka(bootstrap, timeout) as kafka:
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
                click.echo(f"note: {active_group_message(info, spec.full_name)}", err=True)
            if not dry_run:
                click.echo("nothing to do: the group is already there", err=True)
            if as_json:
                report.echo_json(applied=False, dry_run=dry_run)
            return
        if info.live:
            if not force:
                raise click.ClickException(active_group_message(info, spec.full_name)
                                           + " (--force tries anyway.)")
            click.echo(f"warning: --force: {active_group_message(info, spec.full_name)}",
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

