"""The github_actions BuildRunner against a local GitHub API (tests/hosted_ci.py): the
dispatch and its inputs, finding the run (returned by the dispatch, or by its run-name),
every status and conclusion's mapping, cancelling, a repeated trigger, every error class
with its retry delay, the token kept secret, and queues.yaml."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from store.entities import BuildStatus
from streams.config.queues import QueueConfigError, load_queues, make_build_runner
from streams.extensions.buildrunner import BuildRunner, BuildRunnerError
from streams.extensions.buildrunner.github_actions import (
    GitHubActionsBuildRunner,
    GitHubActionsBuildRunnerSpec,
)
from streams.extensions.buildrunner.github_runs import CONCLUSIONS, STATUSES, status_of
from streams.extensions.buildrunner.hosted import correlation_id
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.runtime.classify import outcome_of_exception
from streams.runtime.outcome import NonRetryable, Retryable
from tests.hosted_ci import (
    GH_CONCURRENCY_CANCEL,
    GH_RUNNER_LOST,
    GH_SHUTDOWN,
    GH_STEP_FAILED,
    FakeGitHub,
    gh_job,
    shipped_example_queues,
)
from tests.waiting import wait_until_async

TOKEN = "ghp_s3cr3tT0kenValue0123456789"
TOKEN_ENV = "STOVEPIPE_TEST_GITHUB_TOKEN"
REPO = "/srv/git/monorepo"
HEAD = "a" * 40
BASE = "b" * 40
HEAD_URI = git_uri(REPO, "main", HEAD)
BASE_URI = git_uri(REPO, "main", BASE)
META = {"queue": "mono/main", "request_id": "request/mono/main/7", "strategy": "incremental",
        "trigger_key": "request/mono/main/7"}
FIRST_RUN = "gha-acme/monorepo/1000000001"


def runner_for(fake: FakeGitHub, **kwargs: Any) -> GitHubActionsBuildRunner:
    kwargs.setdefault("environ", {TOKEN_ENV: TOKEN})
    kwargs.setdefault("search_poll", 0.05)
    return GitHubActionsBuildRunner("acme/monorepo", "stovepipe.yml", TOKEN_ENV,
                                    api_url=fake.url, **kwargs)


Scenario = Callable[[FakeGitHub, GitHubActionsBuildRunner], Awaitable[None]]


def serve(scenario: Scenario, fake: FakeGitHub | None = None, **kwargs: Any) -> None:
    async def main() -> None:
        api = fake or FakeGitHub(TOKEN)
        async with api.serving():
            runner = runner_for(api, **kwargs)
            try:
                await scenario(api, runner)
            finally:
                await runner.aclose()

    asyncio.run(main())


async def wait_for(condition: Callable[[], bool], *, what: str) -> None:
    """`tests.waiting.wait_until_async` on the event loop the fake serves from (30 s)."""

    async def holds() -> bool:
        return condition()

    await wait_until_async(holds, within=30.0, what=what, interval=0.01)


async def failure_of(call: Awaitable[Any]) -> BuildRunnerError:
    with pytest.raises(BuildRunnerError) as caught:
        await call
    return caught.value


def test_satisfies_the_protocol() -> None:
    runner: BuildRunner = GitHubActionsBuildRunner("acme/monorepo", "ci.yml", TOKEN_ENV)
    assert runner is not None


def test_trigger_dispatches_the_workflow_with_its_inputs_and_returns_the_run() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        build_id = await runner.trigger(BASE_URI, HEAD_URI, META)
        assert build_id == FIRST_RUN
        correlation = correlation_id(META, BASE_URI, HEAD_URI)
        [dispatch] = fake.requests("POST", "/dispatches")
        assert dispatch.path == "/repos/acme/monorepo/actions/workflows/stovepipe.yml/dispatches"
        assert dispatch.body == {"ref": "main", "return_run_details": True, "inputs": {
            "head": HEAD, "base": BASE, "stovepipe_id": correlation}}
        assert fake.runs[1_000_000_001]["display_title"] == f"Stovepipe {correlation}"
        assert {s.authorization for s in fake.requests()} == {f"Bearer {TOKEN}"}

        await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        assert fake.runs[1_000_000_002]["inputs"]["base"] == ""  # a full build

    serve(scenario)


def test_configured_ref_input_names_and_extra_inputs() -> None:
    fake = FakeGitHub(TOKEN, inputs=("sha", "since", "run_id", "suite"),
                      run_name="Validate ${{ inputs.sha }} [${{ inputs.run_id }}]")

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        await runner.trigger(BASE_URI, HEAD_URI, META)
        [dispatch] = fake.requests("POST", "/dispatches")
        assert dispatch.body["ref"] == "ci"
        assert dispatch.body["inputs"] == {
            "sha": HEAD, "since": BASE, "run_id": correlation_id(META, BASE_URI, HEAD_URI),
            "suite": "full"}

    serve(scenario, fake, ref="ci", input_names=("sha", "since", "run_id"),
          inputs={"suite": "full"})


def test_a_project_s_build_is_dispatched_with_its_project_input() -> None:
    fake = FakeGitHub(TOKEN, inputs=("head", "base", "stovepipe_id", "service"))
    project_meta = {**META, "queue": "mono/main#api", "request_id": "request/mono/main#api/3",
                    "trigger_key": "request/mono/main#api/3"}

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        await runner.trigger(BASE_URI, HEAD_URI, project_meta)
        await runner.trigger(BASE_URI, HEAD_URI, META)  # a queue without projects
        [project_dispatch, whole_repo_dispatch] = fake.requests("POST", "/dispatches")
        assert project_dispatch.body["inputs"] == {
            "head": HEAD, "base": BASE, "service": "api",
            "stovepipe_id": correlation_id(project_meta, BASE_URI, HEAD_URI)}
        assert "service" not in whole_repo_dispatch.body["inputs"]

    serve(scenario, fake, project_input="service")


def test_a_workflow_without_the_project_input_refuses_a_project_s_build() -> None:
    project_meta = {**META, "queue": "mono/main#api"}

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        error = await failure_of(runner.trigger(BASE_URI, HEAD_URI, project_meta))
        assert not error.retryable
        assert "Unexpected inputs provided" in str(error) and "project" in str(error)

    serve(scenario)


def test_a_dispatch_answered_204_finds_its_run_by_its_run_name() -> None:
    fake = FakeGitHub(TOKEN, returns_run_details=False)

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        fake.runs[999] = {"id": 999, "display_title": "Stovepipe sp-someone-else",
                          "event": "workflow_dispatch", "head_branch": "main",
                          "status": "queued", "conclusion": None, "created_at": "2099-01-01"}
        assert await runner.trigger(BASE_URI, HEAD_URI, META) == FIRST_RUN
        lists = fake.requests("GET", "/runs")
        assert lists[-1].query["event"] == "workflow_dispatch"
        assert lists[-1].query["branch"] == "main"
        assert lists[-1].query["created"].startswith(">=20")

    serve(scenario, fake)


@pytest.mark.parametrize("refusal", [400, 422])
def test_a_server_that_refuses_return_run_details_is_dispatched_to_without_it(
        refusal: int) -> None:
    """GitHub Enterprise Server before `return_run_details` ("Create a workflow dispatch
    event", https://docs.github.com/rest/actions/workflows#create-a-workflow-dispatch-event:
    the parameter is recent; older servers refuse a body key they do not know, starting no
    run): the dispatch is sent again at once without it, the run is found by its run-name
    as after a 204, and the runner asks that server without it from then on."""
    fake = FakeGitHub(TOKEN, refuses_run_details=refusal)

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        assert await runner.trigger(BASE_URI, HEAD_URI, META) == FIRST_RUN
        refused, taken = fake.requests("POST", "/dispatches")
        assert refused.body["return_run_details"] is True
        assert "return_run_details" not in taken.body
        assert taken.body["inputs"] == refused.body["inputs"]
        assert len(fake.runs) == 1  # the refused dispatch started nothing
        assert fake.requests("GET", "/runs")  # found by its run-name

        second = await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        assert second == "gha-acme/monorepo/1000000002"
        dispatches = fake.requests("POST", "/dispatches")
        assert len(dispatches) == 3 and "return_run_details" not in dispatches[2].body

    serve(scenario, fake)


def test_a_real_422_is_not_mistaken_for_a_server_without_return_run_details() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        fake.unknown_refs.add("main")
        error = await failure_of(runner.trigger(None, HEAD_URI, {}))
        assert not error.retryable and "No ref found for: main" in str(error)
        fake.unknown_refs.clear()
        assert await runner.trigger(None, HEAD_URI, {}) == FIRST_RUN
        assert [d.body.get("return_run_details") for d in fake.requests(
            "POST", "/dispatches")] == [True, None, True]  # still asked for the run
        assert fake.requests("GET", "/runs") == []

    serve(scenario)


def test_a_run_that_shows_up_late_is_waited_for_within_run_search() -> None:
    fake = FakeGitHub(TOKEN, returns_run_details=False)

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        fake.hide_new_runs = True
        trigger = asyncio.create_task(runner.trigger(BASE_URI, HEAD_URI, META))
        await wait_for(lambda: len(fake.requests("GET", "/runs")) >= 3,
                       what="the runner looking for its run a few times")
        fake.reveal_runs()
        assert await trigger == FIRST_RUN
        assert len(fake.requests("POST", "/dispatches")) == 1

    serve(scenario, fake, run_search=60.0)


def test_a_run_that_never_shows_up_is_retryable_and_the_retry_dispatches_no_second() -> None:
    fake = FakeGitHub(TOKEN, returns_run_details=False)

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        fake.hide_new_runs = True
        error = await failure_of(runner.trigger(BASE_URI, HEAD_URI, META))
        assert error.retryable
        assert "run-name must include the stovepipe_id input" in str(error)
        fake.reveal_runs()  # GitHub was slow: the run exists by the time of the retry
        assert await runner.trigger(BASE_URI, HEAD_URI, META) == FIRST_RUN
        assert len(fake.requests("POST", "/dispatches")) == 1

    serve(scenario, fake, run_search=0.3)


def test_a_workflow_whose_run_name_lacks_the_id_is_never_matched() -> None:
    fake = FakeGitHub(TOKEN, run_name="CI", returns_run_details=False)

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        error = await failure_of(runner.trigger(BASE_URI, HEAD_URI, META))
        assert error.retryable and "run-name" in str(error)

    serve(scenario, fake, run_search=0.2)


def test_a_repeated_trigger_returns_the_run_the_first_one_started() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        first = await runner.trigger(BASE_URI, HEAD_URI, META)
        fake.set_run(1_000_000_001, "in_progress")
        another_worker = runner_for(fake)
        again = await another_worker.trigger(BASE_URI, HEAD_URI, META)
        await another_worker.aclose()
        assert again == first
        assert len(fake.requests("POST", "/dispatches")) == 1
        other = await runner.trigger(BASE_URI, HEAD_URI, {**META, "trigger_key": "r/8"})
        keyless = [await runner.trigger(BASE_URI, HEAD_URI, {}) for _ in range(2)]
        assert len({first, other, *keyless}) == 4
        assert len(fake.requests("POST", "/dispatches")) == 4

    serve(scenario)


EXPECTED = [
    ("requested", None, BuildStatus.ACCEPTED),
    ("queued", None, BuildStatus.ACCEPTED),
    ("pending", None, BuildStatus.ACCEPTED),
    ("waiting", None, BuildStatus.RUNNING),
    ("in_progress", None, BuildStatus.RUNNING),
    ("completed", None, BuildStatus.RUNNING),
    ("completed", "success", BuildStatus.SUCCEEDED),
    ("completed", "failure", BuildStatus.FAILED),
    ("completed", "timed_out", BuildStatus.FAILED),
    ("completed", "startup_failure", BuildStatus.FAILED),
    ("completed", "cancelled", BuildStatus.CANCELLED),
    ("completed", "skipped", BuildStatus.FAILED),
    ("completed", "stale", BuildStatus.CANCELLED),
    ("completed", "neutral", BuildStatus.CANCELLED),
    ("completed", "action_required", BuildStatus.CANCELLED),
    ("completed", "some_future_conclusion", BuildStatus.FAILED),
    ("some_future_status", None, BuildStatus.RUNNING),
]
# what a run that ran says, through a server answering as GitHub's does (one `ci` job that
# follows the run): (status, conclusion, waiting, could not validate (words), permanent)
REPORTS = [
    ("requested", None, "requested, not yet queued for a runner", "", False),
    ("queued", None, "queued for a runner", "", False),
    ("pending", None, "pending behind another run of its concurrency group", "", False),
    ("waiting", None, "waiting for a deployment protection rule (an environment's approval "
                      "or wait timer)", "", False),
    ("in_progress", None, "", "", False),
    ("completed", "failure", "", "", False),
    ("completed", "timed_out", "", "", False),
    ("completed", "startup_failure", "", "GitHub could not start the workflow run "
                                         "(startup_failure", True),
    ("completed", "cancelled", "", "", False),
    ("completed", "skipped", "", "GitHub skipped every job of the run", True),
]


def test_the_mapping_covers_every_documented_status_and_conclusion() -> None:
    assert set(STATUSES) | {"completed"} == {s for s, _, _ in EXPECTED} - {"some_future_status"}
    assert set(CONCLUSIONS) == {c for _, c, _ in EXPECTED if c} - {"some_future_conclusion"}
    for status, conclusion, expected in EXPECTED:
        assert status_of(status, conclusion) is expected, (status, conclusion)
    green = [(s, c) for s, c, _ in EXPECTED if status_of(s, c) is BuildStatus.SUCCEEDED]
    assert green == [("completed", "success")]


def test_status_follows_the_run_through_every_status_and_conclusion() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        build_id = await runner.trigger(BASE_URI, HEAD_URI, META)
        report = await runner.status(build_id)
        assert report.status is BuildStatus.ACCEPTED
        assert report.metadata == {
            "runner": "github_actions", "status": "queued", "conclusion": "",
            "html_url": "https://github.com/acme/monorepo/actions/runs/1000000001"}
        fake.set_run(1_000_000_001, "in_progress")  # a runner took its job
        for status, conclusion, expected in EXPECTED:
            fake.set_run(1_000_000_001, status, conclusion)
            runner = runner_for(fake)  # nothing remembered of an earlier ending
            report = await runner.status(build_id)
            await runner.aclose()
            assert report.status is expected, (status, conclusion)
            # run_started_at is set while the run is queued: never taken as its start
            assert report.started_at is None
        for status, conclusion, waiting, unvalidated, permanent in REPORTS:
            fake.set_run(1_000_000_001, status, conclusion)
            runner = runner_for(fake)
            report = await runner.status(build_id)
            await runner.aclose()
            assert report.waiting == waiting, status
            assert (unvalidated in report.unvalidated if unvalidated
                    else report.unvalidated == ""), (conclusion, report.unvalidated)
            assert report.permanent is permanent, conclusion
            assert report.running_now is (status == "in_progress")

    serve(scenario)


# a failed run's jobs and their annotations as GitHub's REST API shows them, and what the
# run says: (jobs, annotations by job id, could not validate (words), red detail (words))
J1, J2 = 5_000_000_001, 5_000_000_002
FAILED_RUNS = [
    ([gh_job(J1, "ci", "completed", "failure")], {J1: [GH_STEP_FAILED]}, "",
     "GitHub: job 'ci' failed"),
    ([gh_job(J1, "ci", "completed", "failure")], {J1: [GH_RUNNER_LOST]},
     "GitHub could not run it: job 'ci' lost its runner", ""),
    ([gh_job(J1, "ci", "completed", "failure")], {J1: [GH_SHUTDOWN, GH_STEP_FAILED]},
     "job 'ci' lost its runner", ""),
    ([gh_job(J1, "ci", "completed", "failure", ran=False)], {},
     "job 'ci' never got a runner", ""),
    ([gh_job(J1, "ci", "completed", "timed_out")], {}, "", "GitHub: job 'ci' timed out"),
    # one job failed on its runner: red, whatever else lost its runner
    ([gh_job(J1, "lint", "completed", "failure"), gh_job(J2, "ci", "completed", "failure")],
     {J1: [GH_RUNNER_LOST], J2: [GH_STEP_FAILED]}, "", "GitHub: job 'ci' failed"),
    ([gh_job(J1, "lint", "completed", "failure"), gh_job(J2, "ci", "completed", "success")],
     {J1: [GH_RUNNER_LOST]}, "job 'lint' lost its runner", ""),
    ([], {}, "no job of it ran", ""),
]


@pytest.mark.parametrize(("jobs", "annotations", "unvalidated", "red"), FAILED_RUNS)
def test_a_failed_run_is_told_by_its_jobs_and_their_annotations_once(
        jobs: list[dict[str, Any]], annotations: dict[int, list[str]], unvalidated: str,
        red: str) -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.set_jobs(1_000_000_001, jobs)
        for job_id, messages in annotations.items():
            fake.annotate(job_id, *messages)
        fake.set_run(1_000_000_001, "completed", "failure")
        for _ in range(3):  # polled again: nothing more is read
            report = await runner.status(build_id)
            assert report.status is BuildStatus.FAILED
            assert (unvalidated in report.unvalidated if unvalidated
                    else report.unvalidated == ""), report.unvalidated
            assert not report.permanent  # another runner may take the next attempt
            assert red in report.metadata.get("detail", "")
        assert [s.path for s in fake.requests("GET")].count(
            "/repos/acme/monorepo/actions/runs/1000000001/attempts/1/jobs") == 1
        assert len(fake.requests("GET", "/annotations")) <= len(jobs)

    serve(scenario)


def test_a_token_without_checks_read_leaves_a_failed_run_red_and_says_so() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.set_jobs(1_000_000_001, [gh_job(J1, "ci", "completed", "failure")])
        fake.annotate(J1, GH_RUNNER_LOST)
        fake.checks_forbidden = True
        fake.set_run(1_000_000_001, "completed", "failure")
        report = await runner.status(build_id)
        assert report.status is BuildStatus.FAILED and not report.unvalidated
        assert "give the token the 'Checks: read' permission" in report.metadata["detail"]

        # jobs that cannot be read (404): red, as a failed run always was; an outage of
        # them is waited out
        other = await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        fake.set_run(1_000_000_002, "completed", "failure")
        fake.fail_next(503, path="/attempts/1/jobs")
        assert (await failure_of(runner.status(other))).retryable
        fake.fail_next(404, path="/attempts/1/jobs")
        report = await runner.status(other)
        assert report.status is BuildStatus.FAILED and not report.unvalidated
        assert "its jobs could not be read" in report.metadata["detail"]

    serve(scenario)


def test_a_run_its_concurrency_group_cancelled_could_not_validate_a_person_s_cancel_stands(
        ) -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        # pending in its concurrency group, cancelled by a newer run: no job ever started
        pending = await runner.trigger(None, HEAD_URI, {})
        fake.set_run(1_000_000_001, "pending")
        assert (await runner.status(pending)).waiting == \
            "pending behind another run of its concurrency group"
        fake.set_jobs(1_000_000_001, [])  # a workflow-level group: no job was created
        fake.set_run(1_000_000_001, "completed", "cancelled")
        report = await runner.status(pending)
        assert report.status is BuildStatus.FAILED and not report.permanent
        assert report.unvalidated.startswith("GitHub cancelled it before any job started")

        # a job-level group: its jobs were queued, none taken by a runner
        queued = await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        fake.set_jobs(1_000_000_002, [gh_job(J1, "ci", "completed", "cancelled", ran=False)])
        fake.set_run(1_000_000_002, "completed", "cancelled")
        assert "before any job started" in (await runner.status(queued)).unvalidated

        # cancel-in-progress: it ran, and its group cancelled it (GitHub's annotation)
        running = await runner.trigger(None, git_uri(REPO, "main", "d" * 40), {})
        fake.set_jobs(1_000_000_003, [gh_job(J2, "ci", "completed", "cancelled")])
        fake.annotate(J2, GH_CONCURRENCY_CANCEL)
        fake.set_run(1_000_000_003, "completed", "cancelled")
        report = await runner.status(running)
        assert report.status is BuildStatus.FAILED
        assert report.unvalidated.startswith("its concurrency group cancelled it while it "
                                             "ran (cancel-in-progress")

        # a person cancelled a run that ran: cancelled, no fact
        person = await runner.trigger(None, git_uri(REPO, "main", "e" * 40), {})
        fake.set_run(1_000_000_004, "in_progress")
        await runner.cancel(person)
        assert (await runner.status(person)).status is BuildStatus.CANCELLED

    serve(scenario)


def test_a_run_s_start_is_the_first_poll_that_sees_it_in_progress() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.plan(1_000_000_001, queued=0.5, runs=0.5)
        report = await runner.status(build_id)
        assert (report.status, report.waiting) == (BuildStatus.ACCEPTED,
                                                   "queued for a runner")
        assert fake.runs[1_000_000_001]["run_started_at"]  # GitHub sets it while queued
        assert report.started_at is None

        async def running() -> bool:
            report = await runner.status(build_id)
            return report.running_now and report.started_at is None

        await wait_until_async(running, within=30, what="the run in progress", interval=0.05)

        async def passed() -> bool:
            return (await runner.status(build_id)).status is BuildStatus.SUCCEEDED

        await wait_until_async(passed, within=30, what="the run succeeded", interval=0.05)

    serve(scenario)


def test_cancel_stops_a_run_and_leaves_a_completed_one_as_it_ended() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        running = await runner.trigger(None, HEAD_URI, {})
        fake.set_run(1_000_000_001, "in_progress")
        await runner.cancel(running)
        assert (await runner.status(running)).status is BuildStatus.CANCELLED
        await runner.cancel(running)  # idempotent: GitHub answers 409 now
        assert len(fake.requests("POST", "/cancel")) == 2

        done = await runner.trigger(None, git_uri(REPO, "main", "d" * 40), {})
        fake.set_run(1_000_000_002, "completed", "success")
        await runner.cancel(done)
        assert (await runner.status(done)).status is BuildStatus.SUCCEEDED

    serve(scenario)


@pytest.mark.parametrize(("status", "headers", "message", "retryable", "retry_after"), [
    (429, {"retry-after": "7"}, "slow down", True, 7.0),
    (403, {"retry-after": "30"}, "You have exceeded a secondary rate limit", True, 30.0),
    (403, {}, "You have exceeded a secondary rate limit", True, 60.0),
    (403, {"x-ratelimit-remaining": "4870"}, "You have exceeded a secondary rate limit",
     True, 60.0),
    (429, {"x-ratelimit-remaining": "4870"}, "You have exceeded a secondary rate limit",
     True, 60.0),
    (403, {"x-ratelimit-remaining": "4870"}, "Resource not accessible by integration",
     False, None),
    (429, {}, "", True, 60.0),
    (500, {}, "", True, None),
    (502, {}, "", True, None),
    (503, {"retry-after": "12"}, "", True, 12.0),
    (408, {}, "", True, None),
    (401, {}, "Bad credentials", False, None),
    (403, {}, "Resource not accessible by integration", False, None),
    (404, {}, "Not Found", False, None),
    (422, {}, "Unexpected inputs provided", False, None),
])
def test_each_answer_is_retryable_or_not_with_the_delay_it_asks_for(
        status: int, headers: dict[str, str], message: str, retryable: bool,
        retry_after: float | None) -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        for n, call in enumerate((lambda: runner.trigger(None, HEAD_URI, {}),
                                  lambda: runner.status(FIRST_RUN),
                                  lambda: runner.cancel(FIRST_RUN))):
            # a dispatch refused with 400/422 is sent once more without
            # return_run_details (a server that may not know it): refuse that one too
            again = n == 0 and status in (400, 422)
            fake.fail_next(status, headers=headers, times=2 if again else 1,
                           path="/dispatches" if again else None,
                           body={"message": f"{message} (token {TOKEN})"})
            error = await failure_of(call())
            assert (error.retryable, error.retry_after) == (retryable, retry_after), error
            assert f"answered {status}" in str(error) and "/repos/acme/monorepo/" in str(error)
            assert TOKEN not in str(error) and TOKEN not in repr(error)
            assert outcome_of_exception(error) == (
                Retryable(error, retry_after=retry_after) if retryable
                else NonRetryable(error))

    serve(scenario)


def test_the_primary_rate_limit_waits_until_its_reset() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        reset = int(time.time()) + 120
        fake.fail_next(403, headers={"x-ratelimit-remaining": "0",
                                     "x-ratelimit-reset": str(reset)},
                       body={"message": "API rate limit exceeded for user ID 1."})
        error = await failure_of(runner.status(FIRST_RUN))
        assert error.retryable and error.retry_after is not None
        assert 115 <= error.retry_after <= 120

    serve(scenario)


def test_the_real_answers_for_a_bad_token_an_unknown_run_a_bad_ref_and_inputs() -> None:
    fake = FakeGitHub(TOKEN, inputs=("head", "base"))

    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        bad = runner_for(fake, environ={TOKEN_ENV: "wrong"})
        error = await failure_of(bad.status(FIRST_RUN))
        assert not error.retryable and "401" in str(error) and TOKEN_ENV in str(error)
        await bad.aclose()
        error = await failure_of(runner.status("gha-acme/monorepo/42"))
        assert not error.retryable and "404" in str(error)
        error = await failure_of(runner.trigger(None, HEAD_URI, {}))
        assert not error.retryable and "422" in str(error)
        assert "Unexpected inputs provided" in str(error)  # no stovepipe_id input declared
        fake.declared_inputs = ("head", "base", "stovepipe_id")
        fake.unknown_refs.add("main")
        error = await failure_of(runner.trigger(None, HEAD_URI, {}))
        assert not error.retryable and "No ref found for: main" in str(error)
        error = await failure_of(runner.cancel("gha-acme/monorepo"))
        assert not error.retryable and "not a github_actions build id" in str(error)

    serve(scenario, fake)


def test_a_hanging_api_is_a_retryable_timeout() -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        fake.hang_next(path="/dispatches")
        error = await failure_of(runner.trigger(None, HEAD_URI, {}))
        assert error.retryable and "no answer within 0.3s" in str(error)

    serve(scenario, timeout=0.3)


@pytest.mark.parametrize("environ", [{}, {TOKEN_ENV: ""}])
def test_a_missing_token_variable_is_a_configuration_error_naming_it(
        environ: dict[str, str]) -> None:
    async def scenario(fake: FakeGitHub, runner: GitHubActionsBuildRunner) -> None:
        for call in (runner.trigger(None, HEAD_URI, {}), runner.status(FIRST_RUN),
                     runner.cancel(FIRST_RUN)):
            error = await failure_of(call)
            assert not error.retryable and f"the environment variable {TOKEN_ENV}" in str(error)
        assert fake.requests() == []

    serve(scenario, environ=environ)


def test_the_token_is_in_no_repr() -> None:
    spec = GitHubActionsBuildRunnerSpec("acme/monorepo", "ci.yml", TOKEN_ENV)
    runner = GitHubActionsBuildRunner("acme/monorepo", "ci.yml", TOKEN_ENV,
                                      environ={TOKEN_ENV: TOKEN})
    for text in (repr(spec), repr(runner), repr(runner.api), repr(vars(runner))):
        assert TOKEN not in text


# --- queues.yaml ---------------------------------------------------------------------------

GIT_SC = {"kind": "git", "repository": "/srv/git/monorepo", "ref": "main"}
GHA = {"kind": "github_actions", "repository": "acme/monorepo", "workflow": "stovepipe.yml",
       "token_env": "GITHUB_TOKEN"}


def _load(tmp_path: Path, build_runner: Any) -> Any:
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump({"queues": {"q": {"source_control": GIT_SC,
                                                     "build_runner": build_runner}}}))
    return load_queues(path)


def test_queues_yaml_with_every_option(tmp_path: Path) -> None:
    spec = _load(tmp_path, {**GHA, "ref": "ci", "api_url": "https://ghe.example.com/api/v3",
                            "head_input": "sha", "base_input": "since", "id_input": "rid",
                            "inputs": {"suite": "full"}, "run_search": "1m",
                            "lookback": "6h", "request_timeout": "5s"}).get("q").build_runner
    assert spec == GitHubActionsBuildRunnerSpec(
        "acme/monorepo", "stovepipe.yml", "GITHUB_TOKEN", ref="ci",
        api_url="https://ghe.example.com/api/v3", head_input="sha", base_input="since",
        id_input="rid", inputs={"suite": "full"}, run_search=timedelta(minutes=1),
        lookback=timedelta(hours=6), request_timeout=timedelta(seconds=5))
    runner = make_build_runner(_load(tmp_path, {**GHA, "workflow": "123456"}).get("q"))
    assert isinstance(runner, GitHubActionsBuildRunner)
    assert (runner.workflow, runner.api.api_url, runner.run_search, runner.lookback) == (
        "123456", "https://api.github.com", 30.0, 3600.0)


@pytest.mark.parametrize(("build_runner", "expected"), [
    ({**GHA, "repository": "monorepo"},
     "queues.q.build_runner.repository: expected owner/name"),
    ({**GHA, "workflow": "ci"}, "queues.q.build_runner.workflow: expected a workflow file"),
    ({k: v for k, v in GHA.items() if k != "token_env"},
     "queues.q.build_runner: missing 'token_env', e.g. token_env: GITHUB_TOKEN"),
    ({**GHA, "token_env": "ghp_s3cr3tT0kenValue0123456789"},
     "queues.q.build_runner.token_env: expected the NAME of the environment variable"),
    ({**GHA, "head_input": "run id"},
     "queues.q.build_runner.head_input: expected a workflow_dispatch input name"),
    ({**GHA, "base_input": "head"},
     "queues.q.build_runner: head_input, base_input, id_input and project_input must "
     "differ"),
    ({**GHA, "project_input": "base"},
     "queues.q.build_runner: head_input, base_input, id_input and project_input must "
     "differ"),
    ({**GHA, "inputs": {"project": "x"}},
     "queues.q.build_runner: inputs ['project'] are set by Stovepipe"),
    ({**GHA, "inputs": {"stovepipe_id": "x"}},
     "queues.q.build_runner: inputs ['stovepipe_id'] are set by Stovepipe"),
    ({**GHA, "inputs": {"suite": 3}}, "queues.q.build_runner.inputs: expected a mapping"),
    # "Events that trigger workflows", workflow_dispatch: at most 25 inputs
    ({**GHA, "inputs": {f"extra_{n}": "x" for n in range(23)}},
     "queues.q.build_runner: a workflow_dispatch takes at most 25 inputs, and this runner "
     "would send 26: Stovepipe's 3 (head_input, base_input, id_input) and 23 under inputs"),
    ({**GHA, "run_search": "0s"}, "queues.q.build_runner.run_search: must be longer"),
    ({**GHA, "ref": "a..b"}, "queues.q.build_runner.ref: invalid branch name"),
    ({**GHA, "api_url": "api.github.com"}, "queues.q.build_runner.api_url: expected an"),
])
def test_each_queues_yaml_problem_is_reported(tmp_path: Path, build_runner: Any,
                                              expected: str) -> None:
    with pytest.raises(QueueConfigError) as caught:
        _load(tmp_path, build_runner)
    assert any(expected in p for p in caught.value.problems), caught.value.problems
    assert TOKEN not in str(caught.value)


def test_twenty_five_inputs_are_accepted(tmp_path: Path) -> None:
    inputs = {f"extra_{n}": "x" for n in range(22)}
    spec = _load(tmp_path, {**GHA, "inputs": inputs}).get("q").build_runner
    assert isinstance(spec, GitHubActionsBuildRunnerSpec) and spec.inputs == inputs


def test_the_shipped_file_s_github_actions_example_is_valid(tmp_path: Path) -> None:
    queue = shipped_example_queues(tmp_path).get("acme/api")
    assert queue.build_runner == GitHubActionsBuildRunnerSpec(
        "acme/api", "stovepipe.yml", "GITHUB_TOKEN", ref="main",
        api_url="https://api.github.com", head_input="head", base_input="base",
        id_input="stovepipe_id", inputs={"suite": "full"},
        run_search=timedelta(seconds=30), lookback=timedelta(hours=1),
        request_timeout=timedelta(seconds=10), requests_per_minute=41.7, batch_polls=True)
