"""How an attempt of a Request ends (design §4, "Only a build that ran gives a verdict" and
"Attempts"): pure, so it is tested with Hypothesis.

An attempt is one build. It ends with what its build said — or with what Stovepipe could
tell when it said nothing usable:

| the attempt ended                                   | status    | verdict | then        |
|-----------------------------------------------------|-----------|---------|-------------|
| the build succeeded                                 | succeeded | green   | settle      |
| the build ran and failed                            | failed    | red     | re-run (1)  |
| it ran past the poll deadline since it started (2)  | failed    | red     | re-run (1)  |
| its host was lost, it vanished, its agent or runner | failed    | none    | again (3)   |
| was lost, the provider skipped or cancelled it      |           |         |             |
| before it started                                   |           |         |             |
| it never started within its start deadline, or was  | failed    | none    | again (3)   |
| waiting (blocked, an approval) at its deadline      |           |         |             |
| its status could not be read until past its deadline| failed    | none    | again (3)   |
| (the runner unavailable)                            |           |         |             |
| its trigger kept failing past the trigger deadline  | (no build)| none    | again (3)   |
| a permanent cause (4): its trigger was refused, its | failed    | none    | settle      |
| workflow cannot start, its checkout failed          |           |         |             |
| it was cancelled (a person)                         | cancelled | none    | settle      |

(1) up to the queue's ``retry.red`` re-runs, at once; then the Request ends `failed` with
a red verdict (a red fact). Green on a re-run settles the Request green, marked flaky. A
red attempt stands when the attempts after it could not validate: the Request ends red
unless a later attempt was green.
(2) A build that started and then hung is a real failure more often than not (a test that
deadlocks, a step waiting for input): it counts as red, so a hang cannot turn into an
endless series of re-attempts. Time queued for an agent never counts: the poll deadline
runs from the build's start (`streams.stages.buildsignal`).
(3) up to the queue's ``retry.unvalidated`` re-attempts, after ``retry.backoff`` doubling
each time; then the Request ends `failed` without a verdict, its cause *transient*: no
fact, no red alert, its reason recorded, and an ingest of the head validates it again by
itself (a bounded number of times, `store.statements.FIND_OR_MINT`).
(4) building again would fail the same way: the Request ends at once, `failed` without a
verdict, its cause *permanent*; only an explicit retry validates the commit again.
"""

from __future__ import annotations

from dataclasses import dataclass

from store import BuildStatus, Request, RequestState, UnvalidatedCause, Verdict
from store.steps import AttemptEnd
from streams.config.queues import RetrySpec
from streams.stages.kit import seconds

BACKOFF_CAP = 3600.0  # the longest wait before a re-attempt, however many came before


@dataclass(frozen=True)
class Observed:
    """What is known of an attempt's end: its build's terminal status, the verdict it
    gives (None: none), and why, in words (required without a verdict)."""

    status: BuildStatus
    verdict: Verdict | None
    reason: str = ""
    permanent: bool = False  # without a verdict: building again would fail the same way

    def __post_init__(self) -> None:
        if not self.status.is_terminal:
            raise ValueError(f"an attempt ends with a terminal status, got {self.status}")
        allowed = {BuildStatus.SUCCEEDED: (Verdict.GREEN,),
                   BuildStatus.FAILED: (Verdict.RED, None),
                   BuildStatus.CANCELLED: (None,)}[self.status]
        if self.verdict not in allowed:
            raise ValueError(f"a {self.status} build cannot give the verdict {self.verdict}")
        if self.status is BuildStatus.FAILED and self.verdict is None and not self.reason:
            raise ValueError("an attempt without a verdict needs its reason")
        if self.permanent and self.verdict is not None:
            raise ValueError("only an attempt without a verdict has a permanent cause")


def decide(request: Request, observed: Observed, retry: RetrySpec) -> AttemptEnd:
    """How the Request's current attempt ends, given its counts of attempts so far."""
    match observed.status, observed.verdict:
        case BuildStatus.SUCCEEDED, _:
            return AttemptEnd(settle=True, outcome=RequestState.SUCCEEDED,
                              verdict=Verdict.GREEN, reason=observed.reason)
        case BuildStatus.CANCELLED, _:
            return AttemptEnd(settle=True, outcome=RequestState.CANCELLED,
                              reason=observed.reason or "its build was cancelled")
        case BuildStatus.FAILED, Verdict.RED:
            if request.red_reruns < retry.red:
                return AttemptEnd(settle=False, again_after="red", reason=observed.reason)
            return AttemptEnd(settle=True, outcome=RequestState.FAILED, verdict=Verdict.RED,
                              reason=observed.reason)
    # no verdict from this attempt
    red_before = request.red_reruns > 0  # an earlier attempt of this Request was red
    if not observed.permanent and request.unvalidated_retries < retry.unvalidated:
        return AttemptEnd(settle=False, again_after="unvalidated", reason=observed.reason,
                          backoff=backoff(retry, request.unvalidated_retries))
    attempts = request.attempt
    tried = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if red_before:
        # the red verdict stands: what came after it said nothing about the commit
        return AttemptEnd(settle=True, outcome=RequestState.FAILED, verdict=Verdict.RED,
                          reason=f"red on an earlier attempt; the re-run could not be "
                                 f"validated ({tried}): {observed.reason}")
    if observed.permanent:
        return AttemptEnd(settle=True, outcome=RequestState.FAILED, verdict=None,
                          cause=UnvalidatedCause.PERMANENT,
                          reason=f"could not be validated ({tried}), and building it "
                                 f"again would fail the same way: {observed.reason}")
    return AttemptEnd(settle=True, outcome=RequestState.FAILED, verdict=None,
                      cause=UnvalidatedCause.TRANSIENT,
                      reason=f"could not be validated ({tried}): {observed.reason}")


def backoff(retry: RetrySpec, retries_so_far: int) -> float:
    """Seconds before re-attempt number ``retries_so_far`` + 1: ``retry.backoff``
    doubling each time, capped."""
    return min(seconds(retry.backoff) * 2 ** min(retries_so_far, 20), BACKOFF_CAP)
