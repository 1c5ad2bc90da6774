"""Culprit finding: which commit broke the branch (design §5, "backfill").

When a red verdict follows the queue's last green commit and commits between them on the
branch's first-parent history were never built (superseded heads, several commits in one
push), the queue validates some of them to name the culprit: the break the red head is
red for — the *newest* red commit whose first parent is green. A range can hold a break
that was fixed and a later one, so a break found is named as the head's (``confirmed``)
only when every commit from it to the head is known red; otherwise it is named as "a
break, not confirmed as the head's", with the reason. One search per red streak:

1. **Open** (record, on the red verdict of a head or retry newer than the bookmark, when
   the streak has no search yet): list the first-parent commits from the bookmark to the
   red commit (SourceControl.commits_between). One commit: it is the culprit, confirmed.
   More: search.
2. **Advance** (record, after each backfill Request of the search ends; record, when a
   green verdict moves the bookmark; the sweeper, for a search nothing moved for a while
   or whose commit is due to be probed again): from what is known of the range's
   commits, `bisect_step` decides the next probes — Requests of kind `backfill` — or the
   end: bisection to a break, then the commits between it and the head, newest first
   (the rule and its guarantee are in its docstring). Stops when the culprit is named
   (confirmed or not), when the branch went green again (the break was fixed: no more
   builds spent on it), when ``backfill.max_builds`` builds that ran leave no room for
   another probe, or when every commit left was passed by.

**Only builds that ran count.** A probe's builds that gave a verdict (green or red, a
hang included) count against ``max_builds``; one that could not validate does not. A
probe starts only while every build it may run (1 + retry.red) fits, so the builds that
ran never exceed ``max_builds``. A probe that ended without a verdict leaves its commit
unknown: it is probed again after ``backfill.probe_backoff``, doubling (at most
`PROBE_BACKOFF_CAP`), and passed by only once ``backfill.unvalidated_probes`` of its
probes could not validate it; while only such commits are left, the search waits (its
``wake_at`` tells the sweeper when), so an outage never ends a search.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum

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
from store.culprits import CommitRecord, CulpritSearch, ProbeRecord, SearchState
from streams.config.queues import BackfillSpec, UnknownQueue
from streams.extensions.sourcecontrol import CommitInfo, CommitNotFound, NotOnFirstParent
from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps
from streams.stages.kit import seconds

log = logging.getLogger("stovepipe.culprits")

STALLED_AFTER = 60.0  # seconds a bisecting search may go unchanged before the sweeper looks
PROBE_BACKOFF_CAP = 3600.0  # the longest a commit waits to be probed again


# --- the search, as a pure function -----------------------------------------------------


class Known(Enum):
    """What is known of one commit of a search's range."""

    GREEN = "green"
    RED = "red"
    RUNNING = "running"  # a Request of it is accepted or processing
    UNKNOWN = "unknown"  # never validated, passed over, or could not be validated


class Unconfirmed(StrEnum):
    """Why a break the search named is not confirmed as the one the head is red for."""

    BUDGET = "budget"  # no room left to build the commits between it and the head
    UNVALIDATED = "unvalidated"  # some of those commits were passed by
    FIXED = "fixed"  # the branch went green again before they were built


@dataclass(frozen=True)
class Budget:
    """The builds a search may still start: ``max_builds`` bounds the builds that *ran*
    (gave a verdict); a probe can run ``per_probe`` builds (1 + retry.red), so one starts
    only when that many still fit beside the builds that ran (``ran``) and those the
    probes in flight may still run (``reserved``). A build that could not validate is not
    counted."""

    max_builds: int
    per_probe: int = 1
    ran: int = 0
    reserved: int = 0

    @property
    def probes_that_fit(self) -> int:
        return max(0, self.max_builds - self.ran - self.reserved) // max(self.per_probe, 1)


@dataclass(frozen=True)
class Step:
    """What `bisect_step` decided. ``lo`` is the newest commit known green, ``hi`` the
    oldest known red above it; ``probes`` the commits to start probes at now. A break —
    a red commit whose first parent is green — is ``candidate`` once known (``hi`` when
    ``hi == lo + 1``); ``culprit`` is the break named when the search ends `found`,
    ``confirmed`` when every commit from it to the head is known red, else
    ``unconfirmed`` says why not, and ``open_above`` how many commits between it and the
    head are not known red."""

    lo: int
    hi: int
    state: SearchState
    probes: tuple[int, ...] = ()
    candidate: int | None = None
    culprit: int | None = None
    confirmed: bool = False
    unconfirmed: Unconfirmed | None = None
    open_above: int = 0
    waiting: bool = False  # commits wait to be probed again (an outage): wake it then


def bisect_step(known: Sequence[Known], *, passed: frozenset[int] = frozenset(),
                waiting: frozenset[int] = frozenset(), in_flight: int = 0,
                max_concurrent: int = 1, budget: Budget, fixed: bool = False) -> Step:
    """One step of the search over ``known`` (index 0 the green end, the last index the
    red head; both taken as known). ``passed``: commits passed by for good (could not be
    validated too often); ``waiting``: commits whose last probe could not validate and
    whose backoff has not run out; ``in_flight``: this search's probes accepted or
    processing; ``fixed``: the branch went green after the head.

    The head is red for the *newest* break of the range (a red commit whose first parent
    is green), and only a commit with every commit from it to the head known red is
    surely that break. So: ``lo`` is the newest known green commit and ``hi`` the oldest
    known red above it; a break lies in lo+1..hi, and it is the head's when no commit
    above ``hi`` hides a later fix. While the budget covers every commit still unknown
    above ``lo``, those are probed newest first — the first green one found names its
    child, confirmed, with the fewest builds any sure answer needs; otherwise the middle
    of lo..hi is probed (bisection, about log2 of the range) until a break is found, then
    the commits above it, newest first. A green one there restarts the range above it.
    The search ends `found` naming a break, confirmed or not (and why not), or without
    one: `fixed`, `budget_spent`, `inconclusive` (what is left was passed by).

    Guarantee: a culprit ``confirmed`` is the newest break of the range, whatever breaks
    and fixes it holds (its parent is known green and every commit from it to the head
    known red). Limit: a culprit not confirmed is a break (red, its parent green), but a
    later fix and a later break could hide among the commits between it and the head
    that were not built. Builds: those that ran plus those the probes in flight may run
    never exceed ``budget.max_builds``; a commit with a verdict is never probed again."""
    head = len(known) - 1
    lo = max(i for i in range(head) if i == 0 or known[i] is Known.GREEN)
    hi = next(i for i in range(lo + 1, head + 1) if i == head or known[i] is Known.RED)
    candidate = hi if hi == lo + 1 else None
    open_above = [i for i in range(hi + 1, head) if known[i] is not Known.RED]
    if candidate is not None and not open_above:
        return Step(lo, hi, SearchState.FOUND, candidate=hi, culprit=hi, confirmed=True)
    if fixed:
        if candidate is not None:
            return Step(lo, hi, SearchState.FOUND, candidate=hi, culprit=hi,
                        unconfirmed=Unconfirmed.FIXED, open_above=len(open_above))
        return Step(lo, hi, SearchState.FIXED)

    unknown = [i for i in range(lo + 1, head) if known[i] is Known.UNKNOWN]
    running = [i for i in range(lo + 1, head) if known[i] is Known.RUNNING]
    to_build = [i for i in unknown if i not in passed]
    fit = budget.probes_that_fit
    room = min(max_concurrent - in_flight, fit)
    # chosen as if the commits waiting to be probed again were not: a waiting one chosen
    # is waited for (an outage is waited out where the search stands, not spread over
    # every commit of the range)
    chosen: list[int] = []
    if room > 0 and to_build:
        if len(to_build) <= fit:
            # the budget covers everything still unknown: newest first, never a wasted build
            chosen = sorted(to_build, reverse=True)[:room]
        else:
            gap = [i for i in to_build if i < hi]
            for _ in range(room):
                pick = _split_point(lo, hi, sorted(i for i in running + chosen if i < hi),
                                    [c for c in gap if c not in chosen])
                if pick is None:
                    break
                chosen.append(pick)
            if not chosen and not any(i < hi for i in running):
                # nothing left to narrow below hi: look above it, newest first
                chosen = sorted((i for i in to_build if i > hi), reverse=True)[:room]
    probes = tuple(i for i in chosen if i not in waiting)
    if probes or running or in_flight or len(probes) < len(chosen):
        # probes started or in flight; or only commits whose probe could not validate are
        # chosen: they are probed again when their backoff runs out (the sweeper wakes
        # the search then)
        return Step(lo, hi, SearchState.BISECTING, probes, candidate=candidate,
                    open_above=len(open_above),
                    waiting=not probes and not running and not in_flight)
    # nothing more can be learned: the budget is spent, or all that is left was passed by
    short = fit <= 0 and bool(to_build)
    if candidate is not None:
        why = Unconfirmed.BUDGET if short else Unconfirmed.UNVALIDATED
        return Step(lo, hi, SearchState.FOUND, candidate=hi, culprit=hi, unconfirmed=why,
                    open_above=len(open_above))
    return Step(lo, hi, SearchState.BUDGET_SPENT if short else SearchState.INCONCLUSIVE)


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
        # nothing lies between it and the head (it is the head): confirmed
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
            culprit_request_id=red.id if culprit else None,
            confirmed=True if culprit else None)
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
    """After backfill Request ``probe`` ended (with a fact or without one). A search that
    ended while the probe ran (the branch went green, or the culprit was named) keeps its
    outcome; only its count of builds that ran takes the probe's in."""
    search = await deps.db.culprit_searches.of_probe(probe.queue, probe.id)
    if search is None:
        return
    if not search.state.ended:
        await advance(deps, publish, probe.queue, search.red_request_id)
        return
    async with deps.db.queue_transaction(_search_lock(probe.queue)) as tx:
        search = await tx.culprit_searches.get(probe.queue, search.red_request_id)
        probes = await tx.culprit_searches.probe_records(probe.queue, list(search.probes))
        ran = sum(p.ran for p in probes.values())
        if ran != search.builds:
            await tx.culprit_searches.count_builds(search, ran)


async def advance(deps: Deps, publish: Publisher, queue: str,
                  red_request_id: str) -> CulpritSearch:
    """One step of the search: narrow, confirm, then start the next probes or end it."""
    try:
        config = deps.queue_config(queue)
        spec, per_probe = config.backfill, 1 + config.retry.red
    except UnknownQueue:
        # a queue no longer configured: ends below, spending nothing
        spec, per_probe = BackfillSpec(), 1
    started: list[Request] = []
    async with deps.db.queue_transaction(_search_lock(queue)) as tx:
        search = await tx.culprit_searches.get(queue, red_request_id)
        if search.state.ended:
            return search
        commits = search.commits
        requests = await tx.requests.newest_for_commits(queue, list(commits))
        probes = await tx.culprit_searches.probe_records(queue, list(search.probes))
        tally = tally_probes(commits, probes.values(), spec, per_probe)
        # indexes passed by because their id was taken by a commit off this history (a
        # rewrite); an index skipped without a probe of it (rows of the release before
        # skipped a commit whose one probe could not validate: the tally decides those)
        rewritten = {i for i in search.skipped if commits[i] not in tally.probed}
        known = [what_is_known(requests.get(uri)) for uri in commits]
        known[0], known[-1] = Known.GREEN, Known.RED  # the range's ends, whatever came since
        fixed = await _streak_ended(tx, search)
        budget = Budget(spec.max_builds if spec.enabled else 0, per_probe=per_probe,
                        ran=tally.ran, reserved=tally.reserved)
        step = bisect_step(known, passed=frozenset(tally.passed | rewritten),
                           waiting=frozenset(tally.waiting), in_flight=tally.in_flight,
                           max_concurrent=spec.max_concurrent, budget=budget, fixed=fixed)
        new_probes = list(search.probes)
        for index in step.probes:
            uri = commits[index]
            minted = await tx.steps.mint_backfill(
                queue, uri, fresh_probe_id(queue, commits, requests, index))
            if minted.minted_id is None:
                if minted.newest_state is None:
                    # the id is taken by a commit off this history (a rewrite): pass it by
                    rewritten.add(index)
                continue  # otherwise it is being validated, or known, by now
            new_probes.append(minted.minted_id)
            started.append(await tx.requests.get(queue, minted.minted_id))
        culprit_uri = commits[step.culprit] if step.culprit is not None else None
        culprit_request = requests.get(culprit_uri) if culprit_uri else None
        found = step.state is SearchState.FOUND
        search = await tx.culprit_searches.update(
            search, lo=step.lo, hi=step.hi, skipped=rewritten, probes=new_probes,
            builds=tally.ran, state=step.state,
            detail=_detail(step, spec, tally, per_probe), culprit_uri=culprit_uri,
            culprit_request_id=culprit_request.id if culprit_request else None,
            confirmed=step.confirmed if found else None,
            unconfirmed_reason=_unconfirmed_words(step, spec) if found else None,
            candidate_uri=(commits[step.candidate] if step.candidate is not None
                           and not step.state.ended else None),
            wake_in=tally.wake_in if step.state is SearchState.BISECTING else None)
        if found and step.unconfirmed is not Unconfirmed.FIXED:
            # a break named after the branch went green again is not alerted: the green
            # alert went out already, and the streak is over
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
        log.info("culprit_search_ended queue=%s red=%s state=%s culprit=%s confirmed=%s "
                 "builds=%d", queue, red_request_id, search.state, search.culprit_uri,
                 search.confirmed, search.builds)
    return search


@dataclass(frozen=True)
class ProbeTally:
    """What a search's probes add up to: the builds that ran and those the probes in
    flight may still run (the budget), the commits passed by (their probes could not
    validate them ``unvalidated_probes`` times) and those waiting to be probed again
    (``wake_in``: seconds until the first of them is due)."""

    probed: frozenset[str]
    ran: int
    reserved: int
    in_flight: int
    passed: frozenset[int]
    waiting: frozenset[int]
    wake_in: float | None


def tally_probes(commits: Sequence[str], probes: Iterable[ProbeRecord], spec: BackfillSpec,
                 per_probe: int) -> ProbeTally:
    """Count a search's probes: only builds that ran count against the budget; a probe in
    flight keeps room for every build it may still run (``per_probe``: 1 + retry.red).
    A probe that ended without a verdict leaves its commit unknown: it is probed again
    after `probe_again_after`, until ``spec.unvalidated_probes`` of its probes could not
    validate it — or at once when one could not for a permanent cause."""
    index_of = {uri: i for i, uri in enumerate(commits)}
    ran = reserved = in_flight = 0
    failures: dict[int, list[float]] = {}
    permanent: set[int] = set()  # a probe could not validate it for good: passed by at once
    probed: set[str] = set()
    for probe in probes:
        probed.add(probe.uri)
        ran += probe.ran
        if probe.in_flight:
            in_flight += 1
            reserved += max(per_probe - probe.ran, 0)
        elif probe.unvalidated and probe.uri in index_of:
            failures.setdefault(index_of[probe.uri], []).append(probe.changed_ago)
            if probe.permanent:
                permanent.add(index_of[probe.uri])
    passed, waiting, due = set(), set(), []
    for index, ended_ago in failures.items():
        if index in permanent or len(ended_ago) >= spec.unvalidated_probes:
            passed.add(index)
            continue
        due_in = probe_again_after(spec, len(ended_ago)) - min(ended_ago)
        if due_in > 0:
            waiting.add(index)
            due.append(due_in)
    return ProbeTally(frozenset(probed), ran, reserved, in_flight, frozenset(passed),
                      frozenset(waiting), min(due) if due else None)


def probe_again_after(spec: BackfillSpec, failures: int) -> float:
    """Seconds a commit waits, after its probe number ``failures`` could not validate it,
    before it is probed again: ``probe_backoff`` doubling each time, at most
    `PROBE_BACKOFF_CAP`."""
    return min(seconds(spec.probe_backoff) * 2 ** min(max(failures - 1, 0), 20),
               PROBE_BACKOFF_CAP)


async def _streak_ended(tx: Stores, search: CulpritSearch) -> bool:
    """The branch went green after the red commit: the break was fixed."""
    queue = await tx.queues.get(search.queue)
    bookmark = queue.last_green_request_id
    return bookmark is not None and request_order(bookmark) > request_order(
        search.red_request_id)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _detail(step: Step, spec: BackfillSpec, tally: ProbeTally, per_probe: int) -> str:
    """The search's progress or end, in words."""
    left = step.hi - step.lo
    builds = _plural(tally.ran, "backfill build")
    if step.state is SearchState.FOUND:
        if step.confirmed:
            return (f"found after {builds}; confirmed: every commit from it to the head "
                    f"is red")
        return (f"a break, not confirmed as the head's: {_unconfirmed_words(step, spec)}; "
                f"found after {builds}")
    if step.state is SearchState.FIXED:
        return (f"the branch went green again before the culprit was found; it is among "
                f"{_plural(left, 'commit')}")
    if step.state is SearchState.BUDGET_SPENT:
        why = ("backfill is off for this queue now" if not spec.enabled
               else f"backfill.max_builds ({spec.max_builds}) spent: {builds} ran, and a "
                    f"probe may run {_plural(per_probe, 'build')}")
        return f"{why}; the culprit is among {_plural(left, 'commit')}"
    if step.state is SearchState.INCONCLUSIVE:
        return (f"the commits left could not be validated ({spec.unvalidated_probes} "
                f"probes each); the culprit is among {_plural(left, 'commit')}")
    waiting = (f"; {_plural(len(tally.waiting), 'commit')} whose probe could not validate "
               f"wait to be probed again" if tally.waiting else "")
    if step.candidate is not None:
        return (f"confirming a break: {_plural(step.open_above, 'commit')} between it and "
                f"the head to build, {builds} spent{waiting}")
    return f"bisecting: the culprit is among {_plural(left, 'commit')}, {builds} spent{waiting}"


def _unconfirmed_words(step: Step, spec: BackfillSpec) -> str | None:
    """Why the break named is not confirmed as the head's (None: it is)."""
    if step.confirmed or step.unconfirmed is None:
        return None
    between = f"{_plural(step.open_above, 'commit')} between it and the head"
    if step.unconfirmed is Unconfirmed.FIXED:
        why = f"the branch went green again with {between} not built"
    elif step.unconfirmed is Unconfirmed.UNVALIDATED:
        why = f"{between} could not be validated ({spec.unvalidated_probes} probes each)"
    elif not spec.enabled:
        why = f"backfill is off for this queue now, with {between} not built"
    else:
        why = f"backfill.max_builds ({spec.max_builds}) was spent with {between} not built"
    return f"{why}, and a later fix and break could hide there"


async def _announce(deps: Deps, tx: Stores, search: CulpritSearch) -> None:
    """The culprit's alert, in the transaction that named it: once, and only when the
    search had to bisect (a culprit known at once is named in the red alert itself). It
    says whether the culprit is confirmed as the head's break."""
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
         "red_since": search.created_at.isoformat(),
         "confirmed": search.culprit_confirmed,
         "unconfirmed_reason": search.unconfirmed_why},
        channels=channels)
