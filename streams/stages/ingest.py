"""ingest(queue): resolve the head, find or mint its Request, hand it to process (design §5).

Offered as a plain function (`ingest_head`: the CLI and HTTP return the id and whether it
is new) and as a stage on `ingest`.

Ordering: of two ingests racing a moving branch, the one that resolved its head last must
mint last, or an older head would become the queue's latest and supersede the newer one.
So the head is resolved and minted under the queue's *ingest lease* (`store.ingest_leases`),
one resolve at a time — and git runs while the lease is held, never a database connection
or transaction (design §6: slow I/O holds no connection). The mint statement checks that
the lease is still ours and gives it back. An ingest that finds the lease taken waits, and
takes the answer of the first resolve that began after it arrived rather than resolving
again; within a worker, ingests of one queue share resolves the same way (`Coalesced`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from contract import IngestRequest, ProcessRequest, TopicKey
from store import RequestState
from store.steps import Revalidation
from streams.config.names import validate_queue_name
from streams.extensions.sourcecontrol import SourceControl
from streams.runtime import ACK, Outcome
from streams.runtime.stage import Publisher
from streams.stages import attempts
from streams.stages.deps import Deps, StageContext
from streams.stages.kit import dependency_wait, is_dependency_unavailable, seconds

log = logging.getLogger("stovepipe.ingest")

# Seconds an ingest lease lasts unless renewed; its holder renews it every third of that
# while git resolves the head, so a holder that died blocks the queue's ingests this long.
LEASE = 30.0
RENEW_EVERY = LEASE / 3
WAIT_FIRST, WAIT_CAP = 0.05, 1.0  # seconds between two looks at a lease another holds


@dataclass(frozen=True)
class Ingested:
    queue: str
    request_id: str
    new: bool  # minted by this ingest (False: the head already had it, or a resolve
    #            shared with a concurrent ingest found it)


async def ingest_head(deps: Deps, queue: str, publish: Publisher) -> Ingested:
    """The Request validating ``queue``'s current head, published to process while it is
    still ``accepted``, and whether this ingest minted it. Reporting the same head again
    yields the same Request — unless its newest Request could not validate it (failed
    without a verdict): then a new validation of it is minted (design §4). Raises
    InvalidQueueName, UnknownQueue, SourceControlError, and the store's errors."""
    validate_queue_name(queue)
    source_control = deps.extensions.source_control(queue)  # unknown queue: a user error
    ran = False

    async def resolve_and_mint() -> Ingested:
        nonlocal ran
        ran = True
        return await _resolve_and_mint(deps, queue, source_control, publish)

    ingested: Ingested = await deps.head_ingests.run(queue, resolve_and_mint)
    # a resolve shared with the ingest that ran it minted for that ingest, not this one
    return ingested if ran else replace(ingested, new=False)


async def ingest_queue(deps: Deps, queue: str, publish: Publisher) -> str:
    """`ingest_head`'s Request id."""
    return (await ingest_head(deps, queue, publish)).request_id


async def _resolve_and_mint(deps: Deps, queue: str, source_control: SourceControl,
                            publish: Publisher) -> Ingested:
    holder = uuid.uuid4().hex
    arrived: int | None = None  # resolves begun before this ingest arrived
    wait = WAIT_FIRST
    while True:
        if await deps.db.ingest_leases.try_acquire(queue, holder, LEASE) is None:
            progress = await deps.db.ingest_leases.progress(queue)
            if arrived is None:
                arrived = progress.started
            elif progress.finished > arrived and progress.finished_request_id:
                # a resolve that began after this ingest arrived has minted: its head is
                # at least as new as any this ingest could see
                return Ingested(queue, progress.finished_request_id, new=False)
            await asyncio.sleep(wait)  # the lease holder is running git: nothing to await
            wait = min(wait * 2, WAIT_CAP)
            continue
        try:
            async with _renewed(deps, queue, holder):
                uri = await source_control.head()
            found = await deps.db.steps.find_or_mint(queue, uri, lease_holder=holder,
                                                     revalidation=_revalidation(deps, queue))
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(deps.db.ingest_leases.release(queue, holder))
            raise
        if found is None:  # the lease ran out while git ran, or the id was taken meanwhile
            log.warning("ingest_not_minted queue=%s: resolving again", queue)
            continue
        if found.state is RequestState.ACCEPTED:
            # a fresh publication (no loop token) takes over any gate loop of this Request;
            # if this publish never happens, the sweeper publishes it (design §6, liveness)
            await publish(TopicKey.PROCESS, ProcessRequest(id=found.request_id,
                                                           queue_name=queue,
                                                           nonce=found.nonce))
        return Ingested(queue, found.request_id, new=found.minted)


def _revalidation(deps: Deps, queue: str) -> Revalidation:
    """The queue's bound on validating a head again by itself (design §4): its
    ``retry.unvalidated`` more times per commit, spaced like its re-attempts."""
    retry = deps.queue_config(queue).retry
    return Revalidation(most=retry.unvalidated, spacing=seconds(retry.backoff),
                        spacing_cap=attempts.BACKOFF_CAP)


@contextlib.asynccontextmanager
async def _renewed(deps: Deps, queue: str, holder: str) -> AsyncIterator[None]:
    """Keep the lease ``holder``'s while the block runs (git may take minutes)."""

    async def renew() -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY)
            try:
                await deps.db.ingest_leases.renew(queue, holder, LEASE)
            except Exception as exc:  # noqa: BLE001 - the mint checks the lease anyway
                log.warning("ingest_lease_renew_failed queue=%s error=%r", queue, exc)

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def handle_ingest(payload: IngestRequest, ctx: StageContext) -> Outcome:
    try:
        ingested = await ingest_head(ctx.deps, payload.queue, ctx.publish)
    except Exception as exc:
        # the repository is unreachable: wait it out, up to the queue's trigger deadline
        if not is_dependency_unavailable(exc) or ctx.waiting_for >= seconds(
                ctx.deps.queue_config(payload.queue).trigger_deadline):
            raise
        return dependency_wait(ctx, exc, floor=1.0)
    ctx.log.info("ingested request_id=%s new=%s", ingested.request_id, ingested.new)
    return ACK
