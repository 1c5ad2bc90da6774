"""The delivery decisions and delay-tier routing, as pure functions (Hypothesis)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.runtime import headers as h
from streams.runtime.classify import is_retryable, outcome_of_exception
from streams.runtime.outcome import ACK, Hold, NonRetryable, Retryable, RetryableError
from streams.runtime.policy import (
    MAX_RETRY_AFTER,
    Commit,
    DeadLetter,
    ParkMessage,
    Redeliver,
    Retry,
    choose_tier,
    decide,
    tier_wake_time,
)

delays = st.floats(min_value=0, max_value=600, allow_nan=False)
retries = st.builds(
    Retry,
    max_attempts=st.one_of(st.none(), st.integers(min_value=1, max_value=20)),
    backoff=st.lists(st.floats(min_value=0, max_value=300, allow_nan=False), min_size=1,
                     max_size=6).map(tuple),
    park_after=st.integers(min_value=1, max_value=10),
)
attempts = st.integers(min_value=0, max_value=50)
errors = st.sampled_from([ValueError("x"), RetryableError("y"), KeyError("z")])


@given(retry=retries, attempt=attempts, reconciler=st.booleans())
def test_ack_commits(retry: Retry, attempt: int, reconciler: bool) -> None:
    assert decide(ACK, attempt=attempt, retry=retry, reconciler=reconciler) == Commit()


@given(delay=delays, retry=retries, attempt=attempts, reconciler=st.booleans())
def test_hold_redelivers_after_its_delay_and_forgets_earlier_failures(
        delay: float, retry: Retry, attempt: int, reconciler: bool) -> None:
    action = decide(Hold(delay), attempt=attempt, retry=retry, reconciler=reconciler)
    assert action == Redeliver(delay=delay, attempt=0)


@given(error=errors, retry=retries, attempt=attempts)
def test_non_retryable_dead_letters_at_once(error: Exception, retry: Retry,
                                            attempt: int) -> None:
    action = decide(NonRetryable(error), attempt=attempt, retry=retry, reconciler=False)
    assert action == DeadLetter(attempts=attempt + 1, error=error)


@given(error=errors, retry=retries, attempt=attempts)
def test_retryable_retries_with_backoff_until_exhausted(error: Exception, retry: Retry,
                                                        attempt: int) -> None:
    action = decide(Retryable(error), attempt=attempt, retry=retry, reconciler=False)
    failures = attempt + 1
    if retry.max_attempts is not None and failures >= retry.max_attempts:
        assert action == DeadLetter(attempts=failures, error=error)
    else:
        expected = retry.backoff[min(failures, len(retry.backoff)) - 1]
        assert action == Redeliver(delay=expected, attempt=failures)


@given(error=errors, retry=retries, attempt=attempts)
def test_a_reconciler_retries_a_transient_failure_forever(error: Exception, retry: Retry,
                                                          attempt: int) -> None:
    action = decide(Retryable(error), attempt=attempt, retry=retry, reconciler=True)
    assert isinstance(action, Redeliver)  # never dead-lettered, never parked
    assert action.attempt == attempt + 1
    assert action.delay <= max(retry.backoff)  # capped


@given(error=errors, retry=retries, attempt=attempts)
def test_a_reconciler_parks_what_can_never_succeed_after_park_after_calls(
        error: Exception, retry: Retry, attempt: int) -> None:
    action = decide(NonRetryable(error), attempt=attempt, retry=retry, reconciler=True)
    failures = attempt + 1
    if failures >= retry.park_after:
        assert action == ParkMessage(attempts=failures, error=error)
    else:
        assert isinstance(action, Redeliver) and action.attempt == failures
        assert action.delay <= max(retry.backoff)


@given(error=errors, retry=retries)
def test_a_reconciler_message_that_never_succeeds_ends_parked(error: Exception,
                                                              retry: Retry) -> None:
    """Walking the attempts the way redeliveries do: the last action is always a park,
    reached after exactly park_after calls — never a retry without end."""
    attempt = 0
    while True:
        action = decide(NonRetryable(error), attempt=attempt, retry=retry, reconciler=True)
        if not isinstance(action, Redeliver):
            break
        attempt = action.attempt
    assert action == ParkMessage(attempts=retry.park_after, error=error)


tier_sets = st.lists(st.floats(min_value=0.01, max_value=300, allow_nan=False), min_size=1,
                     max_size=6, unique=True)


@given(remaining=st.floats(min_value=0, max_value=1000, allow_nan=False), tiers=tier_sets)
def test_tier_never_overshoots_unless_shortest(remaining: float, tiers: list[float]) -> None:
    tier = choose_tier(remaining, tiers)
    assert tier in tiers
    if tier > remaining:
        assert tier == min(tiers)
    else:
        assert all(t <= tier or t > remaining for t in tiers)  # the longest that fits


@given(due=st.floats(0, 1e6), appended=st.floats(0, 1e6), tier=st.floats(0.01, 300))
def test_wake_time_is_never_after_due(due: float, appended: float, tier: float) -> None:
    wake = tier_wake_time(due=due, appended=appended, tier=tier)
    assert wake <= due
    assert wake <= appended + tier


@given(appended=st.lists(st.floats(0, 1e5), min_size=2, max_size=20).map(sorted),
       tier=st.floats(0.01, 300), data=st.data())
def test_waking_on_the_head_never_delays_a_later_message_by_more_than_the_tier(
        appended: list[float], tier: float, data: st.DataObject) -> None:
    """Messages routed to a tier have at least `tier` to go (except the shortest tier),
    so wake times follow append order and waiting on the head costs the rest nothing."""
    dues = [a + tier + data.draw(st.floats(0, 1000)) for a in appended]
    wakes = [tier_wake_time(due=d, appended=a, tier=tier)
             for d, a in zip(dues, appended, strict=True)]
    assert wakes == sorted(wakes)


def test_classification_defaults_to_non_retryable() -> None:
    assert not is_retryable(ValueError("bad input"))
    assert not is_retryable(KeyError("k"))
    assert is_retryable(RetryableError("later"))
    assert is_retryable(TimeoutError())
    assert is_retryable(ConnectionResetError())
    assert isinstance(outcome_of_exception(RuntimeError("?")), NonRetryable)


def test_store_errors_are_classified_by_the_store() -> None:
    from store import NotFound, VersionMismatch

    assert is_retryable(VersionMismatch("request", {"id": "r"}, expected_version=1,
                                        actual_version=2))
    assert not is_retryable(NotFound("request", {"id": "r"}))


def test_headers_replace_keeps_others_and_takes_the_last_value() -> None:
    hdrs = [("a", b"1"), (h.ATTEMPT, b"2"), ("b", b"3")]
    out = h.replace(hdrs, {h.ATTEMPT: 5, h.DUE_MS: 10})
    assert out == [("a", b"1"), ("b", b"3"), (h.ATTEMPT, b"5"), (h.DUE_MS, b"10")]
    assert h.get_int(out, h.ATTEMPT) == 5
    assert h.get_int([(h.ATTEMPT, b"junk")], h.ATTEMPT) == 0
    assert h.without_runtime(out) == [("a", b"1"), ("b", b"3"), (h.ATTEMPT, b"5")]


# --- a dependency's Retry-After --------------------------------------------------------------

@given(error=errors, retry=retries, attempt=attempts, reconciler=st.booleans(),
       retry_after=st.floats(min_value=0, max_value=10 * MAX_RETRY_AFTER, allow_nan=False))
def test_a_retry_waits_at_least_what_the_error_asked_for_and_at_most_the_cap(
        error: Exception, retry: Retry, attempt: int, reconciler: bool,
        retry_after: float) -> None:
    action = decide(Retryable(error, retry_after=retry_after), attempt=attempt, retry=retry,
                    reconciler=reconciler)
    failures = attempt + 1
    if not reconciler and retry.max_attempts is not None and failures >= retry.max_attempts:
        assert action == DeadLetter(attempts=failures, error=error)  # asking changes nothing
    else:
        ladder = retry.backoff[min(failures, len(retry.backoff)) - 1]
        assert action == Redeliver(delay=max(ladder, min(retry_after, MAX_RETRY_AFTER)),
                                   attempt=failures)


def test_retry_after_examples() -> None:
    retry = Retry(max_attempts=5, backoff=(1.0, 5.0, 30.0))
    error = RetryableError("429")
    assert decide(Retryable(error, retry_after=42.0), attempt=0, retry=retry,
                  reconciler=False) == Redeliver(delay=42.0, attempt=1)
    assert decide(Retryable(error, retry_after=2.0), attempt=2, retry=retry,
                  reconciler=False) == Redeliver(delay=30.0, attempt=3)  # the ladder is longer
    assert decide(Retryable(error, retry_after=86_400.0), attempt=0, retry=retry,
                  reconciler=True) == Redeliver(delay=MAX_RETRY_AFTER, attempt=1)


def test_an_error_s_retry_after_reaches_the_outcome() -> None:
    class RateLimited(Exception):
        retryable = True
        retry_after = 17.5

    error = RateLimited()
    assert outcome_of_exception(error) == Retryable(error, retry_after=17.5)
    plain = RetryableError("5xx")
    assert outcome_of_exception(plain) == Retryable(plain, retry_after=None)
    odd = RateLimited()
    odd.retry_after = "soon"  # type: ignore[assignment]
    assert outcome_of_exception(odd) == Retryable(odd, retry_after=None)
