"""`stovepipe dlq list | redrive`: read a `<key>_dlq` topic with a throwaway reader (it
joins no group and commits nothing) and show, or re-produce to their stage, its messages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
from confluent_kafka import (
    ConsumerGroupState,
    KafkaError,
)

from streams.cli.kafka import (
    Kafka,
    active_group_message,
    app_id_option,
    broker_options,
    json_option,
    load_topics_or_fail,
    open_kafka,
    resolve_dead_letter,
    topics_options,
    yes_option,
)
from streams.cli.messages import (
    TopicMessage,
    decode_payload,
    dlq_partitions,
    produce_all,
    read_topic,
    reading_options,
    record_json,
    record_lines,
    redrive_headers,
    safe_text,
)
from streams.config.topics import TopicsConfig, TopicSpec
from streams.runtime import headers as h

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


# --- dlq ---------------------------------------------------------------------------------


@click.group("dlq")
def dlq_group() -> None:
    """Inspect and redrive the dead-letter (`<key>_dlq`) topics."""


@dlq_group.command("list")
@click.argument("topic")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True, metavar="N",
              help="Show at most this many messages.")
@reading_options
@json_option
@topics_options
@broker_options
def dlq_list_command(topic: str, limit: int, only: tuple[int, ...], from_offset: int,
                     as_json: bool, topics_file: Path | None, prefix: str | None,
                     bootstrap: str | None, timeout: float) -> None:
    """Show the messages of a dead-letter topic, oldest first per partition: the decoded
    payload and why it failed (source topic, partition and offset, attempts, error, time).

    TOPIC is a stage (process) or its dead-letter topic (process_dlq), by topics.yaml
    entry or full Kafka name. Reads without a consumer group: nothing is committed, the
    reconciler's position is untouched.
    """
    config = load_topics_or_fail(topics_file, prefix)
    spec = resolve_dead_letter(config, topic)
    with open_kafka(bootstrap, timeout) as kafka:
        partitions = dlq_partitions(kafka, spec, only)
        records, total = read_topic(kafka, spec.full_name, partitions,
                                    from_offset=from_offset, limit=limit)
    if as_json:
        click.echo(json.dumps({"topic": spec.full_name, "entry": spec.entry, "total": total,
                               "shown": len(records),
                               "messages": [record_json(spec, r) for r in records]},
                              indent=2, ensure_ascii=False))
        return
    for record in records:
        for line in record_lines(spec, record):
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
        _, error = decode_payload(spec, record.value)
        if error is not None:
            plan.append(_Redrive(record, None, f"undecodable ({error}): it would only come "
                                               f"back; the reconciler parks it"))
        elif source != stage.full_name:
            plan.append(_Redrive(record, None, f"its source topic {source!r} is not "
                                               f"{stage.full_name}, the stage of {spec.entry}"))
        else:
            plan.append(_Redrive(record, source))
    return plan


@dlq_group.command("redrive")
@click.argument("topic")
@click.option("--limit", type=click.IntRange(min=1), default=None, metavar="N",
              help="Redrive at most this many messages [default: all].")
@reading_options
@click.option("--dry-run", is_flag=True, help="Show what would be redriven; produce nothing.")
@click.option("--skip-reconciler", is_flag=True,
              help="Also move the reconciler's committed offset past the redriven messages "
                   "it has not handled yet, so it does not fail their Requests first. Needs "
                   "the workers stopped.")
@app_id_option
@yes_option
@json_option
@topics_options
@broker_options
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
    config = load_topics_or_fail(topics_file, prefix)
    spec = resolve_dead_letter(config, topic)
    group = app_id
    with open_kafka(bootstrap, timeout) as kafka:
        partitions = dlq_partitions(kafka, spec, only)
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
                    "--skip-reconciler: " + active_group_message(info, spec.full_name)
                    + " Nothing was redriven.")
        if not yes:
            click.confirm(f"Redrive {len(chosen)} message(s) from {spec.full_name} to "
                          f"{', '.join(targets)}?", abort=True, err=True)
        messages = [(item.target or "", item.record.key, item.record.value,
                     redrive_headers(item.record, {
                         REDRIVEN_FROM_TOPIC: item.record.topic,
                         REDRIVEN_FROM_PARTITION: item.record.partition,
                         REDRIVEN_FROM_OFFSET: item.record.offset,
                         REDRIVEN_FROM_ERROR: item.record.header(h.DLQ_ERROR_CLASS) or "",
                     })) for item in chosen]
        redriven = produce_all(kafka, messages, f"redriving to {', '.join(targets)}")
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
        where = f"[{rec.partition}] @{rec.offset} key {safe_text(rec.key, 80)}"
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

