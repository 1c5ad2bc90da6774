"""What retention keeps (issue 25, item 6; design §12): pure functions over what the store
read, so every case is cheap to enumerate (`tests/test_retention_rules.py`), like the
culprit search's bisection. `streams.stages.retention` does the I/O around them.

A Request older than the cutoff goes, with its fact, project answers, plan, builds,
command builds and ingest mapping, unless a gate or a person may still need it (`Keep`,
the first rule that holds wins):

- it is not terminal, or its verdict is settled but not recorded yet (record still has
  to write its fact: the sweeper's `list_unrecorded`);
- it was created or last changed after the cutoff;
- a row that stays names it: a queue's or a scope's bookmark, latest head or pin, a
  project's pin; the newest `keep_newest` facts of each queue and each scope; a culprit
  search that stays (open, the queue's newest, or ended after the cutoff) as its red,
  green, culprit or probe; a Request whose project plan is not decided; a project's
  bookmark (its newest green answer); where each queue's current greenness began (the
  newest greenness change: "red since"); a project answer that stays (of a Request that
  stays) as its source — the queue's Requests are walked before its projects', so the
  answers of those that went no longer count;
- it validates again a commit whose earlier validation is kept (a commit's answer is
  its newest Request's fact: it never turns into an older one's);
- it is a project's Request (`<queue>#<project>`) of a Request of the queue kept for one
  of the reasons above.

So after a round no row that stays names a Request that went, except as text (the
greenness history's and notifications' request ids are never read back as Requests).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from store import (
    Request,
    RequestKind,
    commit_request_id,
    request_order,
    split_scope,
)
from store.retention import Holdings, SearchRefs
from streams.config.retention import MIN_OLDER_THAN


class Keep(StrEnum):
    """Why a Request older than the cutoff is kept."""

    LIVE = "not terminal"
    UNRECORDED = "verdict not recorded yet"
    RECENT = "inside retention"
    BOOKMARK = "a bookmark"
    LATEST = "a queue's latest head"
    PIN = "a pin"
    NEWEST = "among the newest facts"
    SEARCH = "named by a culprit search"
    PLAN = "a project plan not decided"
    PROJECT_BOOKMARK = "a project's bookmark"
    STREAK = "where the greenness began"
    ANSWER_SOURCE = "source of a kept project answer"
    NEWER_VALIDATION = "a kept commit's newer validation"
    PROJECT_REQUEST = "a kept Request's project build"


@dataclass(frozen=True)
class Policy:
    older_than: timedelta
    keep_newest: int

    def __post_init__(self) -> None:
        if self.older_than < MIN_OLDER_THAN:
            raise ValueError(f"retention must be at least {MIN_OLDER_THAN.days} day")
        if self.keep_newest < 1:
            raise ValueError("keep_newest must be at least 1")


def search_stays(search: SearchRefs, cutoff: datetime) -> bool:
    """A culprit search stays while it bisects, while it is its queue's newest (the
    current red streak's, or the one `culprits` compares a new red verdict with), and
    until it has been over for the retention. (The others are deleted before the
    Requests are chosen.)"""
    return (search.state == "bisecting" or search.newest or search.ended_at is None
            or search.ended_at >= cutoff)


@dataclass(frozen=True)
class Protected:
    """The Requests a family's rows name, each with the first reason, and for each commit
    (its first validation's id) the order of its oldest named validation."""

    named: Mapping[str, Keep]
    commits: Mapping[str, tuple[int, int, int]]


def protected(holdings: Holdings, cutoff: datetime) -> Protected:
    """What the family's rows name."""
    named: dict[str, Keep] = {}

    def name(ids: Iterable[str | None], why: Keep) -> None:
        for request_id in ids:
            if request_id:
                named.setdefault(request_id, why)

    for queue in holdings.queues:
        name([queue.last_green_request_id], Keep.BOOKMARK)
        name([queue.latest_request_id], Keep.LATEST)
        name([queue.pinned_request_id], Keep.PIN)
    name(holdings.project_pins, Keep.PIN)
    name(holdings.newest_facts, Keep.NEWEST)
    for search in (s for s in holdings.searches if search_stays(s, cutoff)):
        name([search.red_request_id, search.green_request_id, search.culprit_request_id,
              *search.probes], Keep.SEARCH)
    name(holdings.open_plans, Keep.PLAN)
    name(holdings.project_bookmarks, Keep.PROJECT_BOOKMARK)
    name(holdings.streaks, Keep.STREAK)
    commits: dict[str, tuple[int, int, int]] = {}
    for request_id in named:
        commit, order = _commit(request_id)
        if commit is not None and (commit not in commits or order < commits[commit]):
            commits[commit] = order
    return Protected(named, commits)


def why_kept(request: Request, cutoff: datetime, held: Protected,
             answered: Collection[str] = ()) -> Keep | None:
    """Why ``request`` stays (None: it goes). ``answered``: the project's Requests that
    a project answer of a Request that stays names as its source."""
    if not request.state.is_terminal:
        return Keep.LIVE
    if request.verdict is not None and not request.recorded:
        return Keep.UNRECORDED
    if request.created_at >= cutoff or request.updated_at >= cutoff:
        return Keep.RECENT
    if request.id in held.named:
        return held.named[request.id]
    if request.id in answered:
        return Keep.ANSWER_SOURCE
    commit, order = _commit(request.id)
    if commit is not None and commit in held.commits and order > held.commits[commit]:
        return Keep.NEWER_VALIDATION
    parent = _parent(request)
    if parent is not None and parent in held.named:
        return Keep.PROJECT_REQUEST
    return None


def walk_ends(request: Request, cutoff: datetime) -> bool:
    """Whether a walk of a queue's Requests in request_rank order may stop at ``request``:
    a head ingested after the cutoff. Heads are numbered in ingest order, and a Request
    that sorts after one (a later head, a commit validated again, a backfilled commit) was
    created after it, so nothing further is older than the cutoff."""
    return request.kind is RequestKind.HEAD and request.created_at >= cutoff


def greenness_delete_before(newest_before: datetime | None,
                            newest_green: datetime | None) -> datetime | None:
    """Greenness changes of a queue strictly before the returned time go (None: none).
    ``newest_before``: the queue's newest change before the history's cutoff — kept, as
    the greenness at the start of every window after it; ``newest_green``: its newest
    green change — kept with every change after it, the current red streak."""
    if newest_before is None:
        return None
    return min(newest_before, newest_green) if newest_green is not None else newest_before


def greenness_cutoff(cutoff: datetime, now: datetime, window: timedelta) -> datetime:
    """The greenness history keeps at least ``window`` (the share of time red's)."""
    return min(cutoff, now - window)


def _commit(request_id: str) -> tuple[str | None, tuple[int, int, int]]:
    try:
        return commit_request_id(request_id), request_order(request_id)
    except ValueError:
        return None, (0, 0, 0)


def _parent(request: Request) -> str | None:
    """The id of the queue's Request a project's Request was planned for."""
    queue, project = split_scope(request.queue)
    own = f"request/{request.queue}/"
    if project is None or not request.id.startswith(own):
        return None
    return f"request/{queue}/{request.id.removeprefix(own)}"

