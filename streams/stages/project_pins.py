"""A project's promotion ref: where it belongs, and pins per project (design §11; issue
24, Deliver 4) — `stovepipe pin QUEUE COMMIT --project P`, `stovepipe unpin QUEUE
--project P` and the API's pin and unpin with a ``project``.

A project with a ``promotion_ref`` has its ref where its state says it belongs: its pin,
else its last-green bookmark (its newest green answer, built or inherited). Every move —
record's, after a project's answer is written, a pin's, an unpin's, the sweeper's — is
`settle_project_promotion`: the ref read *before* the state, then moved by compare-and-set
on the ref, so whoever moves it last moved it from what the state said after every earlier
change, and the ref never goes back past the bookmark.

A pin holds, or says it did not, exactly as a queue's (`streams.stages.pins`): a commit
not green for the project (never answered, red) or no longer on the branch is refused
before anything is written; the pin is written, then the ref moved within
`MOVE_DEADLINE`; a ref that could not be moved rolls the pin back, and the reason is the
project's promotion problem (kept under its scope's name), which the sweeper settles.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from store.projects import ProjectState
from streams.config.names import UnknownQueue, validate_queue_name
from streams.config.projects import scope_name
from streams.extensions.sourcecontrol import CommitNotFound, PromotionMoved
from streams.stages.commits import resolve_commit
from streams.stages.deps import Deps
from streams.stages.kit import CAS_ATTEMPTS
from streams.stages.pins import MOVE_DEADLINE, PinNotApplied, PinRefused, check_words

log = logging.getLogger("stovepipe.pins")


@dataclass(frozen=True)
class ProjectPinned:
    queue: str
    project: str
    pinned_uri: str
    pinned_request_id: str  # the Request of the queue whose green answer it is
    inherited_from: str | None  # the commit it inherits green from (None: built there)
    previous_target: str | None  # where the project's promotion ref was before
    last_green_uri: str | None  # the project's bookmark


@dataclass(frozen=True)
class ProjectUnpinned:
    queue: str
    project: str
    was_pinned: str | None
    target: str | None  # where the ref is now: the bookmark (None: not moved yet)
    last_green_uri: str | None


def project_promotion_ref(deps: Deps, queue: str, project: str) -> str:
    """The project's promotion ref; PinRefused when it has none (or is not declared)."""
    spec = deps.queue_config(queue).projects.get(project)
    if spec is None:
        raise PinRefused(f"queue {queue!r} has no project {project!r}")
    if not spec.promotion_ref:
        raise PinRefused(f"project {project!r} of {queue!r} has no promotion ref to pin "
                         f"(set projects.{project}.promotion_ref in the queue "
                         f"configuration)")
    return str(spec.promotion_ref)


async def settle_project_promotion(deps: Deps, queue: str,
                                   project: str) -> tuple[str | None, str | None]:
    """Move the project's promotion ref where its state says it belongs — its pin, else
    its bookmark — by compare-and-set on the ref, read before the state. (where the ref
    was, where it is now)."""
    source_control = deps.extensions.source_control(scope_name(queue, project))
    for _ in range(CAS_ATTEMPTS):
        target = await source_control.promotion_target()
        state = await deps.db.projects.state(queue, project)
        wanted = state.pinned_uri or state.last_green_uri
        if wanted is None or target == wanted:
            return target, target
        try:
            await source_control.promote(wanted, expected=target)
            return target, wanted
        except PromotionMoved:
            continue
    raise PromotionMoved(f"the promotion ref of project {project} of {queue} kept moving; "
                         f"try again")


async def pin_project(deps: Deps, queue: str, project: str, commit: str, *, by: str,
                      reason: str) -> ProjectPinned:
    """Hold ``project``'s promotion ref at ``commit`` (a sha, a unique prefix or a URI),
    a commit green for the project (built there, or unaffected and inheriting green).
    Raises as `streams.stages.pins.pin_promotion`."""
    validate_queue_name(queue)
    by, reason = check_words(by, reason)
    ref = project_promotion_ref(deps, queue, project)
    uri = await resolve_commit(deps, queue, commit)
    answer = await deps.db.project_answers.of_commit(queue, project, uri)
    if answer is None:
        raise PinRefused(f"{uri} was never validated for project {project!r} of {queue!r}: "
                         f"only a commit green for it can hold {ref!r}")
    if not answer.is_green:
        raise PinRefused(f"{uri} is red for project {project!r} of {queue!r} (answer of "
                         f"{answer.request_id}): only a commit green for it can hold "
                         f"{ref!r}")
    source_control = deps.extensions.source_control(scope_name(queue, project))
    branch_head = await source_control.head()
    if not await source_control.is_ancestor(uri, branch_head):
        raise PinRefused(f"{uri} is no longer on the branch of {queue!r} (its head is "
                         f"{branch_head}): {ref!r} can only be held at a commit of it")
    before = await deps.db.projects.state(queue, project)
    if not await deps.db.project_pins.pin(queue, project, uri, answer.request_id, by=by,
                                          reason=reason):
        raise PinRefused(f"{uri} has no green answer for project {project!r} of {queue!r} "
                         f"any more")
    scope = scope_name(queue, project)
    try:
        async with asyncio.timeout(MOVE_DEADLINE):
            previous, _ = await settle_project_promotion(deps, queue, project)
    except Exception as exc:
        why = (f"{ref!r} could not be moved to {uri} within {MOVE_DEADLINE:g}s"
               if isinstance(exc, TimeoutError) else
               f"{ref!r} could not be moved to {uri}: {exc}")
        # the rollback must happen even when the caller's own deadline cancels us now
        await asyncio.shield(_roll_back(deps, queue, project, uri, before, why))
        raise PinNotApplied(f"the pin did not take, and was rolled back: {why}",
                            retryable=isinstance(exc, TimeoutError)
                            or bool(getattr(exc, "retryable", False))) from exc
    await deps.db.pins.clear_problem(scope)
    return ProjectPinned(queue, project, uri, answer.request_id,
                         answer.source_uri if answer.inherited else None, previous,
                         before.last_green_uri)


async def _roll_back(deps: Deps, queue: str, project: str, uri: str, before: ProjectState,
                     why: str) -> None:
    restored = await deps.db.project_pins.roll_back(queue, project, uri, before, reason=why)
    await deps.db.pins.set_problem(scope_name(queue, project), why)
    log.warning("pin_rolled_back queue=%s project=%s uri=%s restored=%s why=%s", queue,
                project, uri, restored, why)


async def unpin_project(deps: Deps, queue: str, project: str, *,
                        by: str) -> ProjectUnpinned:
    """Let the project's promotion ref follow its bookmark again, and move it there now."""
    validate_queue_name(queue)
    by, _ = check_words(by, "unpin")
    project_promotion_ref(deps, queue, project)
    was = await deps.db.project_pins.unpin(queue, project, by=by)
    scope = scope_name(queue, project)
    target: str | None
    try:
        async with asyncio.timeout(MOVE_DEADLINE):
            _, target = await settle_project_promotion(deps, queue, project)
        await deps.db.pins.clear_problem(scope)
    except CommitNotFound:
        target = None  # the bookmarked commit left the branch: the next green moves it
    except Exception as exc:  # noqa: BLE001 - unpinned all the same; said, settled later
        target = None
        await deps.db.pins.set_problem(
            scope, f"the promotion ref could not be moved to the bookmark: "
                   f"{'the deadline' if isinstance(exc, TimeoutError) else exc}")
    state = await deps.db.projects.state(queue, project)
    return ProjectUnpinned(queue, project, was, target, state.last_green_uri)


async def settle_pinned_projects(deps: Deps) -> list[str]:
    """The sweeper's part for projects: move the ref of every pinned project, and of every
    project whose ref has a problem, where its state says it belongs (compare-and-set).
    Returns the scopes whose ref moved. A repository that does not answer keeps its
    problem."""
    moved = []
    for queue, project in await deps.db.project_pins.to_settle():
        scope = scope_name(queue, project)
        try:
            project_promotion_ref(deps, queue, project)
        except (PinRefused, UnknownQueue):
            continue  # no longer configured: nothing to settle
        try:
            async with asyncio.timeout(MOVE_DEADLINE):
                before, after = await settle_project_promotion(deps, queue, project)
        except Exception as exc:  # noqa: BLE001 - said, and tried again next sweep
            await deps.db.pins.set_problem(
                scope, f"the promotion ref could not be settled: "
                       f"{'the deadline' if isinstance(exc, TimeoutError) else exc}")
            continue
        await deps.db.pins.clear_problem(scope)
        if before != after:
            moved.append(scope)
            log.warning("promotion_settled queue=%s project=%s from=%s to=%s", queue,
                        project, before, after)
    return moved
