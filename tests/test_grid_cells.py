"""What a cell of the projects' grid says (streams/web/grid.py), case by case: a project's
answer (built, or inherited with its source), or why it has none — its build pending,
could not validate or cancelled, the head waiting, superseded or being planned, or the
project not planned at that head. Pure: no database."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from store import Request, RequestState, Verdict
from store.projects import ProjectAnswer, RequestPlan
from streams.web.grid import CellState, cell

NOW = datetime(2026, 12, 1, tzinfo=UTC)
HEAD = "request/mono/main/7"
CHILD = "request/mono/main#api/7"
URI = "git+/r#main@" + "7" * 40
SOURCE = "git+/r#main@" + "5" * 40


def _request(state: RequestState, *, queue: str = "mono/main", request_id: str = HEAD,
             verdict: Verdict | None = None, reason: str = "") -> Request:
    return Request(queue=queue, id=request_id, uri=URI, state=state, build_strategy=None,
                   base_uri=None, version=1, created_at=NOW, updated_at=NOW,
                   verdict=verdict, reason=reason)


def _plan(*affected: str) -> RequestPlan:
    return RequestPlan("mono/main", HEAD, affected, "", False, (), False, NOW)


def _answer(degree: float, *, inherited: bool) -> ProjectAnswer:
    return ProjectAnswer("mono/main", HEAD, "api", URI, degree, inherited,
                         "request/mono/main#api/5" if inherited else CHILD,
                         SOURCE if inherited else URI, False, 0 if inherited else 1, NOW)


@pytest.mark.parametrize(("degree", "state"), [(0.0, CellState.GREEN), (1.0, CellState.RED)])
def test_an_answer_is_built_or_inherited_with_its_source(degree: float,
                                                         state: CellState) -> None:
    head = _request(RequestState.SUCCEEDED)
    built = cell(head, _plan("api"), "api", _answer(degree, inherited=False), None, None)
    assert (built.state, built.inherited, built.request_id, built.source_sha) == (
        state, False, CHILD, None)
    inherited = cell(head, _plan(), "api", _answer(degree, inherited=True), None, None)
    assert (inherited.state, inherited.inherited, inherited.request_id,
            inherited.source_uri, inherited.source_sha) == (
        state, True, "request/mono/main#api/5", SOURCE, "5" * 40)


@pytest.mark.parametrize(("child", "state"), [
    (None, CellState.PENDING),  # planned, its Request being written
    (_request(RequestState.PROCESSING, queue="mono/main#api", request_id=CHILD),
     CellState.PENDING),
    (_request(RequestState.FAILED, queue="mono/main#api", request_id=CHILD,
              reason="could not be validated: lost host"), CellState.UNVALIDATED),
    (_request(RequestState.FAILED, queue="mono/main#api", request_id=CHILD,
              verdict=Verdict.RED), CellState.RED),  # its answer is being written
    (_request(RequestState.SUCCEEDED, queue="mono/main#api", request_id=CHILD,
              verdict=Verdict.GREEN), CellState.GREEN),
    (_request(RequestState.CANCELLED, queue="mono/main#api", request_id=CHILD,
              reason="cancelled by ada"), CellState.CANCELLED),
])
def test_an_affected_project_without_its_answer_says_why(child: Request | None,
                                                         state: CellState) -> None:
    shown = cell(_request(RequestState.PROCESSING), _plan("api"), "api", None, child, None)
    assert (shown.state, shown.inherited, shown.request_id) == (state, False, CHILD)
    assert shown.reason == (child.reason if child else "")


@pytest.mark.parametrize(("head", "state"), [
    (_request(RequestState.ACCEPTED), CellState.WAITING),
    (_request(RequestState.PROCESSING), CellState.PENDING),  # being planned
    (_request(RequestState.SUPERSEDED, reason="superseded by request/mono/main/8"),
     CellState.SUPERSEDED),
    (_request(RequestState.CANCELLED), CellState.CANCELLED),
    (_request(RequestState.FAILED, reason="could not be validated: its build step failed"),
     CellState.UNVALIDATED),
    (_request(RequestState.SUCCEEDED, verdict=Verdict.GREEN), CellState.NONE),
])
def test_a_head_without_a_plan_says_why(head: Request, state: CellState) -> None:
    shown = cell(head, None, "api", None, None, None)
    assert (shown.state, shown.inherited, shown.request_id, shown.reason) == (
        state, False, None, head.reason)


def test_a_project_added_after_the_plan_was_not_planned() -> None:
    shown = cell(_request(RequestState.SUCCEEDED), _plan("web"), "api", None, None, None)
    assert shown.state is CellState.NONE and "not planned" in shown.reason
