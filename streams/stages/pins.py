"""Pin the promotion ref during an incident (design §2, "Promotion ref"): `stovepipe pin`,
`stovepipe unpin` and `POST /api/queues/{queue}/pin|unpin` share these.

A pin holds the queue's promotion ref at a green commit of the queue's history while the
bookmark keeps moving underneath; who pinned, when and why is kept with it. A pin holds,
or says it did not:

1. a commit that is red, never validated, or no longer on the branch is refused before
   anything is written;
2. the pin is written (so a promotion racing with it sees it and stops:
   `streams.stages.record._promote`), then the ref is moved to it by compare-and-set on
   the ref, within `MOVE_DEADLINE`;
3. if the ref could not be moved (a git error, the repository refusing, the deadline),
   the pin is rolled back — the queue is pinned as it was before — with the reason, kept
   as the queue's promotion problem and shown beside the ref's actual target; the caller
   is told (`PinNotApplied`).

The sweeper settles every pinned queue, and every queue with a promotion problem, by the
same compare-and-set (`settle_promotion`): a ref left elsewhere (a move that timed out
after all, a person moving the branch by hand) goes back to the pin — never to a commit
that is not the pin or, unpinned, the bookmark. Unpin clears the pin, then moves the ref
to the bookmark the same way. A queue without a promotion ref is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from store import NotFound, Queue, project_of
from streams.config.names import UnknownQueue, validate_queue_name
from streams.extensions.sourcecontrol import CommitNotFound, PromotionMoved
from streams.stages.commits import resolve_commit
from streams.stages.deps import Deps
from streams.stages.kit import CAS_ATTEMPTS

log = logging.getLogger("stovepipe.pins")

MOVE_DEADLINE = 10.0  # seconds a pin's move of the ref may take (within the API's 15 s)


class PinRefused(Exception):
    """The commit cannot be pinned (not green on the queue, not on its branch), or the
    queue cannot pin."""


class PinNotApplied(Exception):
    """The promotion ref could not be moved to the pin: the pin was rolled back."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable  # the repository was unavailable: try again later


@dataclass(frozen=True)
class Pinned:
    queue: Queue  # its pinned_* fields say which commit, who, when and why
    previous_target: str | None  # where the promotion ref was before


@dataclass(frozen=True)
class Unpinned:
    queue: Queue
    was_pinned: str | None  # the commit that was pinned (None: nothing was)
    target: str | None  # where the promotion ref is now: the bookmark (None: no bookmark)


def _promotion_ref(deps: Deps, queue: str) -> str:
    ref = getattr(deps.queue_config(queue).source_control, "promotion_ref", None)
    if not ref:
        raise PinRefused(f"queue {queue!r} has no promotion ref to pin (set "
                         f"source_control.promotion_ref in the queue configuration)")
    return str(ref)


def check_words(by: str, reason: str) -> tuple[str, str]:
    by, reason = by.strip(), reason.strip()
    if not by:
        raise ValueError("say who pins or unpins (by)")
    if not reason:
        raise ValueError("say why the promotion ref is pinned (reason)")
    if len(by) > 200 or len(reason) > 2000:
        raise ValueError("by is at most 200 characters and reason at most 2000")
    return by, reason


async def pin_promotion(deps: Deps, queue: str, commit: str, *, by: str,
                        reason: str) -> Pinned:
    """Hold ``queue``'s promotion ref at ``commit`` (a sha, a unique prefix or a URI).
    Raises InvalidQueueName, UnknownQueue, ValueError (malformed input), CommitNotFound /
    AmbiguousCommit, PinRefused (not green here, not on the branch, no promotion ref),
    PinNotApplied (the ref could not be moved: nothing changed, and why is kept), and the
    source control's errors while checking the commit (nothing written)."""
    validate_queue_name(queue)
    by, reason = check_words(by, reason)
    ref = _promotion_ref(deps, queue)
    uri = await resolve_commit(deps, queue, commit)
    try:
        fact = await deps.db.facts.get(queue, uri)
    except NotFound:
        raise PinRefused(f"{uri} was never validated on {queue!r}: only a green commit can "
                         f"hold {ref!r}") from None
    if not fact.is_green:
        raise PinRefused(f"{uri} is red on {queue!r} (fact of {fact.request_id}): only a "
                         f"green commit can hold {ref!r}")
    source_control = deps.extensions.source_control(queue)
    branch_head = await source_control.head()
    if not await source_control.is_ancestor(uri, branch_head):
        raise PinRefused(f"{uri} is no longer on the branch of {queue!r} (its head is "
                         f"{branch_head}): {ref!r} can only be held at a commit of it")
    try:
        before = await deps.db.queues.get(queue)
    except NotFound:
        raise PinRefused(f"queue {queue!r} has no state yet (nothing was ingested for "
                         f"it)") from None
    pinned = await deps.db.pins.pin(queue, uri, fact.request_id, by=by, reason=reason)
    try:
        async with asyncio.timeout(MOVE_DEADLINE):
            previous, _ = await settle_promotion(deps, queue)
    except Exception as exc:
        why = (f"{ref!r} could not be moved to {uri} within {MOVE_DEADLINE:g}s"
               if isinstance(exc, TimeoutError) else
               f"{ref!r} could not be moved to {uri}: {exc}")
        # the rollback must happen even when the caller's own deadline cancels us now
        await asyncio.shield(_roll_back(deps, queue, uri, before, why))
        raise PinNotApplied(f"the pin did not take, and was rolled back: {why}",
                            retryable=isinstance(exc, TimeoutError)
                            or bool(getattr(exc, "retryable", False))) from exc
    await deps.db.pins.clear_problem(queue)
    return Pinned(pinned, previous)


async def _roll_back(deps: Deps, queue: str, uri: str, before: Queue, why: str) -> None:
    restored = await deps.db.pins.roll_back(queue, uri, before, reason=why)
    await deps.db.pins.set_problem(queue, why)
    log.warning("pin_rolled_back queue=%s uri=%s restored=%s why=%s", queue, uri,
                restored is not None, why)


async def unpin_promotion(deps: Deps, queue: str, *, by: str) -> Unpinned:
    """Let ``queue``'s promotion ref follow the bookmark again, and move it there now."""
    validate_queue_name(queue)
    by, _ = check_words(by, "unpin")
    _promotion_ref(deps, queue)
    try:
        unpinned, was = await deps.db.pins.unpin(queue, by=by)
    except NotFound:
        raise PinRefused(f"queue {queue!r} has nothing to unpin (nothing was ingested for "
                         f"it yet)") from None
    try:
        async with asyncio.timeout(MOVE_DEADLINE):
            _, target = await settle_promotion(deps, queue)
        await deps.db.pins.clear_problem(queue)
    except CommitNotFound:
        target = None  # the bookmarked commit left the branch: the next green moves it
    except Exception as exc:  # noqa: BLE001 - unpinned all the same; said, settled later
        # unpinned all the same: the ref follows the bookmark again, and the sweeper
        # moves it there once the repository lets it
        target = None
        await deps.db.pins.set_problem(
            queue, f"the promotion ref could not be moved to the bookmark: "
                   f"{'the deadline' if isinstance(exc, TimeoutError) else exc}")
    return Unpinned(unpinned, was, target)


async def settle_promotion(deps: Deps, queue: str) -> tuple[str | None, str | None]:
    """Move the promotion ref to where the queue says it belongs — the pinned commit,
    else the bookmark — by compare-and-set on the ref, reading the ref *before* the
    queue (as record does): whoever moves it last moved it from what the queue said
    after every earlier change, so pins, unpins and promotions racing end where the
    queue's row does. (where the ref was, where it is now)."""
    source_control = deps.extensions.source_control(queue)
    for _ in range(CAS_ATTEMPTS):
        target = await source_control.promotion_target()
        row = await deps.db.queues.get(queue)
        wanted = row.pinned_uri or row.last_green_uri
        if wanted is None or target == wanted:
            return target, target
        try:
            await source_control.promote(wanted, expected=target)
            return target, wanted
        except PromotionMoved:
            continue
    raise PromotionMoved(f"the promotion ref of {queue} kept moving; try again")


async def settle_pinned(deps: Deps) -> list[str]:
    """The sweeper's part: move the ref of every pinned queue, and of every queue with a
    promotion problem, to where the queue says it belongs (compare-and-set). Returns the
    queues whose ref moved. A repository that does not answer keeps its problem."""
    moved = []
    for queue in await deps.db.pins.to_settle():
        if project_of(queue):
            continue  # a project's ref: `streams.stages.project_pins.settle_pinned_projects`
        if not getattr(_config(deps, queue), "promotion_ref", None):
            continue
        try:
            async with asyncio.timeout(MOVE_DEADLINE):
                before, after = await settle_promotion(deps, queue)
        except Exception as exc:  # noqa: BLE001 - said, and tried again next sweep
            await deps.db.pins.set_problem(
                queue, f"the promotion ref could not be settled: "
                       f"{'the deadline' if isinstance(exc, TimeoutError) else exc}")
            continue
        await deps.db.pins.clear_problem(queue)
        if before != after:
            moved.append(queue)
            log.warning("promotion_settled queue=%s from=%s to=%s", queue, before, after)
    return moved


def _config(deps: Deps, queue: str) -> object:
    with contextlib.suppress(UnknownQueue):  # no longer configured: nothing to settle
        return deps.queue_config(queue).source_control
    return None
