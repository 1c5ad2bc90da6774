"""confluent-kafka client settings shared by the CLI, tools and tests."""

from __future__ import annotations

from typing import Any


def producer_conf(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """A producer that partitions like the workers (aiokafka and Java use murmur2).

    librdkafka's default partitioner hashes keys differently; with it a message keyed by a
    queue would land on another partition than the worker's own redeliveries of the same
    key, breaking per-key order (and per-queue single-writer on `process`).
    """
    return {
        "bootstrap.servers": bootstrap,
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 0,
        **extra,
    }
