"""What Buildkite's build answers mean (design §4, §5): a build's ``state`` and ``blocked``
as our build status, what a build that is not running waits for, when it started, and how
a build Buildkite reports over ended — told, for a failed build, by its jobs (the buildkite
runner reads them once, `streams.extensions.buildrunner.buildkite`).

Buildkite's build states, mapped to ours ("Build states" and the REST "Build data model",
https://buildkite.com/docs/pipelines/configure/defining-steps#build-states). Green only
from ``passed`` on a build that is not ``blocked``: a build paused at a block step has not
run what follows it. A build that is not over and not running now says what it waits for
(`BuildReport.waiting`): at its deadline such a build gives no verdict (design §5).

| Buildkite ``state``                          | status    | what it says                    |
|----------------------------------------------|-----------|---------------------------------|
| ``creating``, ``scheduled``                  | accepted  | waits for an agent              |
| ``running``, ``failing`` (1), ``waiting`` (2)| running   | runs                            |
| ``blocked``, ``passed``/``running`` with     | running   | waits for a person at a block   |
| ``blocked: true`` (3)                        |           | step                            |
| ``canceling``                                | running   | waits for its cancel            |
| ``passed`` (not blocked)                     | succeeded | green                           |
| ``failed``, ``waiting_failed``, ``finished`` | failed    | told by its jobs (4)            |
| ``canceled``                                 | cancelled | a person; could not validate    |
|                                              |           | when Buildkite may have (5)     |
| ``skipped``                                  | failed    | could not validate (6)          |
| ``not_run``                                  | failed    | could not validate, permanent   |
|                                              |           | (7)                             |
| anything else (8)                            | running   | runs                            |

(1) a job failed, but a retry may still pass the build: wait for its end. (2) listed as a
build state by the REST data model; the docs define ``waiting`` only for jobs ("waiting on
a wait step to finish"), so the build waits for steps of its own that run: it runs. (3)
Buildkite's REST API reports a blocked build with the state it had (or its block step's
``blocked_state``) and ``blocked: true``; the build waits for a person to unblock it. (4)
a failed build's jobs are read (one more call, ``GET …/builds/{number}`` with its jobs,
once per build): a job that failed by running its command — exited non-zero or timed out,
not soft-failed, and not ended by its agent — makes it **red**; otherwise, when its failed
jobs all ended by the infrastructure — ``expired`` (no agent took it before the scheduled
job expiry), exit status ``-1`` (Buildkite lost contact with its agent), or a
``signal_reason`` that names the agent (``agent_stop``, ``agent_refused``,
``agent_incompatible``, ``process_run_error``, ``stack_error``, ``signature_rejected``) —
it **could not validate** the commit (failed, ``unvalidated``, transient: another agent may
take the next attempt); a build whose only ended jobs were cancelled is **cancelled**; a
failed build still paused at a block step (a block step's ``blocked_state: failed``)
waits for a person; anything else stays red. Jobs that could not be read (a non-retryable
answer) leave it red, as before; a retryable one is waited out like any poll. (5) the REST
API does not say who cancelled a build (GraphQL's ``canceledBy`` does; the REST token has
no GraphQL scope). Buildkite's only documented build cancel of its own is a pipeline's
**Cancel Intermediate Builds** (``cancel_running_branch_builds``, for builds of the
branches its ``cancel_running_branch_builds_filter`` names), whose settings come with the
build: a cancelled build of such a pipeline and branch could not validate (transient,
attempted again); any other is a person's (or a tool's) cancel: cancelled, no fact. The
limit: on such a pipeline a person's cancel is attempted again too, at most
``retry.unvalidated`` times. (6) **Skip Intermediate Builds** skipped it before it started
(a newer build of the branch): transient, attempted again. (7) every step was skipped by
its ``skip`` or ``if``: building the same commit again skips them again, so the cause is
*permanent* (only a person's retry, after the pipeline is fixed, validates it). (8) an
unknown state is never green; the poll deadline ends it.

A build's start is Buildkite's ``started_at`` — "when the build's first job was started by
an agent" — for every state past ``scheduled`` (the docs' own example of a build just
created carries a ``started_at``: it is not trusted before the build left ``scheduled``).
Its limit: a build whose first job started and whose later jobs then wait for agents
counts that wait as running; only the builds' states are polled, never their jobs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from store.entities import BuildStatus
from streams.extensions.buildrunner.hosted import Ending, job_label, listed, provider_time

STATES: Mapping[str, BuildStatus] = {
    "creating": BuildStatus.ACCEPTED,
    "scheduled": BuildStatus.ACCEPTED,
    "running": BuildStatus.RUNNING,
    "waiting": BuildStatus.RUNNING,
    "failing": BuildStatus.RUNNING,
    "canceling": BuildStatus.RUNNING,
    "blocked": BuildStatus.RUNNING,
    "passed": BuildStatus.SUCCEEDED,
    "failed": BuildStatus.FAILED,
    "waiting_failed": BuildStatus.FAILED,
    "finished": BuildStatus.FAILED,
    "canceled": BuildStatus.CANCELLED,
    "skipped": BuildStatus.FAILED,  # never ran: could not validate
    "not_run": BuildStatus.FAILED,  # never ran: could not validate
}
QUEUED = frozenset({"creating", "scheduled"})
# a job that Buildkite's agent, not its command, ended: the REST job data model's
# `signal_reason` values other than `cancel` (a person's)
AGENT_ENDINGS: Mapping[str, str] = {
    "agent_stop": "its agent was stopped",
    "agent_refused": "its agent refused it",
    "agent_incompatible": "no agent could run it (agent_incompatible)",
    "process_run_error": "its agent could not start its process",
    "stack_error": "its agent failed (stack_error)",
    "signature_rejected": "its agent rejected its pipeline signature",
}
LOST_AGENT_EXIT = -1  # "Buildkite lost contact with the agent or it stopped reporting"
WAITING_FOR_AGENT = "scheduled, waiting for an agent to take its first job"
WAITING_AT_BLOCK_STEP = "blocked at a block step, waiting for a person to unblock it"
WAITING_FOR_CANCEL = "canceling"


def status_of(state: str, blocked: bool) -> BuildStatus:
    """Our status for a Buildkite build's ``state`` and ``blocked`` flag (the table in the
    module docstring)."""
    status = STATES.get(state, BuildStatus.RUNNING)
    if blocked and status is BuildStatus.SUCCEEDED:
        # paused at a block step: what follows it has not run (Buildkite reports such a
        # build as `passed` with `blocked: true`)
        return BuildStatus.RUNNING
    return status



def waiting_of(state: str, blocked: bool) -> str:
    """What a build in ``state`` waits for, when it is not over and not running."""
    if state in QUEUED:
        return WAITING_FOR_AGENT
    if state == "canceling":
        return WAITING_FOR_CANCEL
    if state == "failing":
        return ""  # a job of it failed and others run: a hang there is the build's own
    if (state == "blocked" or blocked) and status_of(state, blocked) is BuildStatus.RUNNING:
        return WAITING_AT_BLOCK_STEP
    return ""


def started_at_of(build: Mapping[str, Any]) -> datetime | None:
    """When the build started running, as Buildkite says (None before it left
    ``scheduled``: see the module docstring)."""
    state = build.get("state")
    if not isinstance(state, str) or state in QUEUED:
        return None
    return provider_time(build.get("started_at"))


def ending_of_failed(jobs: Sequence[Any], blocked: bool) -> Ending:
    """A failed build's ending told by its jobs (note (4) of the module docstring)."""
    by_command: list[str] = []
    by_agent: list[str] = []
    cancelled: list[str] = []
    at_block_step = False
    for job in jobs:
        if not isinstance(job, dict):
            continue
        state, name = job.get("state"), job_label(job, "name", "step_key", "id")
        if job.get("type") == "manual" and state == "blocked":
            at_block_step = True
            continue
        if state == "expired":
            by_agent.append(f"{name} expired before an agent took it")
            continue
        if state not in ("failed", "timed_out", "canceled") or job.get("soft_failed") is True:
            continue
        signal_reason = job.get("signal_reason")
        exit_status = job.get("exit_status")
        if isinstance(signal_reason, str) and signal_reason in AGENT_ENDINGS:
            by_agent.append(f"{name}: {AGENT_ENDINGS[signal_reason]}")
        elif state == "timed_out":
            by_command.append(f"{name} timed out")
        elif state == "canceled" or signal_reason == "cancel":
            cancelled.append(name)
        elif exit_status == LOST_AGENT_EXIT:
            by_agent.append(f"{name} lost its agent (exit status -1)")
        else:
            by_command.append(f"{name} failed" + (f" (exit status {exit_status})"
                                                  if isinstance(exit_status, int) else ""))
    if by_command:
        return Ending(BuildStatus.FAILED, detail=listed("Buildkite: job", by_command))
    if by_agent:
        return Ending(BuildStatus.FAILED, unvalidated=listed(
            "Buildkite could not run it: job", by_agent))
    if cancelled:
        return Ending(BuildStatus.CANCELLED, detail=listed("cancelled: job", cancelled))
    if blocked and at_block_step:
        return Ending(BuildStatus.RUNNING, waiting=WAITING_AT_BLOCK_STEP)
    return Ending(BuildStatus.FAILED, detail="Buildkite reports it failed (no job of it "
                                             "failed by its command or its agent)")


def ending_of_canceled(build: Mapping[str, Any]) -> Ending:
    """A cancelled build's ending (note (5) of the module docstring)."""
    pipeline = build.get("pipeline")
    settings = pipeline if isinstance(pipeline, dict) else {}
    branch = build.get("branch")
    reason = build.get("cancel_reason")
    said = f" ({reason})" if isinstance(reason, str) and reason else ""
    if settings.get("cancel_running_branch_builds") is True and isinstance(branch, str) \
            and branch_filter_matches(settings.get("cancel_running_branch_builds_filter"),
                                      branch):
        return Ending(BuildStatus.FAILED, unvalidated=(
            f"Buildkite cancelled it{said}: its pipeline cancels running builds of branch "
            f"{branch} when a newer one starts (Cancel Intermediate Builds; a person's "
            f"cancel looks the same in the REST API)"))
    return Ending(BuildStatus.CANCELLED, detail=f"cancelled{said}")


def branch_filter_matches(branch_filter: object, branch: str) -> bool:
    """Whether a pipeline's branch filter (space-separated patterns, ``*`` wildcards,
    ``!`` excluding) names ``branch``; no filter names every branch, and one that is
    not a string is taken to name it (it then errs towards "could not validate")."""
    if branch_filter is None or not isinstance(branch_filter, str) or not branch_filter.split():
        return True
    patterns = branch_filter.split()
    if any(fnmatchcase(branch, p[1:]) for p in patterns if p.startswith("!")):
        return False
    wanted = [p for p in patterns if not p.startswith("!")]
    return not wanted or any(fnmatchcase(branch, p) for p in wanted)


def ending_of_never_run(state: str) -> Ending:
    """A build that never ran (``skipped``, ``not_run``): notes (6) and (7)."""
    if state == "not_run":
        return Ending(BuildStatus.FAILED, permanent=True, unvalidated=(
            "Buildkite ran none of its steps (not_run: every step was skipped by its "
            "`skip` or `if`); building the commit again would skip them again"))
    return Ending(BuildStatus.FAILED, unvalidated=(
        "Buildkite skipped it before it started (skipped: Skip Intermediate Builds, a "
        "newer build of the branch)"))
