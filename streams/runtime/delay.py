"""Durable delayed redelivery through delay-tier topics (design §6, "hold").

A message to deliver later is produced to a tier topic (1 s, 5 s, 30 s, 2 min as shipped)
with its target topic and due time in headers and its original key. This scheduler
consumes every tier with its own consumer group, one task per partition. The partition's
task waits on its head only until ``appended + tier`` — a time that grows along the
partition, so waiting on the head never delays what is behind it — then sends the message
to the tier that fits what remains, or, when it is due within the shortest tier, hands
the last wait to a task of its own (never early) that produces it to its target. In the
shortest tier every message waits in a task of its own, so a short hold never queues
behind a longer one.
Offsets are committed only below the oldest message not yet re-produced and acknowledged,
so a crash at any instant loses no held message (it may deliver one twice; stages are
idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from streams.config.kafka_security import KafkaSecurity, aiokafka_conf
from streams.runtime import headers as h
from streams.runtime import liveness, metrics, timings
from streams.runtime.policy import choose_tier, tier_wake_time

log = logging.getLogger("stovepipe.delay")

BUFFER_HIGH = 5_000  # per partition: pause fetching above, resume below half
COMMIT_INTERVAL = 0.2


def now_ms() -> int:
    return int(time.time() * 1000)


class DelayTiers:
    """The tier topics and how to route a message into them."""

    def __init__(self, tiers: Mapping[str, float]) -> None:
        if not tiers:
            raise ValueError("at least one delay tier is needed")
        self.delay_of_topic = dict(tiers)
        self.topic_of_delay = {d: t for t, d in tiers.items()}
        self.shortest = min(tiers.values())

    def topic_for(self, remaining: float) -> str:
        return self.topic_of_delay[choose_tier(remaining, list(self.topic_of_delay))]


async def produce_until_acked(producer: AIOKafkaProducer, topic: str, *, key: bytes | None,
                              value: bytes | None, headers: h.Headers,
                              what: str) -> None:
    """Produce and wait for the broker's ack, retrying with backoff until it succeeds.

    A failed produce must never be skipped: the caller commits its source offset only
    after this returns, and blocking here is right since the broker is what is failing.
    """
    backoff = 0.1
    while True:
        try:
            await producer.send_and_wait(topic, value=value, key=key, headers=headers)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every produce failure is retried
            metrics.PRODUCE_FAILURES.labels(topic=topic).inc()
            log.warning("produce_failed topic=%s what=%s error=%r retry_in=%.1fs",
                        topic, what, exc, backoff)
            await asyncio.sleep(backoff)
            liveness.tick()  # the broker is what fails: waiting for it is progress
            backoff = min(backoff * 2, 5.0)


async def send_later(producer: AIOKafkaProducer, tiers: DelayTiers, *, target: str,
                     key: bytes | None, value: bytes | None, headers: h.Headers | None,
                     delay: float, attempt: int) -> None:
    """Deliver ``value`` to ``target`` no earlier than ``delay`` s from now."""
    if delay <= 0:
        out = h.replace(h.without_runtime(headers), {h.ATTEMPT: attempt})
        await produce_until_acked(producer, target, key=key, value=value, headers=out,
                                  what="redeliver")
        return
    due = math.ceil((time.time() + delay) * 1000)  # rounded up: never early
    out = h.replace(h.without_runtime(headers),
                    {h.ATTEMPT: attempt, h.DUE_MS: due, h.TARGET: target})
    await produce_until_acked(producer, tiers.topic_for(delay), key=key, value=value,
                              headers=out, what="delay")


class _Partition:
    def __init__(self) -> None:
        self.buffer: deque[ConsumerRecord] = deque()
        self.next_offset: int | None = None  # after the last record routed
        self.in_flight: set[int] = set()  # offsets whose final wait is still running
        self.finishers: set[asyncio.Task[None]] = set()
        self.committed_offset: int | None = None
        self.task: asyncio.Task[None] | None = None
        self.paused = False

    def commit_point(self) -> int | None:
        """The offset below which every record was re-produced (and acknowledged)."""
        return min(self.in_flight) if self.in_flight else self.next_offset


class DelayScheduler:
    """Consumes every tier topic and re-produces each message when it is due."""

    def __init__(self, *, bootstrap: str, group_id: str, tiers: DelayTiers,
                 producer: AIOKafkaProducer, fetch_max_wait_ms: int = 50,
                 security: KafkaSecurity | None = None, group_instance_id: str | None = None,
                 session_timeout: float = timings.SESSION_TIMEOUT) -> None:
        self.tiers = tiers
        self.producer = producer
        self.group_id = group_id
        self._consumer = AIOKafkaConsumer(
            **aiokafka_conf(bootstrap, security), group_id=group_id, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_wait_ms=fetch_max_wait_ms,
            max_poll_records=1000, heartbeat_interval_ms=int(timings.HEARTBEAT_INTERVAL * 1000),
            # static membership in this group too, under the worker's id (ids are per group)
            group_instance_id=group_instance_id, session_timeout_ms=int(session_timeout * 1000),
        )
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        self._consumer.subscribe(list(self.tiers.delay_of_topic), listener=_Listener(self))
        await self._consumer.start()
        self._tasks = [asyncio.create_task(self._fetch_loop(), name="delay-fetch"),
                       asyncio.create_task(self._commit_loop(), name="delay-commit")]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await self._drop_partitions(list(self._partitions))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._consumer.stop()

    def held(self) -> int:
        """Messages fetched and not yet re-produced, across assigned partitions."""
        return sum(len(p.buffer) for p in self._partitions.values())

    async def _fetch_loop(self) -> None:
        while True:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=1000)
            for tp, records in batches.items():
                part = self._partitions.get(tp)
                if part is None:  # assignment raced the fetch; the listener adds it
                    part = self._partitions[tp] = _Partition()
                part.buffer.extend(records)
                if part.task is None or part.task.done():
                    part.task = asyncio.create_task(self._run_partition(tp, part),
                                                    name=f"delay-{tp.topic}-{tp.partition}")
                if len(part.buffer) > BUFFER_HIGH and not part.paused:
                    self._consumer.pause(tp)
                    part.paused = True
            metrics.DELAY_HELD.set(self.held())

    async def _run_partition(self, tp: TopicPartition, part: _Partition) -> None:
        tier = self.tiers.delay_of_topic[tp.topic]
        shortest = tier == self.tiers.shortest
        while part.buffer:
            record = part.buffer[0]
            routing = self._routing(record)
            if routing is not None:
                target, due = routing
                wake = tier_wake_time(due=due, appended=record.timestamp / 1000, tier=tier)
                if shortest:
                    # everything here is due within about two tiers: wait off the
                    # partition's path, so a short hold never queues behind a longer one
                    self._spawn_finisher(part, record, target, due, wake)
                else:
                    # routed here with at least `tier` to go, so `wake` grows along the
                    # partition: waiting on the head holds up nothing behind it
                    await asyncio.sleep(max(0.0, wake - time.time()))
                    if due - time.time() >= self.tiers.shortest:
                        await self._hop(record, due)
                    else:
                        self._spawn_finisher(part, record, target, due, due)
            part.buffer.popleft()
            part.next_offset = record.offset + 1
            if part.paused and len(part.buffer) < BUFFER_HIGH // 2:
                self._consumer.resume(tp)
                part.paused = False

    def _routing(self, record: ConsumerRecord) -> tuple[str, float] | None:
        """(target topic, due time in epoch seconds), or None for a foreign message."""
        target = h.get(record.headers, h.TARGET)
        if target is None:
            log.error("delay_message_without_target topic=%s partition=%s offset=%s",
                      record.topic, record.partition, record.offset)
            metrics.DELAY_DROPPED.inc()
            return None
        return target.decode(), h.get_int(record.headers, h.DUE_MS,
                                          default=record.timestamp) / 1000

    async def _hop(self, record: ConsumerRecord, due: float) -> None:
        await produce_until_acked(self.producer, self.tiers.topic_for(due - time.time()),
                                  key=record.key, value=record.value,
                                  headers=list(record.headers or ()), what="delay-hop")

    def _spawn_finisher(self, part: _Partition, record: ConsumerRecord, target: str,
                        due: float, wake: float) -> None:
        part.in_flight.add(record.offset)  # commit stops below it until it is done
        task = asyncio.create_task(self._finish(part, record, target, due, wake))
        part.finishers.add(task)
        task.add_done_callback(part.finishers.discard)

    async def _finish(self, part: _Partition, record: ConsumerRecord, target: str,
                      due: float, wake: float) -> None:
        await asyncio.sleep(max(0.0, wake - time.time()))
        if due - time.time() >= self.tiers.shortest:
            await self._hop(record, due)
        else:
            await asyncio.sleep(max(0.0, due - time.time()))  # never early
            metrics.DELAY_LATENESS.observe(max(0.0, time.time() - due))
            out = h.replace(h.without_runtime(list(record.headers or ())),
                            {h.WAS_DUE_MS: math.ceil(due * 1000)})
            await produce_until_acked(self.producer, target, key=record.key,
                                      value=record.value, headers=out, what="delay-due")
        part.in_flight.discard(record.offset)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(COMMIT_INTERVAL)
            await self._commit_done()

    async def _commit_done(self, only: list[TopicPartition] | None = None) -> None:
        offsets = {}
        for tp, part in self._partitions.items():
            if only is not None and tp not in only:
                continue
            point = part.commit_point()
            if point is not None and point != part.committed_offset:
                offsets[tp] = OffsetAndMetadata(point, "")
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except Exception as exc:  # noqa: BLE001 - e.g. a rebalance: the next round retries
            log.warning("delay_commit_failed error=%r", exc)
            return
        for tp, meta in offsets.items():
            if tp in self._partitions:
                self._partitions[tp].committed_offset = meta.offset

    async def _drop_partitions(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            part = self._partitions.get(tp)
            if part is None:
                continue
            for task in [part.task, *part.finishers]:
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        await self._commit_done(only=tps)
        for tp in tps:
            self._partitions.pop(tp, None)


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, scheduler: DelayScheduler) -> None:
        self.scheduler = scheduler

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.scheduler._drop_partitions(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            self.scheduler._partitions.setdefault(tp, _Partition())
