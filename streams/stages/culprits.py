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

import logging

from contract import ProcessRequest, TopicKey
from store import (
    Request,
    RequestKind,
    Stores,
    Verdict,
    request_order,
)
from store.culprits import CommitRecord, CulpritSearch, SearchState
from streams.config.queues import BackfillSpec, UnknownQueue
from streams.extensions import tracing
from streams.extensions.sourcecontrol import CommitInfo, CommitNotFound, NotOnFirstParent
from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages.bisection import (
    PROBE_BACKOFF_CAP,
    Budget,
    Known,
    ProbeTally,
    Step,
    Unconfirmed,
    bisect_step,
    fresh_probe_id,
    probe_again_after,
    tally_probes,
    what_is_known,
)
from streams.stages.deps import Deps

# the pure search, used here and by its tests through this module too
__all__ = ["PROBE_BACKOFF_CAP", "STALLED_AFTER", "Budget", "Known", "ProbeTally", "Step",
           "Unconfirmed", "advance", "advance_probe", "advance_queue", "bisect_step",
           "fresh_probe_id", "open_search", "probe_again_after", "tally_probes",
           "what_is_known"]

log = logging.getLogger("stovepipe.culprits")

STALLED_AFTER = 60.0  # seconds a bisecting search may go unchanged before the sweeper looks


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
                queue, uri, fresh_probe_id(queue, commits, requests, index),
                trace_id=tracing.current_trace_id())
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
