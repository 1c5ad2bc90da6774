"""build(request id): trigger the Request's build and start polling it (design §5).

Never writes the Request. A Request with a build row is not built again: its poll loop
is published afresh instead, which takes the loop over (`streams.stages.loops`). A crash
between the trigger and the row triggers again with the same trigger key (the Request's
id), and a runner that can tell returns the build it already started; one that cannot
starts a second build, which buildsignal absorbs (first writer wins) and cancels.
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, TopicKey
from store import RequestState
from streams.runtime import ACK, Outcome, RetryableError
from streams.stages import loops
from streams.stages.deps import Deps, StageContext, load_request_with_first_build


class StrategyNotVisible(RetryableError):
    """process publishes only after committing the strategy; seeing none is a lagging
    read, never a reason to guess "full"."""


async def handle_build(payload: BuildRequest, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request, first_build_id = await load_request_with_first_build(
        deps, payload.queue_name, payload.id)
    if request.state.is_terminal:
        return ACK
    if request.state is not RequestState.PROCESSING or request.build_strategy is None:
        raise StrategyNotVisible(f"request {request.id} is {request.state} with no strategy")

    if first_build_id is not None:
        # a duplicate BuildRequest, or a redelivery after a crash between the row and the
        # publish below: (re)start the poll loop; a fresh publication takes the loop over
        await _publish_to_buildsignal(ctx, first_build_id, request.queue, loop="")
        return ACK
    runner = deps.extensions.build_runner(request.queue)
    build_id = await runner.trigger(request.base_uri, request.uri,
                                    {"queue": request.queue, "request_id": request.id,
                                     "strategy": request.build_strategy.value,
                                     "trigger_key": request.id})
    # the loop starts with this message's token: no write on its first poll
    token = loops.message_token(ctx.stage, ctx.message)
    build = await deps.db.builds.get_or_create(request.queue, build_id, request.id,
                                               loop_token=token)
    ctx.log.info("triggered build_id=%s strategy=%s", build_id, request.build_strategy)
    await _publish_to_buildsignal(ctx, build_id, request.queue, loop=build.loop_token)
    return ACK


async def _publish_to_buildsignal(ctx: StageContext, build_id: str, queue: str, *,
                                  loop: str) -> None:
    await ctx.publish(TopicKey.BUILDSIGNAL, BuildSignal(id=build_id, queue_name=queue,
                                                        loop=loop))
