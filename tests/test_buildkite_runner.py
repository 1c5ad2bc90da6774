"""The buildkite BuildRunner against a local Buildkite API (tests/hosted_ci.py): the build
it creates, every state's mapping, cancelling, a repeated trigger, every error class with
its retry delay, the token kept secret, queues.yaml, and the pipeline end to end."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
import yaml

from store.entities import BuildStatus
from streams.config.queues import QueueConfigError, load_queues, make_build_runner
from streams.extensions.buildrunner import BuildRunner, BuildRunnerError
from streams.extensions.buildrunner.buildkite import (
    BuildkiteBuildRunner,
    BuildkiteBuildRunnerSpec,
)
from streams.extensions.buildrunner.buildkite_builds import (
    AGENT_ENDINGS,
    STATES,
    branch_filter_matches,
    status_of,
)
from streams.extensions.buildrunner.hosted import correlation_id
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.runtime.classify import outcome_of_exception
from streams.runtime.outcome import NonRetryable, Retryable
from tests.hosted_ci import FakeBuildkite, bk_job, shipped_example_queues
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until, wait_until_async

TOKEN = "bkua_s3cr3t-T0KEN-value"
TOKEN_ENV = "STOVEPIPE_TEST_BUILDKITE_TOKEN"
REPO = "/srv/git/monorepo"
HEAD = "a" * 40
BASE = "b" * 40
HEAD_URI = git_uri(REPO, "main", HEAD)
BASE_URI = git_uri(REPO, "main", BASE)
META = {"queue": "mono/main", "request_id": "request/mono/main/7", "strategy": "incremental",
        "trigger_key": "request/mono/main/7"}


def runner_for(fake: FakeBuildkite, **kwargs: Any) -> BuildkiteBuildRunner:
    kwargs.setdefault("environ", {TOKEN_ENV: TOKEN})
    return BuildkiteBuildRunner("acme", "monorepo", TOKEN_ENV, api_url=fake.url,
                                queue="mono/main", **kwargs)


Scenario = Callable[[FakeBuildkite, BuildkiteBuildRunner], Awaitable[None]]


def serve(scenario: Scenario, **kwargs: Any) -> None:
    """Run ``scenario`` against a fresh fake Buildkite and a runner pointed at it."""
    async def main() -> None:
        fake = FakeBuildkite(TOKEN)
        async with fake.serving():
            runner = runner_for(fake, **kwargs)
            try:
                await scenario(fake, runner)
            finally:
                await runner.aclose()

    asyncio.run(main())


async def failure_of(call: Awaitable[Any]) -> BuildRunnerError:
    with pytest.raises(BuildRunnerError) as caught:
        await call
    return caught.value


def test_satisfies_the_protocol() -> None:
    runner: BuildRunner = BuildkiteBuildRunner("acme", "monorepo", TOKEN_ENV)
    assert runner is not None


def test_trigger_creates_a_build_of_the_head_with_base_and_head_in_its_environment() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        build_id = await runner.trigger(BASE_URI, HEAD_URI, META)
        assert build_id == "bk-acme/monorepo/1"
        [build] = fake.builds.values()
        assert (build["commit"], build["branch"]) == (HEAD, "main")
        assert build["env"] == {
            "DEPLOY": "no",
            "STOVEPIPE_HEAD_SHA": HEAD, "STOVEPIPE_BASE_SHA": BASE,
            "STOVEPIPE_HEAD_URI": HEAD_URI, "STOVEPIPE_BASE_URI": BASE_URI,
            "STOVEPIPE_QUEUE": "mono/main", "STOVEPIPE_PROJECT": "",
            "STOVEPIPE_REQUEST_ID": "request/mono/main/7", "STOVEPIPE_STRATEGY": "incremental"}
        assert build["meta_data"] == {
            "stovepipe-trigger": correlation_id(META, BASE_URI, HEAD_URI),
            "stovepipe-request": "request/mono/main/7"}
        assert "mono/main" in build["message"] and HEAD[:12] in build["message"]
        assert {s.authorization for s in fake.requests()} == {f"Bearer {TOKEN}"}

        full = await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        assert full == "bk-acme/monorepo/2"
        assert fake.builds[2]["env"]["STOVEPIPE_BASE_SHA"] == ""
        assert fake.builds[2]["env"]["STOVEPIPE_QUEUE"] == "mono/main"  # the runner's queue

    serve(scenario, env={"DEPLOY": "no"})


def test_a_project_s_build_carries_its_project_in_env_and_meta_data() -> None:
    project_meta = {**META, "queue": "mono/main#api", "request_id": "request/mono/main#api/3",
                    "trigger_key": "request/mono/main#api/3"}

    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        await runner.trigger(BASE_URI, HEAD_URI, project_meta)
        [build] = fake.builds.values()
        assert (build["env"]["STOVEPIPE_QUEUE"], build["env"]["STOVEPIPE_PROJECT"]) == (
            "mono/main", "api")
        assert build["meta_data"] == {
            "stovepipe-trigger": correlation_id(project_meta, BASE_URI, HEAD_URI),
            "stovepipe-request": "request/mono/main#api/3", "stovepipe-project": "api"}
        # the repeated trigger finds the project's build, not another project's
        assert await runner.trigger(BASE_URI, HEAD_URI, project_meta) == "bk-acme/monorepo/1"
        web = {**project_meta, "queue": "mono/main#web", "request_id": "request/mono/main#web/3",
               "trigger_key": "request/mono/main#web/3"}
        assert await runner.trigger(BASE_URI, HEAD_URI, web) == "bk-acme/monorepo/2"
        assert fake.builds[2]["meta_data"]["stovepipe-project"] == "web"

    serve(scenario)


def test_a_configured_branch_replaces_the_head_s_ref() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        await runner.trigger(None, HEAD_URI, {})
        assert fake.builds[1]["branch"] == "stovepipe"

    serve(scenario, branch="stovepipe")


# every state of the Buildkite docs' build data model and list filter, and `blocked`
EXPECTED_STATES = [
    ("creating", False, BuildStatus.ACCEPTED),
    ("scheduled", False, BuildStatus.ACCEPTED),
    ("running", False, BuildStatus.RUNNING),
    ("waiting", False, BuildStatus.RUNNING),
    ("failing", False, BuildStatus.RUNNING),
    ("canceling", False, BuildStatus.RUNNING),
    ("blocked", False, BuildStatus.RUNNING),
    ("passed", True, BuildStatus.RUNNING),
    ("running", True, BuildStatus.RUNNING),
    ("passed", False, BuildStatus.SUCCEEDED),
    ("failed", False, BuildStatus.FAILED),
    ("failed", True, BuildStatus.FAILED),
    ("waiting_failed", False, BuildStatus.FAILED),
    ("finished", False, BuildStatus.FAILED),
    ("canceled", False, BuildStatus.CANCELLED),
    ("skipped", False, BuildStatus.FAILED),
    ("not_run", False, BuildStatus.FAILED),
    ("some_future_state", False, BuildStatus.RUNNING),
]
AGENT = "scheduled, waiting for an agent to take its first job"
BLOCK_STEP = "blocked at a block step, waiting for a person to unblock it"
# what the runner reports for each, through a server answering as Buildkite's does (one
# `ci` job that follows the build): (state, blocked, status, waiting, could not validate
# (words in it), permanent, red, started)
REPORTS = [
    ("creating", False, BuildStatus.ACCEPTED, AGENT, "", False, False, False),
    ("scheduled", False, BuildStatus.ACCEPTED, AGENT, "", False, False, False),
    ("running", False, BuildStatus.RUNNING, "", "", False, False, True),
    ("waiting", False, BuildStatus.RUNNING, "", "", False, False, True),
    ("failing", False, BuildStatus.RUNNING, "", "", False, False, True),
    ("canceling", False, BuildStatus.RUNNING, "canceling", "", False, False, True),
    ("blocked", False, BuildStatus.RUNNING, BLOCK_STEP, "", False, False, True),
    ("passed", True, BuildStatus.RUNNING, BLOCK_STEP, "", False, False, True),
    ("running", True, BuildStatus.RUNNING, BLOCK_STEP, "", False, False, True),
    ("failing", True, BuildStatus.RUNNING, "", "", False, False, True),
    ("passed", False, BuildStatus.SUCCEEDED, "", "", False, False, True),
    ("failed", False, BuildStatus.FAILED, "", "", False, True, True),
    ("failed", True, BuildStatus.FAILED, "", "", False, True, True),
    ("waiting_failed", False, BuildStatus.FAILED, "", "", False, True, True),
    ("canceled", False, BuildStatus.CANCELLED, "", "", False, False, True),
    ("skipped", False, BuildStatus.FAILED, "", "skipped it before it started", False, False,
     False),
    ("not_run", False, BuildStatus.FAILED, "", "ran none of its steps", True, False, False),
    ("some_future_state", False, BuildStatus.RUNNING, "", "", False, False, True),
]


def test_the_mapping_covers_every_documented_state() -> None:
    assert set(STATES) == {state for state, _, _ in EXPECTED_STATES} - {"some_future_state"}
    for state, blocked, expected in EXPECTED_STATES:
        assert status_of(state, blocked) is expected, (state, blocked)
    # green only from a passed build that is not blocked
    green = [(s, b) for s, b, _ in EXPECTED_STATES if status_of(s, b) is BuildStatus.SUCCEEDED]
    assert green == [("passed", False)]


def test_status_follows_the_build_through_every_state() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        build_id = await runner.trigger(BASE_URI, HEAD_URI, META)
        report = await runner.status(build_id)
        assert report.status is BuildStatus.ACCEPTED  # a new build is scheduled
        assert report.metadata == {"runner": "buildkite", "state": "scheduled",
                                   "blocked": "false",
                                   "web_url": "https://buildkite.com/acme/monorepo/builds/1"}
        assert (report.waiting, report.started_at) == (AGENT, None)
        for n, (state, blocked, expected, waiting, unvalidated, permanent, red,
                started) in enumerate(REPORTS):
            number = fake.add_build(f"{n:040x}")
            fake.set_state(number, state, blocked=blocked)
            report = await runner.status(f"bk-acme/monorepo/{number}")
            assert (report.status, report.metadata["state"]) == (expected, state), state
            assert report.waiting == waiting, state
            assert (unvalidated in report.unvalidated if unvalidated
                    else report.unvalidated == ""), (state, report.unvalidated)
            assert report.permanent is permanent, state
            assert (report.status is BuildStatus.FAILED and not report.unvalidated) is red
            assert (report.started_at is not None) is started, state
        assert fake.requests("GET", "/builds/1")[-1].query == {"exclude_jobs": "true"}

    serve(scenario)


def test_a_build_s_start_is_buildkite_s_started_at_once_it_left_scheduled() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        # the docs' own example of a build just created carries a started_at
        fake.builds[1]["started_at"] = "2015-05-09T21:05:59.874Z"
        assert (await runner.status(build_id)).started_at is None
        fake.set_state(1, "running")
        report = await runner.status(build_id)
        assert report.running_now
        assert report.started_at == datetime.fromisoformat("2015-05-09T21:05:59.874Z")
        assert report.started_at is not None and report.started_at.tzinfo is not None

    serve(scenario)


def test_a_congested_build_waits_for_an_agent_then_runs_from_its_own_start() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.plan(1, queued=0.6, runs=0.6)
        created = datetime.fromisoformat(fake.builds[1]["created_at"])
        report = await runner.status(build_id)
        assert (report.status, report.waiting, report.started_at) == (
            BuildStatus.ACCEPTED, AGENT, None)

        async def running() -> bool:
            return (await runner.status(build_id)).running_now

        await wait_until_async(running, within=30, what="the build running", interval=0.05)
        report = await runner.status(build_id)
        assert report.started_at is not None
        assert abs((report.started_at - created).total_seconds() - 0.6) < 0.01

        async def passed() -> bool:
            return (await runner.status(build_id)).status is BuildStatus.SUCCEEDED

        await wait_until_async(passed, within=30, what="the build passed", interval=0.05)

    serve(scenario)


# a failed build's jobs, as Buildkite's REST API shows them, and what the build says:
# (jobs, blocked, status, could not validate (words in it), red detail (words in it))
FAILED_JOBS = [
    ([bk_job("rspec", "failed", exit_status=1)], False, BuildStatus.FAILED, "",
     "job 'rspec' failed (exit status 1)"),
    ([bk_job("rspec", "expired", agent=False)], False, BuildStatus.FAILED,
     "job 'rspec' expired before an agent took it", ""),
    ([bk_job("rspec", "failed", exit_status=-1)], False, BuildStatus.FAILED,
     "job 'rspec' lost its agent (exit status -1)", ""),
    *[([bk_job("rspec", "failed", exit_status=255, signal_reason=reason)], False,
       BuildStatus.FAILED, words, "") for reason, words in AGENT_ENDINGS.items()],
    # a job that timed out ran too long: the commit's, even when it ends -1 (the docs)
    ([bk_job("rspec", "timed_out", exit_status=-1)], False, BuildStatus.FAILED, "",
     "job 'rspec' timed out"),
    # one job failed by its command: red, whatever else ended by the infrastructure
    ([bk_job("lint", "failed", exit_status=-1), bk_job("rspec", "failed", exit_status=2),
      bk_job("e2e", "expired", agent=False)], False, BuildStatus.FAILED, "",
     "job 'rspec' failed (exit status 2)"),
    # a soft-failed job fails nothing
    ([bk_job("lint", "failed", exit_status=1, soft_failed=True),
      bk_job("rspec", "expired", agent=False)], False, BuildStatus.FAILED,
     "job 'rspec' expired", ""),
    ([bk_job("a", "expired", agent=False), bk_job("b", "failed", exit_status=-1)], False,
     BuildStatus.FAILED, "Buildkite could not run it: jobs 'a' expired before an agent "
                         "took it; 'b' lost its agent", ""),
    # a person cancelled a job: the build failed, but nothing failed
    ([bk_job("rspec", "canceled", exit_status=143, signal_reason="cancel")], False,
     BuildStatus.CANCELLED, "", ""),
    # paused at a block step whose blocked_state is failed: it waits for a person
    ([bk_job("tests", "passed", exit_status=0),
      bk_job("deploy?", "blocked", job_type="manual", agent=False)], True,
     BuildStatus.RUNNING, "", ""),
    ([bk_job("tests", "passed", exit_status=0)], False, BuildStatus.FAILED, "",
     "no job of it failed by its command or its agent"),
]


@pytest.mark.parametrize(("jobs", "blocked", "status", "unvalidated", "red"), FAILED_JOBS)
def test_a_failed_build_is_told_by_its_jobs_with_one_call_once(
        jobs: list[dict[str, Any]], blocked: bool, status: BuildStatus, unvalidated: str,
        red: str) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.set_jobs(1, jobs)
        fake.set_state(1, "failed", blocked=blocked)
        for _ in range(3):  # polled again (a redelivery, a duplicate loop): no more calls
            report = await runner.status(build_id)
            assert report.status is status
            assert (unvalidated in report.unvalidated if unvalidated
                    else report.unvalidated == ""), report.unvalidated
            assert not report.permanent  # another agent may take the next attempt
            assert (red in report.metadata.get("detail", "")) if red \
                else "detail" not in report.metadata or status is not BuildStatus.FAILED
            if status is BuildStatus.RUNNING:
                assert report.waiting == BLOCK_STEP
        reads = fake.requests("GET", "/builds/1")
        # each poll reads the build without its jobs; the first also reads its jobs
        assert [r.query for r in reads] == [{"exclude_jobs": "true"}, {},
                                            {"exclude_jobs": "true"}, {"exclude_jobs": "true"}]

    serve(scenario)


def test_jobs_that_cannot_be_read_leave_a_failed_build_red_and_an_outage_is_waited_out(
        ) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        # batched polls: the build comes in its pipeline's list (…/builds); …/builds/N is
        # the read of its jobs alone
        build_id = await runner.trigger(None, HEAD_URI, {})
        fake.set_jobs(1, [bk_job("rspec", "expired", agent=False)])
        fake.set_state(1, "failed")
        fake.fail_next(503, path="/builds/1")
        error = await failure_of(runner.status(build_id))
        assert error.retryable  # waited out like any poll
        report = await runner.status(build_id)
        assert "expired before an agent took it" in report.unvalidated

        other = await runner.trigger(None, git_uri(REPO, "main", "c" * 40), {})
        fake.set_jobs(2, [bk_job("rspec", "expired", agent=False)])
        fake.set_state(2, "failed")
        fake.fail_next(404, path="/builds/2")
        report = await runner.status(other)
        assert report.status is BuildStatus.FAILED and not report.unvalidated  # red
        assert "its jobs could not be read" in report.metadata["detail"]

    serve(scenario, batch_polls=True)


@pytest.mark.parametrize(("settings", "branch", "status"), [
    ({}, "main", BuildStatus.CANCELLED),
    ({"cancel_running_branch_builds": True}, "main", BuildStatus.FAILED),
    ({"cancel_running_branch_builds": True,
      "cancel_running_branch_builds_filter": "main release/*"}, "main", BuildStatus.FAILED),
    ({"cancel_running_branch_builds": True,
      "cancel_running_branch_builds_filter": "release/*"}, "main", BuildStatus.CANCELLED),
    ({"cancel_running_branch_builds": True,
      "cancel_running_branch_builds_filter": "!main"}, "main", BuildStatus.CANCELLED),
    # skipping queued builds makes them `skipped`, never `canceled`
    ({"skip_queued_branch_builds": True}, "main", BuildStatus.CANCELLED),
])
def test_a_cancelled_build_could_not_validate_where_buildkite_may_have_cancelled_it(
        settings: dict[str, Any], branch: str, status: BuildStatus) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        fake.pipeline_settings.update(settings)
        build_id = await runner.trigger(None, git_uri(REPO, branch, HEAD), {})
        fake.set_state(1, "running")
        fake.set_state(1, "canceled", cancel_reason="a newer build started")
        report = await runner.status(build_id)
        assert report.status is status
        if status is BuildStatus.FAILED:
            assert report.unvalidated.startswith(
                "Buildkite cancelled it (a newer build started): its pipeline cancels "
                "running builds of branch main when a newer one starts")
            assert not report.permanent
        assert len(fake.requests("GET")) == 1  # the build alone: no jobs read

    serve(scenario)


@pytest.mark.parametrize(("branch_filter", "branch", "matches"), [
    (None, "main", True), ("", "main", True), ("main", "main", True),
    ("main", "mainline", False), ("feature/* main", "feature/x", True),
    ("!main", "main", False), ("!main", "dev", True), ("* !release/*", "release/1", False),
    ("release/*", "main", False), (42, "main", True),
])
def test_a_pipeline_s_branch_filter(branch_filter: object, branch: str,
                                    matches: bool) -> None:
    assert branch_filter_matches(branch_filter, branch) is matches


def test_cancel_stops_a_running_build_and_leaves_a_finished_one_as_it_ended() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        running = await runner.trigger(None, HEAD_URI, {})
        fake.set_state(1, "running")
        await runner.cancel(running)
        assert (await runner.status(running)).status is BuildStatus.CANCELLED
        await runner.cancel(running)  # idempotent: Buildkite answers 422 now
        assert [s.method for s in fake.requests(path="/cancel")] == ["PUT", "PUT"]
        assert (await runner.status(running)).status is BuildStatus.CANCELLED

        passed = await runner.trigger(None, git_uri(REPO, "main", "d" * 40), {})
        fake.set_state(2, "passed")
        await runner.cancel(passed)
        assert (await runner.status(passed)).status is BuildStatus.SUCCEEDED

    serve(scenario)


def test_a_repeated_trigger_returns_the_build_the_first_one_started() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        first = await runner.trigger(BASE_URI, HEAD_URI, META)
        fake.set_state(1, "running")
        # a crash between the trigger and the build row: the same trigger again
        another_worker = runner_for(fake)
        again = await another_worker.trigger(BASE_URI, HEAD_URI, META)
        await another_worker.aclose()
        assert again == first
        assert len(fake.requests("POST")) == 1
        # another Request is another build, and so is every trigger without a key
        other = await runner.trigger(BASE_URI, HEAD_URI, {**META, "trigger_key": "r/8"})
        keyless = [await runner.trigger(BASE_URI, HEAD_URI, {}) for _ in range(2)]
        assert len({first, other, *keyless}) == 4
        assert len(fake.requests("POST")) == 4

    serve(scenario)


def test_a_build_of_the_same_commit_started_otherwise_is_never_taken_for_the_trigger_s(
        ) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        pushed = await runner.trigger(None, HEAD_URI, {})  # e.g. a build of a git push
        fake.ignores_meta_data_filter = True
        mine = await runner.trigger(BASE_URI, HEAD_URI, META)
        assert mine != pushed
        assert await runner.trigger(BASE_URI, HEAD_URI, META) == mine
        assert len(fake.requests("POST")) == 2

    serve(scenario)


def _http_date(seconds_from_now: float) -> str:
    return formatdate(time.time() + seconds_from_now, usegmt=True)


# Buildkite's rate-limit answers, written to its documentation, "REST API rate limits"
# (https://buildkite.com/docs/apis/rest-api/limits): every answer carries
# RateLimit-Remaining, RateLimit-Limit (200 a minute per organization) and RateLimit-Reset
# (seconds until the window starts anew); once the limit is spent the answer is 429 with
# RateLimit-Remaining 0, and the next request waits for RateLimit-Reset.
SPENT = {"RateLimit-Remaining": "0", "RateLimit-Limit": "200", "RateLimit-Reset": "42"}


@pytest.mark.parametrize(("status", "headers", "retryable", "retry_after"), [
    (429, {"Retry-After": "7"}, True, 7.0),
    (429, SPENT, True, 42.0),  # the organization's limit is spent: until its reset
    (429, {**SPENT, "RateLimit-Reset": "0"}, True, 0.0),  # its window starts anew now
    # another reset header does not make it wait longer than the limit that is spent
    (429, {**SPENT, "RateLimit-Reset": "12", "RateLimit-User-Reset": "50"}, True, 12.0),
    # requests remain in the organization's window: that limit did not refuse it, and its
    # reset says nothing about when the one that did will allow it
    (429, {**SPENT, "RateLimit-Remaining": "180"}, True, 60.0),
    (429, {**SPENT, "RateLimit-Remaining": "180", "Retry-After": "9"}, True, 9.0),
    (429, {}, True, 60.0),
    (500, {}, True, None),
    (502, {}, True, None),
    (503, {"Retry-After": "12"}, True, 12.0),
    (408, {}, True, None),
    (401, {}, False, None),
    (403, {}, False, None),
    (404, {}, False, None),
    (422, {}, False, None),
])
def test_each_answer_is_retryable_or_not_with_the_delay_it_asks_for(
        status: int, headers: dict[str, str], retryable: bool,
        retry_after: float | None) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        calls = [lambda: runner.trigger(None, HEAD_URI, {}),
                 lambda: runner.status("bk-acme/monorepo/1")]
        if status != 422:  # to a cancel, 422 is Buildkite's "over already": no error
            calls.append(lambda: runner.cancel("bk-acme/monorepo/1"))
        for call in calls:
            fake.fail_next(status, headers=headers, body={"message": f"no ({TOKEN})"})
            error = await failure_of(call())
            assert (error.retryable, error.retry_after) == (retryable, retry_after), error
            assert f"answered {status}" in str(error) and "/v2/organizations/acme" in str(error)
            assert TOKEN not in str(error) and TOKEN not in repr(error)
            outcome = outcome_of_exception(error)
            assert outcome == (Retryable(error, retry_after=retry_after) if retryable
                               else NonRetryable(error))

    serve(scenario)


def test_a_retry_after_date_is_read_as_the_time_until_it() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        fake.fail_next(429, headers={"Retry-After": _http_date(30)})
        error = await failure_of(runner.status("bk-acme/monorepo/1"))
        assert error.retryable and error.retry_after is not None
        assert 27 <= error.retry_after <= 30

    serve(scenario)


def test_the_real_answers_for_a_bad_token_an_unknown_build_and_a_rejected_build() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        bad = runner_for(fake, environ={TOKEN_ENV: "wrong"})
        error = await failure_of(bad.trigger(None, HEAD_URI, {}))
        assert not error.retryable and "401" in str(error) and TOKEN_ENV in str(error)
        await bad.aclose()
        error = await failure_of(runner.status("bk-acme/monorepo/99"))
        assert not error.retryable and "404" in str(error)
        other = BuildkiteBuildRunner("acme", "elsewhere", TOKEN_ENV, api_url=fake.url,
                                     environ={TOKEN_ENV: TOKEN})
        error = await failure_of(other.trigger(None, HEAD_URI, {}))
        assert not error.retryable and "404" in str(error)
        await other.aclose()
        error = await failure_of(runner.status("bk-acme/monorepo"))
        assert not error.retryable and "not a buildkite build id" in str(error)

    serve(scenario)


def test_a_hanging_api_is_a_retryable_timeout() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        fake.hang_next()
        started = time.monotonic()
        error = await failure_of(runner.status("bk-acme/monorepo/1"))
        assert error.retryable and "no answer within 0.3s" in str(error)
        assert time.monotonic() - started < 5

    serve(scenario, timeout=0.3)


def test_an_unreachable_api_is_retryable() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    async def main() -> None:
        runner = BuildkiteBuildRunner("acme", "monorepo", TOKEN_ENV,
                                      api_url=f"http://127.0.0.1:{port}",
                                      environ={TOKEN_ENV: TOKEN})
        error = await failure_of(runner.trigger(None, HEAD_URI, {}))
        await runner.aclose()
        assert error.retryable and error.retry_after is None
        assert error.__cause__ is None  # not mistaken for the broker or the database away
        assert TOKEN not in str(error)

    asyncio.run(main())


@pytest.mark.parametrize("environ", [{}, {TOKEN_ENV: ""}, {TOKEN_ENV: "  "}])
def test_a_missing_token_variable_is_a_configuration_error_naming_it(
        environ: dict[str, str]) -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        for call in (runner.trigger(None, HEAD_URI, {}), runner.status("bk-acme/monorepo/1"),
                     runner.cancel("bk-acme/monorepo/1")):
            error = await failure_of(call)
            assert not error.retryable
            assert f"the environment variable {TOKEN_ENV}" in str(error)
        assert fake.requests() == []

    serve(scenario, environ=environ)


def test_a_uri_that_is_no_git_commit_is_refused() -> None:
    async def scenario(fake: FakeBuildkite, runner: BuildkiteBuildRunner) -> None:
        error = await failure_of(runner.trigger(None, "fake://demo/main/c1", {}))
        assert not error.retryable and "builds git commits only" in str(error)

    serve(scenario)


def test_the_token_is_in_no_repr() -> None:
    spec = BuildkiteBuildRunnerSpec("acme", "monorepo", TOKEN_ENV)
    runner = BuildkiteBuildRunner("acme", "monorepo", TOKEN_ENV, environ={TOKEN_ENV: TOKEN})
    for text in (repr(spec), repr(runner), repr(runner.api), repr(vars(runner))):
        assert TOKEN not in text
    assert TOKEN_ENV in repr(runner)


# --- queues.yaml ---------------------------------------------------------------------------

GIT_SC = {"kind": "git", "repository": "/srv/git/monorepo", "ref": "main"}
BK = {"kind": "buildkite", "organization": "acme", "pipeline": "monorepo",
      "token_env": "BUILDKITE_API_TOKEN"}


def _load(tmp_path: Path, build_runner: Any) -> Any:
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump({"queues": {"q": {"source_control": GIT_SC,
                                                     "build_runner": build_runner}}}))
    return load_queues(path)


def test_queues_yaml_with_every_option(tmp_path: Path) -> None:
    spec = _load(tmp_path, {**BK, "api_url": "https://bk.example.com/", "branch": "ci",
                            "env": {"DEPLOY": "no"}, "request_timeout": "5s"}
                 ).get("q").build_runner
    assert spec == BuildkiteBuildRunnerSpec(
        "acme", "monorepo", "BUILDKITE_API_TOKEN", api_url="https://bk.example.com",
        branch="ci", env={"DEPLOY": "no"}, request_timeout=timedelta(seconds=5))
    assert _load(tmp_path, BK).get("q").build_runner == BuildkiteBuildRunnerSpec(
        "acme", "monorepo", "BUILDKITE_API_TOKEN")
    runner = make_build_runner(_load(tmp_path, BK).get("q"))
    assert isinstance(runner, BuildkiteBuildRunner)
    assert (runner.api.api_url, runner.api.timeout, runner.queue) == (
        "https://api.buildkite.com", 10.0, "q")


@pytest.mark.parametrize(("build_runner", "expected"), [
    ({"kind": "buildkite", "pipeline": "p", "token_env": "T"},
     "queues.q.build_runner: missing 'organization', e.g. organization: acme"),
    ({"kind": "buildkite", "organization": "acme", "pipeline": "p"},
     "queues.q.build_runner: missing 'token_env', e.g. token_env: BUILDKITE_API_TOKEN"),
    ({**BK, "token_env": "bkua_12ab34cd"},
     "queues.q.build_runner.token_env: expected the NAME of the environment variable "
     "holding the token"),
    ({**BK, "token_env": "bkua_12ab34cd"}, "never the token itself; the value given is "
                                           "not shown"),
    ({**BK, "organization": "acme corp"},
     "queues.q.build_runner.organization: expected a slug"),
    ({**BK, "api_url": "ftp://bk.example.com"},
     "queues.q.build_runner.api_url: expected an http(s) URL"),
    ({**BK, "api_url": "https://user:pw@bk.example.com"},
     "queues.q.build_runner.api_url: expected an http(s) URL without credentials"),
    ({**BK, "branch": "refs/heads/main"}, "queues.q.build_runner.branch: invalid branch"),
    ({**BK, "env": {"STOVEPIPE_HEAD_SHA": "x"}},
     "queues.q.build_runner.env: 'STOVEPIPE_HEAD_SHA': the STOVEPIPE_ variables are set"),
    ({**BK, "env": {"N": 1}}, "queues.q.build_runner.env: 'N': expected a string value"),
    ({**BK, "request_timeout": "0s"},
     "queues.q.build_runner.request_timeout: must be longer than zero"),
    ({**BK, "token": "abc"}, "queues.q.build_runner: unknown field 'token'"),
])
def test_each_queues_yaml_problem_is_reported(tmp_path: Path, build_runner: Any,
                                              expected: str) -> None:
    with pytest.raises(QueueConfigError) as caught:
        _load(tmp_path, build_runner)
    assert any(expected in p for p in caught.value.problems), caught.value.problems
    assert "bkua_12ab34cd" not in str(caught.value)  # a token pasted as token_env


def test_the_shipped_file_s_buildkite_example_is_valid(tmp_path: Path) -> None:
    queue = shipped_example_queues(tmp_path).get("acme/web")
    assert queue.build_runner == BuildkiteBuildRunnerSpec(
        "acme", "web", "BUILDKITE_API_TOKEN", api_url="https://api.buildkite.com",
        branch="main", env={"CI_PROFILE": "stovepipe"},
        request_timeout=timedelta(seconds=10))


# --- end to end --------------------------------------------------------------------------


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(work: Path, name: str) -> str:
    (work / "app.txt").write_text(f"{name}\n")
    _git(work, "add", "app.txt")
    _git(work, "commit", "-q", "-m", name)
    return _git(work, "rev-parse", "HEAD")


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_a_queue_on_buildkite_ends_green_for_a_passed_build_and_red_for_a_failed_one(
        pipeline: Pipeline, tmp_path: Path) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    _git(work, "init", "-q")
    c1 = _commit(work, "c1")
    fake = FakeBuildkite(TOKEN)
    with fake.in_thread():
        pipeline.add_raw_queue("mono/main", {
            "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
            "build_runner": {**BK, "token_env": TOKEN_ENV, "api_url": fake.url},
            "gate_delay": "200ms", "poll_delay_queued": "200ms",
            "poll_delay_running": "200ms", "poll_deadline": "120s"})
        pipeline.start_worker(env={TOKEN_ENV: TOKEN})

        def build_of(sha: str) -> dict[str, Any]:
            wait_until(lambda: bool(fake.builds_of(sha)), timeout=90,
                       what=f"a Buildkite build of {sha[:8]}")
            [build] = fake.builds_of(sha)
            return build

        first = pipeline.ingest("mono/main")
        build = build_of(c1)
        fake.set_state(build["number"], "running")
        wait_until(lambda: pipeline.query("SELECT status FROM build") == [("running",)],
                   timeout=60, what="the build seen running")
        fake.set_state(build["number"], "passed")
        pipeline.wait_quiet(timeout=90)
        assert pipeline.states() == {first: "succeeded"}
        assert build["env"]["STOVEPIPE_BASE_SHA"] == ""  # the queue's first build is full

        c2 = _commit(work, "c2")
        second = pipeline.ingest("mono/main")
        build = build_of(c2)
        assert build["env"]["STOVEPIPE_BASE_SHA"] == c1  # incremental from the green c1
        fake.set_state(build["number"], "failed")
        pipeline.wait_quiet(timeout=90)
        assert pipeline.states() == {first: "succeeded", second: "failed"}
        facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
        assert facts == {first: 0, second: 1}
        assert pipeline.query("SELECT id, status FROM build ORDER BY id") == [
            ("bk-acme/monorepo/1", "succeeded"), ("bk-acme/monorepo/2", "failed")]
        assert len(fake.requests("POST")) == 2  # one build per Request
        assert TOKEN not in pipeline.full_logs()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_a_congested_cluster_turns_no_passing_build_red(pipeline: Pipeline,
                                                        tmp_path: Path) -> None:
    """Issue 23, as a new user would meet it: four builds wait 100 s for an agent and then
    run 50 s, under ``poll_deadline: 120s`` and the shipped poll delays; each Request ends
    as its build did — green — and each build's start is Buildkite's ``started_at``, 100 s
    after its trigger (before: red, "it ran past the poll deadline", for 3 of the 4). A
    fifth build whose job expired before an agent took it could not validate the commit:
    failed without a verdict, no fact (before: red)."""
    fake = FakeBuildkite(TOKEN)
    fake.plan_new_builds(queued=100, runs=50)
    shas = {}
    with fake.in_thread():
        for n in range(5):
            work = tmp_path / f"repo{n}"
            work.mkdir()
            _git(work, "init", "-q")
            shas[f"mono{n}"] = _commit(work, f"c{n}")
            pipeline.add_raw_queue(f"mono{n}", {
                "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
                "build_runner": {**BK, "token_env": TOKEN_ENV, "api_url": fake.url},
                "poll_deadline": "120s", "retry": {"unvalidated": 0}})
        pipeline.start_worker(env={TOKEN_ENV: TOKEN})
        ids = {q: pipeline.ingest(q) for q in shas}
        wait_until(lambda: all(fake.builds_of(s) for s in shas.values()), timeout=120,
                   what="a build of every head")
        [expired] = fake.builds_of(shas["mono4"])
        fake.set_jobs(expired["number"], [bk_job("ci", "expired", agent=False)])
        fake.set_state(expired["number"], "failed")
        pipeline.wait_quiet(timeout=600)

    passing = {ids[f"mono{n}"] for n in range(4)}
    assert pipeline.states() == {**{r: "succeeded" for r in passing},
                                 ids["mono4"]: "failed"}
    facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
    assert facts == {r: 0 for r in passing}  # no red fact; none for the expired build
    [(reason,)] = pipeline.query("SELECT reason FROM request WHERE id = %s", ids["mono4"])
    assert "job 'ci' expired before an agent took it" in reason
    started = pipeline.query(
        "SELECT b.request_id, EXTRACT(EPOCH FROM b.started_at - b.created_at)::float8"
        " FROM build b WHERE b.request_id = ANY(%s)", list(passing))
    assert len(started) == 4 and all(95 <= s <= 105 for _, s in started), started
    assert len(fake.requests("POST")) == 5  # one build per Request: none re-attempted
