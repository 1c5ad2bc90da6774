"""buildsignal(build id): poll a build until terminal, then settle its Request (design §5).

The poll loop is a chain of holds on the build's own key; only the loop the Build row
names goes on (`streams.stages.loops`). A terminal status is stored write-once; the first
terminal build of a Request releases its slot and stamps its outcome in one transaction
(first writer wins), then hands the Request to record. A build that no Request waits for
any more (its Request settled by another build, failed by a reconciler, or superseded) is
cancelled at its runner.
"""

from __future__ import annotations

from contract import BuildSignal, Record, TopicKey
from store import Build, BuildStatus, InvariantViolation, Request, VersionMismatch
from streams.runtime import ACK, Hold, Outcome
from streams.stages import loops
from streams.stages.deps import Deps, StageContext, check_queue_name
from streams.stages.kit import seconds, with_cas_retries


async def handle_buildsignal(payload: BuildSignal, ctx: StageContext) -> Outcome:
    return await with_cas_retries(lambda: _poll(payload, ctx))


async def _poll(payload: BuildSignal, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    build, request = await load_build_with_request(deps, payload)
    if request.state.is_terminal:
        if build.status.is_terminal:
            if request.state.is_outcome:
                # an earlier delivery settled the Request, and may have died before
                # publishing to record
                await _publish_to_record(ctx, request)
        else:
            await cancel_build(ctx, build, f"its request is {request.state}")
        return ACK

    mine = loops.message_token(ctx.stage, ctx.message)
    turn = loops.next_turn(row_token=build.loop_token, carried=payload.loop, mine=mine,
                           age=build.loop_age)
    config = deps.queue_config(build.queue)
    status = build.status
    if not status.is_terminal:
        if turn is loops.Turn.DUPLICATE:
            ctx.log.debug("poll_loop_duplicate_ended build_id=%s", build.id)
            return ACK
        status = await _current_status(ctx, build, seconds(config.poll_deadline))
    if not status.is_terminal:
        build = await _store_status(ctx, build, status)
        delay = seconds(config.poll_delay_running if build.status is BuildStatus.RUNNING
                        else config.poll_delay_queued)
        if turn is loops.Turn.CLAIM:
            build = await deps.db.builds.claim_loop(build, mine)
        return Hold(delay, BuildSignal(id=build.id, queue_name=build.queue,
                                       loop=build.loop_token))

    # stores the terminal status (write-once: one stored first stays), and the first
    # terminal build of the Request stamps its outcome and releases its slot
    settled = await deps.db.steps.settle(build, status, config.status_channels)
    if settled.request is None:
        # another build or a reconciler settled the Request first: decide again from a
        # fresh read (which publishes to record if the Request has an outcome)
        raise VersionMismatch("request", {"queue": request.queue, "id": request.id},
                              expected_version=request.version, actual_version=None)
    ctx.log.info("settled build_id=%s outcome=%s", build.id, settled.request.state)
    await _publish_to_record(ctx, settled.request)
    return ACK


async def load_build_with_request(deps: Deps, payload: BuildSignal) -> tuple[Build, Request]:
    """`load_build` and the build's Request, in one read when the message names the
    queue."""
    if not payload.queue_name:
        build = await load_build(deps, payload)
        return build, await deps.db.requests.get(build.queue, build.request_id)
    return await deps.db.steps.build_with_request(payload.queue_name, payload.id)


async def load_build(deps: Deps, payload: BuildSignal) -> Build:
    """The Build a message names by its queue and id (the queue may be missing on old
    payloads: then the id alone, which must name one build)."""
    if payload.queue_name:
        build = await deps.db.builds.get(payload.queue_name, payload.id)
    else:
        build = await deps.db.builds.get_by_id(payload.id)
    check_queue_name(payload.queue_name, build.queue, f"build {build.id}")
    return build


async def cancel_build(ctx: StageContext, build: Build, why: str) -> Build:
    """Stop a build nobody waits for at its runner, and store it `cancelled` (a status
    the runner reported first stays: write-once)."""
    await ctx.deps.extensions.build_runner(build.queue).cancel(build.id)
    ctx.log.info("build_cancelled build_id=%s reason=%s", build.id, why)
    return await _store_status(ctx, build, BuildStatus.CANCELLED)


async def _current_status(ctx: StageContext, build: Build, deadline_s: float) -> BuildStatus:
    """The build's status at its runner, or `failed` past the poll deadline (then it is
    cancelled at its runner)."""
    runner = ctx.deps.extensions.build_runner(build.queue)
    status = (await runner.status(build.id)).status
    age = build.age  # by the database's clock: a worker's clock never shortens a deadline
    if not status.is_terminal and age > deadline_s:
        # a hung build must not wedge its queue: stop it and count it as not green (one
        # that ended meanwhile, even unseen through an outage, keeps its own outcome)
        await runner.cancel(build.id)
        ctx.log.warning("poll_deadline build_id=%s age=%.0fs deadline=%.0fs", build.id,
                        age, deadline_s)
        status = BuildStatus.FAILED
    return status


async def _store_status(ctx: StageContext, build: Build, status: BuildStatus) -> Build:
    if status is build.status:
        return build
    try:
        return await ctx.deps.db.builds.set_status(build, status)
    except InvariantViolation:
        # another delivery stored a terminal status first: it stays (write-once)
        return await ctx.deps.db.builds.get(build.queue, build.id)


async def _publish_to_record(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.RECORD, Record(id=request.id, queue_name=request.queue))

