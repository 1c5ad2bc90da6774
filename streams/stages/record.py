"""record(request id): write the immutable fact, move the bookmark, promote (design §5).

Decisions after the fact write use the stored fact, not the Request: a redelivery or a
reconciler re-running this must reach the same end state.
"""

from __future__ import annotations

from contract import Record
from store import (
    InvariantViolation,
    Queue,
    RequestState,
    ValidationFact,
)
from streams.config.queues import UnknownQueue
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

    degree = DEGREE[request.state]
    # where the promotion ref is, read before the bookmark is checked (see _promote)
    target = await _promotion_target(ctx, request.queue) if degree == 0.0 else None
    statuses, alerts = _channels(deps, request.queue)
    # the fact, the bookmark, the queue's greenness and what they notify: one statement
    recorded = await deps.db.steps.record_fact(request.queue, request.uri,
                                               request_id=request.id, degree=degree,
                                               status_channels=statuses,
                                               alert_channels=alerts)
    fact = recorded.fact
    if fact is None:  # a concurrent delivery's fact, not visible to the statement yet
        fact = await deps.db.facts.get(request.queue, request.uri)
    if fact.request_id != request.id:
        raise FactOfAnotherRequest(
            "validation_fact", {"queue": fact.queue, "uri": fact.uri},
            f"the fact belongs to {fact.request_id}, not {request.id}")
    if fact.is_green and recorded.holds_bookmark:
        await _promote(ctx, fact, target)
    return ACK


def _channels(deps: Deps, queue: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where the queue's statuses and alerts go; nowhere for a queue no longer configured
    (its fact is still recorded)."""
    try:
        config = deps.queue_config(queue)
    except UnknownQueue:
        return (), ()
    return config.status_channels, config.alert_channels


async def _promotion_target(ctx: StageContext, queue: str) -> str | None:
    return await ctx.deps.extensions.source_control(queue).promotion_target()


async def _promote(ctx: StageContext, fact: ValidationFact, target: str | None) -> None:
    """Move the promotion ref to ``fact`` while it holds the bookmark, by compare-and-set
    on the ref: read where the ref is (``target``, read before the caller found ``fact``
    holding the bookmark), *then* whether ``fact`` still holds the bookmark, then move the
    ref only if it is still where it was read. A newer holder that promoted in between
    makes the set fail, and the next round sees the bookmark moved on; one that promotes
    after us finds our value and moves it forward. So the ref never goes back."""
    source_control = ctx.deps.extensions.source_control(fact.queue)
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            target = await source_control.promotion_target()
            queue: Queue = await ctx.deps.db.queues.get(fact.queue)
            if queue.last_green_request_id != fact.request_id:
                return  # a newer green commit holds the bookmark: it promotes
        if target == fact.uri:
            return  # done already
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
