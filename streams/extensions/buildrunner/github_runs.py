"""What GitHub's workflow-run answers mean (design §4, §5): a run's ``status`` and
``conclusion`` as our build status, what a run that is not running waits for, and how a
completed run ended — told, for a failed or cancelled run, by the jobs of its attempt and
their check runs' annotations (`RunEndings`, for the github_actions runner).

A run's ``status`` and ``conclusion``, mapped to ours. Green only from ``success``. A run
that is not over and not running now says what it waits for (`BuildReport.waiting`): at its
deadline such a run gives no verdict (design §5).

| ``status``                   | ``conclusion``                 | status    | what it says       |
|------------------------------|--------------------------------|-----------|--------------------|
| ``requested``, ``queued``    |                                | accepted  | waits for a runner |
| ``pending``                  |                                | accepted  | waits behind its   |
|                              |                                |           | concurrency group  |
| ``waiting`` (1)              |                                | running   | waits for an       |
|                              |                                |           | approval           |
| ``in_progress``              |                                | running   | runs               |
| ``completed``                | ``success``                    | succeeded | green              |
| ``completed``                | ``failure``                    | failed    | told by its jobs   |
|                              |                                |           | (2)                |
| ``completed``                | ``timed_out``                  | failed    | red                |
| ``completed``                | ``startup_failure`` (3)        | failed    | could not validate,|
|                              |                                |           | permanent          |
| ``completed``                | ``cancelled``                  | cancelled | a person; could not|
|                              |                                |           | validate when no   |
|                              |                                |           | job started (4)    |
| ``completed``                | ``skipped`` (5)                | failed    | could not validate,|
|                              |                                |           | permanent          |
| ``completed``                | ``stale``, ``neutral``,        | cancelled | no fact            |
|                              | ``action_required``            |           |                    |
| ``completed``                | none yet (the conclusion       | running   | runs               |
|                              | follows)                       |           |                    |
| ``completed``                | anything else (6)              | failed    | red                |
| anything else (6)            |                                | running   | runs               |

(1) a job waits for a deployment protection rule: an environment's required reviewers
(an approval) or its wait timer. (2) the jobs of the run's attempt are read (``GET
/repos/{owner}/{repo}/actions/runs/{run_id}/attempts/{attempt}/jobs``), and, for each job
that failed after a runner took it, its check run's annotations (``GET
/repos/{owner}/{repo}/check-runs/{job_id}/annotations``) until one failed by itself —
once per run, at most ``ANNOTATION_LOOKS`` jobs. A job that failed or timed out on its
runner makes the run **red**; the run **could not validate** the commit (transient) when
every failed job never got a runner, or lost it — its annotation says the runner "lost
communication with the server" or "received a shutdown signal". Reading annotations takes
the token's "Checks: read" permission; without it (a ``403``), or when the jobs cannot be
read, a failed run stays red as before; a retryable answer is waited out like any poll.
The limit: GitHub says "anything in your workflow that terminates the runner process,
starves it for CPU/Memory, or blocks its network access" loses the runner too, so a
commit that exhausts its runner is not validated rather than red (and is attempted
again, ``retry.unvalidated`` times). (3) GitHub could not start the workflow (an invalid
workflow file, a workflow not allowed to run): no job ran, and starting it again fails
the same way — a *permanent* cause; only a person's retry (after the workflow is fixed)
validates the commit again. (4) the API does not say who cancelled a run. A run cancelled
before any job of it got a runner — a ``concurrency:`` group cancels a pending run when a
newer one of the group queues — could not validate (transient, attempted again); so could
one whose cancelled jobs carry the concurrency group's annotation ("Canceling since a
higher priority waiting request … exists": ``cancel-in-progress``). Any other cancel of a
run that ran is a person's (or a tool's): cancelled, no fact. The limit: a person's cancel
of a run still queued looks the same as the group's and is attempted again, at most
``retry.unvalidated`` times. (5) every job was skipped by its ``if:``: the same inputs skip
them again, a *permanent* cause. (6) an unknown conclusion is over and not known to have
succeeded; an unknown status is never green, and the poll deadline ends it.

A run's start: none is reported (``started_at`` None), so the first poll that sees the run
``in_progress`` is its start. ``run_started_at`` is not a start: GitHub sets it when the
attempt is created, while the run is still ``queued`` (so the published ``requested``
webhook example shows it). The limit: a run that started and whose later jobs then wait
for runners counts that wait as running; only runs are polled, never their jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from store.entities import BuildStatus
from streams.extensions.buildrunner.contract import BuildRunnerError
from streams.extensions.buildrunner.hosted import (
    Ending,
    Endings,
    HostedApi,
    job_label,
    listed,
)

PER_PAGE = 100  # GitHub's largest page
log = logging.getLogger("stovepipe.buildrunner.github_actions")

STATUSES: Mapping[str, BuildStatus] = {
    "requested": BuildStatus.ACCEPTED,
    "queued": BuildStatus.ACCEPTED,
    "pending": BuildStatus.ACCEPTED,
    "in_progress": BuildStatus.RUNNING,
    "waiting": BuildStatus.RUNNING,
}
CONCLUSIONS: Mapping[str, BuildStatus] = {
    "success": BuildStatus.SUCCEEDED,
    "failure": BuildStatus.FAILED,
    "timed_out": BuildStatus.FAILED,
    "startup_failure": BuildStatus.FAILED,
    "cancelled": BuildStatus.CANCELLED,
    "skipped": BuildStatus.FAILED,  # no job ran: could not validate
    "stale": BuildStatus.CANCELLED,
    "neutral": BuildStatus.CANCELLED,
    "action_required": BuildStatus.CANCELLED,
}
WAITING: Mapping[str, str] = {
    "requested": "requested, not yet queued for a runner",
    "queued": "queued for a runner",
    "pending": "pending behind another run of its concurrency group",
    "waiting": "waiting for a deployment protection rule (an environment's approval or "
               "wait timer)",
}
STARTUP_FAILURE = ("GitHub could not start the workflow run (startup_failure: an invalid "
                   "workflow file, or a workflow not allowed to run); no job ran, and "
                   "starting it again fails the same way")
ALL_SKIPPED = ("GitHub skipped every job of the run (skipped: their `if:` conditions); "
               "running it again with the same inputs skips them again")
# what GitHub's annotation says when a job's runner went away ("The self-hosted runner: X
# lost communication with the server. ...", "The hosted runner: X lost communication
# ...", "The runner has received a shutdown signal. ...")
LOST_RUNNER_WORDS = ("lost communication with the server", "received a shutdown signal")
# what it says on a job its concurrency group cancelled ("Canceling since a higher
# priority waiting request for <group> exists")
CONCURRENCY_CANCEL_WORDS = ("higher priority waiting request",)
ANNOTATION_LOOKS = 10  # jobs whose annotations one run's ending reads at most
JOB_PAGES = 5  # pages of 100 jobs read of one attempt


def job_ran(job: Mapping[str, Any]) -> bool:
    """Whether a runner took the job (a job never taken has no runner and no steps)."""
    steps = job.get("steps")
    return bool(job.get("runner_name") or job.get("runner_id")) or (
        isinstance(steps, list) and any(isinstance(step, dict) and step.get("started_at")
                                        for step in steps))


def annotations_say(annotations: Sequence[Any], words: Sequence[str]) -> bool:
    """Whether any of a check run's annotations says one of ``words``."""
    return any(isinstance(a, dict) and any(w in str(a.get("message") or "").lower()
                                           for w in words) for a in annotations)


def status_of(status: str, conclusion: str | None) -> BuildStatus:
    """Our status for a run's ``status`` and ``conclusion`` (the table in the module
    docstring)."""
    if status != "completed":
        return STATUSES.get(status, BuildStatus.RUNNING)
    if not conclusion:
        return BuildStatus.RUNNING
    return CONCLUSIONS.get(conclusion, BuildStatus.FAILED)


class RunEndings:
    """How completed runs ended, read through ``api`` (the runner's): once per run while
    it answers the same (`hosted.Endings`)."""

    def __init__(self, api: HostedApi) -> None:
        self.api = api
        self._endings = Endings()

    async def ending_of(self, repository: str, run_id: int, run: Mapping[str, Any]) -> Ending:
        """The ending of a completed run (the table in the module docstring)."""
        conclusion = run.get("conclusion")
        if conclusion == "startup_failure":
            return Ending(BuildStatus.FAILED, unvalidated=STARTUP_FAILURE, permanent=True)
        if conclusion == "skipped":
            return Ending(BuildStatus.FAILED, unvalidated=ALL_SKIPPED, permanent=True)
        if conclusion == "failure":
            return await self._told(repository, run_id, run, self._failure)
        if conclusion == "cancelled":
            return await self._told(repository, run_id, run, self._cancelled)
        return Ending(status_of("completed", conclusion if isinstance(conclusion, str)
                                else None))

    async def _told(self, repository: str, run_id: int, run: Mapping[str, Any],
                    tell: Callable[[str, list[dict[str, Any]]], Awaitable[Ending]]
                    ) -> Ending:
        """``tell`` the ending of a completed run from the jobs of its attempt: once per
        run while it answers the same. Jobs or annotations that cannot be read (a
        non-retryable answer) leave the run as its conclusion says (red, or cancelled);
        a retryable answer is raised, to be waited out like any poll."""
        attempt = run.get("run_attempt")
        attempt = attempt if isinstance(attempt, int) and attempt > 0 else 1
        key = (repository, run_id)
        answer = (attempt, run.get("conclusion"))
        known = self._endings.get(key, answer)
        if isinstance(known, Ending):
            return known
        try:
            ending = await tell(repository, await self._jobs(repository, run_id, attempt))
        except BuildRunnerError as exc:
            if exc.retryable:
                raise
            log.warning("github_actions_jobs_unreadable run=%s/%d error=%s", repository,
                        run_id, exc)
            return (Ending(BuildStatus.CANCELLED) if run.get("conclusion") == "cancelled"
                    else Ending(BuildStatus.FAILED, detail=f"GitHub reports it failed (its "
                                                           f"jobs could not be read: {exc})"))
        self._endings.put(key, answer, ending)
        return ending

    async def _failure(self, repository: str, jobs: list[dict[str, Any]]) -> Ending:
        """A failed run: red unless every failed job never got a runner or lost it (note
        (2) of the module docstring)."""
        by_runner: list[str] = []
        looks = 0
        for job in jobs:
            conclusion, name = job.get("conclusion"), job_label(job, "name", "id")
            if conclusion not in ("failure", "timed_out"):
                continue
            if not job_ran(job):
                by_runner.append(f"{name} never got a runner")
                continue
            if conclusion == "timed_out":
                return Ending(BuildStatus.FAILED, detail=f"GitHub: job {name} timed out")
            if looks >= ANNOTATION_LOOKS:
                return Ending(BuildStatus.FAILED, detail=f"GitHub: job {name} failed (more "
                                                         f"than {ANNOTATION_LOOKS} failed "
                                                         f"jobs; not all looked at)")
            looks += 1
            annotations = await self._annotations(repository, job)
            if annotations is None:
                return Ending(BuildStatus.FAILED, detail=(
                    f"GitHub: job {name} failed (its annotations could not be read, so a "
                    f"lost runner cannot be told from a failure: give the token the "
                    f"'Checks: read' permission)"))
            if not annotations_say(annotations, LOST_RUNNER_WORDS):
                return Ending(BuildStatus.FAILED, detail=f"GitHub: job {name} failed")
            by_runner.append(f"{name} lost its runner")
        if by_runner:
            return Ending(BuildStatus.FAILED, unvalidated=listed(
                "GitHub could not run it: job", by_runner))
        if not jobs:
            return Ending(BuildStatus.FAILED, unvalidated=(
                "GitHub reports it failed, but no job of it ran (the attempt has no jobs)"))
        return Ending(BuildStatus.FAILED, detail="GitHub reports it failed (no job of it "
                                                 "failed)")

    async def _cancelled(self, repository: str, jobs: list[dict[str, Any]]) -> Ending:
        """A cancelled run: could not validate when no job of it ran or its concurrency
        group cancelled it; otherwise a person's cancel (note (4) of the module
        docstring)."""
        if not any(job_ran(job) for job in jobs):
            return Ending(BuildStatus.FAILED, unvalidated=(
                "GitHub cancelled it before any job started (a newer run of its "
                "concurrency group, or a person: the API does not say who)"))
        looks = 0
        for job in jobs:
            if job.get("conclusion") != "cancelled" or not job_ran(job):
                continue
            if looks >= ANNOTATION_LOOKS:
                break
            looks += 1
            annotations = await self._annotations(repository, job)
            if annotations is None:
                break  # cannot tell: a person's cancel, as it always was
            if annotations_say(annotations, CONCURRENCY_CANCEL_WORDS):
                return Ending(BuildStatus.FAILED, unvalidated=(
                    f"its concurrency group cancelled it while it ran (cancel-in-progress: "
                    f"a newer run of the group), at job {job_label(job, 'name', 'id')}"))
        return Ending(BuildStatus.CANCELLED)

    async def _jobs(self, repository: str, run_id: int, attempt: int) -> list[dict[str, Any]]:
        """The jobs of the run's attempt (at most ``JOB_PAGES`` pages of 100)."""
        jobs: list[dict[str, Any]] = []
        for page in range(1, JOB_PAGES + 1):
            answer = await self.api.call(
                "GET", f"/repos/{repository}/actions/runs/{run_id}/attempts/{attempt}/jobs",
                params={"per_page": str(PER_PAGE), "page": str(page)})
            found = answer.body.get("jobs") if isinstance(answer.body, dict) else None
            found = [j for j in found if isinstance(j, dict)] if isinstance(found, list) else []
            jobs += found
            if len(found) < PER_PAGE:
                break
        return jobs

    async def _annotations(self, repository: str,
                           job: Mapping[str, Any]) -> list[Any] | None:
        """The annotations of the job's check run (a job's check run has the job's id;
        its ``check_run_url`` says so); None when they cannot be read (a non-retryable
        answer: a token without "Checks: read"); a retryable failure is raised."""
        check_run = str(job.get("check_run_url") or "").rstrip("/").rsplit("/", 1)[-1]
        if not check_run.isdigit():
            check_run = str(job.get("id"))
        try:
            answer = await self.api.call(
                "GET", f"/repos/{repository}/check-runs/{check_run}/annotations",
                params={"per_page": str(PER_PAGE)})
        except BuildRunnerError as exc:
            if exc.retryable:
                raise
            log.warning("github_actions_annotations_unreadable repository=%s check_run=%s "
                        "error=%s", repository, check_run, exc)
            return None
        return answer.body if isinstance(answer.body, list) else []
