"""The delivery runtime every stage stands on (design §6).

A stage is a plain async handler ``handle(payload, ctx) -> Outcome``. The runtime decodes
the message, calls the handler, and turns its outcome into Kafka actions: ack, a delayed
redelivery through the delay tiers (hold or retry), a dead letter, or — for reconcilers —
parking in PostgreSQL. Nothing a handler raises ever reaches Faust.
"""

from streams.runtime.outcome import (
    ACK,
    Ack,
    Hold,
    NonRetryable,
    Outcome,
    Retryable,
    RetryableError,
    Wait,
)

__all__ = ["ACK", "Ack", "Hold", "NonRetryable", "Outcome", "Retryable", "RetryableError",
           "Wait"]
