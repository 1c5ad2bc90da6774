"""Issue 16, items 1 to 4 as pure logic: how an attempt ends (`streams.stages.attempts`), and how
long a loop waits for a dependency that is down (`streams.stages.kit.dependency_wait`).
Hypothesis over every count and every observation."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store import BuildStatus, Request, RequestState, UnvalidatedCause, Verdict
from streams.config.queues import RetrySpec
from streams.extensions.buildrunner import BuildRunnerError
from streams.runtime import headers as h
from streams.runtime.stage import Context, Incoming
from streams.stages import attempts
from streams.stages.kit import WAIT_CAP, dependency_wait, is_dependency_unavailable

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _request(attempt: int, unvalidated: int, red: int) -> Request:
    return Request(queue="q", id="request/q/1", uri="fake://r/m/c1",
                   state=RequestState.PROCESSING, build_strategy=None, base_uri=None,
                   version=1, created_at=NOW, updated_at=NOW, attempt=attempt,
                   unvalidated_retries=unvalidated, red_reruns=red)


observations = st.sampled_from([
    attempts.Observed(BuildStatus.SUCCEEDED, Verdict.GREEN),
    attempts.Observed(BuildStatus.FAILED, Verdict.RED),
    attempts.Observed(BuildStatus.FAILED, Verdict.RED, "it ran past the poll deadline"),
    attempts.Observed(BuildStatus.FAILED, None, "its host was lost: host a"),
    attempts.Observed(BuildStatus.FAILED, None, "its trigger was refused: 422",
                      permanent=True),
    attempts.Observed(BuildStatus.CANCELLED, None),
])
retries = st.builds(RetrySpec, unvalidated=st.integers(0, 4), red=st.integers(0, 3),
                    backoff=st.sampled_from([timedelta(seconds=1), timedelta(seconds=30)]))


@given(observed=observations, retry=retries, unvalidated=st.integers(0, 5),
       red=st.integers(0, 5))
def test_an_attempt_ends_as_the_table_says(observed: attempts.Observed, retry: RetrySpec,
                                           unvalidated: int, red: int) -> None:
    request = _request(1 + unvalidated + red, unvalidated, red)
    end = attempts.decide(request, observed, retry)
    if observed.status is BuildStatus.SUCCEEDED:
        # green is final at once, on any attempt
        assert end.settle and end.outcome is RequestState.SUCCEEDED
        assert end.verdict is Verdict.GREEN
    elif observed.status is BuildStatus.CANCELLED:
        # cancelled: no verdict, no fact, never tried again
        assert end.settle and end.outcome is RequestState.CANCELLED and end.verdict is None
    elif observed.verdict is Verdict.RED:
        if red < retry.red:  # a red build re-runs at once while re-runs remain
            assert not end.settle and end.again_after == "red" and end.backoff == 0
        else:
            assert end.settle and end.outcome is RequestState.FAILED
            assert end.verdict is Verdict.RED
    elif not observed.permanent and unvalidated < retry.unvalidated:
        # could not validate, for a cause that may go away: again, after the backoff
        # doubling per retry
        assert not end.settle and end.again_after == "unvalidated"
        assert end.backoff == min(retry.backoff.total_seconds() * 2 ** unvalidated,
                                  attempts.BACKOFF_CAP)
    elif red:
        # an earlier attempt was red: the red verdict stands (only a green re-run would
        # have overturned it), with why the re-run said nothing
        assert end.settle and end.outcome is RequestState.FAILED
        assert end.verdict is Verdict.RED and end.cause is None
        assert observed.reason in end.reason
    else:
        # failed without a verdict, with the reason and its cause: never red
        assert end.settle and end.outcome is RequestState.FAILED and end.verdict is None
        assert observed.reason in end.reason and "could not be validated" in end.reason
        assert end.cause is (UnvalidatedCause.PERMANENT if observed.permanent
                             else UnvalidatedCause.TRANSIENT)


@given(retry=retries)
def test_no_request_is_tried_more_often_than_its_queue_allows(retry: RetrySpec) -> None:
    """Whatever mix of ends its attempts have, a Request settles within 1 + unvalidated +
    red attempts."""
    for pattern in ("unvalidated", "red", "mixed"):
        request = _request(1, 0, 0)
        for n in range(1, 100):
            kind = pattern if pattern != "mixed" else ("red" if n % 2 else "unvalidated")
            observed = (attempts.Observed(BuildStatus.FAILED, Verdict.RED) if kind == "red"
                        else attempts.Observed(BuildStatus.FAILED, None, "lost"))
            end = attempts.decide(request, observed, retry)
            if end.settle:
                break
            request = _request(request.attempt + 1,
                               request.unvalidated_retries + (end.again_after == "unvalidated"),
                               request.red_reruns + (end.again_after == "red"))
        assert end.settle
        assert request.attempt <= 1 + retry.unvalidated + retry.red


def test_a_red_attempt_stands_when_the_re_runs_after_it_could_not_validate() -> None:
    """Issue 23, item 5: retry.red 1 — red, then a re-run whose host is lost on every
    attempt: the Request ends red (a red fact), not without a verdict."""
    retry = RetrySpec(unvalidated=2, red=1)
    request = _request(1, 0, 0)
    ends = []
    for observed in [attempts.Observed(BuildStatus.FAILED, Verdict.RED, "tests failed"),
                     *[attempts.Observed(BuildStatus.FAILED, None, "its host was lost")] * 3]:
        end = attempts.decide(request, observed, retry)
        ends.append(end)
        request = _request(request.attempt + 1,
                           request.unvalidated_retries + (end.again_after == "unvalidated"),
                           request.red_reruns + (end.again_after == "red"))
    assert [e.settle for e in ends] == [False, False, False, True]
    assert ends[-1].outcome is RequestState.FAILED and ends[-1].verdict is Verdict.RED
    # and a green re-run still overturns it (flaky), however many attempts said nothing
    end = attempts.decide(_request(3, 1, 1), attempts.Observed(BuildStatus.SUCCEEDED,
                                                                Verdict.GREEN), retry)
    assert end.settle and end.verdict is Verdict.GREEN


def test_a_permanent_cause_settles_at_once_and_says_so() -> None:
    """Issue 23, item 4: a refused trigger is not attempted again by itself."""
    end = attempts.decide(_request(1, 0, 0), attempts.Observed(
        BuildStatus.FAILED, None, "its trigger was refused: 404", permanent=True),
        RetrySpec(unvalidated=5))
    assert end.settle and end.verdict is None and end.cause is UnvalidatedCause.PERMANENT
    assert "would fail the same way" in end.reason
    with pytest.raises(ValueError, match="permanent"):
        attempts.Observed(BuildStatus.FAILED, Verdict.RED, "x", permanent=True)


def test_an_unvalidated_end_needs_its_reason_and_a_status_its_verdict() -> None:
    with pytest.raises(ValueError, match="reason"):
        attempts.Observed(BuildStatus.FAILED, None)
    with pytest.raises(ValueError, match="verdict"):
        attempts.Observed(BuildStatus.SUCCEEDED, Verdict.RED)
    with pytest.raises(ValueError, match="terminal"):
        attempts.Observed(BuildStatus.RUNNING, None)


def _ctx(waits: int) -> Context[None]:
    headers = [(h.WAITS, str(waits).encode())] if waits else []
    message = Incoming(topic="t", partition=0, offset=0, key=None, value=b"{}",
                       headers=headers)

    async def publish(key: str, payload: object) -> None:  # pragma: no cover
        raise AssertionError("not used")

    return Context(stage="buildsignal", message=message, publish=publish, deps=None,
                   log=logging.LoggerAdapter(logging.getLogger("test"), {}))


@given(floor=st.floats(0.05, 120), waits=st.integers(0, 50),
       retry_after=st.one_of(st.none(), st.floats(0, 7200)))
def test_a_loop_never_calls_a_dependency_that_is_down_sooner_than_asked(
        floor: float, waits: int, retry_after: float | None) -> None:
    error = BuildRunnerError("503", retryable=True, retry_after=retry_after)
    wait = dependency_wait(_ctx(waits), error, floor=floor)
    # never sooner than the healthy loop's own delay: an outage costs no extra calls
    assert wait.delay >= floor
    # never sooner than the dependency asked
    if retry_after is not None:
        assert wait.delay >= retry_after
    # and never much later than the cap once it is back (unless it asked for longer)
    assert wait.delay <= max(floor, WAIT_CAP, retry_after or 0)
    # backing off: more waits never wait less
    later = dependency_wait(_ctx(waits + 1), error, floor=floor)
    assert later.delay >= wait.delay


def test_what_counts_as_a_dependency_being_unavailable() -> None:
    import psycopg

    from store import VersionMismatch
    from streams.extensions.sourcecontrol import SourceControlError

    assert is_dependency_unavailable(BuildRunnerError("503", retryable=True))
    assert is_dependency_unavailable(SourceControlError("fetch failed", retryable=True))
    assert is_dependency_unavailable(TimeoutError())
    # a failure of the message walks the ladder
    assert not is_dependency_unavailable(BuildRunnerError("404 no such build"))
    assert not is_dependency_unavailable(SourceControlError("bad credentials"))
    # the broker or the database away is an outage the runtime waits out in place; a
    # lost compare-and-set is decided again at once
    assert not is_dependency_unavailable(psycopg.OperationalError("connection refused"))
    assert not is_dependency_unavailable(VersionMismatch("request", {}, expected_version=1,
                                                         actual_version=2))
