"""Messages of a topic as the operator commands read, show and re-produce them: a
throwaway reader that joins no group and commits nothing, the text and JSON renderings of
a message and its failure headers, and a bounded producer for redrives."""

from __future__ import annotations

import base64
import json
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
from confluent_kafka import (
    Consumer,
    KafkaError,
    Producer,
    TopicPartition,
)
from google.protobuf import json_format

from contract import MalformedPayload, unmarshal
from streams.cli.kafka import KAFKA_LOG, Kafka
from streams.config.topics import (
    TopicSpec,
)
from streams.runtime import headers as h
from streams.runtime.kafka import producer_conf

F = TypeVar("F", bound=Callable[..., Any])

FAILURE_HEADERS = (h.DLQ_SOURCE_TOPIC, h.DLQ_SOURCE_PARTITION, h.DLQ_SOURCE_OFFSET,
                   h.DLQ_ATTEMPTS, h.DLQ_ERROR_CLASS, h.DLQ_ERROR_MESSAGE, h.DLQ_TIME)
REDRIVEN_FROM_TOPIC = "redriven-from-topic"
REDRIVEN_FROM_PARTITION = "redriven-from-partition"
REDRIVEN_FROM_OFFSET = "redriven-from-offset"
REDRIVEN_FROM_ERROR = "redriven-from-error-class"
REDRIVEN_FROM_PARKED_ID = "redriven-from-parked-id"
REDRIVEN_AT = "redriven-at"
REDRIVEN_PREFIX = "redriven-"
PREVIEW_LIMIT = 300



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
    reader = Consumer(kafka.client_conf(**{
        "group.id": f"stovepipe-reader-{uuid.uuid4().hex}",
        "enable.auto.commit": False, "enable.auto.offset.store": False,
        "enable.partition.eof": True}))
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


def safe_text(data: bytes | str | None, limit: int = PREVIEW_LIMIT) -> str:
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


def blob(data: bytes | None) -> dict[str, str] | None:
    """Bytes for JSON, like the parked store keeps headers: text when UTF-8, else base64."""
    if data is None:
        return None
    try:
        return {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def decode_payload(spec: TopicSpec,
                   value: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
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


def record_json(spec: TopicSpec, record: TopicMessage) -> dict[str, Any]:
    payload, error = decode_payload(spec, record.value)
    return {
        "topic": record.topic, "partition": record.partition, "offset": record.offset,
        "timestamp": (datetime.fromtimestamp(record.timestamp_ms / 1000, UTC).isoformat()
                      if record.timestamp_ms is not None else None),
        "key": blob(record.key), "payload": payload, "decode_error": error,
        "value": None if payload is not None else blob(record.value),
        "failure": _failure(record),
        "headers": [{"key": k, "value": blob(v)} for k, v in record.headers],
    }


def record_lines(spec: TopicSpec, record: TopicMessage) -> list[str]:
    payload, error = decode_payload(spec, record.value)
    fail = _failure(record)
    lines = [f"{record.topic} [{record.partition}] @{record.offset}  "
             f"key {safe_text(record.key)}"]
    if payload is not None:
        lines.append(f"  payload   {safe_text(json.dumps(payload, ensure_ascii=False))}")
    else:
        lines.append(f"  payload   undecodable ({safe_text(error)}); raw "
                     f"{safe_text(record.value)}")
    if fail["source_topic"] is not None:
        lines.append(f"  source    {fail['source_topic']} [{fail['source_partition']}] "
                     f"@{fail['source_offset']}, {fail['attempts']} attempt(s)")
    lines.append(f"  error     {safe_text(fail['error_class'] or '-')}: "
                 f"{safe_text(fail['error_message'] or '-')}")
    lines.append(f"  failed at {safe_text(fail['time'] or '-')}")
    other = [(k, v) for k, v in record.headers if k not in FAILURE_HEADERS]
    if other:
        lines.append("  headers   " + ", ".join(f"{k}={safe_text(v, 80)}" for k, v in other))
    return lines


def reading_options(func: F) -> F:
    func = click.option("--from-offset", type=click.IntRange(min=0), default=0,
                        metavar="N", help="Start at offset N of each partition.")(func)
    return click.option("--partition", "only", type=click.IntRange(min=0), multiple=True,
                        metavar="P", help="Only partition P (repeatable).")(func)


def dlq_partitions(kafka: Kafka, spec: TopicSpec, only: Sequence[int]) -> list[int]:
    existing = kafka.partitions(spec.full_name)
    missing = sorted(set(only) - set(existing))
    if missing:
        raise click.ClickException(f"{spec.full_name} has no partition {missing}; "
                                   f"it has {existing}")
    return sorted(set(only)) if only else existing


def redrive_headers(record: TopicMessage, extra: dict[str, str | int], *,
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


def produce_all(kafka: Kafka, messages: Sequence[tuple[str, bytes | None, bytes | None,
                                                          list[tuple[str, Any]]]],
                 label: str) -> int:
    """Produce (topic, key, value, headers) in order and wait for every ack; the number
    acknowledged. A producer from `producer_conf`: keys land where the workers put them."""
    failures: list[str] = []
    acked = 0
    producer = Producer(producer_conf(
        kafka.bootstrap, security=kafka.security, logger=KAFKA_LOG,
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
