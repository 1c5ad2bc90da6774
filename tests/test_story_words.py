"""The words of the branch's story (streams/web/story.py), as plain functions: what each
state of a Request says, the commits of a culprit search's range never built, the search
itself, and the summary paragraph."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from store import (
    Build,
    BuildStatus,
    Request,
    RequestKind,
    RequestState,
    ValidationFact,
    Verdict,
)
from store.culprits import CulpritSearch, SearchState
from streams.web.queries import Pin
from streams.web.story import (
    CulpritView,
    Entry,
    Promotion,
    duration,
    request_words,
    search_view,
    summary,
    unbuilt_words,
)

NOW = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
Q = "mono/main"


def uri(name: str) -> str:
    return f"fake://r/main/{name}"


def name(u: str) -> str:
    return u.rsplit("/", 1)[1]


def request(n: str, commit: str, state: RequestState, *, kind: RequestKind = RequestKind.HEAD,
            verdict: Verdict | None = None, attempt: int = 1, reason: str = "",
            ago: float = 60.0, **more: object) -> Request:
    at = NOW - timedelta(seconds=ago)
    return Request(queue=Q, id=f"request/{Q}/{n}", uri=uri(commit), state=state,
                   build_strategy=None, base_uri=None, version=1, created_at=at,
                   updated_at=at, kind=kind, attempt=attempt, verdict=verdict,
                   reason=reason, **more)  # type: ignore[arg-type]


def build(request_id: str, status: BuildStatus, *, ago: float = 42.0,
          attempt: int = 1) -> Build:
    at = NOW - timedelta(seconds=ago)
    return Build(queue=Q, id="b1", request_id=request_id, status=status, version=1,
                 created_at=at, updated_at=at, attempt=attempt)


def words(r: Request, b: Build | None = None, fact: ValidationFact | None = None, *,
          newer: Request | None = None, holders: list[tuple[Request, Build | None]] | None = None,
          search: CulpritSearch | None = None) -> str:
    return request_words(r, b, fact, now=NOW, newer_head=newer, holders=holders or [],
                         search=search, name=name)


def search(state: SearchState = SearchState.BISECTING, *, lo: int = 0, hi: int = 4,
           culprit: str | None = None, builds: int = 1, probes: int = 1,
           detail: str = "", confirmed: bool | None = None, why: str | None = None,
           candidate: str | None = None) -> CulpritSearch:
    commits = tuple(uri(f"c{i}") for i in range(5))
    culprit_index = commits.index(uri(culprit)) if culprit else None
    return CulpritSearch(
        queue=Q, red_request_id=f"request/{Q}/2", red_uri=uri("c4"),
        green_request_id=f"request/{Q}/1", green_uri=uri("c0"), commits=commits, lo=lo,
        hi=hi, skipped=(), probes=tuple(f"request/{Q}/1~{i + 1}" for i in range(probes)),
        builds=builds, max_builds=4, state=state, detail=detail,
        culprit_uri=uri(culprit) if culprit else None,
        culprit_request_id=f"request/{Q}/1~{culprit_index}" if culprit_index else None,
        created_at=NOW, updated_at=NOW, ended_at=None if state is SearchState.BISECTING
        else NOW, version=1,
        confirmed=(True if confirmed is None else confirmed) if culprit else None,
        unconfirmed_reason=why, candidate_uri=uri(candidate) if candidate else None)


def test_durations() -> None:
    assert [duration(s) for s in (0, 45.4, 60, 185, 3600, 7860, 86400, 97200)] == [
        "0 s", "45 s", "1 min", "3 min 5 s", "1 h", "2 h 11 min", "1 d", "1 d 3 h"]


def test_superseded_waiting_and_building() -> None:
    newer = request("3", "c3", RequestState.ACCEPTED)
    assert words(request("2", "c2", RequestState.SUPERSEDED), newer=newer) == (
        f"superseded by request/{Q}/3 (c3), a newer head: never built")
    holder = request("1", "c1", RequestState.PROCESSING)
    running = build(holder.id, BuildStatus.RUNNING, ago=125)
    assert words(newer, holders=[(holder, running)]) == (
        f"waiting 1 min for a slot behind request/{Q}/1 (c1, building for 2 min 5 s "
        f"(attempt 1, started 2026-12-02 11:57:55 UTC))")
    # a head with a newer head is superseded when next looked at, whatever holds the slot
    assert words(request("2", "c2", RequestState.ACCEPTED), newer=newer,
                 holders=[(holder, running)]).startswith(
        f"waiting; a newer head, request/{Q}/3 (c3), supersedes it")
    assert words(newer) == "waiting 1 min to be admitted"
    backfill = request("1~2", "c2", RequestState.ACCEPTED, kind=RequestKind.BACKFILL)
    assert words(backfill, holders=[(holder, running)]) == (
        "waiting 1 min for spare capacity (a backfill builds only while the heads leave a "
        "slot free)")
    assert words(holder, build(holder.id, BuildStatus.RUNNING)) == (
        "building for 42 s (attempt 1, started 2026-12-02 11:59:18 UTC)")
    assert words(holder, build(holder.id, BuildStatus.ACCEPTED, ago=5)) == (
        "queued at the build runner for 5 s (attempt 1, triggered 2026-12-02 11:59:55 UTC)")
    assert words(holder) == "admitted: starting its build (attempt 1)"
    again = replace(holder, attempt=2, attempt_due_in=30.0, red_reruns=1)
    assert words(again, running) == (
        "attempt 2 starts in 30 s (a red build is run again (retry.red))")
    passed = request("1~1", "c1", RequestState.SUPERSEDED, kind=RequestKind.BACKFILL,
                     reason="its search ended")
    assert words(passed) == "passed over: its search ended"


def test_outcomes() -> None:
    green = request("1", "c1", RequestState.SUCCEEDED, verdict=Verdict.GREEN)
    assert words(green) == "green"
    fact = ValidationFact(queue=Q, uri=uri("c1"), project="", degree=0.0,
                          request_id=green.id, created_at=NOW, attempts=2, flaky=True)
    assert words(replace(green, attempt=2), fact=fact) == (
        "green (flaky: red first, green when run again) after 2 attempts")
    lost = request("2", "c2", RequestState.FAILED, reason="the build's host was lost")
    assert words(lost) == "could not be validated: the build's host was lost"
    assert words(replace(lost, reason="could not be validated: no build started")) == (
        "could not be validated: no build started")
    assert words(request("2", "c2", RequestState.CANCELLED, reason="cancelled by Ada")) == (
        "cancelled: cancelled by Ada")
    red = request("2", "c4", RequestState.FAILED, verdict=Verdict.RED)
    assert words(red) == "red"


def test_red_and_its_culprit() -> None:
    found = search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=2, probes=2)
    culprit = request("1~2", "c2", RequestState.FAILED, kind=RequestKind.BACKFILL,
                      verdict=Verdict.RED)
    assert words(culprit, search=found) == (
        "red — the culprit: its first parent is green and every commit after it is red")
    head = request("2", "c4", RequestState.FAILED, verdict=Verdict.RED, attempt=2)
    assert words(head, search=found) == "red after 2 attempts — broken since the culprit c2"
    assert words(head, search=search(lo=0, hi=4)) == (
        "red after 2 attempts — finding the culprit: it is among 4 commits")
    unsure = search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=2, probes=2,
                    confirmed=False, why="1 commit between it and the head could not be "
                                         "validated")
    assert words(culprit, search=unsure) == (
        "red — a break (its first parent is green), not confirmed as the head's: 1 commit "
        "between it and the head could not be validated")
    assert words(head, search=unsure) == (
        "red after 2 attempts — after c2, a break not confirmed as the head's")
    old = request("1~1", "c1", RequestState.FAILED, kind=RequestKind.BACKFILL,
                  verdict=Verdict.RED)
    assert words(old, search=unsure) == "red — a break fixed before c2"
    confirming = search(lo=1, hi=2, candidate="c2")
    assert words(culprit, search=confirming) == (
        "red — a break (its first parent is green); the commits between it and the head "
        "are being built to confirm it is the head's")
    assert words(head, search=confirming) == (
        "red after 2 attempts — finding the culprit: confirming the break c2")
    spent = search(SearchState.BUDGET_SPENT, lo=1, hi=4, detail="backfill.max_builds (4) "
                   "spent; the culprit is among 3 commits")
    assert words(head, search=spent) == (
        "red after 2 attempts — the culprit is not known: backfill.max_builds (4) spent; "
        "the culprit is among 3 commits")


def test_unbuilt_commits() -> None:
    found = search(SearchState.FOUND, lo=1, hi=2, culprit="c2")
    assert unbuilt_words(found, 3, name) == "never built: after the culprit c2"
    unsure = search(SearchState.FOUND, lo=1, hi=2, culprit="c2", confirmed=False, why="x")
    assert unbuilt_words(unsure, 3, name) == (
        "never built: between the break c2 and the head, so a later fix and break could "
        "hide here")
    assert unbuilt_words(unsure, 1, name) == "never built: before the break c2"
    confirming = search(lo=1, hi=2, candidate="c2")
    assert unbuilt_words(confirming, 3, name) == (
        "not built yet: between the break c2 and the head; built to confirm it is the "
        "head's")
    bisecting = search(lo=1, hi=4)
    assert unbuilt_words(bisecting, 2, name) == (
        "not built yet: the culprit may be this commit (it is among 3 commits)")
    spent = search(SearchState.BUDGET_SPENT, lo=1, hi=3)
    assert unbuilt_words(spent, 2, name) == "never built: the culprit is among these 2 commits"
    assert unbuilt_words(spent, 4, name) == "never built"


def test_the_search_in_words() -> None:
    # only builds that ran are counted: a probe started, or one that could not validate,
    # spent nothing
    assert search_view(search(builds=0, probes=1), name).words == (
        "bisecting: the culprit is among 4 commits after c0; 0 backfill builds spent (at "
        "most 4)")
    waiting = replace(search(builds=1, probes=2), wake_at=NOW + timedelta(seconds=90))
    assert search_view(waiting, name).words == (
        "bisecting: the culprit is among 4 commits after c0; 1 backfill build spent (at "
        "most 4); a commit whose probe could not validate it is probed again at "
        "2026-12-02 12:01:30 UTC")
    confirming = search_view(search(lo=1, hi=2, candidate="c2", builds=2), name)
    assert (confirming.words, confirming.candidate_uri, confirming.confirmed) == (
        "confirming c2, a break after c1: the commits between it and the head are being "
        "built; 2 backfill builds spent (at most 4)", uri("c2"), None)
    found = search_view(search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=3,
                               probes=3), name)
    assert (found.words, found.builds, found.commits_left, found.commits, found.confirmed) == (
        "found c2 after 3 backfill builds; confirmed: every commit from it to the head is "
        "red", 3, 1, 4, True)
    unsure = search_view(search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=4,
                                confirmed=False, why="backfill.max_builds (4) was spent"),
                         name)
    assert (unsure.words, unsure.confirmed) == (
        "a break, not confirmed as the head's: c2, found after 4 backfill builds "
        "(backfill.max_builds (4) was spent)", False)
    # a culprit named by the release before confirmation was recorded: not confirmed
    old = replace(search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=2),
                  confirmed=None)
    assert search_view(old, name).words.startswith("a break, not confirmed as the head's: c2")
    assert old.unconfirmed_why == ("named by an earlier release, which did not check the "
                                   "commits between it and the head")
    at_once_old = replace(search(SearchState.FOUND, lo=3, hi=4, culprit="c4", builds=0),
                          confirmed=None)
    assert at_once_old.culprit_confirmed
    at_once = search_view(search(SearchState.FOUND, lo=3, hi=4, culprit="c4", builds=0,
                                 probes=0), name)
    assert at_once.words == ("found c4: its first parent is the last green commit, so no "
                             "backfill build was needed")
    assert search_view(search(SearchState.NO_RANGE, detail="the queue has no green commit "
                              "to search from"), name).words == (
        "not searched: the queue has no green commit to search from")


def entry(rid: str, commit: str, words: str, *, verdict: str | None = None,
          state: str = "failed") -> Entry:
    return Entry(request_id=f"request/{Q}/{rid}", uri=uri(commit), sha=f"{commit}ffffffffffff",
                 subject=f"{commit}: change", author="Ada <ada@example.invalid>",
                 kind="head", state=state, verdict=verdict, words=words, build=None,
                 bookmark=False, culprit=False)


@pytest.mark.parametrize("pinned", [False, True])
def test_the_summary(pinned: bool) -> None:
    head = entry("2", "c4", "red — broken since the culprit c2", verdict="red")
    bookmark = entry("1~1", "c1", "green", verdict="green", state="succeeded")
    culprit = CulpritView(uri=uri("c2"), sha="c2ffffffffffffff", subject="c2: change",
                          author="Ada <ada@example.invalid>", committed_at=None,
                          request_id=f"request/{Q}/1~2", build=None, red_since=NOW,
                          found_at=NOW)
    view = search_view(search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=2,
                              probes=2), name)
    pin = Pin(uri=uri("c0"), request_id=f"request/{Q}/1", by="ada", reason="incident 7",
              at=NOW) if pinned else None
    promotion = Promotion(ref="verified-main", uri=uri("c0") if pinned else uri("c1"),
                          known=True, pinned=pin)
    told = summary(Q, head=head, bookmark=bookmark, search=view, culprit=culprit,
                   promotion=promotion, bookmark_name='c1ffffffffff "c1: change"',
                   ingested=True, cut=False)
    expected = (
        f'{Q} is red since c2ffffffffff "c2: change" by Ada <ada@example.invalid>, found '
        f'after 2 backfill builds. The newest head is c4ffffffffff "c4: change" '
        f"(request/{Q}/2): red — broken since the culprit c2. The bookmark, its last green "
        f'commit, is c1ffffffffff "c1: change" (request/{Q}/1~1). ')
    if pinned:
        expected += (f"The promotion ref verified-main is pinned at {uri('c0')} by ada since "
                     f"2026-12-02 12:00:00 UTC: incident 7; it does not follow the bookmark "
                     f"until it is unpinned.")
    else:
        expected += "The promotion ref verified-main is at the bookmark."
    assert told == expected


def test_the_summary_of_a_break_not_confirmed_as_the_heads() -> None:
    head = entry("2", "c4", "red — after c2, a break not confirmed as the head's",
                 verdict="red")
    bookmark = entry("1~1", "c1", "green", verdict="green", state="succeeded")
    culprit = CulpritView(uri=uri("c2"), sha="c2ffffffffffffff", subject="c2: change",
                          author="Ada <ada@example.invalid>", committed_at=None,
                          request_id=f"request/{Q}/1~2", build=None, red_since=NOW,
                          found_at=NOW, confirmed=False,
                          unconfirmed_reason="backfill.max_builds (4) was spent before the "
                                             "1 commit between it and the head were built")
    view = search_view(search(SearchState.FOUND, lo=1, hi=2, culprit="c2", builds=4,
                              confirmed=False, why=culprit.unconfirmed_reason), name)
    nothing = Promotion(ref=None, uri=None, known=True, pinned=None)
    told = summary(Q, head=head, bookmark=bookmark, search=view, culprit=culprit,
                   promotion=nothing, bookmark_name="c1", ingested=True, cut=False)
    assert told.startswith(
        f'{Q} is red; a break, not confirmed as the head\'s: c2ffffffffff "c2: change" by '
        f"Ada <ada@example.invalid>, found after 4 backfill builds (backfill.max_builds (4) "
        f"was spent before the 1 commit between it and the head were built). The newest "
        f"head is"), told


def test_the_summary_of_a_green_queue_and_an_empty_one() -> None:
    head = entry("3", "c3", "green", verdict="green", state="succeeded")
    nothing = Promotion(ref=None, uri=None, known=True, pinned=None)
    assert summary(Q, head=head, bookmark=head, search=None, culprit=None,
                   promotion=nothing, bookmark_name='c3ffffffffff "c3: change"',
                   ingested=True, cut=True) == (
        f'{Q} is green at its newest head c3ffffffffff "c3: change". The bookmark, its '
        f'last green commit, is c3ffffffffff "c3: change" (request/{Q}/3). Only the 100 '
        f"newest entries are told.")
    assert summary(Q, head=None, bookmark=None, search=None, culprit=None,
                   promotion=nothing, bookmark_name=None, ingested=False, cut=False) == (
        f"{Q} has validated nothing yet.")
    waiting = entry("4", "c4", "waiting 5 s to be admitted", state="accepted")
    assert summary(Q, head=waiting, bookmark=head, search=None, culprit=None,
                   promotion=nothing, bookmark_name="c3", ingested=True,
                   cut=False).startswith(
        f"{Q} has no verdict yet on the heads after its last green commit. The newest "
        f'head is c4ffffffffff "c4: change" (request/{Q}/4): waiting 5 s to be admitted.')
