"""Pin the promotion ref during an incident (design §2, "Promotion ref"): `stovepipe pin`,
`stovepipe unpin` and `POST /api/queues/{queue}/pin|unpin` share these.

A pin holds the queue's promotion ref at a green commit of the queue's history while the
bookmark keeps moving underneath; who pinned, when and why is kept with it. The pin is
written first and the ref moved after, by compare-and-set on the ref, so a promotion
racing with it either lands first (and the pin moves the ref over it) or sees the pin
and stops (`streams.stages.record._promote`). Unpin clears the pin, then moves the ref to
the bookmark the same way. A red commit, a commit never validated, or a queue without a
promotion ref is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from store import NotFound, Queue
from streams.config.names import validate_queue_name
from streams.extensions.sourcecontrol import CommitNotFound, PromotionMoved
from streams.stages.commits import resolve_commit
from streams.stages.deps import Deps
from streams.stages.kit import CAS_ATTEMPTS


class PinRefused(Exception):
    """The commit cannot be pinned (not green on the queue), or the queue cannot pin."""


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


def _check_words(by: str, reason: str) -> tuple[str, str]:
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
    AmbiguousCommit, PinRefused (not green here, or no promotion ref), and the source
    control's errors while moving the ref (the pin stays; pinning again finishes it)."""
    validate_queue_name(queue)
    by, reason = _check_words(by, reason)
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
    pinned = await deps.db.pins.pin(queue, uri, fact.request_id, by=by, reason=reason)
    previous, _ = await settle_promotion(deps, queue)
    return Pinned(pinned, previous)


async def unpin_promotion(deps: Deps, queue: str, *, by: str) -> Unpinned:
    """Let ``queue``'s promotion ref follow the bookmark again, and move it there now."""
    validate_queue_name(queue)
    by, _ = _check_words(by, "unpin")
    _promotion_ref(deps, queue)
    try:
        unpinned, was = await deps.db.pins.unpin(queue, by=by)
    except NotFound:
        raise PinRefused(f"queue {queue!r} has nothing to unpin (nothing was ingested for "
                         f"it yet)") from None
    try:
        _, target = await settle_promotion(deps, queue)
    except CommitNotFound:
        target = None  # the bookmarked commit left the branch: the next green moves it
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
