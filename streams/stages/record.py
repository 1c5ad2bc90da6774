"""record(request id): write the immutable fact, move the bookmark, promote (design §5).

Only a verdict is recorded: `succeeded` (green) and `failed` with a red verdict; a Request
that failed without a verdict (it could not be validated), was cancelled or superseded
gets no fact. Decisions after the fact write use the stored fact, not the Request: a
redelivery, a reconciler or the sweeper re-running this must reach the same end state.
The promotion ref's repository being unavailable delays the promotion (waited out up to
the queue's trigger deadline, then retried by the reconciler), never the fact.

A backfilled commit (a culprit search's probe) moves the bookmark only forward to a
commit that descends from the bookmarked one; its fact never waits for git to answer
that: while the repository is unavailable the fact is written, and the bookmark is
considered again when the repository answers (the message waits, then its reconciler).
After the fact, the verdict goes to the queue's culprit search (`streams.stages.culprits`).
"""

from __future__ import annotations

from collections.abc import Sequence

from contract import Record
from store import (
    InvariantViolation,
    Queue,
    Request,
    RequestKind,
    RequestState,
    ValidationFact,
    Verdict,
    VersionMismatch,
    project_of,
    request_order,
    split_scope,
)
from streams.config.queues import UnknownQueue
from streams.extensions.sourcecontrol import CommitNotFound, PromotionMoved
from streams.runtime import ACK, Outcome, metrics
from streams.runtime.classify import is_outage
from streams.runtime.logs import bounded
from streams.stages import analyze, culprits
from streams.stages.deps import Deps, StageContext, is_stale, load_request
from streams.stages.kit import (
    CAS_ATTEMPTS,
    dependency_wait,
    is_dependency_unavailable,
    seconds,
)
from streams.stages.project_pins import settle_project_promotion

DEGREE = {Verdict.GREEN: 0.0, Verdict.RED: 1.0}


class FactOfAnotherRequest(InvariantViolation):
    """The commit already has a green fact written for a different Request."""


class NotSettled(InvariantViolation):
    """record was asked about a Request with no outcome yet."""


async def handle_record(payload: Record, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    request = await load_request(deps, payload.queue_name, payload.id)
    if is_stale(ctx, request, payload.nonce):
        return ACK
    if request.state in (RequestState.CANCELLED, RequestState.SUPERSEDED) \
            or request.unvalidated:
        if request.kind is RequestKind.BACKFILL:  # its search passes the commit by
            return await _find_culprit(ctx, request, None, moved=False)
        await analyze.record_child_answer(ctx, request)  # a project's: its parent may end
        if _has_projects(deps, request.queue):  # its projects' refs move all the same
            return await _promote_projects(ctx, request)
        return ACK  # no verdict: no fact
    if request.state not in (RequestState.SUCCEEDED, RequestState.FAILED) \
            or request.verdict is None:
        raise NotSettled("request", {"id": request.id},
                         f"record needs an outcome, the request is {request.state}")

    degree = DEGREE[request.verdict]
    # where the promotion ref is, read before the bookmark is checked (see _promote); a
    # repository that does not answer now must not keep the fact from being written
    target: str | None = None
    unread: Exception | None = None
    # a project's ref follows the project's bookmark, not its scope's: moved below
    if degree == 0.0 and not project_of(request.queue):
        try:
            target = await _promotion_target(ctx, request.queue)
        except Exception as exc:
            if not is_dependency_unavailable(exc):
                raise
            unread = exc
    statuses, alerts = _channels(deps, request.queue)
    move, checked = True, None
    unanswered: Exception | None = None  # the ancestry question git could not answer
    if request.kind is RequestKind.BACKFILL and degree == 0.0:
        try:
            move, checked = await _descends_from_bookmark(ctx, request)
        except Exception as exc:
            if not is_dependency_unavailable(exc):
                raise
            # the fact does not wait for git: it is written now, and the bookmark
            # considered again when this message comes back
            move, checked, unanswered = False, None, exc
    # the fact, the bookmark, the queue's greenness and what they notify: one statement
    recorded = await deps.db.steps.record_fact(
        request.queue, request.uri, request_id=request.id, degree=degree,
        attempts=max(request.attempt, 1),
        flaky=request.verdict is Verdict.GREEN and request.red_reruns > 0,
        move_bookmark=move, checked_bookmark=checked,
        check_bookmark=request.kind is RequestKind.BACKFILL,
        status_channels=statuses, alert_channels=alerts)
    fact = recorded.fact
    if fact is None:  # a concurrent delivery's fact, not visible to the statement yet
        fact = await deps.db.facts.of_request(request.queue, request.id) \
            or await deps.db.facts.get(request.queue, request.uri)
    if fact.request_id != request.id:
        raise FactOfAnotherRequest(
            "validation_fact", {"queue": fact.queue, "uri": fact.uri},
            f"the commit's green fact belongs to {fact.request_id}, not {request.id}")
    if unanswered is not None:
        if ctx.waiting_for >= _trigger_deadline(deps, request.queue):
            raise unanswered  # the reconciler keeps asking (record_dlq re-runs record)
        return dependency_wait(ctx, unanswered, floor=1.0)
    if fact.is_green and recorded.holds_bookmark and not project_of(request.queue):
        try:
            if unread is not None:
                # the ref must be read before the bookmark is checked: the next delivery
                # starts over in that order
                raise unread
            await _promote(ctx, fact, target, recorded.pinned_uri)
        except Exception as exc:
            # the fact and the bookmark are written; the ref, a cache of the bookmark,
            # follows once the repository answers
            deadline = _trigger_deadline(deps, request.queue)
            if not is_dependency_unavailable(exc) or ctx.waiting_for >= deadline:
                raise
            return dependency_wait(ctx, exc, floor=1.0)
    await analyze.record_child_answer(ctx, request)  # a project's: its parent may end
    if _has_projects(deps, request.queue):
        # its projects find their own culprits, each in its scope
        return await _promote_projects(ctx, request)
    queue, project = split_scope(request.queue)
    if project and fact.is_green:  # its answer may have moved the project's bookmark
        waiting = await _promote_projects(ctx, request, queue, [project])
        if waiting is not ACK:
            return waiting
    return await _find_culprit(ctx, request, fact,
                               moved=fact.is_green and recorded.holds_bookmark)


async def _promote_projects(ctx: StageContext, request: Request, queue: str | None = None,
                            projects: Sequence[str] | None = None) -> Outcome:
    """Move the promotion ref of each of ``queue``'s ``projects`` (default: ``request``'s
    queue, every project) where the project's state says it belongs — its pin, else its
    bookmark (`streams.stages.project_pins`: compare-and-set on the ref, read before the
    state, so a ref never goes back). A repository that does not answer is waited out up
    to the trigger deadline."""
    deps: Deps = ctx.deps
    queue = queue or request.queue
    config = deps.queue_config(queue)
    try:
        for project in projects if projects is not None else list(config.projects):
            if config.projects[project].promotion_ref is None:
                continue
            try:
                await settle_project_promotion(deps, queue, project)
            except CommitNotFound as exc:
                metrics.PROMOTION_SKIPPED.labels(queue=queue).inc()
                ctx.log.warning("promotion_skipped project=%s error=%s", project, exc)
    except Exception as exc:
        if not is_dependency_unavailable(exc) or ctx.waiting_for >= _trigger_deadline(
                deps, request.queue):
            raise
        return dependency_wait(ctx, exc, floor=1.0)
    return ACK


def _has_projects(deps: Deps, queue: str) -> bool:
    try:
        return bool(deps.queue_config(queue).projects)
    except UnknownQueue:
        return False


async def _descends_from_bookmark(ctx: StageContext,
                                  request: Request) -> tuple[bool, str | None]:
    """Whether a backfilled green commit may take the bookmark: only forward, to a commit
    that descends from the bookmarked one (asked of the repository), and only while the
    bookmark is still the one asked about (the statement checks)."""
    for _ in range(CAS_ATTEMPTS):
        queue = await ctx.deps.db.queues.get(request.queue)
        bookmark = queue.last_green_request_id
        if bookmark is None:
            return True, None
        if request_order(bookmark) >= request.order or queue.last_green_uri is None:
            return False, bookmark
        try:
            descends = await ctx.deps.extensions.source_control(request.queue).is_ancestor(
                queue.last_green_uri, request.uri)
        except CommitNotFound:
            descends = False
        if (await ctx.deps.db.queues.get(request.queue)).last_green_request_id == bookmark:
            return descends, bookmark
    return False, None  # the bookmark keeps moving: newer commits are taking it


async def _find_culprit(ctx: StageContext, request: Request, fact: ValidationFact | None,
                        *, moved: bool) -> Outcome:
    """What a verdict means for the queue's culprit search (`streams.stages.culprits`):
    a red one after the last green commit opens one, a backfill's outcome advances its
    own, and a green one that moved the bookmark ends one whose break was fixed. The fact
    is written already: a repository that does not answer is waited out up to the
    queue's trigger deadline, then the search is left to the sweeper."""
    try:
        if request.kind is RequestKind.BACKFILL:
            await culprits.advance_probe(ctx.deps, ctx.publish, request)
        elif fact is not None and not fact.is_green:
            await culprits.open_search(ctx.deps, ctx.publish, request)
        elif moved:
            await culprits.advance_queue(ctx.deps, ctx.publish, request.queue)
    except Exception as exc:
        if is_outage(exc) or isinstance(exc, VersionMismatch):
            raise
        unavailable = is_dependency_unavailable(exc)
        if unavailable and ctx.waiting_for < _trigger_deadline(ctx.deps, request.queue):
            return dependency_wait(ctx, exc, floor=1.0)
        ctx.log.error("culprit_search_failed error=%s",
                      bounded(f"{type(exc).__name__}: {exc}"), exc_info=not unavailable)
        metrics.CULPRIT_FAILURES.labels(queue=request.queue).inc()
    return ACK


def _channels(deps: Deps, queue: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where the queue's statuses and alerts go; nowhere for a queue no longer configured
    (its fact is still recorded)."""
    try:
        config = deps.queue_config(queue)
    except UnknownQueue:
        return (), ()
    return config.status_channels, config.alert_channels


def _trigger_deadline(deps: Deps, queue: str) -> float:
    try:
        return seconds(deps.queue_config(queue).trigger_deadline)
    except UnknownQueue:
        return 0.0


async def _promotion_target(ctx: StageContext, queue: str) -> str | None:
    return await ctx.deps.extensions.source_control(queue).promotion_target()


async def _promote(ctx: StageContext, fact: ValidationFact, target: str | None,
                   pinned: str | None) -> None:
    """Move the promotion ref to ``fact`` while it holds the bookmark, by compare-and-set
    on the ref: read where the ref is (``target``, read before the caller found ``fact``
    holding the bookmark), *then* whether ``fact`` still holds the bookmark, then move the
    ref only if it is still where it was read. A newer holder that promoted in between
    makes the set fail, and the next round sees the bookmark moved on; one that promotes
    after us finds our value and moves it forward. So the ref never goes back.

    While the queue is pinned (`streams.stages.pins`) the ref stays where the pin put it;
    the pin is read after the ref, like the bookmark, so a pin written meanwhile makes
    this set fail (the pin moved the ref) or is seen on the next round."""
    source_control = ctx.deps.extensions.source_control(fact.queue)
    for attempt in range(CAS_ATTEMPTS):
        if attempt:
            target = await source_control.promotion_target()
            queue: Queue = await ctx.deps.db.queues.get(fact.queue)
            pinned = queue.pinned_uri
            if queue.last_green_request_id != fact.request_id:
                return  # a newer green commit holds the bookmark: it promotes
        if pinned is not None:
            ctx.log.info("promotion_pinned pinned=%s", pinned)
            return  # held during an incident: unpin moves it to the bookmark
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
