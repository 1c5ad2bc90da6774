"""The culprit search as a pure function (streams.stages.culprits, design §5): whatever
the verdicts of a range's commits — one break, or breaks and fixes — a culprit named as
confirmed is the break the red head is red for (the newest red commit whose first parent
is green), a culprit named at all is a break, the builds that ran never exceed
``max_builds``, a commit with a verdict is never probed again, and a commit whose probe
could not validate is probed again (bounded) without ending the search. Backfill ids sort
by their place in the history."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Request, RequestKind, RequestState, Verdict, request_order
from store.culprits import ProbeRecord, SearchState
from streams.config.queues import BackfillSpec
from streams.stages.culprits import (
    Budget,
    Known,
    Step,
    Unconfirmed,
    bisect_step,
    fresh_probe_id,
    probe_again_after,
    tally_probes,
    what_is_known,
)

NOW = datetime(2026, 12, 2, tzinfo=UTC)


def newest_break(verdicts: list[bool]) -> int:
    """The break the red head is red for: the newest red commit whose parent is green."""
    return max(i for i in range(1, len(verdicts)) if not verdicts[i] and verdicts[i - 1])


@dataclass
class Run:
    step: Step
    started: list[int]  # every probe started, in order (a commit probed again repeats)
    ran: int  # builds that gave a verdict
    most_ran_or_reserved: int  # the most builds ran + reserved at any moment
    failures: dict[int, int] = field(default_factory=dict)


def _run(verdicts: list[bool], *, max_concurrent: int = 1, max_builds: int = 1000,
         per_probe: int = 1, unvalidatable: dict[int, int] | None = None,
         unvalidated_probes: int = 3, flaky: frozenset[int] = frozenset(),
         seed: int = 0) -> Run:
    """Drive a search to its end over ``verdicts`` (True: green; [0] the green end, [-1]
    the red head), answering each probe as if its builds ran: a green commit runs one
    build, a red one ``per_probe`` (each red run re-run under retry.red), a ``flaky`` one
    red then green. ``unvalidatable`` maps a commit to how many of its probes could not
    validate it before one does (an outage); such a probe runs no build. Probes end in an
    order ``seed`` picks; a commit whose probe could not validate waits until nothing
    else can happen (its backoff), then is due again."""
    unvalidatable = dict(unvalidatable or {})
    known = [Known.UNKNOWN] * len(verdicts)
    known[0], known[-1] = Known.GREEN, Known.RED
    chooser = random.Random(seed)
    started: list[int] = []
    running: list[int] = []
    failures: dict[int, int] = {}
    waiting: set[int] = set()
    ran = most = 0
    while True:
        passed = frozenset(i for i, n in failures.items() if n >= unvalidated_probes)
        budget = Budget(max_builds, per_probe=per_probe, ran=ran,
                        reserved=per_probe * len(running))
        step = bisect_step(known, passed=passed, waiting=frozenset(waiting - passed),
                           in_flight=len(running), max_concurrent=max_concurrent,
                           budget=budget)
        for index in step.probes:
            assert known[index] is Known.UNKNOWN, "only an unknown commit is probed"
            assert index not in passed and index not in waiting
            assert 0 < index < len(verdicts) - 1
            started.append(index)
            running.append(index)
            known[index] = Known.RUNNING
        assert len(running) <= max_concurrent
        most = max(most, ran + per_probe * len(running))
        assert most <= max_builds, "a probe started that could exceed max_builds"
        if step.state is not SearchState.BISECTING:
            assert not step.probes
            return Run(step, started, ran, most, failures)
        if not running:
            assert step.waiting and waiting, "a search waits only on commits due again"
            waiting.clear()  # their backoff runs out
            continue
        done = running.pop(chooser.randrange(len(running)))
        if unvalidatable.get(done, 0) > 0:
            unvalidatable[done] -= 1
            failures[done] = failures.get(done, 0) + 1
            known[done] = Known.UNKNOWN
            waiting.add(done)
        elif done in flaky:
            ran += min(2, per_probe)
            known[done] = Known.GREEN if per_probe > 1 else Known.RED
        else:
            ran += 1 if verdicts[done] else per_probe
            known[done] = Known.GREEN if verdicts[done] else Known.RED


@settings(max_examples=600, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=40), st.integers(1, 30),
       st.integers(1, 3), st.integers(1, 3), st.data())
def test_a_confirmed_culprit_is_the_break_the_head_is_red_for(
        middle: list[bool], max_builds: int, per_probe: int, width: int,
        data: st.DataObject) -> None:
    """Any pattern of breaks and fixes, any budget, retry.red and concurrency, commits
    that could not be validated: a culprit named is a break, a confirmed one is the
    newest break, and the builds that ran (plus those probes in flight could run) never
    exceed max_builds."""
    verdicts = [True, *middle, False]
    inside = list(range(1, len(verdicts) - 1))
    outage = data.draw(st.dictionaries(st.sampled_from(inside), st.integers(1, 4),
                                       max_size=4) if inside else st.just({}))
    run = _run(verdicts, max_builds=max_builds, per_probe=per_probe, max_concurrent=width,
               unvalidatable=outage, seed=data.draw(st.integers(0, 2**16)))
    assert run.ran <= max_builds
    step = run.step
    if step.state is SearchState.FOUND:
        culprit = step.culprit
        assert culprit is not None
        assert not verdicts[culprit] and verdicts[culprit - 1], "a culprit is a break"
        if step.confirmed:
            assert culprit == newest_break(verdicts)
            assert step.unconfirmed is None
        else:
            assert step.unconfirmed is not None and step.open_above > 0
    else:
        assert step.culprit is None and not step.confirmed


def test_every_range_of_up_to_nine_commits_every_budget() -> None:
    """Enumerated: every pattern of breaks and fixes among up to 9 commits between the
    green end and the red head, every max_builds from 1 to 12, retry.red 0 and 1: a
    culprit named is a break, a confirmed one the newest, and the builds never exceed
    max_builds."""
    for length in range(10):
        for bits in range(2 ** length):
            verdicts = [True, *((bits >> k) & 1 == 1 for k in range(length)), False]
            for per_probe in (1, 2):
                for max_builds in range(1, 13):
                    run = _run(verdicts, max_builds=max_builds, per_probe=per_probe)
                    assert run.ran <= max_builds
                    culprit = run.step.culprit
                    if culprit is not None:
                        assert not verdicts[culprit] and verdicts[culprit - 1]
                        assert not run.step.confirmed or culprit == newest_break(verdicts)
                    if max_builds >= length * per_probe:
                        assert run.step.confirmed and culprit == newest_break(verdicts)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=40), st.integers(1, 3))
def test_a_budget_for_every_commit_confirms_the_heads_break_with_the_fewest_builds(
        middle: list[bool], per_probe: int) -> None:
    """With room for every commit of the range, the search always ends naming the newest
    break, confirmed, having built exactly the commits any sure answer needs: the break's
    parent (unless it is the green end) and every commit from the break to the head."""
    verdicts = [True, *middle, False]
    head = len(verdicts) - 1
    run = _run(verdicts, max_builds=max(head - 1, 0) * per_probe, per_probe=per_probe)
    expected = newest_break(verdicts)
    assert run.step.state is SearchState.FOUND and run.step.confirmed
    assert run.step.culprit == expected
    needed = set(range(max(expected - 1, 1), head))
    assert sorted(run.started) == sorted(needed)
    assert run.started == sorted(needed, reverse=True)  # newest first


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=40), st.integers(2, 4), st.data())
def test_concurrent_probes_confirm_the_heads_break(middle: list[bool], width: int,
                                                  data: st.DataObject) -> None:
    verdicts = [True, *middle, False]
    run = _run(verdicts, max_concurrent=width, seed=data.draw(st.integers(0, 2**16)))
    assert run.step.state is SearchState.FOUND and run.step.confirmed
    assert run.step.culprit == newest_break(verdicts)
    assert len(set(run.started)) == len(run.started), "a commit is never probed twice"


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=2, max_value=200), st.data())
def test_one_break_is_named_within_log2_builds(length: int, data: st.DataObject) -> None:
    """A range that breaks once and stays broken: with ⌈log2 n⌉ builds the break is named
    (confirmed when the budget also covered the commits after it)."""
    first_red = data.draw(st.integers(min_value=1, max_value=length))
    verdicts = [i < first_red for i in range(length + 1)]
    budget = max(1, math.ceil(math.log2(length)))
    run = _run(verdicts, max_builds=budget)
    assert run.step.state is SearchState.FOUND and run.step.culprit == first_red
    assert run.ran <= budget
    assert run.step.confirmed == (run.step.open_above == 0)


def test_the_old_break_the_first_probe_lands_on_is_never_confirmed() -> None:
    """Issue 23: a green end, a break at 3, a fix at 5, a new break at 7, the head at 9.
    Bisection's first probe (the middle, 4) is red from the old break and narrows below
    it to 3. With room for every commit, the commits are probed newest first: 8 and 7
    red, 6 green — 7 is named, confirmed, after 3 builds. With 4 builds, bisection finds
    3, and 3 stays "a break, not confirmed as the head's"."""
    verdicts = [True, True, True, False, False, True, True, False, False, False]
    assert newest_break(verdicts) == 7
    wide = _run(verdicts, max_builds=10)
    assert (wide.step.state, wide.step.culprit, wide.step.confirmed) == (
        SearchState.FOUND, 7, True)
    assert wide.started == [8, 7, 6]
    narrow = _run(verdicts, max_builds=4)
    assert narrow.started == [4, 2, 3, 8]
    assert (narrow.step.state, narrow.step.culprit, narrow.step.confirmed) == (
        SearchState.FOUND, 3, False)
    assert (narrow.step.unconfirmed, narrow.step.open_above) == (Unconfirmed.BUDGET, 3)
    # enough for bisection and then the commits above it: the green 6 restarts the range
    five = _run(verdicts, max_builds=7)
    assert (five.step.culprit, five.step.confirmed) == (7, True)


def test_eight_commits_fifth_breaks() -> None:
    """A green commit, then one push of 8; the 5th breaks and it stays broken. With 10
    builds: 7, 6, 5 red and 4 green — confirmed with 4 builds. With 4: bisection first
    (4 is green), then the 3 commits left fit and are built newest first."""
    verdicts = [True, True, True, True, True, False, False, False, False]
    wide = _run(verdicts, max_builds=10)
    assert (wide.step.culprit, wide.step.confirmed, wide.started) == (5, True, [7, 6, 5, 4])
    narrow = _run(verdicts, max_builds=4)
    assert (narrow.step.culprit, narrow.step.confirmed, narrow.started) == (
        5, True, [4, 7, 6, 5])


def test_a_break_fixed_inside_the_range_names_the_newest_break() -> None:
    verdicts = [True, True, False, False, True, True, True, False, False]
    run = _run(verdicts, max_builds=4)
    assert (run.step.culprit, run.step.confirmed) == (7, True)
    assert run.started == [4, 7, 6]


def test_a_flaky_candidate_with_retry_red_keeps_room_for_its_re_runs() -> None:
    """retry.red 1: each probe may run 2 builds, so 6 builds leave room for 3 probes."""
    verdicts = [True, True, True, True, True, False, False, False, False]
    run = _run(verdicts, max_builds=6, per_probe=2, flaky=frozenset({4}))
    assert run.started == [4, 6, 5]
    assert run.ran == 6
    assert (run.step.culprit, run.step.confirmed, run.step.unconfirmed) == (
        5, False, Unconfirmed.BUDGET)
    enough = _run(verdicts, max_builds=8, per_probe=2, flaky=frozenset({4}))
    assert (enough.started, enough.ran, enough.step.confirmed) == ([4, 7, 6, 5], 8, True)


def test_max_builds_below_one_probe_with_its_re_runs_starts_nothing() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.UNKNOWN, Known.RED]
    step = bisect_step(known, budget=Budget(1, per_probe=2))
    assert (step.state, step.probes) == (SearchState.BUDGET_SPENT, ())


def test_budget_spent_stops_and_says_where_the_culprit_is() -> None:
    verdicts = [True] * 20 + [False] * 13
    run = _run(verdicts, max_builds=2)
    assert run.step.state is SearchState.BUDGET_SPENT
    assert len(run.started) == 2 and run.ran == 2
    assert run.step.lo < 20 <= run.step.hi


def test_a_commit_whose_probe_could_not_validate_is_probed_again() -> None:
    """An outage: commit 4's first two probes could not validate it. It is probed again
    after each (no build counted), and the search ends as it would have without the
    outage: 5 confirmed."""
    verdicts = [True, True, True, True, True, False, False, False, False]
    calm = _run(verdicts, max_builds=4)
    stormy = _run(verdicts, max_builds=4, unvalidatable={4: 2})
    assert stormy.started == [4, 4, 4, 7, 6, 5]
    assert (stormy.step.culprit, stormy.step.confirmed, stormy.ran) == (
        calm.step.culprit, calm.step.confirmed, calm.ran)


def test_a_commit_passed_by_ends_nothing_while_others_are_left() -> None:
    """Commit 4 can never be validated: after 3 probes (the bound) it is passed by, and
    the search goes on with the commits left (3 is built after it) before it ends: the
    break is 4 or 5, and nothing can tell which. Passed by between a break and the head,
    a commit leaves the break named but not confirmed."""
    verdicts = [True, True, True, True, True, False, False, False, False]
    run = _run(verdicts, unvalidatable={4: 99}, unvalidated_probes=3)
    assert run.started == [7, 6, 5, 4, 4, 4, 3]
    assert (run.failures, run.ran) == ({4: 3}, 4)
    assert (run.step.state, run.step.lo, run.step.hi) == (SearchState.INCONCLUSIVE, 3, 5)
    above = _run(verdicts, unvalidatable={7: 99}, unvalidated_probes=3)
    assert (above.step.culprit, above.step.confirmed, above.step.unconfirmed) == (
        5, False, Unconfirmed.UNVALIDATED)
    everything = _run([True, False, False, False], unvalidatable={1: 99, 2: 99})
    assert everything.step.state is SearchState.INCONCLUSIVE
    assert (everything.step.lo, everything.step.hi) == (0, 3)


def test_a_search_waiting_only_on_an_outage_is_not_over() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.RED, Known.UNKNOWN, Known.RED]
    step = bisect_step(known, waiting=frozenset({1, 3}), budget=Budget(10))
    assert (step.state, step.probes, step.waiting) == (SearchState.BISECTING, (), True)
    # the same commits passed by for good: the break at 2 is named, not confirmed
    ended = bisect_step(known, passed=frozenset({1, 3}), budget=Budget(10))
    assert ended.state is SearchState.INCONCLUSIVE
    known[1] = Known.GREEN
    named = bisect_step(known, passed=frozenset({3}), budget=Budget(10))
    assert (named.state, named.culprit, named.confirmed, named.unconfirmed) == (
        SearchState.FOUND, 2, False, Unconfirmed.UNVALIDATED)


def test_fixed_stops_and_a_break_found_is_not_confirmed() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.UNKNOWN, Known.RED]
    fixed = bisect_step(known, budget=Budget(10), fixed=True)
    assert fixed.state is SearchState.FIXED and fixed.probes == ()
    known[1], known[2] = Known.GREEN, Known.RED
    found = bisect_step(known, budget=Budget(10), fixed=True)
    assert (found.state, found.culprit, found.confirmed) == (SearchState.FOUND, 2, True)
    known[2], known[1] = Known.UNKNOWN, Known.RED
    named = bisect_step(known, budget=Budget(10), fixed=True)
    assert (named.state, named.culprit, named.confirmed, named.unconfirmed) == (
        SearchState.FOUND, 1, False, Unconfirmed.FIXED)


def test_a_running_probe_is_waited_for() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.RUNNING, Known.UNKNOWN, Known.UNKNOWN,
             Known.UNKNOWN, Known.RED]
    step = bisect_step(known, in_flight=1, budget=Budget(3, reserved=1))
    assert step.state is SearchState.BISECTING and step.probes == ()


def test_two_probes_at_once_split_the_range_in_three() -> None:
    known = [Known.GREEN, *[Known.UNKNOWN] * 8, Known.RED]
    step = bisect_step(known, max_concurrent=2, budget=Budget(4))
    assert step.state is SearchState.BISECTING
    # the middle first, then the middle of the wider half left
    assert step.probes == (4, 6)


def _probe(request_id: str, uri: str, state: str, verdict: str | None, ran: int,
           ago: float) -> ProbeRecord:
    return ProbeRecord(request_id=request_id, uri=uri, state=state, verdict=verdict,
                       ran=ran, changed_ago=ago)


def test_tally_counts_only_builds_that_ran_and_keeps_room_for_re_runs() -> None:
    commits = ["g", "a", "b", "c", "r"]
    spec = BackfillSpec(mode="bisect", unvalidated_probes=3)
    backoff = probe_again_after(spec, 1)
    assert (probe_again_after(spec, 2), probe_again_after(spec, 30)) == (2 * backoff, 3600)
    tally = tally_probes(commits, [
        _probe("p/1~1", "a", "failed", "red", 2, 500),      # red twice: 2 ran
        _probe("p/1~2", "b", "failed", None, 0, 10),        # could not validate
        _probe("p/1~2.2", "b", "failed", None, 0, 5),       # nor again
        _probe("p/1~3", "c", "processing", None, 1, 1),     # in flight, 1 ran so far
    ], spec, per_probe=2)
    assert (tally.ran, tally.reserved, tally.in_flight) == (3, 1, 1)
    assert (tally.passed, tally.waiting) == (frozenset(), frozenset({2}))
    assert tally.wake_in == pytest.approx(probe_again_after(spec, 2) - 5)
    bound = tally_probes(commits, [_probe(f"p/1~2.{k}", "b", "failed", None, 0, 9999)
                                   for k in range(1, 4)], spec, per_probe=1)
    assert (bound.passed, bound.waiting, bound.wake_in) == (frozenset({2}), frozenset(), None)


def test_a_probe_that_can_never_validate_its_commit_passes_it_by_at_once() -> None:
    """Issue 23, items 3 and 4: a probe whose trigger was refused (a permanent cause) is
    not tried again `unvalidated_probes` times: its commit is passed by at once."""
    spec = BackfillSpec(mode="bisect", unvalidated_probes=5)
    refused = ProbeRecord(request_id="p/1~2", uri="b", state="failed", verdict=None, ran=0,
                          changed_ago=1, permanent=True)
    tally = tally_probes(["g", "a", "b", "r"], [refused], spec, per_probe=1)
    assert (tally.passed, tally.waiting, tally.wake_in) == (frozenset({2}), frozenset(), None)


def _request(request_id: str, uri: str, state: RequestState = RequestState.SUCCEEDED,
             verdict: Verdict | None = Verdict.GREEN) -> Request:
    return Request(queue="q", id=request_id, uri=uri, state=state, build_strategy=None,
                   base_uri=None, version=1, created_at=NOW, updated_at=NOW,
                   kind=RequestKind.HEAD, verdict=verdict)


def test_backfill_ids_sort_by_their_place_in_the_history() -> None:
    commits = ["g", "a", "b", "h", "c", "d", "r"]
    requests = {"g": _request("request/q/3", "g"),
                "h": _request("request/q/5", "h", RequestState.SUPERSEDED, None),
                "r": _request("request/q/6", "r", RequestState.FAILED, Verdict.RED)}
    ids = {i: fresh_probe_id("q", commits, requests, i) for i in (1, 2, 4, 5)}
    assert ids == {1: "request/q/3~1", 2: "request/q/3~2", 4: "request/q/5~1",
                   5: "request/q/5~2"}
    placed = ["request/q/3", ids[1], ids[2], "request/q/5", ids[4], ids[5], "request/q/6"]
    assert sorted(placed, key=request_order) == placed
    # after a backfilled commit, positions continue from it
    requests["a"] = _request("request/q/3~1.2", "a")
    assert fresh_probe_id("q", commits, requests, 2) == "request/q/3~2"


def test_what_is_known_of_a_commit() -> None:
    assert what_is_known(None) is Known.UNKNOWN
    assert what_is_known(_request("request/q/1", "x")) is Known.GREEN
    assert what_is_known(_request("request/q/1", "x", RequestState.FAILED,
                                  Verdict.RED)) is Known.RED
    assert what_is_known(_request("request/q/1", "x", RequestState.FAILED,
                                  None)) is Known.UNKNOWN
    assert what_is_known(_request("request/q/1", "x", RequestState.PROCESSING,
                                  None)) is Known.RUNNING
    assert what_is_known(_request("request/q/1", "x", RequestState.SUPERSEDED,
                                  None)) is Known.UNKNOWN


@pytest.mark.parametrize("request_id, order", [
    ("request/q/7", (7, 0, 1)), ("request/q/7.3", (7, 0, 3)), ("request/a/b/7~2", (7, 2, 1)),
    ("request/q/7~12.2", (7, 12, 2))])
def test_request_order_reads_every_shape(request_id: str, order: tuple[int, int, int]) -> None:
    assert request_order(request_id) == order


@pytest.mark.parametrize("bad", ["request/q/7~", "request/q/7~0", "request/q/~2",
                                 "request/q/7~2.1", "request/q/7.2~3"])
def test_malformed_backfill_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a request id"):
        request_order(bad)
