"""What the pipeline's stages share: the database, the queue configuration and the
extensions it names. Built once per worker (or per CLI call)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from store import Database, Queue, Request, parse_request_id
from streams.config.queues import Extensions, QueueConfig, QueuesConfig
from streams.runtime import metrics
from streams.runtime.logs import bounded
from streams.runtime.stage import Context

T = TypeVar("T")


class Coalesced(Generic[T]):
    """Calls for one key that arrive while another runs share the result of the first call
    that *begins* after they arrived (a head resolved before a push arrived may be older
    than that push; one resolved after it is not). Per worker, so a burst of webhook pushes
    for one queue costs a few resolves, not one each. An error is shared like a result."""

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}
        self._begun: dict[str, int] = {}
        self._last: dict[str, tuple[int, Any, BaseException | None]] = {}

    async def run(self, key: str, call: Callable[[], Awaitable[T]]) -> T:
        arrived = self._begun.get(key, 0)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            last = self._last.get(key)
            if last is not None and last[0] > arrived:
                if last[2] is not None:
                    raise last[2]
                result: T = last[1]
                return result
            number = self._begun[key] = self._begun.get(key, 0) + 1
            try:
                result = await call()
            except Exception as exc:
                self._last[key] = (number, None, exc)
                raise
            self._last[key] = (number, result, None)
            return result


@dataclass
class Deps:
    db: Database
    queues: QueuesConfig
    extensions: Extensions
    # ingests of one queue in this worker share head resolutions (streams.stages.ingest)
    head_ingests: Coalesced[Any] = field(default_factory=Coalesced)

    def queue_config(self, name: str) -> QueueConfig:
        """Raises UnknownQueue (a user error) for a queue the configuration lacks."""
        return self.queues.get(name)


class WrongQueue(ValueError):
    """A payload's queue_name disagrees with the stored entity: a malformed message."""


def check_queue_name(payload_queue: str, stored_queue: str, what: str) -> None:
    """`queue_name` may be empty on old payloads; when present it must match."""
    if payload_queue and payload_queue != stored_queue:
        raise WrongQueue(f"{what} belongs to queue {bounded(stored_queue)!r}, "
                         f"but the message says {bounded(payload_queue)!r}")


async def load_request(deps: Deps, queue_name: str, request_id: str) -> Request:
    """The Request a message names by its queue *and* id. The id names its queue
    (`request/<queue>/<n>`); a queue_name, when the message has one, must be the same
    queue (WrongQueue otherwise). ValueError for an id of another shape, NotFound for an
    unknown one: a message can never reach a Request its queue and id do not both name."""
    queue = _queue_of(queue_name, request_id)
    return await deps.db.requests.get(queue, request_id)


async def load_request_with_queue(deps: Deps, queue_name: str,
                                  request_id: str) -> tuple[Request, Queue | None]:
    """`load_request`, and the row of the Request's queue (None if it has none yet), in
    one read."""
    queue = _queue_of(queue_name, request_id)
    return await deps.db.steps.request_with_queue(queue, request_id)


async def load_request_with_attempt_build(deps: Deps, queue_name: str,
                                          request_id: str) -> tuple[Request, str | None]:
    """`load_request`, and the id of the build of the Request's current attempt (None if
    it has none yet), in one read."""
    queue = _queue_of(queue_name, request_id)
    return await deps.db.steps.request_with_attempt_build(queue, request_id)


StageContext = Context[Deps]


def is_stale(ctx: StageContext, request: Request, nonce: str) -> bool:
    """Whether a message carrying ``nonce`` was about an earlier Request with this id (a
    database restored from a backup hands ids out again, design §10): it must not act on
    this one. Logged and counted."""
    if request.is_about(nonce):
        return False
    metrics.STALE_MESSAGES.labels(stage=ctx.stage).inc()
    ctx.log.warning("stale_message nonce=%s: about an earlier request with this id, not %s",
                    bounded(nonce), request.nonce)
    return True


def _queue_of(queue_name: str, request_id: str) -> str:
    """The queue a Request id names, which must be the message's queue_name when it has
    one (ValueError for an id of another shape, WrongQueue for another queue)."""
    queue, _ = parse_request_id(request_id)
    check_queue_name(queue_name, queue, f"request {bounded(request_id)}")
    return queue
