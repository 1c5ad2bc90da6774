"""process(request id): admit, supersede or hold a Request; decide its build strategy.

Single writer per queue: the `process` topic is keyed by queue name (design §5). A
Request waiting for a slot is a gate loop: held, it comes back after the gate delay, and
only the loop the Request row names goes on (`streams.stages.loops`). A head is superseded
by a newer head; a Request validating a commit again (`retry`) or finding a culprit
(`backfill`) supersedes nothing and is superseded by nothing (design §4). A backfill is
admitted only while the queue has a free slot for its heads and a free one of its
backfill capacity, and holds only the latter (it never delays a head); one whose culprit
search ended before it was built is passed over (`streams.stages.culprits`). An ancestry
check the repository cannot answer for now is waited out (the loop stays alive), up to
the queue's trigger deadline; past it the Request is built in full, which needs no
ancestry.
"""

from __future__ import annotations

from contract import BuildRequest, ProcessRequest, TopicKey
from store import (
    BuildStrategy,
    Queue,
    Request,
    RequestKind,
    RequestState,
    VersionMismatch,
    project_of,
    request_order,
)
from streams.config.queues import QueueConfig
from streams.extensions.sourcecontrol import CommitNotFound
from streams.runtime import ACK, Hold, Outcome, Wait
from streams.stages import loops
from streams.stages.deps import Deps, StageContext, is_stale, load_request_with_queue
from streams.stages.kit import (
    dependency_wait,
    is_dependency_unavailable,
    seconds,
    with_cas_retries,
)


async def handle_process(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    return await with_cas_retries(lambda: _process(payload, ctx))


async def _process(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request, queue = await load_request_with_queue(deps, payload.queue_name, payload.id)
    if is_stale(ctx, request, payload.nonce):
        return ACK
    if request.state.is_terminal:
        return ACK
    if request.state is RequestState.PROCESSING:
        # admitted already; without a build row, the admitting delivery may have died
        # before publishing to build (a duplicate here is ignored by build)
        if not await deps.db.builds.list_for_request(request.queue, request.id):
            await _publish_to_build(ctx, request)
        return ACK

    mine = loops.message_token(ctx.stage, ctx.message)
    turn = loops.next_turn(row_token=request.loop_token, carried=payload.loop, mine=mine,
                           age=request.loop_age)
    if turn is loops.Turn.DUPLICATE:
        ctx.log.debug("gate_loop_duplicate_ended")
        return ACK

    if queue is None:  # ingest creates the row; a Request written otherwise may lack it
        queue = await deps.db.queues.get_or_create(request.queue)
    if _is_older_than_latest(request, queue):
        await deps.db.requests.transition(request, RequestState.SUPERSEDED)
        ctx.log.info("superseded latest=%s", queue.latest_request_id)
        return ACK

    config = deps.queue_config(request.queue)
    if request.kind is RequestKind.BACKFILL:
        search = await deps.db.culprit_searches.of_probe(request.queue, request.id)
        if search is None or search.state.ended:
            # its search ended before it was built (the branch went green again, or the
            # culprit was named): no build is spent on it
            await deps.db.requests.pass_over(
                request, f"its culprit search ended ({search.state if search else 'gone'}) "
                         f"before it was built")
            ctx.log.info("backfill_passed_over search=%s",
                         search.state if search else None)
            return ACK
    if not _has_room(request, queue, config):
        # not a failure: comes back after the gate delay and is decided afresh
        if turn is loops.Turn.CLAIM:
            request = await deps.db.requests.claim_loop(request, mine)
        return Hold(seconds(config.gate_delay), _gate_turn(request))

    decided = await _decide_strategy(ctx, request, queue, config)
    if isinstance(decided, Wait):
        # the repository is unavailable: the gate loop waits it out, alive to the sweeper
        request = await deps.db.requests.claim_loop(
            request, mine, quiet=decided.delay - _longest_delay(config))
        return Wait(decided.delay, decided.error, _gate_turn(request))
    strategy, base_uri = decided
    # takes the slot and moves the Request only if what the decision read still holds (the
    # Request unchanged, a free slot, no newer latest, the same bookmark); otherwise
    # nothing is written and the decision is redone from a fresh read
    admitted = await deps.db.steps.admit(
        request, strategy=strategy, base_uri=base_uri, max_concurrent=config.max_concurrent,
        backfill_max_concurrent=config.backfill.max_concurrent,
        last_green_request_id=queue.last_green_request_id,
        status_channels=config.status_channels)
    if admitted is None:
        raise VersionMismatch("request", {"queue": request.queue, "id": request.id},
                              expected_version=request.version, actual_version=None)
    request = admitted
    ctx.log.info("admitted strategy=%s base=%s", strategy, base_uri)
    await _publish_to_build(ctx, request)
    return ACK


def _is_older_than_latest(request: Request, queue: Queue) -> bool:
    """A head older than the queue's latest is superseded; a retry or a backfill never
    is."""
    latest = queue.latest_request_id
    return (request.kind.supersedable and latest is not None
            and request.order < request_order(latest))


def _has_room(request: Request, queue: Queue, config: QueueConfig) -> bool:
    """A free slot for the queue's heads; a backfill also needs one of the backfill
    capacity (it holds only that one: it never keeps a head waiting)."""
    if queue.in_flight_count >= config.max_concurrent:
        return False
    return (request.kind is not RequestKind.BACKFILL
            or queue.backfill_in_flight < config.backfill.max_concurrent)


def _gate_turn(request: Request) -> ProcessRequest:
    return ProcessRequest(id=request.id, queue_name=request.queue, loop=request.loop_token,
                          nonce=request.nonce)


def _longest_delay(config: QueueConfig) -> float:
    return max(seconds(config.gate_delay), seconds(config.poll_delay_queued),
               seconds(config.poll_delay_running))


async def _decide_strategy(ctx: StageContext, request: Request, queue: Queue,
                           config: QueueConfig) -> tuple[BuildStrategy, str | None] | Wait:
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
    except Exception as exc:
        if not is_dependency_unavailable(exc):
            raise
        if ctx.waiting_for < seconds(config.trigger_deadline):
            return dependency_wait(ctx, exc, floor=seconds(config.gate_delay))
        # a full build validates the commit without knowing its ancestry
        ctx.log.warning("ancestry_unavailable waited=%.0fs error=%s: building full",
                        ctx.waiting_for, exc)
        return BuildStrategy.FULL, None
    if descends:
        return BuildStrategy.INCREMENTAL, last_green
    return BuildStrategy.FULL, None  # history rewritten: the last green is not an ancestor


async def _publish_to_build(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.BUILD, BuildRequest(id=request.id, queue_name=request.queue,
                                                   nonce=request.nonce,
                                                   attempt=request.attempt,
                                                   project=project_of(request.queue)))
