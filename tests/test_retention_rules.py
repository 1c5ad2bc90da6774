"""Issue 25, item 6: what retention keeps, case by case, as pure functions
(`streams.stages.retention_rules`): every rule of "never deletes what a gate or a person
still needs" is a case here, and Hypothesis checks that a commit's answer never turns into
an older validation's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import Request, RequestKind, RequestState, Verdict, commit_request_id, request_order
from store.retention import Holdings, QueueRefs, SearchRefs
from streams.stages.retention import MAX_REST, rest_after
from streams.stages.retention_rules import (
    Keep,
    Policy,
    greenness_cutoff,
    greenness_delete_before,
    protected,
    search_stays,
    walk_ends,
    why_kept,
)

NOW = datetime(2027, 1, 1, tzinfo=UTC)
CUTOFF = NOW - timedelta(days=180)
OLD = NOW - timedelta(days=200)
RECENT = NOW - timedelta(days=10)


def _request(request_id: str, state: RequestState = RequestState.SUCCEEDED, *,
             at: datetime = OLD, updated: datetime | None = None, recorded: bool = True,
             verdict: Verdict | str | None = "auto",
             kind: RequestKind = RequestKind.HEAD) -> Request:
    queue = request_id.removeprefix("request/").rsplit("/", 1)[0]
    if verdict == "auto":
        verdict = {RequestState.SUCCEEDED: Verdict.GREEN,
                   RequestState.FAILED: Verdict.RED}.get(state)
    assert verdict is None or isinstance(verdict, Verdict)
    return Request(queue=queue, id=request_id, uri=f"u:{request_id}", state=state,
                   build_strategy=None, base_uri=None, version=1, created_at=at,
                   updated_at=updated or at, kind=kind, verdict=verdict, recorded=recorded)


def _search(red: str, *, state: str = "bisecting", ended: datetime | None = None,
            newest: bool = False, green: str | None = None, culprit: str | None = None,
            probes: tuple[str, ...] = ()) -> SearchRefs:
    return SearchRefs(queue=red.removeprefix("request/").rsplit("/", 1)[0],
                      red_request_id=red, green_request_id=green, culprit_request_id=culprit,
                      probes=probes, state=state, ended_at=ended, newest=newest)


HOLDINGS = Holdings(
    queues=(QueueRefs("q", "request/q/10", "request/q/11", "request/q/12"),
            QueueRefs("q#web", "request/q#web/13", None, None)),
    project_pins=("request/q#web/14",),
    newest_facts=("request/q/15", "request/q/10"),
    searches=(_search("request/q/20", green="request/q/19", probes=("request/q/19~1",)),
              _search("request/q/30", state="found", ended=OLD, newest=True,
                      culprit="request/q/29"),
              _search("request/q/40", state="found", ended=RECENT, culprit="request/q/39"),
              _search("request/q/50", state="fixed", ended=OLD, green="request/q/49")),
    open_plans=("request/q/60",),
    project_bookmarks=("request/q/61",),
    streaks=("request/q/62",),
)


@pytest.mark.parametrize(("request_", "expected"), [
    # not terminal, or its verdict not recorded yet: always kept
    (_request("request/q/1", RequestState.ACCEPTED), Keep.LIVE),
    (_request("request/q/1", RequestState.PROCESSING), Keep.LIVE),
    (_request("request/q/1", recorded=False), Keep.UNRECORDED),
    (_request("request/q/1", RequestState.FAILED, recorded=False), Keep.UNRECORDED),
    # failed without a verdict (could not validate): nothing to record, so it goes
    (_request("request/q/1", RequestState.FAILED, verdict=None, recorded=False), None),
    # inside retention, by creation or by its last change
    (_request("request/q/1", at=RECENT), Keep.RECENT),
    (_request("request/q/1", updated=RECENT), Keep.RECENT),
    (_request("request/q/1", updated=CUTOFF), Keep.RECENT),
    # named by the family's rows
    (_request("request/q/10"), Keep.BOOKMARK),  # the bookmark and a newest fact: first wins
    (_request("request/q/11", RequestState.SUPERSEDED), Keep.LATEST),
    (_request("request/q/12"), Keep.PIN),
    (_request("request/q#web/13"), Keep.BOOKMARK),  # a scope's bookmark
    (_request("request/q#web/14"), Keep.PIN),  # a project's pin
    (_request("request/q/15", RequestState.FAILED), Keep.NEWEST),
    (_request("request/q/20", RequestState.FAILED), Keep.SEARCH),  # an open search's red
    (_request("request/q/19"), Keep.SEARCH),  # ... its green
    (_request("request/q/19~1", kind=RequestKind.BACKFILL), Keep.SEARCH),  # ... its probe
    (_request("request/q/29", RequestState.FAILED), Keep.SEARCH),  # the newest's culprit
    (_request("request/q/39", RequestState.FAILED), Keep.SEARCH),  # ended after the cutoff
    (_request("request/q/49"), None),  # a search ended long ago, not the newest: it goes
    (_request("request/q/50", RequestState.FAILED), None),
    (_request("request/q/60"), Keep.PLAN),
    (_request("request/q/61"), Keep.PROJECT_BOOKMARK),
    (_request("request/q/62", RequestState.FAILED), Keep.STREAK),
    # a commit validated again after a kept validation: its answer stays the newest's
    (_request("request/q/20.2"), Keep.NEWER_VALIDATION),
    (_request("request/q/10.3", RequestState.FAILED, verdict=None), Keep.NEWER_VALIDATION),
    (_request("request/q/19~1.2"), Keep.NEWER_VALIDATION),
    # ... but not another commit after it, nor an older validation
    (_request("request/q/10~1", kind=RequestKind.BACKFILL), None),
    (_request("request/q/21"), None),
    # a project's Request of a kept Request of the queue (same number and validation)
    (_request("request/q#web/10"), Keep.PROJECT_REQUEST),
    (_request("request/q#web/20.2"), None),  # its parent is kept, but for its own state
    (_request("request/q#web/21"), None),
    # everything else older than the cutoff goes
    (_request("request/q/1"), None),
    (_request("request/q/2", RequestState.SUPERSEDED), None),
    (_request("request/q/3", RequestState.CANCELLED), None),
    (_request("request/other/10"), None),  # another queue's id: named nothing
], ids=lambda v: v.id if isinstance(v, Request) else str(v))
def test_what_retention_keeps(request_: Request, expected: Keep | None) -> None:
    assert why_kept(request_, CUTOFF, protected(HOLDINGS, CUTOFF)) is expected


def test_a_projects_request_is_kept_while_an_answer_that_stays_names_it() -> None:
    held = protected(Holdings(), CUTOFF)
    source = _request("request/q#web/7")
    assert why_kept(source, CUTOFF, held) is None
    assert why_kept(source, CUTOFF, held, answered={"request/q#web/7"}) is Keep.ANSWER_SOURCE


def test_an_older_validation_of_a_kept_commit_goes() -> None:
    held = protected(Holdings(newest_facts=("request/q/5.2",)), CUTOFF)
    assert why_kept(_request("request/q/5.2"), CUTOFF, held) is Keep.NEWEST
    assert why_kept(_request("request/q/5", RequestState.FAILED), CUTOFF, held) is None
    assert why_kept(_request("request/q/5.3", RequestState.FAILED), CUTOFF,
                    held) is Keep.NEWER_VALIDATION


@pytest.mark.parametrize(("search", "stays"), [
    (_search("request/q/1"), True),
    (_search("request/q/1", state="found", ended=OLD, newest=True), True),
    (_search("request/q/1", state="budget_spent", ended=RECENT), True),
    (_search("request/q/1", state="found", ended=CUTOFF), True),
    (_search("request/q/1", state="inconclusive", ended=OLD), False),
    (_search("request/q/1", state="no_range", ended=CUTOFF - timedelta(seconds=1)), False),
])
def test_which_culprit_searches_stay(search: SearchRefs, stays: bool) -> None:
    assert search_stays(search, CUTOFF) is stays


@pytest.mark.parametrize(("newest_before", "newest_green", "expected"), [
    (None, None, None),  # nothing before the cutoff
    (None, OLD, None),
    (OLD, None, OLD),  # never green: all but the newest before the cutoff
    (OLD, RECENT, OLD),  # green since after the cutoff: the one before it stays
    (OLD, OLD - timedelta(days=5), OLD - timedelta(days=5)),  # a red streak since then
])
def test_greenness_history_keeps_the_window_start_and_the_current_streak(
        newest_before: datetime | None, newest_green: datetime | None,
        expected: datetime | None) -> None:
    assert greenness_delete_before(newest_before, newest_green) == expected


def test_greenness_history_always_covers_the_share_of_time_red_window() -> None:
    week = timedelta(days=7)
    assert greenness_cutoff(CUTOFF, NOW, week) == CUTOFF
    assert greenness_cutoff(NOW - timedelta(days=2), NOW, week) == NOW - week


def test_a_walk_ends_at_the_first_head_ingested_after_the_cutoff() -> None:
    assert walk_ends(_request("request/q/9", at=RECENT), CUTOFF)
    assert not walk_ends(_request("request/q/9"), CUTOFF)
    # a commit validated again or backfilled lately sorts among old heads: go on
    assert not walk_ends(_request("request/q/9.2", at=RECENT, kind=RequestKind.RETRY),
                         CUTOFF)
    assert not walk_ends(_request("request/q/9~2", at=RECENT, kind=RequestKind.BACKFILL),
                         CUTOFF)


def test_the_policy_refuses_what_would_delete_todays_history() -> None:
    with pytest.raises(ValueError, match="at least 1 day"):
        Policy(timedelta(hours=23), 100)
    with pytest.raises(ValueError, match="keep_newest"):
        Policy(timedelta(days=180), 0)


# --- a commit's answer never turns into an older validation's ---------------------------

_validation = st.tuples(
    st.integers(min_value=1, max_value=4),  # the commit
    st.integers(min_value=1, max_value=4),  # its validation
    st.sampled_from([RequestState.SUCCEEDED, RequestState.FAILED, RequestState.CANCELLED,
                     RequestState.SUPERSEDED, RequestState.PROCESSING]),
    st.booleans(),  # named by a row (a bookmark, a search, a newest fact ...)
)


@given(st.lists(_validation, max_size=16, unique_by=lambda v: (v[0], v[1])),
       st.dictionaries(st.integers(min_value=1, max_value=4),
                       st.integers(min_value=1, max_value=5)))
def test_a_commit_keeps_its_newest_validation_whenever_it_keeps_any(
        validations: list[tuple[int, int, RequestState, bool]],
        recent_from: dict[int, int]) -> None:
    """``recent_from``: per commit, its first validation created after the cutoff (a
    later validation is created later)."""
    requests = {}
    named = []
    # a Request still under way was created after the cutoff (deadlines and the
    # reconcilers end every Request within hours), and so was every later validation
    recent_from = dict(recent_from)
    for commit, k, state, _ in validations:
        if not state.is_terminal:
            recent_from[commit] = min(recent_from.get(commit, 5), k)
    for commit, k, state, is_named in validations:
        request_id = f"request/q/{commit}" + (f".{k}" if k > 1 else "")
        old = k < recent_from.get(commit, 5)
        requests[request_id] = _request(request_id, state, at=OLD if old else RECENT)
        if is_named:
            named.append(request_id)
    held = protected(Holdings(newest_facts=tuple(named)), CUTOFF)
    stays = [r for r in requests.values() if why_kept(r, CUTOFF, held) is not None]
    for commit in {commit_request_id(r.id) for r in stays}:
        validations_of = [r for r in requests.values() if commit_request_id(r.id) == commit]
        newest = max(validations_of, key=lambda r: request_order(r.id))
        assert newest in stays, (commit, [r.id for r in stays])


# --- pacing: a round works its duty cycle of the time -------------------------------------


@given(busy=st.floats(0, 100), duty=st.floats(0.01, 1))
def test_rest_makes_work_the_duty_cycle_of_the_time(busy: float, duty: float) -> None:
    rest = rest_after(busy, duty)
    assert 0 <= rest <= MAX_REST
    if duty == 1 or busy == 0:
        assert rest == 0
    elif rest < MAX_REST:
        assert busy / (busy + rest) == pytest.approx(duty)
