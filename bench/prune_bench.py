"""Pruning old history while the pipeline runs (issue 25, item 6): ingest → fact latency
with an idle database against the same latency while a retention round deletes about
1,000,000 old rows, and the round's rows/s. Prints figures; asserts nothing about timing.

    .venv/bin/python bench/prune_bench.py [--rows 1000000] [--queues 4] [--runs 3]
        [--idle-requests 150] [--prune-by worker|cli] [--delay 50ms] [--duty-cycle 0.25]
        [--interval 0]

Per run, a deployment of its own (bench/pipeline_bench.py's: topics, schema, queues on the
fake source control and build runner with instant builds, one real `stovepipe worker`):

1. old history: about ``--rows`` rows 200 days old, written by the database in bulk
   (tests/retention_support.py: per Request its ingest mapping and, for 9 in 10, its
   build, fact and sent commit status, for 1 in 10 a command build) into the queues the
   pipeline then validates, as a long-lived deployment's would be; then ANALYZE. The
   queues.yaml has `retention: {older_than: 180d, every: 1h, max_rows: <all>,
   duty_cycle: <--duty-cycle>}` (default: the shipped default) and the
   newest round is recorded as just started, so no round is due yet;
2. idle: one chain of Requests per queue (push a head, ingest it in-process as
   `stovepipe ingest` does, wait for its fact, next — at once, the machine saturated, or
   ``--interval`` seconds after the last push), ``--idle-requests`` each; the latency is
   ingest start → the fact's created_at;
3. pruning: the round made due (``--prune-by worker``: the worker's own retention round,
   in the worker process, which starts it on its next sweep tick; ``cli``: `stovepipe
   prune --older-than 180d` in a process of its own), the same chains running until the
   round has finished; only Requests ingested while it ran count.

Reported per run and as the median of the runs: p50/p99 of both phases and their ratio,
the round's rows deleted, its seconds and rows/s, and the machine's load average at the start (the
machine is shared: other tenants move every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pipeline_bench as pb
import psycopg
import yaml
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streams.config.retention import DEFAULT_BATCH_ROWS, DEFAULT_DUTY_CYCLE
from tests.retention_support import ROWS_PER_REQUEST, old_history

AGE = timedelta(days=200)
HEADS = itertools.count()  # every head pushed has a name of its own


def log(text: str) -> None:
    pb.log(text)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def write_old_history(dep: pb.Deployment, queues: list[str], rows: int,
                      autovacuum: bool) -> int:
    per_queue = max(1, round(rows / ROWS_PER_REQUEST / len(queues)))
    written = 0
    started = time.monotonic()
    with psycopg.connect(dep.dsn, autocommit=True) as conn:
        if not autovacuum:  # a diagnosis: how much of the cost is vacuum's
            for (table,) in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                    ).fetchall():
                conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)")
                             .format(sql.Identifier(table)))
        for queue in queues:
            written += sum(old_history(conn, queue, first=1, count=per_queue,
                                       age=AGE).values())
        conn.execute("ANALYZE")
        # the newest round "just started": none is due before the pruning phase
        conn.execute("INSERT INTO retention_round (name) VALUES ('prune')")
    log(f"old history: {written:,} rows ({per_queue:,} Requests per queue) in "
        f"{time.monotonic() - started:.1f} s")
    return written


async def chains(drv: pb.Driver, queues: list[str], *, interval: float,
                 each: int | None = None, until: asyncio.Event | None = None) -> list[str]:
    """One chain of Requests per queue: ``each`` of them, or until ``until`` is set; a
    head at most every ``interval`` seconds (0: the next as soon as the fact is there)."""
    ids: list[str] = []

    async def chain(queue: str) -> None:
        n = 0
        while (each is None or n < each) and not (until is not None and until.is_set()):
            pushed = time.monotonic()
            rid = await drv.push_and_ingest(queue, f"h{next(HEADS)}")
            ids.append(rid)
            await drv.watcher.wait("fact", rid)
            n += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - pushed)))

    await asyncio.gather(*(chain(q) for q in queues))
    return ids


def round_row(dep: pb.Deployment) -> tuple[Any, ...] | None:
    with psycopg.connect(dep.dsn) as conn:
        return conn.execute(
            "SELECT EXTRACT(EPOCH FROM started_at)::float8,"
            " EXTRACT(EPOCH FROM finished_at)::float8, deleted FROM retention_round"
            " WHERE name = 'prune'").fetchone()


async def drive(args: argparse.Namespace, dep: pb.Deployment,
                queues: list[str]) -> dict[str, float]:
    async with pb.Driver(dep) as drv:
        for queue in queues:  # warm-up: the first head of each queue is built in full
            await chains(drv, [queue], each=3, interval=0)
        idle_ids = await chains(drv, queues, each=args.idle_requests,
                                interval=args.interval)
        idle = pb.fact_latencies(dep.dsn, drv.ingest_started, idle_ids)
        log(f"idle: {len(idle)} Requests, p50 {percentile(idle, .5) * 1000:.0f} ms, "
            f"p99 {percentile(idle, .99) * 1000:.0f} ms")

        done = asyncio.Event()
        running = asyncio.create_task(chains(drv, queues, until=done,
                                             interval=args.interval))
        prune_process = None
        triggered = time.time()
        if args.prune_by == "worker":
            with psycopg.connect(dep.dsn, autocommit=True) as conn:
                conn.execute("UPDATE retention_round SET started_at = now() - interval '1 day',"
                             " finished_at = now() - interval '1 day'")
        else:
            prune_process = subprocess.Popen(  # noqa: ASYNC220 (a process that outlives this call)
                [str(Path(sys.executable).parent / "stovepipe"), "prune", "--older-than",
                 "180d", "--duty-cycle", str(args.duty_cycle), "--batch-rows",
                 str(args.batch_rows)],
                env={**dep.env, "STOVEPIPE_QUEUES_FILE": str(dep.queues_file)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while True:
            await asyncio.sleep(0.2)
            dep.check_worker()
            if prune_process is not None:
                if prune_process.poll() is not None:
                    break
            else:
                row = round_row(dep)
                if row is not None and row[1] is not None and row[0] > triggered - 5:
                    break
        finished = time.time()
        done.set()
        pruning_ids = await running
        if prune_process is not None:
            output = prune_process.stdout.read().decode() if prune_process.stdout else ""
            if prune_process.returncode != 0:
                raise RuntimeError(f"stovepipe prune failed:\n{output}")
            deleted = int(next(line.split()[-1].replace(",", "") for line in
                               output.splitlines() if line.strip().startswith("total")))
            began, ended = triggered, finished
        else:
            row = round_row(dep)
            assert row is not None
            began, ended = row[0], row[1]
            deleted = sum(int(n) for n in row[2].values())
        pruning = pb.fact_latencies(dep.dsn, drv.ingest_started, pruning_ids,
                                     (began, ended))
        seconds = ended - began
        log(f"pruning: {deleted:,} rows in {seconds:.1f} s ({deleted / seconds:,.0f} rows/s);"
            f" {len(pruning)} Requests ingested meanwhile, p50 "
            f"{percentile(pruning, .5) * 1000:.0f} ms, p99 "
            f"{percentile(pruning, .99) * 1000:.0f} ms")
        return {"idle_p50": percentile(idle, .5), "idle_p99": percentile(idle, .99),
                "idle_n": len(idle), "prune_p50": percentile(pruning, .5),
                "prune_p99": percentile(pruning, .99), "prune_n": len(pruning),
                "deleted": deleted, "seconds": seconds, "rows_s": deleted / seconds}


def run(args: argparse.Namespace) -> dict[str, float]:
    dep = pb.one_worker_deployment(args.delay, "prune-bench")
    load = os.getloadavg()[0]
    try:
        dep.setup()
        queues = [f"prune{i}/main" for i in range(args.queues)]
        dep.add_queues(queues)
        dep.queues_file.write_text(yaml.safe_dump({
            "queues": dep.queues,
            "retention": {"older_than": "180d", "every": "1h",
                          "max_rows": max(1, args.rows * 2),
                          "duty_cycle": args.duty_cycle,
                          "batch_rows": args.batch_rows}}))
        write_old_history(dep, queues, args.rows, args.autovacuum)
        dep.start_worker(None)
        dep.wait_metrics()
        result = asyncio.run(drive(args, dep, queues))
        result["load"] = load
        return result
    except BaseException:
        log(f"worker log tail:\n{dep.worker_log()}")
        raise
    finally:
        dep.teardown()
        with contextlib.suppress(Exception):
            shutil.rmtree(dep.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000, help="old rows to prune")
    p.add_argument("--queues", type=int, default=4, help="queues, one chain of Requests each")
    p.add_argument("--idle-requests", type=int, default=150, help="per queue, idle phase")
    p.add_argument("--prune-by", choices=["worker", "cli"], default="worker")
    p.add_argument("--delay", default="50ms", help="gate and poll delays of every queue")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--batch-rows", type=int, default=DEFAULT_BATCH_ROWS,
                   help="rows a batch of the round deletes")
    p.add_argument("--no-autovacuum", dest="autovacuum", action="store_false",
                   help="turn autovacuum off on the deployment's tables (a diagnosis)")
    p.add_argument("--interval", type=float, default=0.0,
                   help="seconds between a chain's heads at least (0: closed loop, the next "
                        "head as soon as the fact is there: the machine saturated)")
    p.add_argument("--duty-cycle", type=float, default=DEFAULT_DUTY_CYCLE,
                   help="the round's share of time spent deleting (1: never rests)")
    args = p.parse_args(argv)
    one, five, _ = os.getloadavg()
    log(f"{os.cpu_count()} cores, load average {one:.2f} / {five:.2f}; pruning by "
        f"{args.prune_by}, duty cycle {args.duty_cycle}, batches of {args.batch_rows} rows, "
        f"a head per chain every "
        f"{args.interval:g} s at most")
    results = []
    for n in range(args.runs):
        log(f"run {n + 1} of {args.runs}")
        results.append(run(args))
    keys = ("idle_p50", "idle_p99", "prune_p50", "prune_p99")
    print()
    print(f"{'run':>4} {'load':>5} {'idle p50':>9} {'idle p99':>9} {'prune p50':>10} "
          f"{'prune p99':>10} {'ratio':>6} {'rows':>10} {'s':>6} {'rows/s':>8} "
          f"{'n idle/prune':>13}")
    for i, r in enumerate(results, 1):
        print(f"{i:>4} {r['load']:>5.2f} " + " ".join(
            f"{r[k] * 1000:>{10 if k.startswith('prune') else 9}.0f}" for k in keys)
              + f" {r['prune_p99'] / r['idle_p99']:>6.2f}"
              f" {int(r['deleted']):>10,} {r['seconds']:>6.1f} {r['rows_s']:>8,.0f}"
              f" {int(r['idle_n']):>6}/{int(r['prune_n'])}")
    if len(results) > 1:
        med = {k: statistics.median(r[k] for r in results)
               for k in (*keys, "rows_s", "seconds")}
        print(f"median: idle p50 {med['idle_p50'] * 1000:.0f} ms, p99 "
              f"{med['idle_p99'] * 1000:.0f} ms; pruning p50 {med['prune_p50'] * 1000:.0f} ms, "
              f"p99 {med['prune_p99'] * 1000:.0f} ms; {med['rows_s']:,.0f} rows/s "
              f"({med['seconds']:.1f} s)")
        idle99 = sorted(r["idle_p99"] * 1000 for r in results)
        ratios = [r["prune_p99"] / r["idle_p99"] for r in results]
        print(f"pruning p99 / idle p99: median {statistics.median(ratios):.2f} "
              f"(runs {', '.join(f'{x:.2f}' for x in ratios)}); idle p99 itself ranged "
              f"{idle99[0]:.0f}-{idle99[-1]:.0f} ms across runs")


if __name__ == "__main__":
    main()
