"""What callers outside the stages ask of the pipeline: the CLI, the HTTP API and the
dashboard share these reads, so they all answer the same way. Every database read is a
key lookup or a range of an index; nothing scans a table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from store import (
    Build,
    Database,
    NotFound,
    Queue,
    Request,
    ValidationFact,
    parse_request_id,
)
from streams.config.names import validate_queue_name, validate_queue_or_scope_name
from streams.extensions.sourcecontrol import SourceControlError
from streams.runtime.topic_admin import read_watermarks

if TYPE_CHECKING:  # the read queries need no stage machinery, only its type
    from streams.stages.deps import Deps

MAX_RECENT_REQUESTS = 100


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: entities become objects (without their internal
    bookkeeping fields), times ISO 8601 strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not f.metadata.get("internal")}
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    return value


# --- requests and facts -----------------------------------------------------------------


async def fact_or_none(db: Database, queue: str, uri: str) -> ValidationFact | None:
    """The whole-repo fact for ``uri`` on ``queue``; None means not validated (not green)."""
    try:
        return await db.facts.get(queue, uri)
    except NotFound:
        return None


@dataclass(frozen=True)
class RequestDetail:
    request: Request
    builds: list[Build]  # its attempts, by attempt number
    fact: ValidationFact | None  # the Request's own fact; None: it recorded none
    commit_fact: ValidationFact | None  # the commit's answer: its newest Request's fact
    newest_for_commit: Request | None  # the commit's newest Request: this one or a later

    @property
    def green(self) -> bool:
        """Whether the commit is green (whichever of its Requests said so)."""
        return self.commit_fact is not None and self.commit_fact.is_green


def parse_request_path(request_id: str) -> str:
    """The queue (or a project's scope, `<queue>#<project>`) of a `request/<queue>/<n>`
    or `request/<queue>/<n>.<k>` id. ValueError
    (or its subclass InvalidQueueName) naming the problem for anything else."""
    queue, _ = parse_request_id(request_id)
    validate_queue_or_scope_name(queue)  # a project's Requests are its scope's
    return queue


async def request_detail(db: Database, request_id: str) -> RequestDetail:
    """The Request, its builds, its own fact, and its commit's answer and newest Request
    (a commit validated again has several Requests). ValueError for a malformed id,
    NotFound for an unknown one."""
    queue = parse_request_path(request_id)
    request = await db.requests.get(queue, request_id)
    builds = await db.builds.list_for_request(queue, request_id)
    own = await db.facts.of_request(queue, request_id)
    return RequestDetail(request, builds, own, await fact_or_none(db, queue, request.uri),
                         await db.requests.newest_for_commit(queue, request.uri))


@dataclass(frozen=True)
class RequestSummary:
    request: Request
    fact: ValidationFact | None  # the Request's own fact

    @property
    def green(self) -> bool:
        return self.fact is not None and self.fact.is_green


async def recent_requests(db: Database, queue: str, limit: int) -> list[RequestSummary]:
    """The queue's last ``limit`` Requests, newest first, each with its own fact.

    Newest is by (ingest order, validation): a commit validated again
    (`request/<queue>/<n>.<k>`) sorts next to its first Request `…/<n>`, above it. One
    indexed read finds them; the facts are then read one Request after another on
    purpose: the worker's stages share this pool, and a dashboard must not take many
    connections at once.
    """
    if not 1 <= limit <= MAX_RECENT_REQUESTS:
        raise ValueError(f"limit must be between 1 and {MAX_RECENT_REQUESTS}, got {limit}")
    return [RequestSummary(request, await db.facts.of_request(queue, request.id))
            for request in await db.requests.recent(queue, limit)]


# --- queues -----------------------------------------------------------------------------


async def queue_state(db: Database, name: str) -> Queue | None:
    """The queue's row; None before its first ingest."""
    try:
        return await db.queues.get(name)
    except NotFound:
        return None


@dataclass(frozen=True)
class Pin:
    """The promotion ref held at a green commit (`stovepipe pin`): which, who, when, why."""

    uri: str
    request_id: str
    by: str | None
    reason: str | None
    at: datetime | None


@dataclass(frozen=True)
class PromotionProblemView:
    reason: str  # why the ref is not where the queue says it belongs (the last failure)
    since: datetime


@dataclass(frozen=True)
class PromotionRef:
    name: str
    target: str | None  # None: not promoted yet, or the repository did not answer
    target_known: bool  # whether the repository answered
    pinned: Pin | None = None  # None: it follows the bookmark
    # where the queue says it belongs: the pin, else the bookmark (None: nowhere yet)
    wanted: str | None = None
    problem: PromotionProblemView | None = None  # None: no failed move since the last
    # the repository answered, and the ref is not where the queue says it belongs
    differs: bool = False


def pin_of(row: Queue | None) -> Pin | None:
    if row is None or row.pinned_uri is None or row.pinned_request_id is None:
        return None
    return Pin(row.pinned_uri, row.pinned_request_id, row.pinned_by, row.pinned_reason,
               row.pinned_at)


@dataclass(frozen=True)
class QueueOverview:
    name: str
    max_concurrent: int
    ingested: bool  # False until the queue's first ingest creates its row
    in_flight: int
    last_green_uri: str | None
    last_green_request_id: str | None
    promotion_ref: PromotionRef | None  # None: the queue promotes nothing
    latest_request: Request | None


async def queue_overview(deps: Deps, name: str) -> QueueOverview:
    """A configured queue at a glance. Raises InvalidQueueName, UnknownQueue."""
    validate_queue_name(name)
    config = deps.queue_config(name)
    row = await queue_state(deps.db, name)
    latest = None
    if row is not None and row.latest_request_id is not None:
        try:
            latest = await deps.db.requests.get(name, row.latest_request_id)
        except NotFound:  # impossible by construction; show the queue all the same
            latest = None
    return QueueOverview(
        name=name,
        max_concurrent=config.max_concurrent,
        ingested=row is not None,
        in_flight=row.in_flight_count if row else 0,
        last_green_uri=row.last_green_uri if row else None,
        last_green_request_id=row.last_green_request_id if row else None,
        promotion_ref=await promotion_ref(deps, name, pin_of(row), row),
        latest_request=latest,
    )


async def promotion_ref(deps: Deps, name: str, pinned: Pin | None,
                        row: Queue | None = None) -> PromotionRef | None:
    """The queue's promotion ref: where it is (asked of the repository), where the queue
    says it belongs (``row``: the pin, else the bookmark), and the last failed move."""
    ref_name = getattr(deps.queue_config(name).source_control, "promotion_ref", None)
    if not ref_name:
        return None
    wanted = (pinned.uri if pinned is not None
              else row.last_green_uri if row is not None else None)
    found = await deps.db.pins.problem(name)
    problem = PromotionProblemView(found.reason, found.at) if found is not None else None
    try:
        target = await deps.extensions.source_control(name).promotion_target()
    except SourceControlError:  # the rest of the overview still answers
        return PromotionRef(ref_name, None, False, pinned, wanted, problem)
    return PromotionRef(ref_name, target, True, pinned, wanted, problem,
                        differs=wanted is not None and target != wanted)


# --- health -----------------------------------------------------------------------------


async def database_answers(db: Database) -> None:
    """Returns when the database answers a trivial query; raises what the driver raised
    otherwise. The caller bounds the wait."""
    async with db.pool.connection() as conn:
        await conn.execute("SELECT 1")


# --- dead-letter topics -----------------------------------------------------------------


@dataclass(frozen=True)
class DeadLetterDepth:
    stage: str  # the stage whose dead letters these are, e.g. "process"
    topic: str
    depth: int  # messages the reconciler (the workers' group) has not committed yet


@dataclass(frozen=True)
class DeadLetterReport:
    group: str
    measured_at: datetime
    topics: list[DeadLetterDepth]
    error: str | None = None  # set when Kafka did not answer; `topics` is then empty

    @property
    def total(self) -> int:
        return sum(t.depth for t in self.topics)


class DeadLetterDepths:
    """How many dead letters wait for their reconciler, per `<key>_dlq` topic: the
    messages past the consumer group's committed offset (from the low watermark where the
    group never committed). Measured with confluent-kafka in a worker thread, at most once
    per ``ttl`` seconds however many callers ask."""

    def __init__(self, *, bootstrap: str, group: str, topics: Mapping[str, str],
                 ttl: float = 5.0, timeout: float = 5.0) -> None:
        self.bootstrap = bootstrap
        self.group = group
        self.topics = dict(topics)  # stage key -> dead-letter topic name
        self.ttl = ttl
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._cached: tuple[float, DeadLetterReport] | None = None

    async def report(self) -> DeadLetterReport:
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.ttl:
                return self._cached[1]
            try:
                depths = await asyncio.to_thread(self._measure)
                report = DeadLetterReport(self.group, datetime.now(UTC), depths)
            except Exception as exc:  # noqa: BLE001 - reported to the caller, never raised
                report = DeadLetterReport(self.group, datetime.now(UTC), [],
                                          error=f"{type(exc).__name__}: {exc}")
            self._cached = (time.monotonic(), report)
            return report

    def _measure(self) -> list[DeadLetterDepth]:

        # Never subscribes, so it does not join the group: it only reads its offsets.
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.group,
                             "enable.auto.commit": False, "socket.timeout.ms": 5000})
        try:
            depths = []
            for stage, topic in sorted(self.topics.items()):
                metadata = consumer.list_topics(topic, timeout=self.timeout).topics[topic]
                if metadata.error is not None:
                    raise KafkaException(metadata.error)
                partitions = [TopicPartition(topic, p) for p in sorted(metadata.partitions)]
                depth = 0
                for tp in consumer.committed(partitions, timeout=self.timeout):
                    low, high = read_watermarks(consumer, topic, tp.partition,
                                                self.timeout)
                    position = tp.offset if tp.offset >= 0 else low
                    depth += max(0, high - max(position, low))
                depths.append(DeadLetterDepth(stage, topic, depth))
            return depths
        finally:
            consumer.close()
