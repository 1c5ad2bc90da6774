"""Greenness per project through the running pipeline (issue 24, item 7), side by side with
a queue without projects: what a head costs from ingest to its facts. Prints figures;
asserts nothing about timing.

    .venv/bin/python bench/projects_bench.py [--projects 200] [--heads 60] [--runs 3]
        [--delay 50ms]

Per run, a deployment of its own (bench/pipeline_bench.py's: topics, schema, one real
`stovepipe worker`) with two queues on real git repositories of the same shape
(`services/pNNN/` per project and a shared `libs/common/`) and the fake build runner's
instant builds, so what is measured is Stovepipe's own work:

- `plain/main`: no projects — one build of everything per head;
- `mono/main`: ``--projects`` projects, project P's paths `services/P/**` and
  `libs/common/**` — a build per affected project, the others inherit.

After a warm-up (each queue's first heads, where every project is built), one chain of
heads per phase (commit, ingest in-process as `stovepipe ingest` does, wait for the
whole-repository fact, next):

1. plain: ``--heads`` heads each changing one project's file;
2. mono, one project: the same heads on the monorepo;
3. mono, ten projects: ``--heads`` / 5 heads each changing ten projects' files;
4. mono, everything: 3 heads changing `libs/common/` (every project affected).

Per phase: ingest → whole-repository fact p50/p99, builds, diffs
(`stovepipe_affected_diffs_total`), rows written (every table's row count before and
after) and the worker's CPU (with its git processes), each per head; medians over
``--runs`` (the machine is shared: other tenants move every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pipeline_analysis as pa
import pipeline_bench as pb
import psycopg
import yaml
from psycopg import sql

PLAIN, MONO = "plain/main", "mono/main"
WARMUP = 3


def git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=Bench", "-c",
                           "user.email=bench@example.invalid", "-C", str(work), *args],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


class Repo:
    """`main` of a real repository with a directory per project and a shared library."""

    def __init__(self, work: Path, projects: int) -> None:
        self.work, self.n = work, 0
        work.mkdir(parents=True)
        git(work, "init", "-q", "-b", "main")
        for p in range(projects):
            (work / "services" / name(p)).mkdir(parents=True)
            (work / "services" / name(p) / "f.txt").write_text("0\n")
        (work / "libs" / "common").mkdir(parents=True)
        (work / "libs" / "common" / "c.txt").write_text("0\n")
        self.commit([])

    def commit(self, paths: list[str]) -> str:
        self.n += 1
        for path in paths:
            (self.work / path).write_text(f"{self.n}\n")
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "--allow-empty", "-m", f"change {self.n}")
        return git(self.work, "rev-parse", "HEAD")


def name(project: int) -> str:
    return f"p{project:03d}"


def queue_config(work: Path, delay: str, projects: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "source_control": {"kind": "git", "repository": str(work), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "fake"},
        "max_concurrent": 1, "gate_delay": delay, "poll_delay_queued": delay,
        "poll_delay_running": delay, "poll_deadline": "120s"}
    if projects is not None:
        config["projects"] = {name(p): {"paths": [f"services/{name(p)}/**",
                                                  "libs/common/**"]}
                              for p in range(projects)}
    return config


@dataclass
class Phase:
    label: str
    queue: str
    heads: int
    touched: int  # projects a head changes; 0: the shared library (every project)


@dataclass
class Measured:
    p50: float
    p99: float
    builds: float
    diffs: float
    rows: float
    cpu_ms: float


class Driver(pb.Driver):
    repos: dict[str, Repo]

    async def commit_and_ingest(self, queue: str, paths: list[str]) -> str:
        from streams.stages.ingest import ingest_queue

        await asyncio.to_thread(self.repos[queue].commit, paths)
        started = time.time()
        rid = await ingest_queue(self.deps, queue, self.publish)
        self.ingest_started[rid] = started
        return rid


def row_counts(dep: pb.Deployment) -> dict[str, int]:
    with psycopg.connect(dep.dsn) as conn:
        tables = [r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s"
            " AND table_type = 'BASE TABLE'", (dep.schema,))]
        return {t: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(t))).fetchone()[0] for t in tables}  # type: ignore[index]


def worker_cpu(pid: int) -> float:
    """utime + stime of the worker and of its children it waited for (git)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / pa.CLK_TCK


def diffs(dep: pb.Deployment) -> float:
    return sum(v for (sample, _), v in dep.scrape().items()
               if sample == "stovepipe_affected_diffs_total")


async def run_phase(drv: Driver, phase: Phase, projects: int,
                    rng: random.Random) -> Measured:
    dep = drv.dep
    assert dep.worker is not None
    rows0, cpu0, diffs0 = row_counts(dep), worker_cpu(dep.worker.pid), diffs(dep)
    ids = []
    for _ in range(phase.heads):
        if phase.touched:
            paths = [f"services/{name(p)}/f.txt"
                     for p in rng.sample(range(projects), phase.touched)]
        else:
            paths = ["libs/common/c.txt"]
        rid = await drv.commit_and_ingest(phase.queue, paths)
        ids.append(rid)
        await drv.watcher.wait("fact", rid)
    await drv.watcher.wait("terminal", ids[-1])
    await asyncio.sleep(1.0)  # the last head's trailing writes (bookmark, notifications)
    rows1, cpu1, diffs1 = row_counts(dep), worker_cpu(dep.worker.pid), diffs(dep)
    lat = pb.fact_latencies(dep.dsn, drv.ingest_started, ids)
    n = phase.heads
    written = sum(max(0, rows1[t] - rows0.get(t, 0)) for t in rows1)
    builds = rows1.get("build", 0) - rows0.get("build", 0)
    measured = Measured(pa.percentile(lat, .5), pa.percentile(lat, .99), builds / n,
                        (diffs1 - diffs0) / n, written / n, (cpu1 - cpu0) * 1000 / n)
    pb.log(f"{phase.label}: {n} heads, p50 {measured.p50 * 1000:.0f} ms, p99 "
           f"{measured.p99 * 1000:.0f} ms, {measured.builds:.1f} builds, "
           f"{measured.diffs:.1f} diffs, {measured.rows:.1f} rows, "
           f"{measured.cpu_ms:.0f} ms worker CPU per head")
    return measured


def run(args: argparse.Namespace, seed: int) -> dict[str, Measured]:
    dep = pb.one_worker_deployment(args.delay, "projects-bench")
    try:
        dep.setup()
        repos = {PLAIN: Repo(dep.root / "plainrepo", args.projects),
                 MONO: Repo(dep.root / "monorepo", args.projects)}
        dep.queues = {PLAIN: queue_config(repos[PLAIN].work, args.delay, None),
                      MONO: queue_config(repos[MONO].work, args.delay, args.projects)}
        dep.queues_file.write_text(yaml.safe_dump({"queues": dep.queues}))
        dep.start_worker(None)
        dep.wait_metrics()
        return asyncio.run(drive(args, dep, repos, random.Random(seed)))
    except BaseException:
        pb.log(f"worker log tail:\n{dep.worker_log()}")
        raise
    finally:
        dep.teardown()
        with contextlib.suppress(Exception):
            shutil.rmtree(dep.root, ignore_errors=True)


async def drive(args: argparse.Namespace, dep: pb.Deployment, repos: dict[str, Repo],
                rng: random.Random) -> dict[str, Measured]:
    phases = [Phase("plain, one project's file", PLAIN, args.heads, 1),
              Phase("mono, one project", MONO, args.heads, 1),
              Phase("mono, ten projects", MONO, max(1, args.heads // 5), 10),
              Phase("mono, libs/common (all)", MONO, 3, 0)]
    async with Driver(dep) as drv:
        drv.repos = repos
        for queue in (PLAIN, MONO):  # the first head builds everything
            started = time.monotonic()
            for _ in range(WARMUP):
                rid = await drv.commit_and_ingest(queue, ["libs/common/c.txt"])
                await drv.watcher.wait("fact", rid)
            pb.log(f"warm-up {queue}: {WARMUP} heads building everything in "
                   f"{time.monotonic() - started:.1f} s")
        return {phase.label: await run_phase(drv, phase, args.projects, rng)
                for phase in phases}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--projects", type=int, default=200)
    p.add_argument("--heads", type=int, default=60, help="heads of the one-project phases")
    p.add_argument("--delay", default="50ms", help="gate and poll delays of both queues")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    one, five, _ = os.getloadavg()
    pb.log(f"{os.cpu_count()} cores, load average {one:.2f} / {five:.2f}; "
           f"{args.projects} projects")
    runs = []
    for n in range(args.runs):
        pb.log(f"run {n + 1} of {args.runs}")
        runs.append(run(args, seed=n))
    print()
    print(f"median of {len(runs)} run(s), per head:")
    print(f"{'phase':<28} {'p50 ms':>7} {'p99 ms':>7} {'builds':>7} {'diffs':>6} "
          f"{'rows':>6} {'CPU ms':>7}")
    for label in runs[0]:
        med = {k: statistics.median(getattr(r[label], k) for r in runs)
               for k in ("p50", "p99", "builds", "diffs", "rows", "cpu_ms")}
        print(f"{label:<28} {med['p50'] * 1000:>7.0f} {med['p99'] * 1000:>7.0f} "
              f"{med['builds']:>7.1f} {med['diffs']:>6.1f} {med['rows']:>6.1f} "
              f"{med['cpu_ms']:>7.0f}")


if __name__ == "__main__":
    main()
