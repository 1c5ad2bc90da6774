"""`Delivery.deliver` in process, with a recording producer: what it produces for each
outcome, that it never raises, and that every outcome is counted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import REGISTRY

from contract import ProcessRequest, marshal
from streams.runtime import ACK, Hold, RetryableError
from streams.runtime import headers as h
from streams.runtime.delay import DelayTiers
from streams.runtime.outcome import Outcome
from streams.runtime.policy import Retry
from streams.runtime.stage import Context, Delivery, Incoming, PublishFailed, Route, Stage


class RecordingProducer:
    def __init__(self, fail_first: int = 0) -> None:
        self.sent: list[dict[str, Any]] = []
        self.fail_first = fail_first

    async def send_and_wait(self, topic: str, value: bytes | None = None,
                            key: bytes | None = None, headers: Any = None) -> None:
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("broker away")
        self.sent.append({"topic": topic, "key": key, "value": value,
                          "headers": list(headers or [])})


TIERS = DelayTiers({"delay_1s": 1.0, "delay_5s": 5.0, "delay_100ms": 0.1})
ROUTES = {
    "process": Route("p.process", Retry(3, (1.0, 5.0)), "p.process_dlq"),
    "process_dlq": Route("p.process_dlq", Retry(None, (1.0, 5.0)), None),
}


def _delivery(producer: RecordingProducer, parked: list[Any] | None = None) -> Delivery:
    async def park(stage: str, msg: Incoming, error: str) -> None:
        assert parked is not None
        parked.append((stage, msg.value, error))

    async def publish(key: str, payload: Any) -> None:
        raise AssertionError("not used")

    return Delivery(producer=producer, tiers=TIERS, routes=ROUTES,  # type: ignore[arg-type]
                    publish=publish, park=park, deps=None)


def _msg(value: bytes, attempt: int = 0, topic: str = "p.process") -> Incoming:
    return Incoming(topic=topic, partition=2, offset=41, key=b"q",
                    value=value, headers=[("trace", b"t1"), (h.ATTEMPT, str(attempt).encode())])


def _counter(stage: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("stovepipe_deliveries_total",
                                     {"stage": stage, "outcome": outcome}) or 0.0


def _stage(result: Outcome | BaseException, key: str = "process") -> Stage[ProcessRequest]:
    async def handle(payload: ProcessRequest, ctx: Context) -> Outcome:
        assert payload.id == "request/q/1"
        if isinstance(result, BaseException):
            raise result
        return result

    return Stage(key, ProcessRequest, handle)


PAYLOAD = marshal(ProcessRequest(id="request/q/1", queue_name="q"))


def test_ack_produces_nothing_and_counts() -> None:
    producer = RecordingProducer()
    before = _counter("process", "ack")
    asyncio.run(_delivery(producer).deliver(_stage(ACK), _msg(PAYLOAD)))
    assert producer.sent == []
    assert _counter("process", "ack") == before + 1


def test_hold_goes_to_the_fitting_tier_with_due_time_and_a_fresh_attempt_count() -> None:
    producer = RecordingProducer()
    start = time.time()
    asyncio.run(_delivery(producer).deliver(_stage(Hold(2.5)), _msg(PAYLOAD, attempt=1)))
    [sent] = producer.sent
    assert sent["topic"] == "delay_1s"  # the longest tier not longer than 2.5 s
    assert sent["key"] == b"q" and sent["value"] == PAYLOAD
    assert h.get(sent["headers"], h.TARGET) == b"p.process"
    assert h.get_int(sent["headers"], h.ATTEMPT) == 0  # a hold is progress
    due = h.get_int(sent["headers"], h.DUE_MS) / 1000
    assert start + 2.5 <= due + 0.001 <= time.time() + 2.5 + 0.01
    assert ("trace", b"t1") in sent["headers"]


def test_retryable_error_redelivers_with_the_next_attempt_and_its_backoff() -> None:
    producer = RecordingProducer()
    asyncio.run(_delivery(producer).deliver(_stage(RetryableError("later")),
                                            _msg(PAYLOAD, attempt=1)))
    [sent] = producer.sent
    assert sent["topic"] == "delay_5s"  # backoff before retry 2 is 5 s
    assert h.get_int(sent["headers"], h.ATTEMPT) == 2


def test_unclassified_error_dead_letters_with_every_header() -> None:
    producer = RecordingProducer()
    before = _counter("process", "dead_letter")
    asyncio.run(_delivery(producer).deliver(_stage(KeyError("boom")), _msg(PAYLOAD)))
    [sent] = producer.sent
    assert sent["topic"] == "p.process_dlq" and sent["value"] == PAYLOAD
    names = {k for k, _ in sent["headers"]}
    assert {h.DLQ_SOURCE_TOPIC, h.DLQ_SOURCE_PARTITION, h.DLQ_SOURCE_OFFSET, h.DLQ_ATTEMPTS,
            h.DLQ_ERROR_CLASS, h.DLQ_ERROR_MESSAGE, h.DLQ_TIME} <= names
    assert h.get(sent["headers"], h.DLQ_SOURCE_OFFSET) == b"41"
    assert h.get(sent["headers"], h.DLQ_ERROR_CLASS) == b"builtins.KeyError"
    assert _counter("process", "dead_letter") == before + 1


def test_a_failed_publish_is_retryable_not_dead_lettered() -> None:
    producer = RecordingProducer()
    asyncio.run(_delivery(producer).deliver(_stage(PublishFailed("x")), _msg(PAYLOAD)))
    assert producer.sent[0]["topic"] == "delay_1s"


def test_produce_failures_are_retried_until_acknowledged() -> None:
    producer = RecordingProducer(fail_first=2)
    asyncio.run(_delivery(producer).deliver(_stage(KeyError("boom")), _msg(PAYLOAD)))
    assert [s["topic"] for s in producer.sent] == ["p.process_dlq"]


def test_undecodable_on_a_stage_dead_letters_and_on_a_reconciler_parks() -> None:
    producer, parked = RecordingProducer(), []
    delivery = _delivery(producer, parked)
    asyncio.run(delivery.deliver(_stage(ACK), _msg(b"\x00garbage")))
    assert producer.sent[0]["topic"] == "p.process_dlq"
    assert producer.sent[0]["value"] == b"\x00garbage"
    asyncio.run(delivery.deliver(_stage(ACK, key="process_dlq"),
                                 _msg(b"\x00garbage", topic="p.process_dlq")))
    assert len(producer.sent) == 1
    assert parked and parked[0][0] == "process_dlq" and "MalformedPayload" in parked[0][2]


def test_a_reconciler_retries_a_transient_error_without_end() -> None:
    producer = RecordingProducer()
    asyncio.run(_delivery(producer).deliver(_stage(RetryableError("y"), key="process_dlq"),
                                            _msg(PAYLOAD, attempt=7, topic="p.process_dlq")))
    [sent] = producer.sent
    assert sent["topic"] == "delay_5s"  # capped at the last backoff
    assert h.get(sent["headers"], h.TARGET) == b"p.process_dlq"
    assert h.get_int(sent["headers"], h.ATTEMPT) == 8


def test_a_reconciler_retries_a_permanent_error_then_parks_it_with_its_reason() -> None:
    producer, parked = RecordingProducer(), []
    delivery = _delivery(producer, parked)
    asyncio.run(delivery.deliver(_stage(KeyError("x"), key="process_dlq"),
                                 _msg(PAYLOAD, attempt=1, topic="p.process_dlq")))
    assert [s["topic"] for s in producer.sent] == ["delay_5s"] and not parked  # call 2 of 3
    asyncio.run(delivery.deliver(_stage(KeyError("x"), key="process_dlq"),
                                 _msg(PAYLOAD, attempt=2, topic="p.process_dlq")))
    assert len(producer.sent) == 1  # nothing produced: parked, acked
    [(stage, value, reason)] = parked
    assert (stage, value) == ("process_dlq", PAYLOAD)
    assert reason == "after 3 attempt(s): KeyError: 'x'"


def test_an_outage_is_retried_in_place_without_spending_an_attempt() -> None:
    import psycopg

    calls: list[int] = []

    async def handle(payload: ProcessRequest, ctx: Context) -> Outcome:
        calls.append(1)
        if len(calls) < 3:
            raise psycopg.OperationalError("connection refused")  # the database is away
        return ACK

    producer = RecordingProducer()
    started = time.monotonic()
    asyncio.run(_delivery(producer).deliver(Stage("process", ProcessRequest, handle),
                                            _msg(PAYLOAD, attempt=0)))
    assert len(calls) == 3 and producer.sent == []  # no retry, no dead letter: acked
    assert time.monotonic() - started >= 1.0  # waited (0.5 s, then 1 s) between calls


def test_an_oversized_payload_is_undecodable() -> None:
    producer = RecordingProducer()
    big = marshal(ProcessRequest(id="request/q/" + "1" * 1_000_000, queue_name="q"))
    asyncio.run(_delivery(producer).deliver(_stage(ACK), _msg(big)))
    [sent] = producer.sent
    assert sent["topic"] == "p.process_dlq" and sent["value"] == big
    message = h.get(sent["headers"], h.DLQ_ERROR_MESSAGE) or b""
    assert b"over the limit" in message and len(message) < 400  # bounded
