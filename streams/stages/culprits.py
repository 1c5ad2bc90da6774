"""Culprit finding: which commit broke the branch (design §5, "backfill").

When a red verdict follows the queue's last green commit and commits between them on the
branch's first-parent history were never built (superseded heads, several commits in one
push), the queue validates some of them to name the culprit: a red commit whose first
parent is green. One search per red streak:

1. **Open** (record, on the red verdict of a head or retry newer than the bookmark, when
   the streak has no search yet): list the first-parent commits from the bookmark to the
   red commit (SourceControl.commits_between). One commit: it is the culprit. More: bisect.
2. **Advance** (record, after each backfill Request of the search ends; record, when a
   green verdict moves the bookmark; the sweeper, for a search nothing moved for a while):
   from what is known of the range's commits, narrow ``lo`` (newest known green) and
   ``hi`` (oldest known red above it), and start the next probe — a Request of kind
   `backfill` at the middle of what is left — as `bisect_step` decides. Stops when the
   culprit is named, when the branch went green again (the break was fixed: no more builds
   spent on it), when ``backfill.max_builds`` builds were spent, or when every commit left
   could not be validated.

A backfill Request supersedes nothing and holds the backfill capacity only, admitted
while the queue has a free slot for its heads (`streams.stages.process`), so it never
delays a head. Its fact is an ordinary fact, sorted by its place in the history
(`store.make_request_id` with a position); the bookmark moves to a backfilled green
commit only when it descends from the bookmark (`streams.stages.record`).

Searches of one queue are advanced one at a time (a transaction holding the queue's
search lock): the probes started and the search's progress are written together, so a
probe is never started twice nor lost.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from contract import ProcessRequest, TopicKey
from store import (
    Request,
    RequestKind,
    RequestState,
    Stores,
    Verdict,
    commit_request_id,
    make_request_id,
    request_order,
)
from store.culprits import CommitRecord, CulpritSearch, SearchState
from streams.config.queues import BackfillSpec, UnknownQueue
from streams.extensions.sourcecontrol import CommitInfo, CommitNotFound, NotOnFirstParent
from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps

log = logging.getLogger("stovepipe.culprits")

STALLED_AFTER = 60.0  # seconds a bisecting search may go unchanged before the sweeper looks


# --- the bisection, as a pure function --------------------------------------------------


class Known(Enum):
    """What is known of one commit of a search's range."""

    GREEN = "green"
    RED = "red"
    RUNNING = "running"  # a Request of it is accepted or processing
    UNKNOWN = "unknown"  # never validated, passed over, or could not be validated


@dataclass(frozen=True)
class Step:
    """What `bisect_step` decided: the new bounds, the state, the commits (indexes) to
    start probes at now, and the culprit's index once found."""

    lo: int
    hi: int
    state: SearchState
    probes: tuple[int, ...] = ()
    culprit: int | None = None


def bisect_step(known: Sequence[Known], lo: int, hi: int, *, skipped: frozenset[int],
                builds: int, max_builds: int, max_concurrent: int, fixed: bool) -> Step:
    """One step of the search over ``known`` (index 0: the green end; ``hi`` starts at the
    red commit). The invariant: ``known[lo]`` is green (or lo is the green end) and
    ``known[hi]`` red, so a red commit whose first parent is green lies in lo+1..hi, and
    narrowing to the *newest* known green first finds the break the red commit is red
    for, even when an older break was fixed inside the range."""
    greens = [i for i in range(lo + 1, hi) if known[i] is Known.GREEN]
    if greens:
        lo = max(greens)
    reds = [i for i in range(lo + 1, hi) if known[i] is Known.RED]
    if reds:
        hi = min(reds)
    if hi == lo + 1:
        return Step(lo, hi, SearchState.FOUND, culprit=hi)
    if fixed:
        return Step(lo, hi, SearchState.FIXED)
    inside = range(lo + 1, hi)
    running = [i for i in inside if known[i] is Known.RUNNING]
    candidates = [i for i in inside if known[i] is Known.UNKNOWN and i not in skipped]
    if not candidates:
        state = SearchState.BISECTING if running else SearchState.INCONCLUSIVE
        return Step(lo, hi, state)
    room = min(max_concurrent - len(running), max_builds - builds)
    if room <= 0:
        spent = builds >= max_builds and not running
        return Step(lo, hi, SearchState.BUDGET_SPENT if spent else SearchState.BISECTING)
    chosen: list[int] = []
    for _ in range(room):
        pick = _split_point(lo, hi, sorted(running + chosen),
                            [c for c in candidates if c not in chosen])
        if pick is None:
            break
        chosen.append(pick)
    return Step(lo, hi, SearchState.BISECTING, tuple(chosen))


def _split_point(lo: int, hi: int, taken: list[int], candidates: list[int]) -> int | None:
    """The candidate nearest the middle of the widest stretch between ``lo``, the commits
    already being validated and ``hi`` (the next probe halves what is least known)."""
    edges = [lo, *taken, hi]
    gaps = sorted(itertools.pairwise(edges), key=lambda g: g[1] - g[0], reverse=True)
    for low, high in gaps:
        inside = [c for c in candidates if low < c < high]
        if inside:
            middle = (low + high) / 2
            return min(inside, key=lambda c: (abs(c - middle), c))
    return None


def fresh_probe_id(queue: str, commits: Sequence[str], requests: dict[str, Request],
                   index: int) -> str:
    """The id of a first validation of ``commits[index]``, a commit the queue never
    validated: `…/<n>~<p>`, placed after the nearest commit before it that has a Request
    (at worst the green end) — p first-parent commits after that commit's head — so it
    sorts by its place in the history."""
    for anchor in range(index - 1, -1, -1):
        known = requests.get(commits[anchor])
        if known is not None:
            n, position, _ = request_order(commit_request_id(known.id))
            return make_request_id(queue, n, 1, position + index - anchor)
    raise ValueError(f"the green end of the range ({commits[0]}) has no Request")


def what_is_known(request: Request | None) -> Known:
    if request is None:
        return Known.UNKNOWN
    if request.state in (RequestState.ACCEPTED, RequestState.PROCESSING):
        return Known.RUNNING
    if request.verdict is Verdict.GREEN:
        return Known.GREEN
    if request.verdict is Verdict.RED:
        return Known.RED
    return Known.UNKNOWN


# --- opening a search -------------------------------------------------------------------


def _search_lock(queue: str) -> str:
    # a lock of its own per queue (not the queue's ingest lock): searches of a queue are
    # opened and advanced one at a time
    return f"culprit-search\x1f{queue}"


async def open_search(deps: Deps, publish: Publisher, red: Request) -> CulpritSearch | None:
    """Open the search of ``red``'s red streak when it is the red verdict that follows
    the queue's last green commit and the streak has no search yet; then advance it.
    None when there is nothing to search (backfill off, a backfill's own verdict, an
    older verdict, a streak already searched)."""
    try:
        spec = deps.queue_config(red.queue).backfill
    except UnknownQueue:
        return None
    if not spec.enabled or red.kind is RequestKind.BACKFILL or red.verdict is not Verdict.RED:
        return None
    queue = await deps.db.queues.get(red.queue)
    if not await _starts_a_streak(deps.db, red, queue.last_green_request_id):
        return None
    commits: list[CommitInfo] = []
    state, detail = SearchState.BISECTING, ""
    if queue.last_green_uri is None:
        state, detail = SearchState.NO_RANGE, "the queue has no green commit to search from"
    else:
        try:
            commits = await deps.extensions.source_control(red.queue).commits_between(
                queue.last_green_uri, red.uri, limit=spec.max_commits)
        except (NotOnFirstParent, CommitNotFound) as exc:
            state, detail = SearchState.NO_RANGE, str(exc)
    if commits:
        await deps.db.commit_infos.remember(red.queue, [_record(red.queue, c) for c in commits])
    uris: list[str] = []
    if state is SearchState.BISECTING and queue.last_green_uri is not None:
        uris = [queue.last_green_uri, *(c.uri for c in commits)]
    culprit: str | None = None
    if state is SearchState.BISECTING and len(uris) == 2:
        # the red commit's first parent is the green one: it is the culprit, no build spent
        state, culprit, detail = SearchState.FOUND, red.uri, "the red commit follows the green one"
    async with deps.db.queue_transaction(_search_lock(red.queue)) as tx:
        # the streak may have been searched meanwhile (a newer red, or a redelivery)
        fresh = await tx.queues.get(red.queue)
        if not await _starts_a_streak(tx, red, fresh.last_green_request_id):
            return None
        if fresh.last_green_request_id != queue.last_green_request_id:
            return None  # the bookmark moved on while the range was listed: no longer red
        search, opened = await tx.culprit_searches.open(
            red.queue, red.id, red.uri, green_request_id=queue.last_green_request_id,
            green_uri=queue.last_green_uri, commits=uris, max_builds=spec.max_builds,
            state=state, detail=detail, culprit_uri=culprit,
            culprit_request_id=red.id if culprit else None)
    if opened:
        metrics.CULPRIT_SEARCHES.labels(queue=red.queue, state=search.state.value).inc()
        log.info("culprit_search_opened queue=%s red=%s commits=%d state=%s", red.queue,
                 red.id, len(uris), search.state)
    if search.state is SearchState.BISECTING:
        return await advance(deps, publish, red.queue, red.id)
    return search


async def _starts_a_streak(stores: Stores, red: Request, bookmark: str | None) -> bool:
    """Whether ``red`` is newer than the bookmark and its red streak has no search: the
    newest search is of an older streak (its red commit is not newer than the
    bookmark)."""
    if bookmark is not None and red.order <= request_order(bookmark):
        return False
    newest = await stores.culprit_searches.newest(red.queue)
    if newest is None:
        return True
    if newest.red_request_id == red.id:
        return False
    return bookmark is not None and request_order(newest.red_request_id) <= request_order(
        bookmark)


def _record(queue: str, commit: CommitInfo) -> CommitRecord:
    return CommitRecord(queue=queue, uri=commit.uri, sha=commit.sha, subject=commit.subject,
                        author=commit.author, committed_at=commit.committed_at,
                        parent_uri=commit.parent_uri)


# --- advancing a search -----------------------------------------------------------------


async def advance_queue(deps: Deps, publish: Publisher, queue: str) -> CulpritSearch | None:
    """Advance the queue's newest search if it is still bisecting (after its bookmark
    moved: a search whose streak ended stops). Nothing to read for a queue that finds no
    culprits (a search left from before is ended by the sweeper)."""
    try:
        if not deps.queue_config(queue).backfill.enabled:
            return None
    except UnknownQueue:
        return None
    newest = await deps.db.culprit_searches.newest(queue)
    if newest is None or newest.state.ended:
        return newest
    return await advance(deps, publish, queue, newest.red_request_id)


async def advance_probe(deps: Deps, publish: Publisher, probe: Request) -> None:
    """After backfill Request ``probe`` ended (with a fact or without one)."""
    search = await deps.db.culprit_searches.of_probe(probe.queue, probe.id)
    if search is not None and not search.state.ended:
        await advance(deps, publish, probe.queue, search.red_request_id)


async def advance(deps: Deps, publish: Publisher, queue: str,
                  red_request_id: str) -> CulpritSearch:
    """One step of the search: narrow, then start the next probes or end it."""
    try:
        spec = deps.queue_config(queue).backfill
    except UnknownQueue:
        spec = BackfillSpec()  # a queue no longer configured: ends below, spending nothing
    started: list[Request] = []
    async with deps.db.queue_transaction(_search_lock(queue)) as tx:
        search = await tx.culprit_searches.get(queue, red_request_id)
        if search.state.ended:
            return search
        commits = search.commits
        requests = await tx.requests.newest_for_commits(queue, list(commits))
        probes = await tx.requests.get_many(queue, list(search.probes))
        index_of = {uri: i for i, uri in enumerate(commits)}
        skipped = set(search.skipped)
        for probe in probes.values():
            if probe.state.is_terminal and probe.verdict is None:
                skipped.add(index_of[probe.uri])  # it could not be validated: pass it by
        # builds spent, a probe still to build counting as one
        builds = sum(p.attempt if p.state.is_terminal else max(p.attempt, 1)
                     for p in probes.values())
        known = [what_is_known(requests.get(uri)) for uri in commits]
        known[0] = Known.GREEN  # the green end, whatever validated it since
        fixed = await _streak_ended(tx, search)
        step = bisect_step(known, search.lo, search.hi, skipped=frozenset(skipped),
                           builds=builds, max_builds=spec.max_builds if spec.enabled else 0,
                           max_concurrent=spec.max_concurrent, fixed=fixed)
        new_probes = list(search.probes)
        for index in step.probes:
            uri = commits[index]
            minted = await tx.steps.mint_backfill(
                queue, uri, fresh_probe_id(queue, commits, requests, index))
            if minted.minted_id is None:
                if minted.newest_state is None:
                    # the id is taken by a commit off this history (a rewrite): pass it by
                    skipped.add(index)
                continue  # otherwise it is being validated, or known, by now
            new_probes.append(minted.minted_id)
            started.append(await tx.requests.get(queue, minted.minted_id))
        culprit_uri = commits[step.culprit] if step.culprit is not None else None
        culprit_request = requests.get(culprit_uri) if culprit_uri else None
        search = await tx.culprit_searches.update(
            search, lo=step.lo, hi=step.hi, skipped=skipped, probes=new_probes,
            builds=builds, state=step.state, detail=_detail(step, spec, search, builds),
            culprit_uri=culprit_uri,
            culprit_request_id=culprit_request.id if culprit_request else None)
        if search.state is SearchState.FOUND:
            await _announce(deps, tx, search)
    for request in started:
        # after the commit: a probe published is a probe written; one never published is
        # re-published by the sweeper (an accepted Request's lost gate loop)
        await publish(TopicKey.PROCESS, ProcessRequest(id=request.id, queue_name=queue,
                                                       nonce=request.nonce))
    if started:
        metrics.BACKFILL_PROBES.labels(queue=queue).inc(len(started))
    if search.state.ended:
        metrics.CULPRIT_SEARCHES.labels(queue=queue, state=search.state.value).inc()
        log.info("culprit_search_ended queue=%s red=%s state=%s culprit=%s builds=%d",
                 queue, red_request_id, search.state, search.culprit_uri, search.builds)
    return search


async def _streak_ended(tx: Stores, search: CulpritSearch) -> bool:
    """The branch went green after the red commit: the break was fixed."""
    queue = await tx.queues.get(search.queue)
    bookmark = queue.last_green_request_id
    return bookmark is not None and request_order(bookmark) > request_order(
        search.red_request_id)


def _detail(step: Step, spec: BackfillSpec, search: CulpritSearch, builds: int) -> str:
    left = step.hi - step.lo
    if step.state is SearchState.FOUND:
        return f"found after {builds} backfill build{'s' if builds != 1 else ''}"
    if step.state is SearchState.FIXED:
        return (f"the branch went green again before the culprit was found; it is among "
                f"{left} commit{'s' if left != 1 else ''}")
    if step.state is SearchState.BUDGET_SPENT:
        why = ("backfill is off for this queue now" if not spec.enabled
               else f"backfill.max_builds ({spec.max_builds}) spent")
        return f"{why}; the culprit is among {left} commits"
    if step.state is SearchState.INCONCLUSIVE:
        return (f"the commits left could not be validated; the culprit is among {left} "
                f"commits")
    return f"bisecting: the culprit is among {left} commits, {builds} builds spent"


async def _announce(deps: Deps, tx: Stores, search: CulpritSearch) -> None:
    """The culprit's alert, in the transaction that named it: once, and only when the
    search had to bisect (a culprit known at once is named in the red alert itself)."""
    try:
        channels = deps.queue_config(search.queue).alert_channels
    except UnknownQueue:
        return
    if not channels or search.culprit_uri is None:
        return
    await tx.notifications.add_alert(
        search.queue, f"culprit:{search.red_request_id}",
        {"kind": "alert", "event": "culprit", "queue": search.queue,
         "request_id": search.culprit_request_id, "uri": search.culprit_uri,
         "red_request_id": search.red_request_id, "builds": search.builds,
         "red_since": search.created_at.isoformat()},
        channels=channels)
