"""build(request id): trigger the build of the Request's current attempt and start polling
it (design §5).

Never writes the Request — but for an attempt whose trigger could not reach its runner
before the queue's trigger deadline: that attempt ends without a verdict, and is tried
again or ends the Request (`streams.stages.attempts`). An attempt with a build row is not
built again: its poll loop is published afresh instead, which takes the loop over
(`streams.stages.loops`). A crash between the trigger and the row triggers again with the
same trigger key (the Request, its nonce and the attempt), and a runner that can tell
returns the build it already started; one that cannot starts a second build, which
buildsignal absorbs (first writer wins) and cancels. A re-attempt waits for its backoff
(held), and a runner that is unavailable (5xx, 429, a timeout) is waited out with capped
backoff while the Request stays alive to the sweeper.
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, Record, TopicKey
from store import BuildStatus, Request, RequestState, VersionMismatch, project_of
from streams.extensions import budget
from streams.extensions.buildrunner import BuildRunnerError
from streams.runtime import ACK, Hold, Outcome, RetryableError, metrics
from streams.stages import analyze, attempts, loops
from streams.stages.deps import (
    Deps,
    StageContext,
    WrongQueue,
    is_stale,
    load_request_with_attempt_build,
)
from streams.stages.kit import dependency_wait, is_dependency_unavailable, seconds


class StrategyNotVisible(RetryableError):
    """process publishes only after committing the strategy; seeing none is a lagging
    read, never a reason to guess "full"."""


def trigger_key(request: Request) -> str:
    """What a runner recognises a repeated trigger by: one per attempt of one Request —
    never the same for two Requests, even when a restored database hands a Request's id
    to another (the nonce differs)."""
    return f"{request.id}#{request.attempt}@{request.nonce}"


async def handle_build(payload: BuildRequest, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request, attempt_build_id = await load_request_with_attempt_build(
        deps, payload.queue_name, payload.id)
    if is_stale(ctx, request, payload.nonce):
        return ACK
    if payload.project and payload.project != project_of(request.queue):
        raise WrongQueue(f"request {request.id} is of project "
                         f"{project_of(request.queue) or '(none)'!r}, but the message says "
                         f"{payload.project!r}")
    if request.state.is_terminal:
        return ACK
    if request.state is not RequestState.PROCESSING or request.build_strategy is None:
        raise StrategyNotVisible(f"request {request.id} is {request.state} with no strategy")
    if payload.attempt and payload.attempt != request.attempt:
        if payload.attempt > request.attempt:
            raise StrategyNotVisible(f"request {request.id} is at attempt "
                                     f"{request.attempt}, the message names "
                                     f"{payload.attempt}")
        return ACK  # an attempt that is over

    config = deps.queue_config(request.queue)
    if config.projects:
        # a Request of a queue with projects builds each affected project in its scope
        return await analyze.handle_parent(ctx, request, config)
    if attempt_build_id is not None:
        # a duplicate BuildRequest, or a redelivery after a crash between the row and the
        # publish below: (re)start the poll loop; a fresh publication takes the loop over
        await _publish_to_buildsignal(ctx, attempt_build_id, request.queue, loop="")
        return ACK
    if request.attempt_due_in > 0:  # a re-attempt's backoff
        return Hold(request.attempt_due_in, _this_attempt(request))

    runner = deps.extensions.build_runner(request.queue)
    try:
        # a trigger the budget spaces out says when it is back (streams.stages.loops)
        build_id = await budget.announcing(
            loops.request_back_after(deps.db, request.queue, request.id),
            runner.trigger(request.base_uri, request.uri, {
                "queue": request.queue, "request_id": request.id,
                "strategy": request.build_strategy.value,
                "trigger_key": trigger_key(request), "attempt": str(request.attempt)}))
    except BuildRunnerError as exc:
        if not exc.retryable:
            # refused (401, 404, 422, no token, a bad configuration): triggering again
            # would be refused the same way
            return await _end_without_build(ctx, request, attempts.Observed(
                BuildStatus.FAILED, None, f"its trigger was refused: {exc}",
                permanent=True))
        return await _wait_for_trigger(ctx, request, exc)
    except Exception as exc:
        if not is_dependency_unavailable(exc):
            raise
        return await _wait_for_trigger(ctx, request, exc)
    # the loop starts with this message's token: no write on its first poll
    token = loops.message_token(ctx.stage, ctx.message)
    build = await deps.db.builds.get_or_create(request.queue, build_id, request.id,
                                               loop_token=token, attempt=request.attempt)
    ctx.log.info("triggered build_id=%s attempt=%d strategy=%s", build_id, request.attempt,
                 request.build_strategy)
    await _publish_to_buildsignal(ctx, build_id, request.queue, loop=build.loop_token)
    return ACK


async def _wait_for_trigger(ctx: StageContext, request: Request,
                            error: BaseException) -> Outcome:
    """Wait out a runner that is unavailable, up to the queue's trigger deadline; past
    it, this attempt could not validate (no build ran)."""
    deps: Deps = ctx.deps
    config = deps.queue_config(request.queue)
    if ctx.waiting_for < seconds(config.trigger_deadline):
        wait = dependency_wait(ctx, error, floor=1.0, payload=_this_attempt(request))
        # alive to the sweeper while it waits: it re-publishes only a lost message
        await deps.db.requests.touch_loop(request.queue, request.id, quiet=wait.delay)
        return wait
    return await _end_without_build(ctx, request, attempts.Observed(
        BuildStatus.FAILED, None,
        f"its build could not be triggered for {ctx.waiting_for:.0f}s (trigger deadline "
        f"{seconds(config.trigger_deadline):.0f}s): {error}"))


async def _end_without_build(ctx: StageContext, request: Request,
                             observed: attempts.Observed) -> Outcome:
    """End this attempt, which has no build, as ``observed`` says (`attempts.decide`)."""
    deps: Deps = ctx.deps
    config = deps.queue_config(request.queue)
    reason = observed.reason
    end = attempts.decide(request, observed, config.retry)
    ended = await deps.db.steps.end_attempt(request, end,
                                            status_channels=config.status_channels)
    if ended.request is None:  # the Request changed meanwhile: decide again
        raise VersionMismatch("request", {"queue": request.queue, "id": request.id},
                              expected_version=request.version, actual_version=None)
    metrics.ATTEMPTS_ENDED.labels(queue=request.queue, outcome="unvalidated").inc()
    ctx.log.warning("trigger_failed attempt=%d settled=%s permanent=%s reason=%s",
                    request.attempt, ended.settled, observed.permanent, reason)
    if ended.settled:
        await ctx.publish(TopicKey.RECORD, Record(id=request.id, queue_name=request.queue,
                                                  nonce=request.nonce))
        return ACK
    return Hold(max(0.0, ended.request.attempt_due_in), _this_attempt(ended.request))


def _this_attempt(request: Request) -> BuildRequest:
    return BuildRequest(id=request.id, queue_name=request.queue, nonce=request.nonce,
                        attempt=request.attempt, project=project_of(request.queue))


async def _publish_to_buildsignal(ctx: StageContext, build_id: str, queue: str, *,
                                  loop: str) -> None:
    await ctx.publish(TopicKey.BUILDSIGNAL, BuildSignal(id=build_id, queue_name=queue,
                                                        loop=loop))

