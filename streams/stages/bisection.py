"""The culprit search as pure functions (design §5, "backfill"): what the next probes are,
given what is known of the range's commits (`bisect_step`), and what a search's probes add
up to (`tally_probes`). The I/O around them — opening and advancing searches, minting the
probes — is `streams.stages.culprits`; being pure, every case here is cheap to enumerate
(tests/test_culprit_bisect.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum

from store import (
    Request,
    RequestState,
    Verdict,
    commit_request_id,
    make_request_id,
    request_order,
)
from store.culprits import ProbeRecord, SearchState
from streams.config.queues import BackfillSpec
from streams.stages.kit import seconds

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
