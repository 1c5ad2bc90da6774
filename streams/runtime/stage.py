"""A stage declaration and the delivery of one message through it.

`deliver` is the whole contract of the runtime for one message: decode, call the
handler, turn the outcome into Kafka actions, and return only once the source offset is
safe to commit — the handler's transaction committed, every message it produced and the
redelivery/dead letter acknowledged by the broker. It never raises (except cancellation,
which leaves the message unacknowledged so it is delivered again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar

from aiokafka import AIOKafkaProducer
from google.protobuf.message import Message

from contract import MalformedPayload, marshal, unmarshal
from streams.extensions import tracing
from streams.runtime import headers as h
from streams.runtime import liveness, metrics, timings
from streams.runtime.classify import is_backpressure, is_outage, outcome_of_exception
from streams.runtime.delay import DelayTiers, produce_until_acked, send_later
from streams.runtime.logs import bounded
from streams.runtime.outcome import Hold, Outcome, RetryableError, Wait
from streams.runtime.policy import (
    Action,
    Commit,
    DeadLetter,
    ParkMessage,
    Redeliver,
    Retry,
    decide,
)

log = logging.getLogger("stovepipe.runtime")
outage_log = logging.getLogger("stovepipe.outage")  # rate-limited (streams.runtime.logs)
OUTAGE_FIRST_BACKOFF = timings.OUTAGE_FIRST_BACKOFF
OUTAGE_MAX_BACKOFF = timings.OUTAGE_MAX_BACKOFF

P = TypeVar("P", bound=Message)
D = TypeVar("D")  # what a worker's handlers share (the pipeline's: streams.stages.deps.Deps)


@dataclass(frozen=True)
class Incoming:
    """One consumed Kafka message, independent of the client that fetched it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp: float = 0.0  # the record's Kafka timestamp, epoch seconds

    @property
    def attempt(self) -> int:
        return h.get_int(self.headers, h.ATTEMPT)

    @property
    def origin(self) -> str:
        """Where this delivery began: its own coordinates, or for a retry those of the
        message it retries (every retry of one delivery has the same origin)."""
        carried = h.get(self.headers, h.ORIGIN)
        if carried is not None:
            return carried.decode("ascii", "replace")
        return f"{self.partition}:{self.offset}"


@dataclass(frozen=True)
class Route:
    """Where a stage's topic lives and how it retries (from topics.yaml)."""

    topic: str
    retry: Retry
    dlq_topic: str | None  # None for reconcilers: they never dead-letter


class Publisher(Protocol):
    async def __call__(self, key: str, payload: Message) -> None: ...


@dataclass
class Context(Generic[D]):
    """What a handler may use besides its payload."""

    stage: str
    message: Incoming
    publish: Publisher
    deps: D
    log: logging.LoggerAdapter[logging.Logger] = field(repr=False)

    @property
    def attempt(self) -> int:
        return self.message.attempt

    @property
    def waits(self) -> int:
        """How many times in a row this message waited out a dependency (`Wait`)."""
        return h.get_int(self.message.headers, h.WAITS)

    @property
    def waiting_for(self) -> float:
        """Seconds since this message's first wait in a row began (0: not waiting). By
        the workers' clocks: fine for deadlines of minutes, not of milliseconds."""
        since = h.get_int(self.message.headers, h.WAITING_SINCE_MS)
        return max(0.0, time.time() - since / 1000) if since else 0.0


Handler = Callable[[P, Context[Any]], Awaitable[Outcome]]
Park = Callable[[str, Incoming, str], Awaitable[None]]


@dataclass(frozen=True)
class Stage(Generic[P]):
    """A stage: the topic key it consumes (``process`` or ``process_dlq``), its payload
    type and its handler. A stage on a ``_dlq`` key runs in reconciler mode."""

    key: str
    payload_type: type[P]
    handle: Handler[P]

    @property
    def reconciler(self) -> bool:
        return self.key.endswith("_dlq")


class Delivery(Generic[D]):
    """Runs messages through stages; shared by every stage of a worker."""

    def __init__(self, *, producer: AIOKafkaProducer, tiers: DelayTiers,
                 routes: dict[str, Route], publish: Publisher, park: Park, deps: D) -> None:
        self.producer = producer
        self.tiers = tiers
        self.routes = routes
        self.publish = publish
        self.park = park
        self.deps = deps
        self.progress = liveness.Progress()  # what the liveness probe judges

    async def deliver(self, stage: Stage[Any], msg: Incoming) -> None:
        where = f"{msg.topic}:{msg.partition}:{msg.offset}"
        with (self.progress.delivering(stage.key, where),
              tracing.consuming(stage.key, msg.headers, {
                  "messaging.destination.name": msg.topic,
                  "messaging.kafka.partition": msg.partition,
                  "messaging.kafka.offset": msg.offset,
                  "stovepipe.attempt": msg.attempt})):
            await self._deliver(stage, msg)

    async def _deliver(self, stage: Stage[Any], msg: Incoming) -> None:
        started = time.perf_counter()
        was_due = h.get_int(msg.headers, h.WAS_DUE_MS)
        if was_due:  # a held message, back from the delay scheduler
            metrics.HOLD_LATENESS.labels(stage=stage.key).observe(
                max(0.0, time.time() - was_due / 1000))
        route = self.routes[stage.key]
        fields: dict[str, Any] = {"stage": stage.key, "topic": msg.topic,
                                  "partition": msg.partition, "offset": msg.offset,
                                  "attempt": msg.attempt}
        try:
            payload = unmarshal(msg.value or b"", stage.payload_type)
        except MalformedPayload as exc:
            await self._undecodable(stage, route, msg, exc, fields)
            return
        fields["id"] = bounded(getattr(payload, "id", "") or getattr(payload, "queue", ""))
        trace_id = tracing.current_trace_id()
        if trace_id is not None:
            fields["trace_id"] = trace_id
        ctx: Context[D] = Context(stage=stage.key, message=msg, publish=self.publish,
                                  deps=self.deps, log=_Adapter(log, fields))
        outcome = await self._handle_through_outages(stage, payload, ctx)
        metrics.HANDLE_SECONDS.labels(stage=stage.key).observe(time.perf_counter() - started)
        action = decide(outcome, attempt=msg.attempt, retry=route.retry,
                        reconciler=stage.reconciler)
        await self._perform(stage, route, msg, outcome, action, ctx)
        metrics.DELIVERY_SECONDS.labels(stage=stage.key).observe(time.perf_counter() - started)

    async def _handle_through_outages(self, stage: Stage[Any], payload: Message,
                                      ctx: Context[D]) -> Outcome:
        """The handler's outcome. While the broker or the database is unreachable the
        same call is made again in place, with capped backoff and without spending an
        attempt: an outage is nobody's message's fault, and must not walk the retry
        ladder into a dead-letter topic however long it lasts (handlers are idempotent).
        This holds up the partition, as it should: every message needs the same service."""
        backoff = OUTAGE_FIRST_BACKOFF
        waited = 0.0
        while True:
            pending: list[tuple[str, asyncio.Future[Any]]] = []
            token = _unacknowledged.set(pending)
            try:
                outcome = await stage.handle(payload, ctx)
                await _acknowledged(pending)  # every publish of the handler, together
                return outcome
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - nothing a handler raises reaches Faust
                if not is_outage(exc):
                    return outcome_of_exception(exc)
                if is_backpressure(exc):  # every pooled connection busy: nothing is down
                    metrics.BACKPRESSURE_RETRIES.labels(stage=stage.key).inc()
                    outage_log.warning("pool_busy stage=%s waited=%.0fs retry_in=%.1fs",
                                       stage.key, waited, backoff)
                else:
                    metrics.OUTAGE_RETRIES.labels(stage=stage.key).inc()
                    outage_log.warning("dependency_unreachable stage=%s waited=%.0fs "
                                       "error=%s retry_in=%.1fs", stage.key, waited,
                                       _describe(exc), backoff)
                await asyncio.sleep(backoff)
                liveness.tick()  # waiting out an outage is progress: no restart helps
                waited += backoff
                backoff = min(backoff * 2, OUTAGE_MAX_BACKOFF)
            finally:
                _unacknowledged.reset(token)

    async def _perform(self, stage: Stage[Any], route: Route, msg: Incoming, outcome: Outcome,
                       action: Action, ctx: Context[D]) -> None:
        match action:
            case Commit():
                metrics.count(stage.key, "ack")
            case Redeliver(delay=delay, attempt=attempt):
                value = msg.value
                if isinstance(outcome, Hold | Wait) and outcome.payload is not None:
                    value = marshal(outcome.payload)
                # its next delivery is the child of this one: the Request's trace goes on
                headers = tracing.with_current_context(_redelivery_headers(msg, outcome))
                await send_later(self.producer, self.tiers, target=route.topic, key=msg.key,
                                 value=value, headers=headers, delay=delay,
                                 attempt=attempt)
                if isinstance(outcome, Hold):
                    metrics.count(stage.key, "hold")
                    ctx.log.debug("hold delay=%.3fs", delay)
                elif isinstance(outcome, Wait):
                    metrics.count(stage.key, "wait")
                    metrics.DEPENDENCY_WAITS.labels(stage=stage.key).inc()
                    # one template per stage: the log's flood limit is per template
                    outage_log.warning(f"dependency_wait stage={stage.key} "
                                       "waits=%d retry_in=%.1fs error=%s", ctx.waits + 1,
                                       delay, _describe(outcome.error))
                else:
                    metrics.count(stage.key, "retry")
                    ctx.log.warning("retry attempt=%d delay=%.1fs error=%s", attempt, delay,
                                    _describe(getattr(outcome, "error", None)))
            case DeadLetter(attempts=attempts, error=error):
                assert route.dlq_topic is not None
                tracing.mark_error(f"dead-lettered: {_describe(error)}")
                await self._dead_letter(route.dlq_topic, msg, attempts, error)
                metrics.count(stage.key, "dead_letter")
                ctx.log.error("dead_letter attempts=%d error=%s", attempts, _describe(error))
            case ParkMessage(attempts=attempts, error=error):
                reason = f"after {attempts} attempt(s): {_describe(error)}"
                await _until_done(lambda: self.park(stage.key, msg, reason), what="park",
                                  log=ctx.log)
                metrics.PARKED.labels(stage=stage.key).inc()
                metrics.count(stage.key, "parked")
                ctx.log.error("parked %s", reason)

    async def _undecodable(self, stage: Stage[Any], route: Route, msg: Incoming,
                           exc: MalformedPayload, fields: dict[str, Any]) -> None:
        adapter = _Adapter(log, fields)
        if stage.reconciler:
            await _until_done(lambda: self.park(stage.key, msg, _describe(exc)),
                              what="park", log=adapter)
            metrics.PARKED.labels(stage=stage.key).inc()
            metrics.count(stage.key, "parked")
            adapter.error("parked error=%s", _describe(exc))
            return
        assert route.dlq_topic is not None
        await self._dead_letter(route.dlq_topic, msg, msg.attempt + 1, exc)
        metrics.count(stage.key, "undecodable")
        adapter.error("dead_letter_undecodable error=%s", _describe(exc))

    async def _dead_letter(self, dlq_topic: str, msg: Incoming, attempts: int,
                           error: BaseException) -> None:
        failure: dict[str, str | int] = {
            h.DLQ_SOURCE_TOPIC: msg.topic,
            h.DLQ_SOURCE_PARTITION: msg.partition,
            h.DLQ_SOURCE_OFFSET: msg.offset,
            h.DLQ_ATTEMPTS: attempts,
            h.DLQ_ERROR_CLASS: f"{type(error).__module__}.{type(error).__qualname__}",
            h.DLQ_ERROR_MESSAGE: bounded(str(error)),
            h.DLQ_TIME: datetime.now(UTC).isoformat(timespec="milliseconds"),
        }
        # the reconciler starts counting its own attempts from zero
        out = h.replace(h.without_runtime(msg.headers), {**failure, h.ATTEMPT: 0})
        await produce_until_acked(self.producer, dlq_topic, key=msg.key, value=msg.value,
                                  headers=out, what="dead-letter")


def _redelivery_headers(msg: Incoming, outcome: Outcome) -> h.Headers:
    """A hold starts a new turn: where it began and any waiting are forgotten. A wait is
    a new turn too, counted (with when the first wait began). A retry carries where its
    delivery began."""
    if isinstance(outcome, Hold):
        return h.remove(h.remove(h.remove(msg.headers, h.ORIGIN), h.WAITS),
                        h.WAITING_SINCE_MS)
    if isinstance(outcome, Wait):
        since = h.get_int(msg.headers, h.WAITING_SINCE_MS) or int(time.time() * 1000)
        return h.replace(h.remove(msg.headers, h.ORIGIN), {
            h.WAITS: h.get_int(msg.headers, h.WAITS) + 1, h.WAITING_SINCE_MS: since})
    return h.replace(msg.headers, {h.ORIGIN: msg.origin})


class ParkingStore(Protocol):
    async def park(self, *, topic: str, partition: int, offset: int, key: bytes | None,
                   value: bytes | None, headers: Any, error: str) -> Any: ...


class ParkingDatabase(Protocol):
    @property
    def parked(self) -> ParkingStore: ...


PARKED_BYTES_LIMIT = 64 * 1024  # of a parked key or value: past any payload of ours
PARKED_HEADERS_LIMIT = 32


def park_into(db: ParkingDatabase) -> Park:
    """Park reconciler messages that can never be reconciled in the store's
    ``parked_message`` table. Bounded: a key or value is kept up to `PARKED_BYTES_LIMIT`
    bytes (no payload of ours comes near), header values and the reason to `bounded`
    lengths, with what was cut noted in the reason."""

    async def park(stage: str, msg: Incoming, error: str) -> None:
        cut = [f"{what} of {len(data)} bytes kept to {PARKED_BYTES_LIMIT}"
               for what, data in (("key", msg.key), ("value", msg.value))
               if data is not None and len(data) > PARKED_BYTES_LIMIT]
        headers = [(bounded(k, 64), bounded(v.decode("utf-8", "replace")).encode())
                   for k, v in msg.headers[:PARKED_HEADERS_LIMIT]]
        reason = bounded(error) + (f" ({'; '.join(cut)})" if cut else "")
        await db.parked.park(topic=msg.topic, partition=msg.partition, offset=msg.offset,
                             key=msg.key[:PARKED_BYTES_LIMIT] if msg.key else msg.key,
                             value=msg.value[:PARKED_BYTES_LIMIT] if msg.value else msg.value,
                             headers=headers, error=reason)

    return park


def message_key(payload: Message, key_field: str) -> bytes:
    return str(getattr(payload, key_field)).encode()


class PublishFailed(RetryableError):
    """The broker did not acknowledge a message a handler published."""


# The acknowledgements a delivery still waits for: a handler's publishes are sent without
# waiting, one after another, and the delivery waits for all of them together before its
# source offset may be committed. None outside a delivery (the CLI): each publish waits.
_unacknowledged: ContextVar[list[tuple[str, asyncio.Future[Any]]] | None] = ContextVar(
    "stovepipe_unacknowledged", default=None)


async def publish_payload(producer: AIOKafkaProducer, topic: str, payload: Message,
                          key_field: str) -> None:
    """Produce ``payload``: within a delivery, without waiting for the broker's ack (the
    delivery waits for every ack before its offset is committed); outside one, waiting.
    A failure is always a retryable failure of the delivery (it must not be only logged,
    nor dead-letter the source)."""
    try:
        future = await producer.send(topic, value=marshal(payload),
                                     key=message_key(payload, key_field),
                                     headers=tracing.headers_for_publish() or None)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # whatever the client raised, the delivery retries
        raise _publish_failed(topic, exc) from exc
    pending = _unacknowledged.get()
    if pending is None:
        await _acknowledged([(topic, future)])
    else:
        pending.append((topic, future))


async def _acknowledged(sent: list[tuple[str, asyncio.Future[Any]]]) -> None:
    """Returns once the broker acknowledged every message of ``sent``; PublishFailed for
    the first it refused (each one is waited for, none left unobserved)."""
    failure: PublishFailed | None = None
    for topic, future in sent:
        try:
            await future
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the client raised: retried
            failure = failure or _publish_failed(topic, exc)
    if failure is not None:
        raise failure


def _publish_failed(topic: str, exc: BaseException) -> PublishFailed:
    metrics.PRODUCE_FAILURES.labels(topic=topic).inc()
    failed = PublishFailed(f"publish to {topic} failed: {exc!r}")
    failed.__cause__ = exc
    return failed


async def _until_done(step: Callable[[], Awaitable[None]], *, what: str,
                      log: logging.LoggerAdapter[logging.Logger]) -> None:
    """Retry ``step`` with capped backoff until it succeeds: used where giving up would
    lose a message (parking it when the database is briefly away)."""
    backoff = 0.2
    while True:
        try:
            await step()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - giving up would lose the message
            log.warning("%s_failed error=%r retry_in=%.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            liveness.tick()
            backoff = min(backoff * 2, 10.0)


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "-"
    return bounded(f"{type(error).__name__}: {error}")


class _Adapter(logging.LoggerAdapter[logging.Logger]):
    """Structured log lines: the event first, then key=value fields of the message."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        suffix = " ".join(f"{k}={bounded(v)}" for k, v in extra.items())
        return f"{msg} {suffix}", kwargs
