"""Builds started at once on one Buildkite organization and run by N `stovepipe worker`
processes of one deployment sharing one machine and one STOVEPIPE_HOME, against
`tests.hosted_ci.FakeBuildkite` enforcing Buildkite's 200 calls a minute (issue 23): what
tests/test_hosted_budget.py checks and bench/worker_budget_bench.py prints.

Every queue is a branch of one git repository, built on a pipeline of its own (20
pipelines by default: a pipeline is polled with one list call per period, so the budget,
not the poll delay, then sets the period) with the shipped defaults (2 s polls, a budget
of 100 calls a minute). The ingests are produced all at once; once every build is seen
running they run for ``running_seconds`` (the calls of that window are the steady cost),
then all pass at once; lateness is the time from then to each Request's outcome, held
against the poll period the budget gives the worker that polled the build
(`Budget.poll_period`: its pipelines * the workers * 60 / (0.8 * 100) s, at least 2 s).
"""

from __future__ import annotations

import bisect
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from streams.extensions.budget import Budget
from streams.extensions.buildrunner.buildkite import DEFAULT_REQUESTS_PER_MINUTE
from streams.extensions.buildrunner.snapshots import MARGIN
from streams.stages.pipeline import TEND_INTERVAL
from tests.hosted_ci import FakeBuildkite
from tests.pipeline_support import Pipeline, produce_ingests
from tests.waiting import wait_until

TOKEN = "bkua_budget-T0KEN"
TOKEN_ENV = "STOVEPIPE_TEST_BUILDKITE_TOKEN"
ORGANIZATION = "acme"
POLL_DELAY_RUNNING = 2.0  # the shipped default
_COUNTED = re.compile(r"budget_workers_counted workers=(\d+)")
_REPUBLISHED = re.compile(r"sweeper_republished what=(\w+) count=(\d+)")
_SETTLED = re.compile(r"settled build_id=bk-[^/\s]+/([^/\s]+)/(\d+)")


@dataclass
class BudgetRun:
    workers: int
    calls_while_running: float  # calls a minute while every build ran
    busiest_minute: int  # the most calls in any 60 s of the run
    refused: int  # 429s the server answered
    lateness: dict[str, float]  # request id -> seconds from the builds' end to its outcome
    periods: dict[str, float]  # request id -> the poll period of the worker that saw it end
    republished: dict[str, int]  # what the sweeper re-published, by kind
    counted: list[int]  # each worker's last count of the live workers
    states: dict[str, str]  # every Request's state

    @property
    def late(self) -> dict[str, tuple[float, float]]:
        """The Requests recorded later than one poll period (plus a second for the
        pipeline's stages) after their build's end: (lateness, period)."""
        return {r: (late, self.periods[r]) for r, late in self.lateness.items()
                if late > self.periods[r] + 1.0}


def poll_period(workers: int, pipelines: int) -> float:
    """One poll period of a worker polling ``pipelines`` pipelines, ``workers`` counted,
    at the shipped defaults (`Budget.poll_period`), plus the loops' margin after it."""
    budget = Budget("x", DEFAULT_REQUESTS_PER_MINUTE, workers=workers)
    return budget.poll_period(pipelines, floor=POLL_DELAY_RUNNING) + MARGIN


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def fake_organization(pipelines: int) -> FakeBuildkite:
    """Buildkite's organization `ORGANIZATION` with pipelines ``p0``…, enforcing 200 calls a
    minute."""
    names = [f"p{n}" for n in range(pipelines)]
    return FakeBuildkite(TOKEN, ORGANIZATION, names[0], more_pipelines=tuple(names[1:]),
                         limit_per_minute=200)


def add_buildkite_queues(pipeline: Pipeline, root: Path, fake: FakeBuildkite,
                         count: int) -> list[str]:
    """``count`` queues ``q0``… on branches ``b0``… of one repository, queue n built on
    the organization's pipeline n (modulo its pipelines) with the shipped defaults."""
    pipelines = sorted(fake.pipelines, key=lambda name: (len(name), name))
    work = root / "repo"
    work.mkdir()
    _git(work, "init", "-q")
    names = []
    for n in range(count):
        _git(work, "checkout", "-q", "-b", f"b{n}")
        (work / "app.txt").write_text(f"{n}\n")
        _git(work, "add", "app.txt")
        _git(work, "commit", "-q", "-m", f"c{n}")
        pipeline.add_raw_queue(f"q{n}", {
            "source_control": {"kind": "git", "repository": str(work), "ref": f"b{n}"},
            "build_runner": {"kind": "buildkite", "organization": fake.organization,
                             "pipeline": pipelines[n % len(pipelines)],
                             "token_env": TOKEN_ENV,
                             "api_url": fake.url}})
        names.append(f"q{n}")
    return names


def group_members(bootstrap: str, group: str) -> int:
    """Members of the consumer group once it is stable (0 while it rebalances)."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    described = admin.describe_consumer_groups([group])[group].result(timeout=30)
    return len(described.members) if described.state == ConsumerGroupState.STABLE else 0


def counted_workers(pipeline: Pipeline) -> list[int]:
    """Each worker's last count of the live workers (0: not counted yet), from its log."""
    counts = []
    for log in sorted(pipeline.root.glob("worker-*.log")):
        found = _COUNTED.findall(log.read_text(errors="replace"))
        counts.append(int(found[-1]) if found else 0)
    return counts


def start_counted_workers(pipeline: Pipeline, workers: int, *,
                          require_count: bool = True) -> None:
    """``workers`` worker processes of one deployment (one STOVEPIPE_HOME), started
    together; returns once their group is stable and each counted all of them (without
    ``require_count``, for code that does not count processes: two tends later)."""
    for _ in range(workers):
        pipeline.start_worker(env={TOKEN_ENV: TOKEN})
    wait_until(lambda: group_members(pipeline.bootstrap, pipeline.app_id) == workers,
               timeout=180, what=f"{workers} workers in a stable group")
    if require_count:
        wait_until(lambda: counted_workers(pipeline) == [workers] * workers, timeout=60,
                   what=f"every worker counting {workers}")
    else:
        time.sleep(2 * TEND_INTERVAL + 1.0)


def worker_periods(pipeline: Pipeline, workers: int) -> dict[str, float]:
    """Build id -> the poll period of the worker whose log says it settled the build's
    Request (that worker polled so many pipelines)."""
    periods: dict[str, float] = {}
    for log in sorted(pipeline.root.glob("worker-*.log")):
        settled = _SETTLED.findall(log.read_text(errors="replace"))
        period = poll_period(workers, len({name for name, _ in settled}))
        for name, number in settled:
            periods[f"bk-{ORGANIZATION}/{name}/{number}"] = period
    return periods


def republished(pipeline: Pipeline) -> dict[str, int]:
    found: dict[str, int] = {}
    for what, count in _REPUBLISHED.findall(pipeline.full_logs()):
        found[what] = found.get(what, 0) + int(count)
    return found


def run_builds_at_once(pipeline: Pipeline, root: Path, fake: FakeBuildkite, *,
                       workers: int, builds: int = 20, running_seconds: float = 60.0,
                       require_count: bool = True) -> BudgetRun:
    """The run the module docstring describes; ``fake`` must be serving (in a thread)."""
    queues = add_buildkite_queues(pipeline, root, fake, builds)
    start_counted_workers(pipeline, workers, require_count=require_count)
    produce_ingests(pipeline.bootstrap, pipeline.topics, queues)  # all at once
    wait_until(lambda: len(fake.builds) == builds, timeout=300,
               what=f"{builds} builds created")
    for number in list(fake.builds):
        fake.set_state(number, "running")
    wait_until(lambda: pipeline.query("SELECT count(*) FROM build WHERE status = 'running'")
               == [(builds,)], timeout=180, what="every build seen running")
    started = time.time()
    time.sleep(running_seconds)  # the builds run: what that costs is measured
    in_window = len([s for s in fake.requests() if started <= s.at < started
                     + running_seconds])
    ended = time.time()
    for number in list(fake.builds):
        fake.set_state(number, "passed")
    pipeline.wait_quiet(timeout=300)
    lateness = {str(r[0]): float(r[1]) for r in pipeline.query(
        "SELECT id, EXTRACT(EPOCH FROM updated_at)::float8 - %s FROM request", ended)}
    by_build = worker_periods(pipeline, workers)
    periods = {str(request): by_build[str(build)] for request, build in pipeline.query(
        "SELECT request_id, id FROM build")}
    times = sorted(s.at for s in fake.requests())
    busiest = max((bisect.bisect_left(times, at + 60.0) - i for i, at in enumerate(times)),
                  default=0)
    return BudgetRun(workers=workers,
                     calls_while_running=in_window * 60.0 / running_seconds,
                     busiest_minute=busiest, refused=fake.refused, lateness=lateness,
                     periods=periods, republished=republished(pipeline),
                     counted=counted_workers(pipeline),
                     states=pipeline.states())
