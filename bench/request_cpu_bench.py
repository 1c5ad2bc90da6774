"""CPU per Request of one `stovepipe worker` (docs/production.md, Sizing): Requests run
through the real pipeline — real worker process, broker and database, git queues built by
the command build runner — and the worker process's CPU seconds (user + system, from
/proc/<pid>/stat) are divided by the Requests that ended. Prints figures; asserts only
that every Request ended as its build did.

    .venv/bin/python bench/request_cpu_bench.py [--queues 10] [--rounds 10] [--runs 3]
        [--command true] [--idle-seconds 20]

Each run is a deployment of its own (topics, schema, STOVEPIPE_HOME, one local git
repository per queue) with the shipped delays (gate 1 s, polls 5 s / 2 s) and sweep
interval. A round commits a new head on every queue, produces one IngestRequest per queue
to the `ingest` topic (so the worker ingests, as it does for a webhook) and waits until
every Request of the round has its fact; rounds never overlap, so nothing is superseded
and every Request is built. One warm-up round is not counted; then the worker's CPU while
idle for --idle-seconds gives its idle rate (sweeps, tends, gauges: paid whether Requests
come or not), then --rounds rounds are measured.

Per run it prints: the worker's own CPU per Request, the same less its idle rate over the
measured wall time, and the CPU of the worker's reaped children (the git commands of
source control) per Request. The build itself (clone, checkout, the command) runs in a
process of its own, nobody's child, so none of its CPU is counted. The summary gives the
median of the runs (and their range) and the machine's load average at the start: the
machine may be shared, and other tenants' load moves every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline_bench import endpoints, free_port
from bench.throwaway import throwaway_pipeline
from tests.command_support import git
from tests.pipeline_support import Pipeline, produce_ingests
from tests.waiting import wait_until

TICKS = os.sysconf("SC_CLK_TCK")
ROUND_TIMEOUT = 300.0


@dataclass(frozen=True)
class Cpu:
    own: float  # the process's user + system seconds
    children: float  # its waited-for children's


def process_cpu(pid: int) -> Cpu:
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # fields from the third (state) on
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return Cpu((utime + stime) / TICKS, (cutime + cstime) / TICKS)


@dataclass(frozen=True)
class RunResult:
    requests: int
    wall: float
    own: float
    idle_rate: float  # CPU seconds per second while idle
    children: float

    @property
    def per_request(self) -> float:
        return self.own / self.requests

    @property
    def per_request_less_idle(self) -> float:
        return (self.own - self.idle_rate * self.wall) / self.requests

    @property
    def children_per_request(self) -> float:
        return self.children / self.requests


def _commit(repo: Path, text: str) -> None:
    (repo / "app.txt").write_text(text + "\n")
    git(repo, "add", "app.txt")
    git(repo, "commit", "-q", "-m", text)


class Bench:
    def __init__(self, pipeline: Pipeline, root: Path, args: argparse.Namespace) -> None:
        self.pipeline, self.args = pipeline, args
        self.repos: dict[str, Path] = {}
        for n in range(args.queues):
            queue, repo = f"q{n:03d}/main", root / "repos" / f"q{n:03d}"
            repo.mkdir(parents=True)
            git(repo, "init", "-q")  # on main: command_support.git sets the default
            _commit(repo, "c0")
            self.repos[queue] = repo
            pipeline.add_raw_queue(queue, {
                "source_control": {"kind": "git", "repository": str(repo), "ref": "main"},
                "build_runner": {"kind": "command", "command": args.command}})
        self.round = 0

    def run_round(self) -> None:
        self.round += 1
        for queue, repo in self.repos.items():
            _commit(repo, f"{queue} round {self.round}")
        produce_ingests(self.pipeline.bootstrap, self.pipeline.topics, list(self.repos))
        wanted = self.round * len(self.repos)

        def built() -> bool:
            for proc in self.pipeline.workers:
                assert proc.poll() is None, self.pipeline.logs()
            [(facts,)] = self.pipeline.query("SELECT count(*) FROM validation_fact")
            return int(facts) >= wanted  # type: ignore[call-overload]

        wait_until(built, timeout=ROUND_TIMEOUT, what=f"round {self.round}'s facts",
                   interval=0.2)

    def check_outcomes(self) -> None:
        states = self.pipeline.states()
        wanted = self.round * len(self.repos)
        problems = self.pipeline.exact_outcome_problems()
        if sorted(states.values()) != ["succeeded"] * wanted or problems:
            counts = {s: list(states.values()).count(s) for s in set(states.values())}
            raise SystemExit(f"not every Request succeeded: {counts}; {problems}")


def one_run(bootstrap: str, admin_dsn: str, args: argparse.Namespace) -> RunResult:
    with throwaway_pipeline(bootstrap, admin_dsn, "rc") as pipeline:
        bench = Bench(pipeline, pipeline.root, args)
        port = free_port()
        worker = pipeline.start_worker(web_port=port)
        wait_until(lambda: _answers(port, "/startupz"), timeout=180,
                   what="the worker to start", interval=0.5)
        bench.run_round()  # warm-up: partitions assigned, caches and clones made
        before = process_cpu(worker.pid)
        time.sleep(args.idle_seconds)  # the idle rate is measured over a fixed time
        idle = process_cpu(worker.pid)
        idle_rate = (idle.own - before.own) / args.idle_seconds
        started = time.monotonic()
        for _ in range(args.rounds):
            bench.run_round()
        wall = time.monotonic() - started
        after = process_cpu(worker.pid)
        pipeline.wait_quiet(timeout=ROUND_TIMEOUT)
        bench.check_outcomes()
        return RunResult(args.rounds * args.queues, wall, after.own - idle.own, idle_rate,
                         after.children - idle.children)


def _answers(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:  # not listening yet, or 503 while starting
        return False


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--command", default="true", help="every build's command")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    args = parser.parse_args()
    if min(args.queues, args.rounds, args.runs) < 1 or args.idle_seconds <= 0:
        parser.error("--queues, --rounds and --runs must be at least 1, --idle-seconds > 0")
    bootstrap, admin_dsn = endpoints()
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} cores, load average {load:.2f}; {args.queues} git queues x "
          f"{args.rounds} rounds, command runner `{args.command}`, shipped delays",
          flush=True)
    results = []
    for n in range(1, args.runs + 1):
        result = one_run(bootstrap, admin_dsn, args)
        results.append(result)
        print(f"  run {n}: {result.requests} Requests in {result.wall:.1f} s; worker CPU "
              f"{ms(result.per_request)}/Request ({ms(result.per_request_less_idle)} less "
              f"its idle {100 * result.idle_rate:.1f}% of a core); git children "
              f"{ms(result.children_per_request)}/Request", flush=True)

    def summary(values: list[float]) -> str:
        return f"{ms(statistics.median(values))} ({ms(min(values))} to {ms(max(values))})"

    print(f"SUMMARY, median of {len(results)} run(s) (range): worker CPU per Request "
          f"{summary([r.per_request for r in results])}; less idle "
          f"{summary([r.per_request_less_idle for r in results])}; idle "
          f"{100 * statistics.median(r.idle_rate for r in results):.1f}% of a core; git "
          f"children {summary([r.children_per_request for r in results])}; load at start "
          f"{load:.2f}")


if __name__ == "__main__":
    main()
