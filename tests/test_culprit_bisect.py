"""The culprit search's bisection as a pure function (streams.stages.culprits, design §5):
whatever the verdicts of a range's commits, it names a red commit whose first parent is
green, within about log2(n) builds, never builds a commit twice, and stops when told the
branch went green again, when its budget is spent, or when nothing is left to validate.
Backfill ids sort by their place in the history."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import Request, RequestKind, RequestState, Verdict, request_order
from store.culprits import SearchState
from streams.stages.culprits import Known, bisect_step, fresh_probe_id, what_is_known

NOW = datetime(2026, 12, 2, tzinfo=UTC)


def _run(verdicts: list[bool], *, max_concurrent: int = 1, max_builds: int = 1000,
         unvalidatable: frozenset[int] = frozenset()) -> tuple[object, list[int]]:
    """Drive a search to its end over ``verdicts`` (True: green; [0] the green end, [-1]
    the red commit), answering each probe as if its build ran. Returns the final step and
    the probes in the order they were started."""
    known = [Known.UNKNOWN] * len(verdicts)
    known[0], known[-1] = Known.GREEN, Known.RED
    lo, hi = 0, len(verdicts) - 1
    skipped: set[int] = set()
    started: list[int] = []
    running: list[int] = []
    while True:
        step = bisect_step(known, lo, hi, skipped=frozenset(skipped), builds=len(started),
                           max_builds=max_builds, max_concurrent=max_concurrent,
                           fixed=False)
        lo, hi = step.lo, step.hi
        for index in step.probes:
            assert index not in started, "a commit is never probed twice"
            assert lo < index < hi
            started.append(index)
            running.append(index)
            known[index] = Known.RUNNING
        if step.state is not SearchState.BISECTING:
            return step, started
        assert running, "a search that bisects has a probe running"
        done = running.pop(0)  # the oldest probe ends first
        if done in unvalidatable:
            known[done] = Known.UNKNOWN
            skipped.add(done)
        else:
            known[done] = Known.GREEN if verdicts[done] else Known.RED


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=60))
def test_bisection_names_a_red_commit_whose_parent_is_green(middle: list[bool]) -> None:
    verdicts = [True, *middle, False]
    step, started = _run(verdicts)
    assert step.state is SearchState.FOUND
    culprit = step.culprit
    assert culprit is not None
    assert not verdicts[culprit] and verdicts[culprit - 1]
    span = len(verdicts) - 1
    assert len(started) <= math.ceil(math.log2(span)) if span > 1 else not started


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=200), st.data())
def test_one_break_is_found_exactly(length: int, data: st.DataObject) -> None:
    """A range that breaks once and stays broken: the first red commit is the culprit."""
    first_red = data.draw(st.integers(min_value=1, max_value=length))
    verdicts = [i < first_red for i in range(length + 1)]
    step, started = _run(verdicts)
    assert step.culprit == first_red
    assert len(started) <= max(0, math.ceil(math.log2(length)))


def test_eight_commits_fifth_breaks_three_builds() -> None:
    """The issue's case: a green commit, then one push of 8; the 5th breaks."""
    verdicts = [True, True, True, True, True, False, False, False, False]
    step, started = _run(verdicts)
    assert step.culprit == 5
    assert started == [4, 6, 5]


def test_a_break_fixed_inside_the_range_finds_the_newest_break() -> None:
    """Broken at 2, fixed at 4, broken again at 7: the red commit is red for 7's break."""
    verdicts = [True, True, False, False, True, True, True, False, False]
    step, started = _run(verdicts)
    assert step.culprit == 7
    assert len(started) <= 3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40), st.integers(2, 4))
def test_concurrent_probes_still_name_a_culprit(middle: list[bool], width: int) -> None:
    verdicts = [True, *middle, False]
    step, started = _run(verdicts, max_concurrent=width)
    assert step.state is SearchState.FOUND and step.culprit is not None
    assert not verdicts[step.culprit] and verdicts[step.culprit - 1]
    assert len(set(started)) == len(started)


def test_two_probes_at_once_split_the_range_in_three() -> None:
    known = [Known.GREEN, *[Known.UNKNOWN] * 8, Known.RED]
    step = bisect_step(known, 0, 9, skipped=frozenset(), builds=0, max_builds=10,
                       max_concurrent=2, fixed=False)
    assert step.state is SearchState.BISECTING
    # the middle first, then the middle of the wider half left
    assert step.probes == (4, 6)


def test_budget_spent_stops_and_says_where_the_culprit_is() -> None:
    verdicts = [True] * 20 + [False] * 13
    step, started = _run(verdicts, max_builds=2)
    assert step.state is SearchState.BUDGET_SPENT
    assert len(started) == 2
    assert step.lo < 20 <= step.hi


def test_commits_that_cannot_be_validated_are_passed_by() -> None:
    verdicts = [True, True, True, True, False, False, False, False, False]
    step, started = _run(verdicts, unvalidatable=frozenset({4}))
    # 4 is the first red commit but cannot be validated: the search narrows to 4..5
    assert step.state is SearchState.INCONCLUSIVE
    assert (step.lo, step.hi) == (3, 5)
    assert started == [4, 3, 5]
    everything = _run([True, False, False, False], unvalidatable=frozenset({1, 2}))[0]
    assert everything.state is SearchState.INCONCLUSIVE
    assert (everything.lo, everything.hi) == (0, 3)


def test_fixed_stops_unless_the_culprit_is_known_already() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.UNKNOWN, Known.RED]
    fixed = bisect_step(known, 0, 3, skipped=frozenset(), builds=1, max_builds=10,
                        max_concurrent=1, fixed=True)
    assert fixed.state is SearchState.FIXED and fixed.probes == ()
    known[2] = Known.GREEN
    found = bisect_step(known, 0, 3, skipped=frozenset(), builds=1, max_builds=10,
                        max_concurrent=1, fixed=True)
    assert found.state is SearchState.FOUND and found.culprit == 3


def test_a_running_probe_is_waited_for() -> None:
    known = [Known.GREEN, Known.UNKNOWN, Known.RUNNING, Known.UNKNOWN, Known.RED]
    step = bisect_step(known, 0, 4, skipped=frozenset(), builds=1, max_builds=10,
                       max_concurrent=1, fixed=False)
    assert step.state is SearchState.BISECTING and step.probes == ()


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
