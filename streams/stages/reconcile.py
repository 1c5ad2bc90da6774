"""The `<key>_dlq` reconcilers: drive work that can never finish to `failed` (design §6).

They run in reconciler mode: every failure is retried with capped backoff, nothing is
dead-lettered again, and an undecodable message is parked by the runtime. Idempotent;
a late legitimate transition wins through the compare-and-set.
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, IngestRequest, ProcessRequest, Record
from store import NotFound, RequestState
from streams.runtime import ACK, Outcome, metrics
from streams.stages.deps import Deps, StageContext
from streams.stages.kit import with_cas_retries
from streams.stages.record import handle_record


async def fail_request(ctx: StageContext, request_id: str) -> Outcome:
    """Fail-closed: a Request whose work can never complete ends `failed`, never green.
    A `processing` Request gives its slot back in the same transaction."""

    async def step() -> Outcome:
        deps: Deps = ctx.deps
        try:
            request = await deps.db.requests.get_by_id(request_id)
        except NotFound:
            ctx.log.warning("reconcile_skipped reason=request_not_found")
            return ACK
        if request.state.is_terminal:
            return ACK
        async with deps.db.transaction() as tx:
            if request.state is RequestState.PROCESSING:
                queue = await tx.queues.get(request.queue)
                await tx.queues.release_slot(queue)
            await tx.requests.transition(request, RequestState.FAILED)
        metrics.RECONCILED.labels(stage=ctx.stage).inc()
        ctx.log.warning("reconciled_to_failed was=%s", request.state)
        return ACK

    return await with_cas_retries(step)


async def handle_process_dlq(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    return await fail_request(ctx, payload.id)


async def handle_build_dlq(payload: BuildRequest, ctx: StageContext) -> Outcome:
    return await fail_request(ctx, payload.id)


async def handle_buildsignal_dlq(payload: BuildSignal, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    try:
        if payload.queue_name:
            build = await deps.db.builds.get(payload.queue_name, payload.id)
        else:
            build = await deps.db.builds.get_by_id(payload.id)
    except NotFound:
        ctx.log.warning("reconcile_skipped reason=build_not_found")
        return ACK
    return await fail_request(ctx, build.request_id)


async def handle_record_dlq(payload: Record, ctx: StageContext) -> Outcome:
    # the outcome is already stamped; only the fact, bookmark or ref may be missing
    return await handle_record(payload, ctx)


async def handle_ingest_dlq(payload: IngestRequest, ctx: StageContext) -> Outcome:
    # nothing was minted: keep the message for an operator
    msg = ctx.message
    deps: Deps = ctx.deps
    await deps.db.parked.park(topic=msg.topic, partition=msg.partition, offset=msg.offset,
                              key=msg.key, value=msg.value, headers=msg.headers,
                              error=f"ingest of queue {payload.queue!r} failed")
    metrics.PARKED.labels(stage=ctx.stage).inc()
    ctx.log.warning("ingest_parked queue=%s", payload.queue)
    return ACK
