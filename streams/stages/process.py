"""process(request id): admit, supersede or hold a Request; decide its build strategy.

Single writer per queue: the `process` topic is keyed by queue name (design §5).
"""

from __future__ import annotations

import logging

from contract import BuildRequest, ProcessRequest, TopicKey
from store import BuildStrategy, Queue, Request, RequestState, request_seq
from streams.extensions.sourcecontrol import CommitNotFound
from streams.runtime import ACK, Hold, Outcome
from streams.stages.deps import Deps, StageContext, check_queue_name
from streams.stages.kit import seconds, with_cas_retries

log = logging.getLogger("stovepipe.process")


async def handle_process(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    return await with_cas_retries(lambda: _process(payload, ctx))


async def _process(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request = await deps.db.requests.get_by_id(payload.id)
    check_queue_name(payload.queue_name, request.queue, f"request {request.id}")
    if request.state.is_terminal:
        return ACK
    if request.state is RequestState.PROCESSING:
        # admitted already; without a build row, the admitting delivery may have died
        # before publishing to build (a duplicate here is ignored by build)
        if not await deps.db.builds.list_for_request(request.queue, request.id):
            await _publish_to_build(ctx, request)
        return ACK

    queue = await deps.db.queues.get_or_create(request.queue)
    if _is_older_than_latest(request, queue):
        await deps.db.requests.transition(request, RequestState.SUPERSEDED)
        ctx.log.info("superseded latest=%s", queue.latest_request_id)
        return ACK

    config = deps.queue_config(request.queue)
    if queue.in_flight_count >= config.max_concurrent:
        # not a failure: comes back after the gate delay and is decided afresh
        return Hold(seconds(config.gate_delay))

    strategy, base_uri = await _decide_strategy(ctx, request, queue)
    async with deps.db.transaction() as tx:
        # the slot CAS fails if the queue changed since we read it (another admission,
        # a release, a bookmark): both writes roll back and the decision is redone
        await tx.queues.take_slot(queue)
        request = await tx.requests.transition(request, RequestState.PROCESSING,
                                               strategy=strategy, base_uri=base_uri)
    ctx.log.info("admitted strategy=%s base=%s", strategy, base_uri)
    await _publish_to_build(ctx, request)
    return ACK


def _is_older_than_latest(request: Request, queue: Queue) -> bool:
    latest = queue.latest_request_id
    return latest is not None and request.seq < request_seq(latest)


async def _decide_strategy(ctx: StageContext, request: Request,
                           queue: Queue) -> tuple[BuildStrategy, str | None]:
    last_green = queue.last_green_uri
    if last_green is None:
        return BuildStrategy.FULL, None
    source_control = ctx.deps.extensions.source_control(request.queue)
    try:
        descends = await source_control.is_ancestor(last_green, request.uri)
    except CommitNotFound as exc:
        ctx.log.warning("ancestry_unknown last_green=%s error=%s: building full",
                        last_green, exc)
        return BuildStrategy.FULL, None
    if descends:
        return BuildStrategy.INCREMENTAL, last_green
    return BuildStrategy.FULL, None  # history rewritten: the last green is not an ancestor


async def _publish_to_build(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.BUILD, BuildRequest(id=request.id, queue_name=request.queue))
