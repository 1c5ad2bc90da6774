"""Issue 17, Deliver items 2 and 3: a rate budget per credential, shared by every queue and
build of a worker and divided among the workers; batched polls (one list call answers
every running build of a pipeline). The budget's arithmetic is checked on its own; the
runners against a local server implementing Buildkite's builds API and its published rate
limit ("REST API rate limits": 200 requests a minute per organization); and a whole worker
on the real broker and database with 20 builds running on one organization."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from streams.extensions import budget as budget_mod
from streams.extensions.budget import Budget
from streams.extensions.buildrunner.buildkite import BuildkiteBuildRunner
from streams.extensions.buildrunner.snapshots import MARGIN
from streams.extensions.sourcecontrol.gituri import git_uri
from tests.hosted_ci import FakeBuildkite
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

TOKEN = "bkua_budget-T0KEN"
TOKEN_ENV = "STOVEPIPE_TEST_BUILDKITE_TOKEN"


def test_a_budget_spends_its_share_of_the_limit_and_no_more() -> None:
    async def main() -> float:
        budget = Budget("t", per_minute=600)  # 10 a second for one worker
        started = time.monotonic()
        for _ in range(int(budget.capacity) + 20):  # a full bucket, then 20 more
            await budget.acquire()
        return time.monotonic() - started

    elapsed = asyncio.run(main())
    assert 1.8 <= elapsed < 3.0, elapsed  # the 20 beyond the burst at 10 a second


def test_workers_share_a_budget_and_callers_are_served_in_turn() -> None:
    async def main() -> list[int]:
        budget = Budget("t", per_minute=1200, workers=2)  # 10 a second for this worker
        assert budget.per_second == 10
        budget.tokens = 0.0
        budget._updated = time.monotonic()
        order: list[int] = []

        async def call(n: int) -> None:
            await budget.acquire()
            order.append(n)

        await asyncio.gather(*(call(n) for n in range(5)))
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]  # first come, first served


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


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.slow
def test_twenty_builds_on_one_organization_at_the_defaults_draw_no_429(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """20 queues on one Buildkite organization with the shipped defaults (2 s polls, the
    default budget of 100 requests a minute), the server enforcing Buildkite's 200 a
    minute: no request is refused, and every outcome is recorded within one poll interval
    of the build's end."""
    fake = FakeBuildkite(TOKEN, limit_per_minute=200)
    with fake.in_thread():
        for n in range(20):
            work = tmp_path / f"repo{n}"
            work.mkdir()
            _git(work, "init", "-q")
            (work / "app.txt").write_text(f"{n}\n")
            _git(work, "add", "app.txt")
            _git(work, "commit", "-q", "-m", f"c{n}")
            pipeline.add_raw_queue(f"q{n}", {
                "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
                "build_runner": {"kind": "buildkite", "organization": "acme",
                                 "pipeline": "monorepo", "token_env": TOKEN_ENV,
                                 "api_url": fake.url}})
        pipeline.start_worker(env={TOKEN_ENV: TOKEN})
        ids = [pipeline.ingest(f"q{n}") for n in range(20)]
        wait_until(lambda: len(fake.builds) == 20, timeout=180, what="20 builds created")
        for number in list(fake.builds):
            fake.set_state(number, "running")
        wait_until(lambda: pipeline.query("SELECT count(*) FROM build WHERE status"
                                          " = 'running'") == [(20,)], timeout=120,
                   what="every build seen running")
        started = time.time()
        time.sleep(60)  # a minute of 20 builds running: what it costs is measured
        calls_in_a_minute = len([s for s in fake.requests() if s.at >= started])
        ended = time.time()
        for number in list(fake.builds):
            fake.set_state(number, "passed")
        pipeline.wait_quiet(timeout=120)
        assert pipeline.states() == dict.fromkeys(ids, "succeeded")
        lateness = [r[0] for r in pipeline.query(
            "SELECT EXTRACT(EPOCH FROM updated_at)::float8 - %s FROM request", ended)]

    period = 2.0 + MARGIN  # one list of the pipeline every poll delay, just after it is due
    print(f"20 builds on one organization at the defaults: {calls_in_a_minute} calls in a "
          f"minute of running, {fake.refused} refused (429); outcome recorded after the "
          f"build's end: median {statistics.median(lateness):.2f}s, max "
          f"{max(lateness):.2f}s (poll interval {period:.2f}s)")
    assert fake.refused == 0
    assert calls_in_a_minute <= 100  # the default share: half the organization's limit
    assert max(lateness) <= period + 1.0, lateness
