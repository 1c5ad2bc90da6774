"""Capacity of one worker on the real broker and database: poll loops, replay, memory.
Prints figures; asserts nothing about timing.

    .venv/bin/python bench/capacity_bench.py [--only poll,replay]
        [--poll-builds 1000] [--poll-minutes 5] [--poll-delay 2s] [--status-latency 200ms]
        [--replay-messages 100000] [--replay-queues 10000] [--held 5000]

poll    --poll-builds queues, each with one fake build running for longer than the
        measurement, polled every --poll-delay with a --status-latency answer from the
        fake runner (a hosted CI). Every --window seconds for --poll-minutes: polls done,
        hold lateness (stovepipe_hold_lateness_seconds: handler start minus due time, so
        scheduler and stage intake together) p50/p99/max bucket, the buildsignal and
        delay-tier consumer lag, and the worker's CPU. Lag that does not grow and a flat
        p99 mean the worker keeps up.
replay  --replay-queues queues in queues.yaml, one already-terminal Request each, and
        --replay-messages ProcessRequest messages of those Requests on `process` (a
        replayed topic), plus --held holds parked in the delay tiers for longer than the
        run. One worker starts against that backlog: messages/s from its first delivery
        to the last, and its resident memory (VmRSS) sampled every second — at start,
        while draining and at the end.

Each phase gets its own topics (fresh prefix), schema and worker, and removes them
afterwards. Endpoints as in bench/pipeline_bench.py (the local stack by default).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pipeline_analysis as pa
import pipeline_bench as pb
import psycopg
import yaml
from confluent_kafka import Producer

from contract import ProcessRequest, marshal
from streams.config.kafka_security import librdkafka_conf
from streams.runtime import headers as h
from streams.runtime.kafka import producer_conf

BUILDSIGNAL_LAG_TOPICS = ("buildsignal",)


def log(text: str) -> None:
    pb.log(text)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f}"


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def deployment(args: argparse.Namespace, name: str) -> pb.Deployment:
    bootstrap, admin_dsn = pb.endpoints()
    ns = pb.parse_args([])  # the pipeline bench's defaults, then this bench's choices
    ns.delay, ns.loglevel, ns.plain_worker, ns.experiments = "1s", "warn", True, ""
    ns.workers, ns.hosted_latency = 1, False
    root = Path(tempfile.mkdtemp(prefix=f"capacity-{name}-"))
    dep = pb.Deployment(ns, bootstrap, admin_dsn, pb.Variant("shipped", None), root)
    dep.setup()
    return dep


def write_queues(dep: pb.Deployment, names: list[str], **extra: Any) -> None:
    runner = extra.pop("build_runner", {"kind": "fake"})
    for name in names:
        path = dep.repos / (name.replace("/", "_") + ".json")
        dep.queues[name] = {
            "source_control": {"kind": "fake", "path": str(path), "repo": "r", "ref": pb.REF},
            "build_runner": runner, "max_concurrent": 1, "poll_deadline": "2h", **extra}
    dep.queues_file.write_text(yaml.safe_dump({"queues": dep.queues}))


def lag(dep: pb.Deployment, keys: tuple[str, ...], group: str | None = None) -> int:
    assert dep.topics is not None
    topics = [dep.topics.stage(k).full_name for k in keys]
    return pa_group_lag(dep.bootstrap, group or dep.app_id, topics)


def pa_group_lag(bootstrap: str, group: str, topics: list[str]) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(librdkafka_conf(bootstrap, **{"group.id": group,
                         "enable.auto.commit": False}))
    try:
        metadata = consumer.list_topics(timeout=10)
        parts = [TopicPartition(t, p) for t in topics for p in metadata.topics[t].partitions]
        total = 0
        for tp in consumer.committed(parts, timeout=10):
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            total += max(0, high - (tp.offset if tp.offset >= 0 else low))
        return total
    finally:
        consumer.close()


# --- poll capacity ----------------------------------------------------------------------


def run_poll(args: argparse.Namespace) -> None:
    dep = deployment(args, "poll")
    try:
        names = [f"poll{i:04d}/main" for i in range(args.poll_builds)]
        write_queues(dep, names, gate_delay=args.poll_delay,
                     poll_delay_queued=args.poll_delay, poll_delay_running=args.poll_delay,
                     build_runner={"kind": "fake",
                                   "latency": {"status": args.status_latency}})
        dep.start_worker(None)
        dep.wait_metrics()
        run_for = args.poll_minutes * 60 + args.window + 120
        log(f"poll: {len(names)} queues; starting one build each (running {run_for} s)")
        started = time.monotonic()
        asyncio.run(_ingest_all(dep, names, f"p-slow{run_for}"))
        with psycopg.connect(dep.dsn, autocommit=True) as conn:
            pb_wait(lambda: conn.execute("SELECT count(*) FROM build").fetchone()[0]
                    >= len(names), 300, "every build triggered")
        log(f"poll: {len(names)} builds triggered in {time.monotonic() - started:.1f} s; "
            f"warming up for one window")
        time.sleep(args.window)
        print(f"\n=== POLL CAPACITY: {len(names)} builds running, polled every "
              f"{args.poll_delay} with a {args.status_latency} status call; one worker; "
              f"{load()} ===")
        print(f"  {'window':>8}{'polls':>8}{'polls/s':>9}{'late p50':>10}{'p99':>8}"
              f"{'max<=':>8}{'lag bs':>8}{'lag tiers':>10}{'CPU %':>7}{'RSS MB':>8}")
        before = dep.scrape()
        cpu0, t0 = pa.process_cpu_seconds(dep.worker_pids[0]), time.monotonic()
        p99s, rates = [], []
        end = time.monotonic() + args.poll_minutes * 60
        n = 0
        while time.monotonic() < end:
            time.sleep(args.window)
            dep.check_worker()
            after = dep.scrape()
            cpu1, t1 = pa.process_cpu_seconds(dep.worker_pids[0]), time.monotonic()
            window = pa.delta(after, before)
            late = pa.histogram(window, "stovepipe_hold_lateness_seconds", stage="buildsignal")
            polls = pa.histogram(window, "stovepipe_handle_seconds", stage="buildsignal").count
            tiers = pa_group_lag(dep.bootstrap, f"{dep.app_id}-delay",
                                 [t.full_name for t in dep.topics.delay_tiers])  # type: ignore[union-attr]
            n += 1
            p99s.append(late.quantile(.99))
            rates.append(polls / (t1 - t0))
            print(f"  {n * args.window:>7.0f}s{polls:>8.0f}{polls / (t1 - t0):>9.1f}"
                  f"{pa.ms(late.quantile(.5)):>10}{pa.ms(late.quantile(.99)):>8}"
                  f"{pa.ms(late.quantile(1.0)):>8}{lag(dep, BUILDSIGNAL_LAG_TOPICS):>8}"
                  f"{tiers:>10}{100 * (cpu1 - cpu0) / (t1 - t0):>7.0f}"
                  f"{rss_mb(dep.worker_pids[0]):>8.0f}", flush=True)
            before, cpu0, t0 = after, cpu1, t1
        expected = len(names) / (pb_seconds(args.poll_delay) + pb_seconds(args.status_latency))
        print(f"  hold lateness p99 per window: median {pa.ms(statistics.median(p99s))} ms, "
              f"worst {pa.ms(max(p99s))} ms (target <= 250 ms); polls/s median "
              f"{statistics.median(rates):.0f} (a poll loop at full speed would do "
              f"{expected:.0f}/s); first vs last window p99 {pa.ms(p99s[0])} -> "
              f"{pa.ms(p99s[-1])} ms; {load()}")
    finally:
        dep.teardown()
        shutil.rmtree(dep.root, ignore_errors=True)


def pb_seconds(text: str) -> float:
    from streams.schema.durations import parse_duration

    return parse_duration(text).total_seconds()


def pb_wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.5)


async def _ingest_all(dep: pb.Deployment, names: list[str], sha: str) -> None:
    async with pb.Driver(dep) as drv:
        limit = asyncio.Semaphore(50)

        async def one(name: str) -> None:
            async with limit:
                await drv.push_and_ingest(name, sha)

        await asyncio.gather(*(one(name) for name in names))


# --- replay and memory ------------------------------------------------------------------


def run_replay(args: argparse.Namespace) -> None:
    dep = deployment(args, "replay")
    try:
        names = [f"rp{i:05d}/main" for i in range(args.replay_queues)]
        write_queues(dep, names, gate_delay="1s", poll_delay_queued="1s",
                     poll_delay_running="1s")
        with psycopg.connect(dep.dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO request (queue, id, uri, state, build_strategy, version)"
                " SELECT q, 'request/' || q || '/1', 'fake://r/' || q || '/done',"
                "        'failed', NULL, 2"
                "   FROM unnest(%s::text[]) AS q", (names,))
        assert dep.topics is not None
        producer = Producer({**producer_conf(dep.bootstrap), "linger.ms": 20})
        rng = random.Random(7)
        process_topic = dep.topics.stage("process").full_name
        t = time.monotonic()
        for i in range(args.replay_messages):
            queue = names[rng.randrange(len(names))]
            producer.produce(process_topic, key=queue.encode(), value=marshal(
                ProcessRequest(id=f"request/{queue}/1", queue_name=queue)))
            if i % 10_000 == 0:
                producer.poll(0)
        tier = max(dep.topics.delay_tiers, key=lambda t: t.delay)
        due = int((time.time() + 3600) * 1000)  # held for longer than the run
        target = dep.topics.stage("process").full_name
        for i in range(args.held):
            queue = names[i % len(names)]
            producer.produce(tier.full_name, key=queue.encode(), value=marshal(
                ProcessRequest(id=f"request/{queue}/1", queue_name=queue)),
                headers=[(h.ATTEMPT, b"0"), (h.DUE_MS, str(due).encode()),
                         (h.TARGET, target.encode())])
        producer.flush(120)
        log(f"replay: {args.replay_messages} process messages and {args.held} holds produced "
            f"in {time.monotonic() - t:.1f} s; {len(names)} queues configured")

        dep.start_worker(None)
        pid = dep.worker_pids[0]
        samples: list[tuple[float, float, float]] = []  # (t, rss MB, delivered)
        started = time.monotonic()
        first = last = None
        delivered = 0.0
        while True:
            time.sleep(1.0)
            dep.check_worker()
            try:
                m = dep.scrape()
            except OSError:
                samples.append((time.monotonic() - started, rss_mb(pid), 0.0))
                continue
            delivered = sum(v for (name, labels), v in m.items()
                            if name == "stovepipe_deliveries_total"
                            and dict(labels).get("stage") == "process")
            now = time.monotonic() - started
            samples.append((now, rss_mb(pid), delivered))
            if first is None and delivered > 0:
                first = now
            if delivered >= args.replay_messages:
                last = now
                break
            if now > args.replay_timeout:
                break
        time.sleep(5)
        end_rss = rss_mb(pid)
        held_gauge = sum(v for (name, _), v in dep.scrape().items()
                         if name == "stovepipe_delay_held_messages")
        print(f"\n=== REPLAY: {args.replay_messages} process messages of already-terminal "
              f"Requests, {args.replay_queues} queues, {args.held} holds parked in the tiers; "
              f"one worker; {load()} ===")
        if first is not None and last is not None:
            print(f"  drained in {last - first:.1f} s after the first delivery "
                  f"({first:.1f} s after start): {args.replay_messages / (last - first):.0f} "
                  f"messages/s")
        else:
            print(f"  NOT drained within {args.replay_timeout:g} s: {delivered:.0f} delivered")
        rss = [r for _, r, _ in samples if not math.isnan(r)]
        draining = [r for t_, r, d in samples if first is not None and t_ >= first
                    and d < args.replay_messages and not math.isnan(r)]
        print(f"  worker RSS: at first delivery {rss[0] if rss else math.nan:.0f} MB; while "
              f"draining min {min(draining, default=math.nan):.0f} / median "
              f"{statistics.median(draining) if draining else math.nan:.0f} / max "
              f"{max(draining, default=math.nan):.0f} MB; 5 s after the end {end_rss:.0f} MB; "
              f"holds held by the scheduler now {held_gauge:.0f}")
        step = max(1, len(samples) // 12)
        print("  timeline (s, RSS MB, delivered): " + ", ".join(
            f"{t_:.0f}s {r:.0f}MB {d:.0f}" for t_, r, d in samples[::step]))
    finally:
        dep.teardown()
        shutil.rmtree(dep.root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="poll,replay")
    ap.add_argument("--poll-builds", type=int, default=1000)
    ap.add_argument("--poll-minutes", type=float, default=5.0)
    ap.add_argument("--poll-delay", default="2s")
    ap.add_argument("--status-latency", default="200ms")
    ap.add_argument("--window", type=float, default=30.0, help="seconds per reported window")
    ap.add_argument("--replay-messages", type=int, default=100_000)
    ap.add_argument("--replay-queues", type=int, default=10_000)
    ap.add_argument("--held", type=int, default=5000)
    ap.add_argument("--replay-timeout", type=float, default=1200.0)
    args = ap.parse_args(argv)
    log(f"{os.cpu_count()} cores, {load()}; python {sys.version.split()[0]}")
    for phase in args.only.split(","):
        {"poll": run_poll, "replay": run_replay}[phase.strip()](args)


if __name__ == "__main__":
    main()
