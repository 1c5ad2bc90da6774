"""A project's state at the queue's head (streams/web/project_states.py, issue 24 Deliver
5), as a pure function of what the reads found: built green or red, unaffected (inheriting
green or red, from where), pending while nothing is known yet, and could not be validated
(why) — never green without a green verdict, never pending for a head that ended without
one."""

from __future__ import annotations

from datetime import UTC, datetime

from store import Request, RequestState, Verdict
from store.projects import ProjectAnswer, RequestPlan
from streams.web.project_states import head_state

AT = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
Q = "mono/main"
SHA1 = "1" * 40
SHA5 = "5" * 40


def _uri(sha: str) -> str:
    return f"git+/srv/mono#main@{sha}"


def _request(queue: str, state: RequestState, *, verdict: Verdict | None = None,
             reason: str = "") -> Request:
    return Request(queue=queue, id=f"request/{queue}/5", uri=_uri(SHA5), state=state,
                   build_strategy=None, base_uri=None, version=1, created_at=AT,
                   updated_at=AT, verdict=verdict, reason=reason)


def _plan(*affected: str) -> RequestPlan:
    return RequestPlan(queue=Q, request_id=f"request/{Q}/5", affected=affected, reason="",
                       backstop=False, rules_unaffected=(), completed=False, created_at=AT)


def _answer(degree: float, *, inherited: bool, flaky: bool = False) -> ProjectAnswer:
    source = (f"request/{Q}#api/1", _uri(SHA1)) if inherited else (
        f"request/{Q}#api/5", _uri(SHA5))
    return ProjectAnswer(queue=Q, request_id=f"request/{Q}/5", project="api",
                         uri=_uri(SHA5), degree=degree, inherited=inherited,
                         source_request_id=source[0], source_uri=source[1], flaky=flaky,
                         attempts=1, created_at=AT)


HEAD = _request(Q, RequestState.PROCESSING)


def test_an_answer_says_built_or_inherited_and_its_colour() -> None:
    built = head_state(HEAD, _plan("api"), "api", _answer(0.0, inherited=False), None)
    assert (built.state, built.green, built.words) == ("green", True,
                                                       "green: built at this head")
    red = head_state(HEAD, _plan("api"), "api", _answer(1.0, inherited=False), None)
    assert (red.state, red.green) == ("red", False)
    flaky = head_state(HEAD, _plan("api"), "api", _answer(0.0, inherited=False, flaky=True),
                       None)
    assert flaky.words == "green (flaky: green on a re-run): built at this head"
    for degree, colour in ((0.0, "green"), (1.0, "red")):
        kept = head_state(HEAD, _plan(), "api", _answer(degree, inherited=True), None)
        assert (kept.state, kept.green, kept.words) == (
            "unaffected", degree == 0, f"unaffected, inherits {colour} from {SHA1[:12]}")


def test_without_an_answer_the_state_is_pending_until_something_ended() -> None:
    nothing = head_state(None, None, "api", None, None)
    assert (nothing.state, nothing.green, nothing.words) == (
        "pending", None, "nothing was ingested yet")
    waiting = head_state(_request(Q, RequestState.ACCEPTED), None, "api", None, None)
    assert (waiting.state, waiting.words) == (
        "pending", "the head waits for the queue's slot: its projects are not planned yet")
    planning = head_state(HEAD, None, "api", None, None)
    assert (planning.state, planning.words) == (
        "pending", "the head's projects are being planned")
    child = _request(f"{Q}#api", RequestState.PROCESSING)
    building = head_state(HEAD, _plan("api"), "api", None, child)
    assert (building.state, building.words) == (
        "pending", f"being validated: request/{Q}#api/5")
    not_yet = head_state(HEAD, _plan("api"), "api", None, None)
    assert not_yet.state == "pending"
    added_later = head_state(HEAD, _plan("web"), "api", None, None)
    assert added_later.state == "pending" and "added later" in added_later.words


def test_a_verdict_whose_answer_is_being_written_says_the_verdict() -> None:
    ended = _request(f"{Q}#api", RequestState.SUCCEEDED, verdict=Verdict.GREEN)
    assert head_state(HEAD, _plan("api"), "api", None, ended) == head_state(
        HEAD, _plan("api"), "api", _answer(0.0, inherited=False), None)
    red = _request(f"{Q}#api", RequestState.FAILED, verdict=Verdict.RED)
    assert head_state(HEAD, _plan("api"), "api", None, red).state == "red"


def test_a_build_or_a_head_that_ended_without_a_verdict_could_not_validate() -> None:
    lost = _request(f"{Q}#api", RequestState.FAILED,
                    reason="could not be validated: the build's host was lost")
    state = head_state(HEAD, _plan("api"), "api", None, lost)
    assert (state.state, state.green, state.words) == (
        "unvalidated", None, "could not be validated: the build's host was lost")
    bare = _request(f"{Q}#api", RequestState.FAILED, reason="trigger refused")
    assert head_state(HEAD, _plan("api"), "api", None, bare).words == (
        "could not be validated: trigger refused")
    cancelled = _request(f"{Q}#api", RequestState.CANCELLED, reason="by ada")
    assert head_state(HEAD, _plan("api"), "api", None, cancelled).words == (
        f"could not be validated: request/{Q}#api/5 was cancelled: by ada")
    reconciled = _request(Q, RequestState.FAILED,
                          reason="could not be validated: a dead letter")
    before_plan = head_state(reconciled, None, "api", None, None)
    assert (before_plan.state, before_plan.words) == (
        "unvalidated", "could not be validated: a dead letter")
