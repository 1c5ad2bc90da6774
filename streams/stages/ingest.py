"""ingest(queue): resolve the head, find or mint its Request, hand it to process (design §5).

Offered as a plain function (`ingest_head`: the CLI and HTTP return the id and whether it
is new) and as a stage on `ingest`.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import IngestRequest, ProcessRequest, TopicKey
from store import (
    AlreadyExists,
    NotFound,
    RequestState,
    RequestUri,
    Stores,
    Transaction,
    VersionMismatch,
    make_request_id,
    request_seq,
)
from streams.config.names import validate_queue_name
from streams.runtime import ACK, Outcome
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps, StageContext

LATEST_CAS_ATTEMPTS = 10


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
    async with deps.db.transaction() as tx:
        # One ingest of a queue at a time, and the head is resolved under the lock: the
        # head resolved last is minted last, so two ingests racing a moving branch never
        # leave the older head as the queue's latest (it would supersede the newer one).
        await tx.lock_queue(queue)
        uri = await source_control.head()
        request_id = await _find_or_mint_request(tx, queue, uri)
        await _advance_latest(tx, queue, request_id)
        request = await tx.requests.get(queue, request_id)
    if request.state is RequestState.ACCEPTED:
        # a fresh publication (no loop token) takes over any gate loop of this Request;
        # if this publish never happens, the sweeper publishes it (design §6, liveness)
        await publish(TopicKey.PROCESS, ProcessRequest(id=request_id, queue_name=queue))
    return request_id


async def _find_or_mint_request(tx: Transaction, queue: str, uri: str) -> str:
    try:
        mapping = await tx.request_uris.get(queue, uri)
    except NotFound:
        return await _mint_request(tx, queue, uri)
    if await _needs_revalidation(tx, mapping.request_id):
        return await _mint_request(tx, queue, uri, replacing=mapping)
    return mapping.request_id


async def _needs_revalidation(tx: Stores, request_id: str) -> bool:
    """A head whose Request was superseded was never built; if the branch is back at it
    (a force-push reset to an older commit) it must be validated after all, or the branch
    would silently stay unvalidated until the next push."""
    try:
        request = await tx.requests.get_by_id(request_id)
    except NotFound:  # a mapping whose Request was never written: mint afresh
        return True
    return request.state is RequestState.SUPERSEDED


async def _mint_request(tx: Transaction, queue: str, uri: str,
                        replacing: RequestUri | None = None) -> str:
    try:
        # counter, dedup mapping and Request commit together: no orphan Request (one
        # nobody would ever publish) and no mapping without its Request
        async with tx.savepoint():
            request_id = make_request_id(queue, await tx.counters.next(queue))
            await tx.requests.create(queue, request_id, uri)
            if replacing is None:
                await tx.request_uris.create(queue, uri, request_id)
            else:
                await tx.request_uris.reassign(replacing, request_id)
            return request_id
    except (AlreadyExists, VersionMismatch):
        # an ingest that did not take the queue lock (an older version) won the mapping:
        # adopt its id
        return (await tx.request_uris.get(queue, uri)).request_id


async def _advance_latest(tx: Stores, queue: str, request_id: str) -> None:
    for _ in range(LATEST_CAS_ATTEMPTS):
        row = await tx.queues.get_or_create(queue)
        latest = row.latest_request_id
        if latest is not None and request_seq(latest) >= request_seq(request_id):
            return
        try:
            await tx.queues.set_latest_request(row, request_id)
            return
        except VersionMismatch:
            continue
    raise VersionMismatch("queue", {"name": queue}, expected_version=-1, actual_version=None)


async def handle_ingest(payload: IngestRequest, ctx: StageContext) -> Outcome:
    request_id = await ingest_queue(ctx.deps, payload.queue, ctx.publish)
    ctx.log.info("ingested request_id=%s", request_id)
    return ACK
