"""buildsignal(build id): poll a build until terminal, then end its attempt (design §5).

The poll loop is a chain of holds on the build's own key; only the loop the Build row
names goes on (`streams.stages.loops`). A terminal status is stored write-once with the
verdict it gives; the first terminal build of an attempt ends it in one statement: the
Request settles (its slot released, then record) or its next attempt begins (it keeps
its slot; `streams.stages.attempts`). A build that no Request waits for any more (its
Request settled by another build, failed by a reconciler, or its attempt over) is
cancelled at its runner.

A runner that is unavailable (5xx, 429, a rate limit, a timeout) is waited out: the loop
backs off from its poll delay, never polling more often than it would when healthy, and
says when it will be back so the sweeper does not start another.

Deadlines are measured from the moment what they bound began. A build's start is
recorded once (the provider's own start time, else the first poll that saw it running).
A build that started is bounded by the queue's poll deadline *from its start*: past it, a
build still running is cancelled and counts red (it hung), while one waiting then
(blocked at a block step, awaiting an approval, canceling) gives no verdict. A build that
never started is bounded by the start deadline from its trigger: time spent queued for an
agent never makes a build red. A build whose status could not be read until past its
deadline gives no verdict either.
"""

from __future__ import annotations

from contract import BuildRequest, BuildSignal, Record, TopicKey
from store import (
    Build,
    BuildStatus,
    InvariantViolation,
    Request,
    RequestState,
    Verdict,
    VersionMismatch,
    project_of,
)
from streams.config.queues import QueueConfig
from streams.extensions import budget
from streams.extensions.buildrunner import BuildReport
from streams.runtime import ACK, Hold, Outcome, Wait, metrics
from streams.stages import attempts, loops
from streams.stages.deps import Deps, StageContext, check_queue_name
from streams.stages.kit import (
    dependency_wait,
    is_dependency_unavailable,
    seconds,
    with_cas_retries,
)


async def handle_buildsignal(payload: BuildSignal, ctx: StageContext) -> Outcome:
    return await with_cas_retries(lambda: _poll(payload, ctx))


async def _poll(payload: BuildSignal, ctx: StageContext) -> Outcome:
    deps: Deps = ctx.deps
    build, request = await load_build_with_request(deps, payload)
    if request.state.is_terminal:
        if build.status.is_terminal:
            if request.state.is_outcome and build.attempt == request.attempt:
                # an earlier delivery settled the Request, and may have died before
                # publishing to record
                await _publish_to_record(ctx, request)
        else:
            return await _cancel_or_wait(ctx, build, f"its request is {request.state}")
        return ACK
    if build.attempt != request.attempt:
        if not build.status.is_terminal:  # its attempt ended without it
            return await _cancel_or_wait(ctx, build,
                                         f"attempt {build.attempt} of its request is over")
        if build.attempt == request.attempt - 1 and not any(
                b.attempt == request.attempt
                for b in await deps.db.builds.list_for_request(request.queue, request.id)):
            # this build's end began the next attempt, and the delivery that did may have
            # died before publishing it (build builds an attempt once, so this is safe)
            await _publish_next_attempt(ctx, request)
        return ACK

    config = deps.queue_config(build.queue)
    if build.status.is_terminal:
        # stored by an earlier delivery that did not get to end the attempt
        return await _end_attempt(ctx, request, build, attempts.Observed(
            build.status, build.verdict, build.reason), config)

    mine = loops.message_token(ctx.stage, ctx.message)
    turn = loops.next_turn(row_token=build.loop_token, carried=payload.loop, mine=mine,
                           age=build.loop_age)
    if turn is loops.Turn.DUPLICATE:
        ctx.log.debug("poll_loop_duplicate_ended build_id=%s", build.id)
        return ACK
    runner = ctx.deps.extensions.build_runner(build.queue)
    try:
        # a poll the budget spaces out says when it is back (streams.stages.loops)
        report = await budget.announcing(loops.build_back_after(deps.db, build.queue, build.id),
                                         runner.status(build.id))
    except Exception as exc:
        if not is_dependency_unavailable(exc):
            raise
        past = past_deadline(build, config)  # by the database's clock
        if past is None:
            return await _wait_for_runner(ctx, build, config, mine, exc)
        await _cancel_quietly(ctx, build)
        return await _end_attempt(ctx, request, build, attempts.Observed(
            BuildStatus.FAILED, None, f"its status could not be read past {past}: {exc}"),
            config)

    build = await _note_start(ctx, build, report)
    observed = _observed(report)
    if observed is None:
        # a hung build must not wedge its queue (one that ended meanwhile, even unseen
        # through an outage, keeps its own outcome)
        observed = ended_by_deadline(build, report, config)
        if observed is not None:
            await _cancel_quietly(ctx, build)
            ctx.log.warning("deadline build_id=%s age=%.0fs run_age=%s status=%s "
                            "waiting=%s verdict=%s", build.id, build.age,
                            "-" if build.run_age is None else f"{build.run_age:.0f}s",
                            report.status, report.waiting or "-",
                            observed.verdict.value if observed.verdict else "none")
    if observed is None:
        build = await _store_status(ctx, build, report.status)
        configured = seconds(config.poll_delay_running if report.running_now
                             else config.poll_delay_queued)
        # a hosted CI spaces the polls as its credential's budget allows, and aligns them
        # with the batched list of the build's pipeline (streams.extensions.budget)
        poll_delay = getattr(runner, "poll_delay", None)
        delay = poll_delay(build.id, configured) if poll_delay is not None else configured
        quiet = delay - _longest_delay(config)
        if quiet > 0:  # longer than the sweeper expects: say when the loop is back
            build = await deps.db.builds.claim_loop(build, mine, quiet=quiet)
        elif turn is loops.Turn.CLAIM:
            build = await deps.db.builds.claim_loop(build, mine)
        return Hold(delay, _next_turn(build))
    return await _end_attempt(ctx, request, build, observed, config)


def past_deadline(build: Build, config: QueueConfig) -> str | None:
    """The deadline ``build`` is past, in words, or None: the poll deadline from its
    start once it started, else the start deadline from its trigger."""
    if build.run_age is not None:
        deadline = seconds(config.poll_deadline)
        if build.run_age > deadline:
            return f"the poll deadline ({deadline:.0f}s since it started)"
        return None
    # how long it may wait for an agent, a runner or a free slot before it starts
    deadline = seconds(config.start_deadline if config.start_deadline is not None
                       else config.poll_deadline)
    if build.age > deadline:
        return f"the start deadline ({deadline:.0f}s since its trigger, never started)"
    return None


def ended_by_deadline(build: Build, report: BuildReport,
                      config: QueueConfig) -> attempts.Observed | None:
    """How the attempt of a build that is still going on ends at its deadline (None:
    within it). Only a build that *ran* longer than the poll deadline since it started is
    red (a hang); one that waits at its deadline — queued, blocked at a block step,
    awaiting an approval, canceling — says nothing about the commit."""
    past = past_deadline(build, config)
    if past is None:
        return None
    if build.run_age is not None and report.running_now:
        return attempts.Observed(BuildStatus.FAILED, Verdict.RED, f"it ran past {past}")
    waiting = report.waiting or ("queued" if build.run_age is None else "not running")
    return attempts.Observed(BuildStatus.FAILED, None, f"at {past} it was {waiting}")


async def _note_start(ctx: StageContext, build: Build, report: BuildReport) -> Build:
    """Record the build's start once: the provider's start time when it gives one, else
    now, the first poll that sees it running."""
    if build.started_at is not None or (report.started_at is None and not report.running_now):
        return build
    return await ctx.deps.db.builds.mark_started(build, report.started_at)


def _observed(report: BuildReport) -> attempts.Observed | None:
    """The end a runner's report tells of, or None while the build goes on."""
    if not report.status.is_terminal:
        return None
    if report.status is BuildStatus.FAILED and report.unvalidated:
        return attempts.Observed(BuildStatus.FAILED, None, report.unvalidated,
                                 permanent=report.permanent)
    verdict = {BuildStatus.SUCCEEDED: Verdict.GREEN,
               BuildStatus.FAILED: Verdict.RED}.get(report.status)
    return attempts.Observed(report.status, verdict, report.metadata.get("detail", "")
                             if verdict is Verdict.RED else "")


async def _wait_for_runner(ctx: StageContext, build: Build, config: QueueConfig, mine: str,
                           error: BaseException) -> Outcome:
    """Poll again later, backing off from the loop's own delay; the loop stays the row's
    and says when it is back, so the sweeper starts no other meanwhile."""
    floor = seconds(config.poll_delay_running if build.status is BuildStatus.RUNNING
                    else config.poll_delay_queued)
    wait = dependency_wait(ctx, error, floor=floor)
    build = await ctx.deps.db.builds.claim_loop(build, mine,
                                                quiet=wait.delay - _longest_delay(config))
    return Wait(wait.delay, error, _next_turn(build))


async def _end_attempt(ctx: StageContext, request: Request, build: Build,
                       observed: attempts.Observed, config: QueueConfig) -> Outcome:
    """Store the build's end and end its attempt as `attempts.decide` says, in one
    statement; then hand a settled Request to record, or trigger the next attempt."""
    end = attempts.decide(request, observed, config.retry)
    ended = await ctx.deps.db.steps.end_attempt(
        request, end, build=build, build_status=observed.status,
        build_verdict=observed.verdict, build_reason=observed.reason,
        status_channels=config.status_channels)
    if ended.request is None:
        # another delivery, a reconciler, or a different status stored first: decide
        # again from a fresh read
        raise VersionMismatch("request", {"queue": request.queue, "id": request.id},
                              expected_version=request.version, actual_version=None)
    outcome = (observed.verdict.value if observed.verdict is not None
               else "cancelled" if observed.status is BuildStatus.CANCELLED
               else "unvalidated")
    metrics.ATTEMPTS_ENDED.labels(queue=request.queue, outcome=outcome).inc()
    settled = ended.request
    if ended.settled:
        how = (settled.verdict.value if settled.verdict is not None
               else "cancelled" if settled.state is RequestState.CANCELLED
               else "unvalidated")
        metrics.REQUESTS_SETTLED.labels(queue=request.queue, outcome=how).inc()
        if settled.verdict is Verdict.GREEN and settled.red_reruns:
            metrics.FLAKY.labels(queue=request.queue).inc()
        ctx.log.info("settled build_id=%s attempt=%d outcome=%s verdict=%s reason=%s",
                     build.id, settled.attempt, settled.state, how, settled.reason or "-")
        await _publish_to_record(ctx, settled)
        return ACK
    ctx.log.warning("attempt_again build_id=%s ended=%s next_attempt=%d in=%.0fs reason=%s",
                    build.id, outcome, settled.attempt, end.backoff, observed.reason or "-")
    await _publish_next_attempt(ctx, settled)
    return ACK


async def _publish_next_attempt(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.BUILD, BuildRequest(
        id=request.id, queue_name=request.queue, nonce=request.nonce,
        attempt=request.attempt, project=project_of(request.queue)))


def _longest_delay(config: QueueConfig) -> float:
    """The longest delay the sweeper expects of the queue's loops (`sweeper.unseen_after`)."""
    return max(seconds(config.gate_delay), seconds(config.poll_delay_queued),
               seconds(config.poll_delay_running))


def _next_turn(build: Build) -> BuildSignal:
    return BuildSignal(id=build.id, queue_name=build.queue, loop=build.loop_token)


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


async def _cancel_or_wait(ctx: StageContext, build: Build, why: str) -> Outcome:
    """`cancel_build`, waiting out a runner that is unavailable."""
    try:
        await cancel_build(ctx, build, why)
    except Exception as exc:
        if not is_dependency_unavailable(exc):
            raise
        config = ctx.deps.queue_config(build.queue)
        return dependency_wait(ctx, exc, floor=seconds(config.poll_delay_running),
                               payload=_next_turn(build))
    return ACK


async def _cancel_quietly(ctx: StageContext, build: Build) -> None:
    """Ask the runner to stop a build whose attempt is ending; a runner that is down
    now is not a reason to keep the attempt open (the build's row ends either way, and a
    later report from it is ignored: write-once)."""
    try:
        await ctx.deps.extensions.build_runner(build.queue).cancel(build.id)
    except Exception as exc:
        if not is_dependency_unavailable(exc):
            raise
        ctx.log.warning("cancel_failed build_id=%s error=%s", build.id, exc)


async def _store_status(ctx: StageContext, build: Build, status: BuildStatus) -> Build:
    if status is build.status:
        return build
    try:
        return await ctx.deps.db.builds.set_status(build, status)
    except InvariantViolation:
        # another delivery stored a terminal status first: it stays (write-once)
        return await ctx.deps.db.builds.get(build.queue, build.id)


async def _publish_to_record(ctx: StageContext, request: Request) -> None:
    await ctx.publish(TopicKey.RECORD, Record(id=request.id, queue_name=request.queue,
                                              nonce=request.nonce))
