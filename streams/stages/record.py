"""record(request id): write the immutable fact, move the bookmark, promote (design §5).

Decisions after the fact write use the stored fact, not the Request: a redelivery or a
reconciler re-running this must reach the same end state.
"""

from __future__ import annotations

from contract import Record
from store import (
    AlreadyExists,
    InvariantViolation,
    Queue,
    RequestState,
    ValidationFact,
    VersionMismatch,
    request_seq,
)
from streams.extensions.sourcecontrol import CommitNotFound, PromotionMoved
from streams.runtime import ACK, Outcome, metrics
from streams.stages.deps import Deps, StageContext, load_request
from streams.stages.kit import CAS_ATTEMPTS

DEGREE = {RequestState.SUCCEEDED: 0.0, RequestState.FAILED: 1.0}


class FactOfAnotherRequest(InvariantViolation):
    """The commit already has a fact written for a different Request."""


class NotSettled(InvariantViolation):
    """record was asked about a Request with no outcome yet."""


async def handle_record(payload: Record, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request = await load_request(deps, payload.queue_name, payload.id)
    if request.state in (RequestState.CANCELLED, RequestState.SUPERSEDED):
        return ACK
    if request.state not in DEGREE:
        raise NotSettled("request", {"id": request.id},
                         f"record needs an outcome, the request is {request.state}")

    fact = await _write_fact(deps, request.queue, request.uri, request.id,
                             DEGREE[request.state])
    if not fact.is_green:
        return ACK
    holds = await _advance_bookmark(deps, fact)
    if holds:
        await _promote(ctx, fact)
    return ACK


async def _write_fact(deps: Deps, queue: str, uri: str, request_id: str,
                      degree: float) -> ValidationFact:
    try:
        return await deps.db.facts.create(queue, uri, degree=degree, request_id=request_id)
    except AlreadyExists:
        fact = await deps.db.facts.get(queue, uri)
    if fact.request_id != request_id:
        raise FactOfAnotherRequest("validation_fact", {"queue": queue, "uri": uri},
                                   f"the fact belongs to {fact.request_id}, not {request_id}")
    return fact  # an earlier delivery wrote it: first fact wins, forever


async def _advance_bookmark(deps: Deps, fact: ValidationFact) -> bool:
    """Move the bookmark to ``fact`` if it is newer; True when ``fact`` holds it."""
    for _ in range(CAS_ATTEMPTS):
        queue = await deps.db.queues.get_or_create(fact.queue)
        current = queue.last_green_request_id
        if current == fact.request_id:
            return True  # an earlier delivery moved it: still the holder
        if current is not None and request_seq(current) > request_seq(fact.request_id):
            return False  # a newer green commit holds it
        try:
            await deps.db.queues.advance_bookmark(queue, uri=fact.uri,
                                                  request_id=fact.request_id)
            return True
        except VersionMismatch:
            continue
    raise VersionMismatch("queue", {"name": fact.queue}, expected_version=-1,
                          actual_version=None)


async def _promote(ctx: StageContext, fact: ValidationFact) -> None:
    """Move the promotion ref to ``fact`` while it holds the bookmark, by compare-and-set
    on the ref: read where the ref is, *then* whether ``fact`` still holds the bookmark,
    then move the ref only if it is still where it was read. A newer holder that promoted
    in between makes the set fail, and the next round sees the bookmark moved on; one that
    promotes after us finds our value and moves it forward. So the ref never goes back."""
    source_control = ctx.deps.extensions.source_control(fact.queue)
    for _ in range(CAS_ATTEMPTS):
        target = await source_control.promotion_target()
        queue: Queue = await ctx.deps.db.queues.get(fact.queue)
        if queue.last_green_request_id != fact.request_id or target == fact.uri:
            return  # a newer green commit holds the bookmark (it promotes), or done already
        try:
            await source_control.promote(fact.uri, expected=target)
            return
        except PromotionMoved:
            continue
        except CommitNotFound as exc:
            metrics.PROMOTION_SKIPPED.labels(queue=fact.queue).inc()
            ctx.log.warning("promotion_skipped uri=%s error=%s", fact.uri, exc)
            return
    raise PromotionMoved(f"the promotion ref of {fact.queue} kept moving; trying again later")
