"""The Kafka clients Stovepipe produces with, outside Faust's own consumer.

- `KafkaPublisher`: aiokafka, for everything asyncio produces (workers, ingest from the
  CLI): one producer, every publish awaited until the broker acknowledges it.
- `producer_conf`: confluent-kafka, for synchronous tools (the operator commands, tests,
  load generators), configured to partition exactly like the workers.

Both connect with the TLS and SASL settings of `streams.config.kafka_security`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from aiokafka import AIOKafkaProducer
from google.protobuf.message import Message

from streams.config.kafka_security import KafkaSecurity, aiokafka_conf, librdkafka_conf
from streams.runtime.stage import publish_payload


def producer_conf(bootstrap: str, *, security: KafkaSecurity | None = None,
                  **extra: Any) -> dict[str, Any]:
    """A producer that partitions like the workers (aiokafka and Java use murmur2).

    librdkafka's default partitioner hashes keys differently; with it a message keyed by a
    queue would land on another partition than the worker's own redeliveries of the same
    key, breaking per-key order (and per-queue single-writer on `process`).
    """
    return librdkafka_conf(bootstrap, security, **{
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 0,
        **extra,
    })


@dataclass(frozen=True)
class TopicRoute:
    """A topic as a producer or worker sees it: its Kafka name, partitions, and which
    payload field is the Kafka key."""

    topic: str
    partitions: int
    key_field: str


class KafkaPublisher:
    """Publishes contract payloads by topic key through one aiokafka producer (acks=all,
    idempotent: an acknowledged message survives a broker restart, and a retried produce
    is not duplicated by the producer itself). Every publish waits for the broker's ack;
    a failure is `PublishFailed` (retryable). Use ``async with`` or start()/stop()."""

    def __init__(self, bootstrap: str, routes: Mapping[str, TopicRoute], *,
                 request_timeout_ms: int = 30_000, security: KafkaSecurity | None = None
                 ) -> None:
        self.routes = dict(routes)
        self.producer = AIOKafkaProducer(**aiokafka_conf(bootstrap, security), acks="all",
                                         enable_idempotence=True, linger_ms=0,
                                         request_timeout_ms=request_timeout_ms)

    async def start(self) -> None:
        await self.producer.start()

    async def stop(self) -> None:
        await self.producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def __call__(self, key: str, payload: Message) -> None:
        route = self.routes[key]
        await publish_payload(self.producer, route.topic, payload, route.key_field)
