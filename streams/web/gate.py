"""Deploy-gate answers by commit (design §9): is this commit green on the queue, and when
it is not, which green commits are nearest it — the newest green ancestor (what was green
before it: "deploy this instead") and the oldest green descendant (the first later commit
that is green: "wait for, or deploy, this").

A gate has a sha, not our URI, so a commit may be named by its full sha, a unique prefix
of one, or the URI itself. The CLI (`stovepipe fact`) and the HTTP API
(`/api/facts`, `/api/queues/{queue}/green`) share these reads.

The search walks the queue's green facts by their Requests' order (ingest order, and
a backfilled commit's place in the history) on an index (never the whole
table) and asks the repository about ancestry one candidate at a time, at most
`SEARCH_LIMIT` candidates in each direction; `complete` says whether it was exhaustive.
`nearest_greens` is that search over any list of green answers: a project's
(`streams.web.project_answers`) walks its green answers the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from store import NotFound, Order, ValidationFact, commit_request_id, request_order
from streams.extensions.sourcecontrol import CommitNotFound, SourceControl
from streams.stages.commits import names_a_uri, resolve_commit
from streams.web.queries import fact_or_none

__all__ = ["SEARCH_LIMIT", "GreenAnswer", "Nearest", "commit_rank", "green_answer",
           "names_a_uri", "nearest_greens", "resolve_commit"]

if TYPE_CHECKING:  # the reads need no stage machinery, only its type
    from streams.stages.deps import Deps

SEARCH_LIMIT = 100  # green facts examined in each direction


@dataclass(frozen=True)
class GreenAnswer:
    queue: str
    uri: str
    committed_at: datetime | None  # None when the fact answered alone (green)
    fact: ValidationFact | None  # None: never validated, which is never green
    prior_green: ValidationFact | None  # the newest green ancestor (when not green)
    next_green: ValidationFact | None  # the oldest green descendant (when not green)
    searched: int  # green facts whose ancestry was examined
    complete: bool  # False when SEARCH_LIMIT cut a search short

    @property
    def green(self) -> bool:
        return self.fact is not None and self.fact.is_green


async def green_answer(deps: Deps, queue: str, uri: str) -> GreenAnswer:
    """Whether the commit ``uri`` is green on ``queue`` and, if not, its nearest green
    commits. Raises UnknownQueue, and CommitNotFound when the commit is not green and the
    repository does not have it."""
    fact = await fact_or_none(deps.db, queue, uri)
    if fact is not None and fact.is_green:  # the fact alone answers: no repository needed
        return GreenAnswer(queue, uri, None, fact, None, None, 0, True)
    source_control = deps.extensions.source_control(queue)
    committed_at = await source_control.commit_time(uri)  # CommitNotFound: no such commit
    nearest = await nearest_greens(
        source_control, uri,
        await commit_rank(deps, queue, uri, fact.request_id if fact is not None else None),
        lambda rank: deps.db.facts.green_older_than(queue, rank, SEARCH_LIMIT),
        lambda rank: deps.db.facts.green_newer_than(queue, rank, SEARCH_LIMIT))
    return GreenAnswer(queue, uri, committed_at, fact, nearest.prior, nearest.following,
                       nearest.searched, nearest.complete)


class Green(Protocol):
    """A green answer the search can walk: its commit and the Request that gave it."""

    @property
    def uri(self) -> str: ...

    @property
    def request_id(self) -> str: ...


G = TypeVar("G", bound=Green)


@dataclass(frozen=True)
class Nearest(Generic[G]):
    prior: G | None  # the newest green ancestor
    following: G | None  # the oldest green descendant
    searched: int  # green answers whose ancestry was examined
    complete: bool  # False when SEARCH_LIMIT cut a search short


async def nearest_greens(
        source_control: SourceControl, uri: str, own_rank: Order | None,
        older_than: Callable[[Order | None], Awaitable[Sequence[G]]],
        newer_than: Callable[[Order], Awaitable[Sequence[G]]]) -> Nearest[G]:
    """The newest green ancestor and the oldest green descendant of ``uri`` among the
    green answers ``older_than`` (newest first, below a rank; None: all) and
    ``newer_than`` (oldest first, above a rank) list, at most `SEARCH_LIMIT` each way.
    ``own_rank`` is where the commit sorts (None: never validated)."""
    older = await older_than(own_rank)
    prior, looked_back, back_done = await _first_match(
        older, lambda green: source_control.is_ancestor(green.uri, uri))
    # a green descendant was ingested after the commit itself, or at least after its
    # green ancestor
    floor = own_rank if own_rank is not None else (
        request_order(prior.request_id) if prior is not None else (0, 0, 0))
    newer = await newer_than(floor)
    following, looked_ahead, ahead_done = await _first_match(
        newer, lambda green: source_control.is_ancestor(uri, green.uri))
    return Nearest(prior, following, looked_back + looked_ahead,
                   (back_done or len(older) < SEARCH_LIMIT)
                   and (ahead_done or len(newer) < SEARCH_LIMIT))


async def commit_rank(deps: Deps, queue: str, uri: str,
                      answered_by: str | None) -> Order | None:
    """Where the commit ``uri`` sorts among the queue's Requests (its first validation's
    order; None: the queue never validated it). ``answered_by``: the Request whose fact
    answers for the commit, when there is one (its place is the commit's)."""
    if answered_by is not None:
        return request_order(commit_request_id(answered_by))
    try:
        request_id = (await deps.db.request_uris.get(queue, uri)).request_id
    except NotFound:
        return None
    return request_order(commit_request_id(request_id))


async def _first_match(
        candidates: Sequence[G], related: Callable[[G], Awaitable[bool]],
) -> tuple[G | None, int, bool]:
    """The first candidate ``related`` accepts, how many were examined, and whether the
    search ended by finding one. A candidate whose commit left the repository (a rewrite
    and a garbage collection) is passed over."""
    for examined, candidate in enumerate(candidates, start=1):
        try:
            if await related(candidate):
                return candidate, examined, True
        except CommitNotFound:
            continue
    return None, len(candidates), False
