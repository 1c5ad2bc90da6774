"""The `<key>_dlq` reconcilers: drive work that can never finish to `failed` (design §6).

They run in reconciler mode: a transient failure is retried forever with capped backoff,
nothing is dead-lettered again, and a message that can never be reconciled — undecodable,
an unknown or malformed id, a queue the id does not name, an invariant violation — is
parked with its reason after a few attempts (`retry.park_after` in topics.yaml), so no
message is retried without end. A reconciler acts only on the entity that the message's
queue *and* id both name, and on the Request the message was about (its nonce): after a
database restore an id can name a newer Request, which an old dead letter never fails.
A Request failed here could not be validated: no fact, no red alert, its reason recorded,
and its builds cancelled at their runner. Idempotent; a late legitimate transition wins
through the compare-and-set.
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, IngestRequest, ProcessRequest, Record
from store import Build, NotFound, Request, RequestState
from streams.config.queues import UnknownQueue
from streams.runtime import ACK, Outcome, metrics
from streams.runtime import headers as h
from streams.runtime.logs import bounded
from streams.stages import analyze
from streams.stages.buildsignal import cancel_build, load_build
from streams.stages.deps import Deps, StageContext, WrongQueue, is_stale, load_request
from streams.stages.kit import with_cas_retries
from streams.stages.record import handle_record


class Irreconcilable(Exception):
    """The message names nothing a reconciler may act on; it will be parked.
    Non-retryable, like every error not classified otherwise."""


async def fail_request(ctx: StageContext, queue_name: str, request_id: str, *,
                       nonce: str = "", admitted_only: bool = False) -> Outcome:
    """Fail-closed: a Request whose work can never complete ends `failed` without a
    verdict (it could not be validated: no fact, and its commit may be validated again),
    never green. A `processing` Request gives its slot back in the same transaction, and
    every build of it still running is cancelled at its runner. With ``admitted_only`` an
    ``accepted`` Request is not the message's to fail: only an admitted Request has a
    build to run, so a build message about one that is not is forged or stray (parked,
    harming none). A message about an earlier Request with the same id (``nonce``) fails
    nothing."""
    request = await _named_request(ctx.deps, queue_name, request_id)
    if is_stale(ctx, request, nonce):
        return ACK
    if admitted_only and request.state is RequestState.ACCEPTED:
        raise Irreconcilable(f"request {request.id} was never admitted: no build of it can "
                             f"have failed")
    reason = _reason(ctx)

    async def step() -> Request:
        current = await ctx.deps.db.requests.get(request.queue, request.id)
        if current.state.is_terminal:
            return current
        async with ctx.deps.db.transaction() as tx:
            if current.state is RequestState.PROCESSING:
                queue = await tx.queues.get(current.queue)
                await tx.queues.release_slot(queue, current.kind)
                # admitted, so its commit may show `pending`: it ends without a fact
                await tx.notifications.add_status(
                    current.queue, current.id, current.uri, state="error",
                    description=reason, channels=_status_channels(ctx, current.queue))
            failed = await tx.requests.fail_unvalidated(current, reason)
        metrics.RECONCILED.labels(stage=ctx.stage).inc()
        metrics.REQUESTS_SETTLED.labels(queue=current.queue, outcome="unvalidated").inc()
        ctx.log.warning("reconciled_to_failed was=%s reason=%s", current.state, reason)
        return failed

    settled = await with_cas_retries(step)
    # every time, not only when failing it here: a cancel that failed last time is retried
    for build in await ctx.deps.db.builds.list_for_request(settled.queue, settled.id):
        if not build.status.is_terminal:
            await cancel_build(ctx, build, f"its request is {settled.state}")
    # a project's Request that ended so: its queue's Request may be decided now
    await analyze.record_child_answer(ctx, settled)
    return ACK


def _reason(ctx: StageContext) -> str:
    """Why the Request could not be validated, from the dead letter's headers."""
    stage = ctx.stage.removesuffix("_dlq")
    error = h.get(ctx.message.headers, h.DLQ_ERROR_MESSAGE)
    said = error.decode("utf-8", "replace") if error else "no error recorded"
    return bounded(f"could not be validated: its {stage} step failed for good ({said})")


def _status_channels(ctx: StageContext, queue: str) -> tuple[str, ...]:
    try:
        return ctx.deps.queue_config(queue).status_channels
    except UnknownQueue:  # no longer configured: nothing to notify
        return ()


async def _named_request(deps: Deps, queue_name: str, request_id: str) -> Request:
    try:
        return await load_request(deps, queue_name, request_id)
    except ValueError as exc:  # a malformed id, or WrongQueue
        kind = "queue mismatch" if isinstance(exc, WrongQueue) else "malformed id"
        raise Irreconcilable(f"{kind}: {exc}") from None
    except NotFound:
        raise Irreconcilable(f"unknown request {bounded(request_id)!r}") from None


async def handle_process_dlq(payload: ProcessRequest, ctx: StageContext) -> Outcome:
    return await fail_request(ctx, payload.queue_name, payload.id, nonce=payload.nonce)


async def handle_build_dlq(payload: BuildRequest, ctx: StageContext) -> Outcome:
    return await fail_request(ctx, payload.queue_name, payload.id, nonce=payload.nonce,
                              admitted_only=True)


async def handle_buildsignal_dlq(payload: BuildSignal, ctx: StageContext) -> Outcome:
    build = await _named_build(ctx.deps, payload)
    request = await ctx.deps.db.requests.get(build.queue, build.request_id)
    if build.attempt == request.attempt:
        outcome = await fail_request(ctx, build.queue, build.request_id)
    else:  # an attempt that is over: its Request went on without it
        outcome = ACK
    current = await ctx.deps.db.builds.get(build.queue, build.id)
    if not current.status.is_terminal:  # a build its request no longer names
        await cancel_build(ctx, current, "its poll loop was dead-lettered")
    return outcome


async def _named_build(deps: Deps, payload: BuildSignal) -> Build:
    try:
        return await load_build(deps, payload)
    except WrongQueue as exc:
        raise Irreconcilable(f"queue mismatch: {exc}") from None
    except NotFound:
        raise Irreconcilable(f"unknown build {bounded(payload.id)!r} in queue "
                             f"{bounded(payload.queue_name)!r}") from None


async def handle_record_dlq(payload: Record, ctx: StageContext) -> Outcome:
    # the outcome is already stamped; only the fact, bookmark or ref may be missing
    return await handle_record(payload, ctx)


async def handle_ingest_dlq(payload: IngestRequest, ctx: StageContext) -> Outcome:
    # nothing was minted: keep the message for an operator
    raise Irreconcilable(f"the ingest of queue {bounded(payload.queue)!r} failed for good; "
                         f"nothing was minted")
