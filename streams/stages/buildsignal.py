"""buildsignal(build id): poll a build until terminal, then settle its Request (design §5).

The poll loop is a chain of holds on the build's own key. A terminal status is stored
write-once; the first terminal build of a Request releases its slot and stamps its
outcome in one transaction (first writer wins), then hands the Request to record.
"""

from __future__ import annotations

from datetime import UTC, datetime

from contract import BuildSignal, Record, TopicKey
from store import Build, BuildStatus, InvariantViolation, Request, RequestState
from streams.runtime import ACK, Hold, Outcome
from streams.stages.deps import Deps, StageContext, check_queue_name
from streams.stages.kit import seconds, with_cas_retries


async def handle_buildsignal(payload: BuildSignal, ctx: StageContext) -> Outcome:
    return await with_cas_retries(lambda: _poll(payload, ctx))


async def _poll(payload: BuildSignal, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    build = await _load_build(deps, payload)
    request = await deps.db.requests.get(build.queue, build.request_id)
    if request.state.is_outcome:
        if build.status.is_terminal:
            # an earlier delivery settled the Request and may have died before publishing
            await _publish_to_record(ctx, request)
        return ACK  # a duplicate build of a settled Request needs no more polling
    if request.state is not RequestState.PROCESSING:
        return ACK  # superseded, or failed by a reconciler

    config = deps.queue_config(build.queue)
    if not build.status.is_terminal:
        if deps.poll_loops.is_duplicate(build.id):
            return ACK  # another loop of this build polled it and goes on
        build = await _refresh_status(ctx, build, seconds(config.poll_deadline))
    if not build.status.is_terminal:
        delay = seconds(config.poll_delay_running if build.status is BuildStatus.RUNNING
                        else config.poll_delay_queued)
        deps.poll_loops.polled(build.id, delay)
        return Hold(delay)

    outcome = build.status.request_outcome
    async with deps.db.transaction() as tx:
        queue = await tx.queues.get(request.queue)
        await tx.queues.release_slot(queue)
        request = await tx.requests.transition(request, outcome)
    ctx.log.info("settled build_id=%s outcome=%s", build.id, outcome)
    await _publish_to_record(ctx, request)
    return ACK


async def _load_build(deps: Deps, payload: BuildSignal) -> Build:
    if payload.queue_name:
        build = await deps.db.builds.get(payload.queue_name, payload.id)
    else:
        build = await deps.db.builds.get_by_id(payload.id)
    check_queue_name(payload.queue_name, build.queue, f"build {build.id}")
    return build


async def _refresh_status(ctx: StageContext, build: Build, deadline_s: float) -> Build:
    runner = ctx.deps.extensions.build_runner(build.queue)
    age = (datetime.now(UTC) - build.created_at).total_seconds()
    if age > deadline_s:
        # a hung build must not wedge its queue: stop it and count it as not green
        await runner.cancel(build.id)
        ctx.log.warning("poll_deadline build_id=%s age=%.0fs deadline=%.0fs", build.id,
                        age, deadline_s)
        status = BuildStatus.FAILED
    else:
        status = (await runner.status(build.id)).status
    if status is build.status:
        return build
    try:
        return await ctx.deps.db.builds.set_status(build, status)
    except InvariantViolation:
        # another delivery stored a terminal status first: it stays (write-once)
        return await ctx.deps.db.builds.get(build.queue, build.id)


async def _publish_to_record(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.RECORD, Record(id=request.id, queue_name=request.queue))

