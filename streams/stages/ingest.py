"""ingest(queue): resolve the head, find or mint its Request, hand it to process (design §5).

Offered as a plain function (`ingest_head`: the CLI and HTTP return the id and whether it
is new) and as a stage on `ingest`.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import IngestRequest, ProcessRequest, TopicKey
from store import RequestState, request_seq
from streams.config.names import validate_queue_name
from streams.runtime import ACK, Outcome
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps, StageContext


@dataclass(frozen=True)
class Ingested:
    queue: str
    request_id: str
    new: bool  # minted by this call (or by a concurrent one racing it for the same head)


async def ingest_head(deps: Deps, queue: str, publish: Publisher) -> Ingested:
    """`ingest_queue`, telling a new Request from the one the head already had: the id is
    new when its counter value was drawn after this call began. Raises what
    `ingest_queue` raises (InvalidQueueName, UnknownQueue, SourceControlError, ...)."""
    validate_queue_name(queue)
    deps.queue_config(queue)
    before = await deps.db.counters.current(queue)
    request_id = await ingest_queue(deps, queue, publish)
    return Ingested(queue, request_id, new=request_seq(request_id) > before)


async def ingest_queue(deps: Deps, queue: str, publish: Publisher) -> str:
    """The id of the Request validating ``queue``'s current head, published to process
    while it is still ``accepted``. Reporting the same head again yields the same id."""
    validate_queue_name(queue)
    source_control = deps.extensions.source_control(queue)  # unknown queue: a user error
    # One ingest of a queue at a time, and the head is resolved under the lock: the head
    # resolved last is minted last, so two ingests racing a moving branch never leave the
    # older head as the queue's latest (it would supersede the newer one).
    async with deps.db.queue_transaction(queue) as tx:
        uri = await source_control.head()
        # the head's Request, or a new one if it has none or only a superseded one (the
        # branch came back to a commit never built: it must be validated after all), and
        # the queue's latest moved forward to it
        found = await tx.steps.find_or_mint(queue, uri)
    if found.state is RequestState.ACCEPTED:
        # a fresh publication (no loop token) takes over any gate loop of this Request;
        # if this publish never happens, the sweeper publishes it (design §6, liveness)
        await publish(TopicKey.PROCESS, ProcessRequest(id=found.request_id, queue_name=queue))
    return found.request_id


async def handle_ingest(payload: IngestRequest, ctx: StageContext) -> Outcome:
    request_id = await ingest_queue(ctx.deps, payload.queue, ctx.publish)
    ctx.log.info("ingested request_id=%s", request_id)
    return ACK
