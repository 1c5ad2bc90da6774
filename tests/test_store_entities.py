"""Entity helpers (pure) and the request state machine, which the schema mirrors."""

from __future__ import annotations

import itertools

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import BuildStatus, RequestState, make_request_id, parse_request_id, request_seq
from store.entities import check_degree

queue_names = st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)


@given(queue=queue_names, n=st.integers(min_value=1, max_value=2**62))
def test_request_ids_round_trip(queue: str, n: int) -> None:
    request_id = make_request_id(queue, n)
    assert request_id.startswith("request/")
    assert parse_request_id(request_id) == (queue, n)
    assert request_seq(request_id) == n


@given(a=st.integers(min_value=1, max_value=10**6), b=st.integers(min_value=1, max_value=10**6))
def test_request_order_is_numeric_not_textual(a: int, b: int) -> None:
    ids = make_request_id("monorepo/main", a), make_request_id("monorepo/main", b)
    assert (request_seq(ids[0]) < request_seq(ids[1])) == (a < b)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "request/",
        "request/q",
        "request/q/",
        "request//3",
        "request/q/x",
        "req/q/1",
        "request/q/-1",
    ],
)
def test_malformed_request_ids_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_request_id(bad)


def test_counter_values_start_at_one() -> None:
    with pytest.raises(ValueError):
        make_request_id("q", 0)


def test_request_state_machine_is_the_designed_one() -> None:
    s = RequestState
    edges = {(a, b) for a, b in itertools.product(s, s) if a.can_become(b)}
    assert edges == {
        (s.ACCEPTED, s.PROCESSING),
        (s.ACCEPTED, s.SUPERSEDED),
        (s.ACCEPTED, s.FAILED),
        (s.PROCESSING, s.SUCCEEDED),
        (s.PROCESSING, s.FAILED),
        (s.PROCESSING, s.CANCELLED),
    }
    assert {x for x in s if x.is_terminal} == {s.SUPERSEDED, s.SUCCEEDED, s.FAILED, s.CANCELLED}
    assert {x for x in s if x.is_outcome} == {s.SUCCEEDED, s.FAILED, s.CANCELLED}


def test_build_statuses() -> None:
    b = BuildStatus
    assert {x for x in b if x.is_terminal} == {b.SUCCEEDED, b.FAILED, b.CANCELLED}
    assert b.SUCCEEDED.request_outcome is RequestState.SUCCEEDED
    assert b.FAILED.request_outcome is RequestState.FAILED
    assert b.CANCELLED.request_outcome is RequestState.CANCELLED
    with pytest.raises(ValueError):
        _ = b.RUNNING.request_outcome


def test_degree_bounds() -> None:
    assert check_degree(0) == 0.0 and check_degree(1) == 1.0
    for bad in (-0.01, 1.01, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            check_degree(bad)


@pytest.mark.postgres
def _verdict(state: RequestState) -> str | None:
    """A verdict the state allows (succeeded is green; failed may be red)."""
    return {RequestState.SUCCEEDED: "green", RequestState.FAILED: "red"}.get(state)


def test_the_database_trigger_allows_exactly_the_python_state_machine(
    migrated_dsn: str,
) -> None:
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        for n, (old, new) in enumerate(itertools.product(RequestState, RequestState), 1):
            if old is new:
                continue
            request_id = make_request_id("q", n)
            strategy = "full" if old is not RequestState.ACCEPTED else None
            conn.execute(
                "INSERT INTO request (queue, id, uri, state, build_strategy, verdict)"
                " VALUES ('q', %s, %s, %s, %s, %s)",
                (request_id, f"uri-{n}", old.value, strategy, _verdict(old)),
            )
            new_strategy = "full" if new is RequestState.PROCESSING else strategy
            try:
                conn.execute(
                    "UPDATE request SET state = %s, build_strategy = %s, verdict = %s"
                    " WHERE id = %s",
                    (new.value, new_strategy, _verdict(new), request_id),
                )
                allowed = True
            except psycopg.IntegrityError as exc:
                assert exc.diag.constraint_name == "request_state_transition"
                allowed = False
            assert allowed == old.can_become(new), (old, new)
