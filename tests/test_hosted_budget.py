"""Issue 17, Deliver items 2 and 3: a rate budget per credential, shared by every queue and
build of a worker and divided among the workers; batched polls (one list call answers
every running build of a pipeline). The budget's arithmetic is checked on its own; the
runners against a local server implementing Buildkite's builds API and its published rate
limit ("REST API rate limits": 200 requests a minute per organization); and a whole worker
on the real broker and database with 20 builds running on one organization."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import Database
from streams.extensions import budget as budget_mod
from streams.extensions.budget import BURST_SECONDS, Budget
from streams.extensions.buildrunner.buildkite import (
    DEFAULT_REQUESTS_PER_MINUTE,
    BuildkiteBuildRunner,
)
from streams.extensions.buildrunner.contract import BuildRunnerError
from streams.extensions.buildrunner.github_actions import GitHubActionsBuildRunner
from streams.extensions.buildrunner.snapshots import MARGIN
from streams.extensions.notify import Notice, NotifyError, NotifyPostponed
from streams.extensions.notify.github_status import GitHubStatusNotifier
from streams.extensions.sourcecontrol.gituri import git_uri
from tests.budget_support import (
    TOKEN,
    TOKEN_ENV,
    BudgetRun,
    add_buildkite_queues,
    fake_organization,
    republished,
    run_builds_at_once,
    start_counted_workers,
)
from tests.hosted_ci import FakeBuildkite, FakeGitHub
from tests.pipeline_support import Pipeline, produce_ingests
from tests.waiting import wait_until

GH_TOKEN = "ghs_budget_T0KEN"
GH_TOKEN_ENV = "STOVEPIPE_TEST_GITHUB_TOKEN"
# GitHub's answer to a secondary rate limit ("Rate limits for the REST API"): a 403 whose
# message says so, without retry-after
SECONDARY_LIMIT = {"message": "You have exceeded a secondary rate limit and have been "
                              "temporarily blocked from content creation. Please retry "
                              "your request again later.",
                   "documentation_url": "https://docs.github.com/rest/using-the-rest-api/"
                                        "rate-limits-for-the-rest-api"}


@pytest.fixture(autouse=True)
def _fresh_budgets() -> Iterator[None]:
    """Each test starts as a process that never counted workers nor met a rate limit."""
    budget_mod.forget_all()
    yield
    budget_mod.forget_all()


def test_a_budget_spends_its_share_of_the_limit_and_no_more() -> None:
    async def main() -> float:
        budget = Budget("t", per_minute=600, workers=1)  # 10 a second for one worker
        started = time.monotonic()
        for _ in range(int(budget.capacity) + 20):  # a full burst, then 20 more
            await budget.acquire()
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    assert 1.8 <= elapsed < 3.0, elapsed  # the 20 beyond the burst at 10 a second


def test_workers_share_a_budget_and_callers_are_served_in_turn() -> None:
    async def main() -> list[int]:
        budget = Budget("t", per_minute=1200, workers=2)  # 10 a second for this worker
        assert budget.per_second == 10
        for _ in range(int(budget.capacity)):  # the burst spent
            await budget.acquire()
        order: list[int] = []

        async def call(n: int) -> None:
            await budget.acquire()
            order.append(n)

        await asyncio.gather(*(call(n) for n in range(5)))
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]  # first come, first served


def test_a_budget_made_after_a_count_uses_the_last_count() -> None:
    """Issue 23: a budget made after the workers were counted (a queue's first call, a
    notifier built later) is divided by that count, not by one."""
    budget_mod.share_among(3)
    made_later = budget_mod.budget_for("buildkite:x:org", 90)
    assert made_later.per_second == pytest.approx(90 / 60 / 3)
    budget_mod.share_among(2)  # and follows every later count
    assert made_later.per_second == pytest.approx(90 / 60 / 2)


def test_a_worker_that_has_not_counted_yet_takes_a_conservative_share() -> None:
    """Issue 23: a worker that just started (a rolling restart, a scale-out) does not know
    how many share the credential: until its first count it spends a tenth of the share,
    never the whole of it."""
    budget_mod.start_counting()
    budget = budget_mod.budget_for("buildkite:x:org", 60)
    assert budget_mod.UNCOUNTED_WORKERS == 10
    assert budget.per_second == pytest.approx(60 / 60 / 10)
    now = time.monotonic()
    for _ in range(int(budget.capacity)):  # its whole burst
        budget.reserve(now)
    assert budget.turn_in(now) == pytest.approx(10.0)  # a call every 10 s
    budget_mod.share_among(1)  # counted: alone, the whole share
    assert budget.per_second == pytest.approx(60 / 60)
    assert budget.turn_in(now) == pytest.approx(1.0)  # what it owes is paid off sooner


def test_a_long_wait_for_a_turn_is_announced_before_it_is_waited() -> None:
    """A caller whose turn is ANNOUNCE_AFTER or more away hears it first (so a poll or
    trigger loop can tell the sweeper when it is back); a short wait is not announced,
    and a caller without a listener just waits."""
    async def main() -> list[tuple[float, float]]:
        budget = Budget("t", per_minute=30, workers=1)  # one every 2 s, a burst of 5
        heard: list[tuple[float, float]] = []

        async def listener(wait: float) -> None:
            heard.append((wait, time.monotonic()))

        for _ in range(5):
            await budget_mod.announcing(listener, budget.acquire())  # the burst: no wait
        assert heard == []
        asked = time.monotonic()
        await budget.acquire()  # the 6th, without a listener: 2 s
        assert time.monotonic() - asked >= 1.9
        asked = time.monotonic()
        await budget_mod.announcing(listener, budget.acquire())  # the 7th
        assert time.monotonic() - asked >= 1.9
        return [(wait, at - asked) for wait, at in heard]

    heard = asyncio.run(main())
    assert len(heard) == 1
    wait, after = heard[0]
    assert 1.9 <= wait <= 2.01 and after < 0.1  # announced at once, before waiting


def test_the_poll_period_is_what_the_budget_allows() -> None:
    budget = Budget("t", per_minute=100)  # Buildkite's default share: half of 200/min
    # one worker: 100/min, 80 of them for polls: 1.33 a second
    assert budget.poll_period(1, floor=2.0) == 2.0  # the configured delay suffices
    assert budget.poll_period(20, floor=2.0) == pytest.approx(15.0)  # 20 pipelines
    budget.workers = 2
    assert budget.poll_period(20, floor=2.0) == pytest.approx(30.0)
    budget.workers = 1
    assert budget.poll_period(0, floor=5.0) == 5.0


def test_one_budget_per_credential_the_strictest_share_wins() -> None:
    key = budget_mod.budget_key("buildkite", "https://api.buildkite.com", "organization:x")
    assert "organization" not in key.split(":", 2)[2]  # the credential is hashed
    first = budget_mod.budget_for(key, 100)
    assert budget_mod.budget_for(key, 150) is first and first.per_minute == 100
    assert budget_mod.budget_for(key, 50).per_minute == 50


def _runner(fake: FakeBuildkite, pipeline: str) -> BuildkiteBuildRunner:
    return BuildkiteBuildRunner("acme", pipeline, TOKEN_ENV, api_url=fake.url,
                                environ={TOKEN_ENV: TOKEN}, requests_per_minute=6000,
                                batch_polls=True)


def test_one_list_call_answers_every_running_build_of_a_pipeline(tmp_path: Path) -> None:
    """Ten builds on each of two pipelines, polled by their loops as buildsignal polls
    them (status, then hold for the runner's poll delay): a round of polls costs one list
    call per pipeline, no build is asked for alone, and every end is seen in the round
    after it happened."""
    fake = FakeBuildkite(TOKEN, more_pipelines=("other",))

    async def main() -> tuple[int, int, list[float]]:
        async with fake.serving():
            runners = {p: _runner(fake, p) for p in ("monorepo", "other")}
            ids = []
            for n in range(20):
                pipeline = "monorepo" if n % 2 else "other"
                uri = git_uri("/r", "main", f"{n:040x}")
                ids.append(await runners[pipeline].trigger(None, uri, {}))
            for number in fake.builds:
                fake.set_state(number, "running")
            ended: dict[str, float] = {}
            seen: dict[str, float] = {}

            async def loop(build_id: str) -> None:
                runner = runners[build_id.split("/")[1]]
                while True:
                    report = await runner.status(build_id)
                    if report.status.is_terminal:
                        seen[build_id] = time.monotonic()
                        return
                    await asyncio.sleep(runner.poll_delay(build_id, 1.0))

            polling = [asyncio.create_task(loop(b)) for b in ids]
            await asyncio.sleep(3.5)  # a few rounds
            lists_before = len([s for s in fake.requests("GET") if s.path.endswith("builds")])
            await asyncio.sleep(3.0)
            lists = len([s for s in fake.requests("GET")
                         if s.path.endswith("builds")]) - lists_before
            gets = len([s for s in fake.requests("GET") if s.path.rsplit("/", 1)[1].isdigit()])
            for build_id in ids:  # every build ends now
                fake.set_state(int(build_id.rsplit("/", 1)[1]), "passed")
                ended[build_id] = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*polling), 30)
            for runner in runners.values():
                await runner.aclose()
            return lists, gets, [seen[b] - ended[b] for b in ids]

    lists, gets, lateness = asyncio.run(main())
    # 3 s at a period of 1 s: about three rounds, two pipelines, one list each a round
    assert 4 <= lists <= 8, lists
    assert gets == 0  # no build asked for alone: the lists named every one
    period = 1.0 + MARGIN
    assert max(lateness) <= period + 0.5, lateness  # seen within one round of its end


def test_a_rate_limit_pauses_the_whole_organization_for_polls_and_triggers() -> None:
    """Issue 23: Buildkite's 429 for one call (its organization's limit spent, the reset
    in 30 s) pauses every call on the organization — another pipeline's trigger, the
    polls — until the reset: none reaches the server, each fails retryably at once,
    asking to be tried after the reset."""
    fake = FakeBuildkite(TOKEN, more_pipelines=("other",))

    async def main() -> None:
        async with fake.serving():
            mono, other = _runner(fake, "monorepo"), _runner(fake, "other")
            build = await mono.trigger(None, git_uri("/r", "main", "a" * 40), {})
            fake.fail_next(429, headers={"RateLimit-Limit": "200",
                                         "RateLimit-Remaining": "0", "RateLimit-Reset": "30"})
            with pytest.raises(BuildRunnerError) as limited:
                await mono.status(build)
            assert limited.value.retryable and limited.value.retry_after == 30
            asked = len(fake.requests())
            for call in (other.trigger(None, git_uri("/r", "main", "b" * 40), {}),
                         mono.status(build), mono.cancel(build)):
                with pytest.raises(BuildRunnerError) as paused:
                    await call
                assert paused.value.retryable, paused.value
                assert paused.value.retry_after is not None
                assert 28 < paused.value.retry_after <= 30, paused.value
                assert "paused" in str(paused.value)
            assert len(fake.requests()) == asked  # not one call more
            for runner in (mono, other):
                await runner.aclose()

    asyncio.run(main())


def test_a_github_rate_limit_pauses_the_token_for_polls_triggers_and_statuses() -> None:
    """Issue 23: a secondary rate limit (403, no Retry-After, requests remaining) answered
    to a commit status pauses the token for a minute for every caller on it: the GitHub
    Actions runner's polls and dispatches are not sent, and a second status is postponed,
    not failed. And the other way round: a limit answered to a poll holds the statuses."""
    github = FakeGitHub(GH_TOKEN)

    async def main() -> None:
        async with github.serving():
            runner = GitHubActionsBuildRunner(
                "acme/monorepo", "stovepipe.yml", GH_TOKEN_ENV, api_url=github.url,
                environ={GH_TOKEN_ENV: GH_TOKEN}, requests_per_minute=6000,
                batch_polls=True, content_per_hour=36000)
            statuses = GitHubStatusNotifier(github.url, "acme/monorepo", GH_TOKEN,
                                            "stovepipe/validation", content_per_hour=36000)
            build = await runner.trigger(None, git_uri("/r", "main", "a" * 40), {})
            await statuses.send(_pending("request/q/1"))  # accepted
            github.fail_next(403, body=SECONDARY_LIMIT, method="POST", path="/statuses/")
            with pytest.raises(NotifyError) as limited:
                await statuses.send(_pending("request/q/2"))
            assert limited.value.retryable and limited.value.retry_after == 60
            asked = len(github.requests())
            for call in (runner.status(build),
                         runner.trigger(None, git_uri("/r", "main", "b" * 40), {})):
                with pytest.raises(BuildRunnerError) as paused:
                    await call
                assert paused.value.retryable and paused.value.retry_after is not None
                assert 58 < paused.value.retry_after <= 60, paused.value
            with pytest.raises(NotifyPostponed) as postponed:
                await statuses.send(_pending("request/q/3"))
            assert 58 < postponed.value.delay <= 60
            assert len(github.requests()) == asked  # not one call more

            budget_mod.forget_all()  # the minute is over
            github.fail_next(403, body=SECONDARY_LIMIT, method="GET")
            with pytest.raises(BuildRunnerError):
                await runner.status(build)
            asked = len(github.requests())
            with pytest.raises(NotifyPostponed):
                await statuses.send(_pending("request/q/3"))
            assert len(github.requests()) == asked
            await runner.aclose()

    asyncio.run(main())


def _pending(request_id: str) -> Notice:
    return Notice(kind="status", event="pending", queue="q", request_id=request_id,
                  uri=git_uri("/r", "main", "c" * 40), sha="c" * 40,
                  at="2026-01-01T00:00:00+00:00")


@pytest.mark.postgres
def test_workers_are_counted_by_process_and_older_workers_by_host(migrated_dsn: str) -> None:
    """Issue 23: three worker processes with one host id (one machine, one
    STOVEPIPE_HOME) are three; a worker of an earlier version, which heartbeats only its
    host, counts once; a process silent for longer than the window is not counted."""
    async def main() -> None:
        async with await Database.open(migrated_dsn, max_size=2) as db:
            hosts = db.worker_hosts
            assert await hosts.beat_process("p1", "m:/home", 12.0) == 1
            assert await hosts.beat_process("p2", "m:/home", 12.0) == 2
            assert await hosts.beat_process("p3", "m:/home", 12.0) == 3
            assert await hosts.beat_process("p1", "m:/home", 12.0) == 3
            await hosts.heartbeat("m:/home", 6.0)  # the processes' own host: no more
            assert await hosts.beat_process("p1", "m:/home", 12.0) == 3
            await hosts.heartbeat("old:/home", 6.0)  # a worker of an earlier version
            assert await hosts.beat_process("p1", "m:/home", 12.0) == 4
            async with db.pool.connection() as conn:
                await conn.execute("UPDATE worker_process SET heartbeat_at = now()"
                                   " - interval '13 seconds' WHERE id = 'p3'")
            assert await hosts.beat_process("p1", "m:/home", 12.0) == 3

    asyncio.run(main())


@pytest.mark.postgres
def test_a_pause_one_worker_learned_reaches_the_others(migrated_dsn: str) -> None:
    async def main() -> None:
        async with await Database.open(migrated_dsn, max_size=2) as db:
            pauses = db.credential_pauses
            assert await pauses.exchange({}) == {}
            told = await pauses.exchange({"buildkite:x:1": 30.0})
            assert told.keys() == {"buildkite:x:1"} and 29 < told["buildkite:x:1"] <= 30
            heard = await pauses.exchange({})  # another worker, at its tend
            assert 29 < heard["buildkite:x:1"] <= 30
            shorter = await pauses.exchange({"buildkite:x:1": 5.0})  # the longer stays
            assert 29 < shorter["buildkite:x:1"] <= 30

    asyncio.run(main())


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_twenty_builds_started_at_once_on_one_organization_at_the_defaults(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """20 queues on 20 pipelines of one Buildkite organization, their builds started at
    once, one worker with the shipped defaults (2 s polls, a budget of 100 calls a
    minute), the server enforcing Buildkite's 200 a minute: no call is refused, the
    sweeper re-publishes no trigger and no poll loop (the loops the budget spaces out say
    when they are back), and every outcome is recorded within one poll period (what the
    budget allows) of the build's end."""
    fake = fake_organization(20)
    with fake.in_thread():
        run = run_builds_at_once(pipeline, tmp_path, fake, workers=1)
    _report(run)
    _assert_within_the_share(run)


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_three_worker_processes_with_one_home_keep_to_the_share(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """Issue 23: three `stovepipe worker` processes on one machine with one
    STOVEPIPE_HOME (one host id) are counted as three, so together they spend the
    organization's share once, not three times: 20 builds on 20 pipelines started at
    once, the server enforcing 200 calls a minute — no 429, no re-published trigger or
    poll loop, every outcome within one poll period (what the budget allows the worker
    that polled it, counting three)."""
    fake = fake_organization(20)
    with fake.in_thread():
        run = run_builds_at_once(pipeline, tmp_path, fake, workers=3)
    _report(run)
    assert run.counted == [3, 3, 3]
    _assert_within_the_share(run)


def _report(run: BudgetRun) -> None:
    lateness = list(run.lateness.values())
    print(f"20 builds on one organization, {run.workers} worker process(es): "
          f"{run.calls_while_running:.0f} calls a minute while they ran (busiest minute "
          f"{run.busiest_minute}), {run.refused} refused (429); outcome recorded after the "
          f"build's end: median {statistics.median(lateness):.2f}s, max "
          f"{max(lateness):.2f}s (poll periods {sorted(set(run.periods.values()))}); "
          f"re-published by the sweeper: {run.republished or 'nothing'}")


def _assert_within_the_share(run: BudgetRun) -> None:
    assert set(run.states.values()) == {"succeeded"} and len(run.states) == 20, run.states
    assert run.refused == 0
    # together the workers spend at most the default share a minute, plus one burst of
    # BURST_SECONDS of it (and a few calls that arrive late by the network's jitter)
    share = DEFAULT_REQUESTS_PER_MINUTE * (1 + BURST_SECONDS / 60)
    assert run.busiest_minute <= share + 3, run.busiest_minute
    assert not {"build", "buildsignal"} & run.republished.keys(), run.republished
    assert run.late == {}


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_a_rate_limit_answered_to_one_worker_pauses_the_organization_for_all(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """Issue 23: three worker processes poll six running builds on one organization; one
    of them is answered a 429 (the organization's limit spent, reset in 40 s). Within two
    tends (4 s; 6 s allowed here) no worker calls the organization any more, until the
    reset; then the builds' ends are seen and every Request succeeds, none re-published
    by the sweeper meanwhile."""
    fake = fake_organization(6)
    with fake.in_thread():
        queues = add_buildkite_queues(pipeline, tmp_path, fake, 6)
        start_counted_workers(pipeline, 3)
        produce_ingests(pipeline.bootstrap, pipeline.topics, queues)
        wait_until(lambda: len(fake.builds) == 6, timeout=180, what="6 builds created")
        for number in list(fake.builds):
            fake.set_state(number, "running")
        wait_until(lambda: pipeline.query("SELECT count(*) FROM build WHERE status"
                                          " = 'running'") == [(6,)], timeout=120,
                   what="every build seen running")
        before = len(fake.requests())
        fake.fail_next(429, headers={"RateLimit-Limit": "200", "RateLimit-Remaining": "0",
                                     "RateLimit-Reset": "40"})
        wait_until(lambda: len(fake.requests()) > before, timeout=60, what="the 429")
        limited_at = fake.requests()[before].at
        wait_until(lambda: time.time() > limited_at + 39, timeout=60, what="the reset")
        paused = [s for s in fake.requests() if limited_at + 6 <= s.at < limited_at + 39]
        after = [s.at - limited_at for s in fake.requests()
                 if limited_at < s.at < limited_at + 39]
        print(f"calls after the 429 and before its reset: {len(after)}, the last "
              f"{max(after, default=0):.1f}s after it")
        for number in list(fake.builds):
            fake.set_state(number, "passed")
        pipeline.wait_quiet(timeout=180)
        states = pipeline.states()
    assert paused == []
    assert set(states.values()) == {"succeeded"} and len(states) == 6, states
    assert not {"build", "buildsignal"} & republished(pipeline).keys()


