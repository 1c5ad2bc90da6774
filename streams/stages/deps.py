"""What the pipeline's stages share: the database, the queue configuration and the
extensions it names. Built once per worker (or per CLI call)."""

from __future__ import annotations

from dataclasses import dataclass

from store import Database, Queue, Request, parse_request_id
from streams.config.queues import Extensions, QueueConfig, QueuesConfig
from streams.runtime.logs import bounded
from streams.runtime.stage import Context


@dataclass
class Deps:
    db: Database
    queues: QueuesConfig
    extensions: Extensions

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


async def load_request_with_first_build(deps: Deps, queue_name: str,
                                        request_id: str) -> tuple[Request, str | None]:
    """`load_request`, and the id of the Request's first build (None if it has none), in
    one read."""
    queue = _queue_of(queue_name, request_id)
    return await deps.db.steps.request_with_first_build(queue, request_id)


StageContext = Context[Deps]


def _queue_of(queue_name: str, request_id: str) -> str:
    """The queue a Request id names, which must be the message's queue_name when it has
    one (ValueError for an id of another shape, WrongQueue for another queue)."""
    queue, _ = parse_request_id(request_id)
    check_queue_name(queue_name, queue, f"request {bounded(request_id)}")
    return queue
