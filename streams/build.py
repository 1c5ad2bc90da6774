"""build(request id): trigger the Request's build and start polling it (design §5).

Never writes the Request. A Request with a build row already has its build and poll
loop, so a duplicate BuildRequest is acknowledged; a crash between trigger and that row
can still start a second build, which buildsignal absorbs (first writer wins).
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, TopicKey
from store import RequestState
from streams.deps import Deps, check_queue_name
from streams.runtime import ACK, Outcome, RetryableError
from streams.runtime.stage import Context


class StrategyNotVisible(RetryableError):
    """process publishes only after committing the strategy; seeing none is a lagging
    read, never a reason to guess "full"."""


async def handle_build(payload: BuildRequest, ctx: Context) -> Outcome:
    deps: Deps = ctx.deps
    request = await deps.db.requests.get_by_id(payload.id)
    check_queue_name(payload.queue_name, request.queue, f"request {request.id}")
    if request.state.is_terminal:
        return ACK
    if request.state is not RequestState.PROCESSING or request.build_strategy is None:
        raise StrategyNotVisible(f"request {request.id} is {request.state} with no strategy")

    if await deps.db.builds.list_for_request(request.queue, request.id):
        # a duplicate BuildRequest: a build row exists only once its poll loop was
        # published (below), so there is nothing left to do
        ctx.log.info("build_exists: duplicate ignored")
        return ACK
    runner = deps.extensions.build_runner(request.queue)
    build_id = await runner.trigger(request.base_uri, request.uri,
                                    {"queue": request.queue, "request_id": request.id,
                                     "strategy": request.build_strategy.value})
    # publish before the row: a crash in between re-triggers on redelivery (a second
    # build, absorbed downstream) and the orphaned poll loop retries until it ends
    await ctx.publish(TopicKey.BUILDSIGNAL, BuildSignal(id=build_id, queue_name=request.queue))
    await deps.db.builds.get_or_create(request.queue, build_id, request.id)
    ctx.log.info("triggered build_id=%s strategy=%s", build_id, request.build_strategy)
    return ACK
