"""Benchmark of the delivery runtime on the real broker and database (prints figures).

    .venv/bin/python bench/runtime_bench.py [--only pipeline,throughput,hold,long] [...]

Every measurement runs `bench/bench_worker.py` as a real worker process over its own
topics (a fresh prefix, created from topics.yaml with `ensure_topics`) and its own
PostgreSQL schema, then stops it and deletes what it created. Measured:

1. pipeline    per-hop latency through ingest -> process -> build -> buildsignal -> record
               at low load (one message every --pipeline-spacing-ms): handler start minus
               the consumed record's Kafka timestamp; end to end = record-stage handler
               start minus the ingest record's timestamp.
2. throughput  one stage (`process`) draining a preloaded backlog: no-op handler, then one
               PostgreSQL round trip per message; first handled to last handled, and how
               long after the last one the committed offsets reached the end.
3. hold        --holds messages each holding once for a random delay; lateness =
               redelivery handler start - (first handler start + delay), with the shipped
               delay tiers and with an extra, shorter tier (--short-tiers).
4. long        the same with long delays (--long-delays), to cross the 30 s / 2 m tiers;
               both tier variants run side by side (two workers) to save time.
               --long-holds 0 skips it.

Hold lateness is split in two: the scheduler's part (the redelivered record's Kafka
timestamp, i.e. when the delay scheduler re-produced it, minus its due time) and the
stage's part (redelivery handler start minus that timestamp: the stage's own backlog).
Holds are produced all at once unless --hold-rate paces them. With the defaults the whole
run takes about 4.5 minutes on 2 cores. The machine's load average is printed with the
table: other processes on a small machine move every figure.

Figures only: nothing here asserts on timing. Endpoints come from
`streams.config.settings.load_settings()` (STOVEPIPE_KAFKA_BOOTSTRAP / STOVEPIPE_POSTGRES_DSN);
without them the local stack is started with `streams.devstack.ensure_up`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psycopg
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from contract import IngestRequest, ProcessRequest, marshal
from streams.config.kafka_security import librdkafka_conf
from streams.config.settings import REPO_ROOT, load_settings
from streams.config.topics import TopicsConfig, load_topics
from streams.runtime.kafka import producer_conf
from streams.runtime.topic_admin import ensure_topics

WORKER_MODULE = "bench.bench_worker"
PIPELINE = ("ingest", "process", "build", "buildsignal", "record")
KEYS = 64  # distinct Kafka keys (queues) the load is spread over
POLL = 0.02

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS bench_sink (
    id text PRIMARY KEY,
    deliveries int NOT NULL DEFAULT 1,
    received_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""  # written by bench_worker's `db` mode


# --- small helpers ----------------------------------------------------------------------


def pct(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def parse_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    lo, hi = float(low), float(high or low)
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH seconds, 0 < LOW <= HIGH: {text!r}")
    return lo, hi


def endpoints() -> tuple[str, str]:
    """Kafka bootstrap and PostgreSQL DSN: from the environment, else the local stack."""
    settings = load_settings()
    if settings.kafka_from_env and settings.postgres_from_env:
        return settings.kafka_bootstrap, settings.postgres_dsn
    try:
        from streams.devstack import ensure_up
    except ImportError:  # no devstack (yet): the defaults point at the local stack
        return settings.kafka_bootstrap, settings.postgres_dsn
    stack = ensure_up(settings, quiet=True)
    return (settings.kafka_bootstrap if settings.kafka_from_env else stack.kafka_bootstrap,
            settings.postgres_dsn if settings.postgres_from_env else stack.postgres_dsn)


def versions(dsn: str) -> str:
    import confluent_kafka

    parts = [f"python {platform.python_version()}"]
    for dist in ("faust-streaming", "aiokafka", "confluent-kafka", "psycopg"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            parts.append(f"{dist} {metadata.version(dist)}")
    parts.append(f"librdkafka {confluent_kafka.libversion()[0]}")
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    parts.append(f"postgresql {row[0] if row else '?'}")
    return ", ".join(parts)


# --- topics, worker process, observations -----------------------------------------------


def write_topics(path: Path, base: Path, *, extra_tiers: Sequence[str] = (),
                 partitions: int | None = None) -> Path:
    """topics.yaml as shipped (its delay tiers included), plus ``extra_tiers`` such as
    ``100ms``, optionally with another partition count for every topic."""
    raw = yaml.safe_load(base.read_text())
    if partitions is not None:
        raw["defaults"]["partitions"] = partitions
        raw["dlq_defaults"]["partitions"] = min(partitions, raw["dlq_defaults"]["partitions"])
    for tier in extra_tiers:
        raw["delay_tiers"][f"delay_{tier}"] = {"name": f"delay_{tier}", "delay": tier}
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclass
class Observation:
    event: str
    ident: str
    stage: str
    handled_at: float
    record_ts: float
    extra: str


class Observations:
    """The lines a worker appends to its output file, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[Observation] = []
        self._offset = 0

    def poll(self) -> list[Observation]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # only whole lines
        self._offset += end
        new = []
        for line in data[:end].decode().splitlines():
            event, ident, stage, handled_at, record_ts, extra = line.split("\t")
            new.append(Observation(event, ident, stage, float(handled_at), float(record_ts),
                                   extra))
        self.rows.extend(new)
        return new


class BenchError(RuntimeError):
    pass


@dataclass
class Phase:
    """One measurement: its topics, its worker process, its observations."""

    name: str
    mode: str
    bootstrap: str
    dsn: str
    topics: TopicsConfig
    workdir: Path
    app_id: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:10]}")
    loglevel: str = "info"
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.cpu_samples: list[tuple[float, float]] = []
        self.out = Observations(self.workdir / f"{self.name}.tsv")
        self.log_path = self.workdir / f"{self.name}.log"

    def start_worker(self) -> None:
        env = dict(os.environ, BENCH_MODE=self.mode, BENCH_BOOTSTRAP=self.bootstrap,
                   BENCH_DSN=self.dsn, BENCH_TOPICS=str(self.topics.path),
                   BENCH_PREFIX=self.topics.prefix, BENCH_APP_ID=self.app_id,
                   BENCH_OUT=str(self.out.path), BENCH_DATADIR=str(self.workdir / "faust"),
                   BENCH_LOGLEVEL=self.loglevel,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        self.started_at = time.time()
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env,
                                         stdout=fh, stderr=subprocess.STDOUT, cwd=self.workdir)

    def stop_worker(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)

    def worker_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """CPU time the worker process used so far (all its threads); NaN off Linux."""
        if self.proc is None:
            return math.nan
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return math.nan
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def cpu_share(self, start: float, end: float) -> float:
        """The worker's CPU use between two epoch times (1.0 = one core), from the samples
        taken while waiting."""
        samples = [s for s in self.cpu_samples if not math.isnan(s[1])]
        if len(samples) < 2 or end <= start:
            return math.nan
        a = min(samples, key=lambda s: abs(s[0] - start))
        b = min(samples, key=lambda s: abs(s[0] - end))
        return (b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else math.nan

    def wait(self, done: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Poll the observations until ``done()``; fail with the worker's log otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            self.cpu_samples.append((time.time(), self.cpu_seconds()))
            self.out.poll()
            if done():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(f"{self.name}: worker exited ({self.proc.returncode}) waiting"
                                 f" for {what}\n{self.worker_log()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: timed out after {timeout:.0f}s waiting for"
                                 f" {what}\n{self.worker_log()}")
            time.sleep(POLL)

    def ids(self, event: str, prefix: str = "") -> set[str]:
        return {o.ident for o in self.out.rows if o.event == event and o.ident.startswith(prefix)}


@contextlib.contextmanager
def phase(name: str, mode: str, *, bootstrap: str, dsn: str, base_topics: Path,
          workdir: Path, extra_tiers: Sequence[str] = (), partitions: int | None = None,
          keep: bool = False, loglevel: str = "info") -> Iterator[Phase]:
    prefix = f"bench{uuid.uuid4().hex[:8]}.{name}."
    topics_file = write_topics(workdir / f"{name}-topics.yaml", base_topics,
                               extra_tiers=extra_tiers, partitions=partitions)
    topics = load_topics(topics_file, prefix=prefix)
    report = ensure_topics(librdkafka_conf(bootstrap), topics)
    if not report.ok:
        raise BenchError(f"topics not created: {[s.detail for s in report if not s.ok]}")
    ph = Phase(name, mode, bootstrap, dsn, topics, workdir, loglevel=loglevel)
    try:
        yield ph
    finally:
        ph.stop_worker()
        if not keep:
            delete_kafka_things(bootstrap, [t.full_name for t in topics.all_topics()],
                                [ph.app_id, f"{ph.app_id}-delay"])


def delete_kafka_things(bootstrap: str, topics: list[str], groups: list[str]) -> None:
    admin = AdminClient(librdkafka_conf(bootstrap, **{"log_level": 4}))
    futures = list(admin.delete_topics(topics, operation_timeout=30).values())
    futures += list(admin.delete_consumer_groups(groups, request_timeout=10).values())
    for fut in futures:
        with contextlib.suppress(Exception):  # best effort: e.g. a group never formed
            fut.result(timeout=30)


def producer(bootstrap: str) -> Producer:
    return Producer(producer_conf(bootstrap, log_level=4))


def produce_process(bootstrap: str, topics: TopicsConfig, ids: Sequence[str],
                    rate: float = 0.0, tick: Callable[[], None] | None = None) -> None:
    """ProcessRequests keyed over KEYS queues; ``rate`` > 0 paces them (messages/s) and
    calls ``tick`` now and then."""
    prod = producer(bootstrap)
    topic = topics.stage("process").full_name
    t0 = time.monotonic()
    for n, ident in enumerate(ids):
        if rate > 0:
            time.sleep(max(0.0, t0 + n / rate - time.monotonic()))
            if tick is not None and n % 50 == 0:
                tick()
        queue = f"q{n % KEYS}"
        while True:
            try:
                prod.produce(topic, key=queue.encode(),
                             value=marshal(ProcessRequest(id=ident, queue_name=queue)))
                break
            except BufferError:  # local queue full: let it drain
                prod.poll(0.05)
        prod.poll(0)
    if prod.flush(60) != 0:
        raise BenchError("preload: messages left unacknowledged")


# --- 1. pipeline latency -----------------------------------------------------------------


@dataclass
class Row:
    what: str
    n: int
    p50: str = ""
    p99: str = ""
    maxv: str = ""
    note: str = ""


def run_pipeline(args: argparse.Namespace, ctx: dict, rows: list[Row]) -> None:
    with phase("pipeline", "pipeline", **ctx) as ph:
        ph.start_worker()
        ingest = ph.topics.stage("ingest").full_name
        prod = producer(ph.bootstrap)

        def send(ident: str) -> None:
            prod.produce(ingest, key=ident.encode(), value=marshal(IngestRequest(queue=ident)))
            prod.poll(0)
            ph.cpu_samples.append((time.time(), ph.cpu_seconds()))

        # warm up: the worker has joined and every hop has run once
        for n in range(args.warmup):
            warm = f"warm-{n}"
            send(warm)
            prod.flush(10)
            ph.wait(lambda: warm in ph.ids("hop"), timeout=90,  # noqa: B023 - called here
                    what="warm-up through the pipeline")
        log(f"pipeline: worker ready after {time.time() - ph.started_at:.1f}s; sending"
            f" {args.pipeline_messages} messages {args.pipeline_spacing_ms} ms apart")
        spacing = args.pipeline_spacing_ms / 1000
        t0 = time.monotonic()
        for n in range(args.pipeline_messages):
            time.sleep(max(0.0, t0 + n * spacing - time.monotonic()))
            send(f"m-{n}")
        prod.flush(30)
        want = {f"m-{n}" for n in range(args.pipeline_messages)}

        def all_recorded() -> bool:
            return want <= {o.ident for o in ph.out.rows if o.stage == "record"}

        ph.wait(all_recorded, timeout=120, what="every message at the record stage")
        # the same, nearly idle: what one message alone pays per hop
        idle = {f"i-{n}" for n in range(args.pipeline_idle_messages)}
        for n in range(args.pipeline_idle_messages):
            send(f"i-{n}")
            prod.flush(10)
            time.sleep(args.pipeline_idle_spacing_ms / 1000)
        ph.wait(lambda: idle <= {o.ident for o in ph.out.rows if o.stage == "record"},
                timeout=120, what="every idle message at the record stage")

    by_stage: dict[str, list[float]] = defaultdict(list)
    ingest_ts: dict[str, float] = {}
    record_at: dict[str, float] = {}
    for o in ph.out.rows:
        if o.ident not in want:
            continue
        by_stage[o.stage].append(o.handled_at - o.record_ts)
        if o.stage == "ingest":
            ingest_ts[o.ident] = o.record_ts
        elif o.stage == "record":
            record_at[o.ident] = o.handled_at
    for stage in PIPELINE:
        lat = by_stage[stage]
        rows.append(Row(f"hop -> {stage}", len(lat), ms(pct(lat, 50)), ms(pct(lat, 99)),
                        ms(max(lat, default=math.nan))))
    e2e = [record_at[i] - ingest_ts[i] for i in want if i in record_at and i in ingest_ts]
    cpu = ph.cpu_share(min(ingest_ts.values(), default=0), max(record_at.values(), default=0))
    rows.append(Row("end to end (5 hops)", len(e2e), ms(pct(e2e, 50)), ms(pct(e2e, 99)),
                    ms(max(e2e, default=math.nan)),
                    f"produce -> record handler; {args.pipeline_spacing_ms:g} ms apart;"
                    f" worker cpu {cpu:.0%}"))
    if idle:
        hops: dict[str, list[float]] = defaultdict(list)
        first_ts = {o.ident: o.record_ts for o in ph.out.rows
                    if o.ident in idle and o.stage == "ingest"}
        idle_e2e = []
        for o in ph.out.rows:
            if o.ident in idle:
                hops[o.stage].append(o.handled_at - o.record_ts)
                if o.stage == "record" and o.ident in first_ts:
                    idle_e2e.append(o.handled_at - first_ts[o.ident])
        rows.append(Row("end to end, idle (5 hops)", len(idle_e2e), ms(pct(idle_e2e, 50)),
                        ms(pct(idle_e2e, 99)), ms(max(idle_e2e, default=math.nan)),
                        f"one message at a time, {args.pipeline_idle_spacing_ms:g} ms apart;"
                        " hop p50s " + "/".join(ms(pct(hops[s], 50)) for s in PIPELINE)))


# --- 2. one stage's throughput ------------------------------------------------------------


def end_offsets(bootstrap: str, topics: Sequence[tuple[str, int]]) -> int:
    """Messages ever written to ``topics`` (name, partitions): the sum of their ends."""
    consumer = Consumer(librdkafka_conf(bootstrap, **{"group.id": "bench-watermarks",
                         "log_level": 4}))
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1]
                   for name, count in topics for p in range(count))
    finally:
        consumer.close()


def committed_lag(bootstrap: str, group: str, topic: str, partitions: int) -> int:
    """Messages of ``topic`` past ``group``'s committed offsets."""
    consumer = Consumer(librdkafka_conf(bootstrap, **{"group.id": group,
                         "enable.auto.commit": False, "log_level": 4}))
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
        lag = 0
        for p in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            done = committed[p] if committed[p] >= 0 else low
            lag += high - done
        return lag
    finally:
        consumer.close()


def run_throughput(args: argparse.Namespace, ctx: dict, rows: list[Row], mode: str,
                   count: int) -> None:
    label = {"noop": "no-op handler", "db": "1 PostgreSQL round trip"}[mode]
    with phase(f"throughput-{mode}", mode, **ctx) as ph:
        ids = [f"t:{n}" for n in range(count)]
        t0 = time.monotonic()
        produce_process(ph.bootstrap, ph.topics, ids)
        log(f"throughput/{mode}: preloaded {count} messages in {time.monotonic() - t0:.1f}s;"
            " starting the worker")
        ph.start_worker()
        handled: set[str] = set()
        seen = 0

        def drained() -> bool:
            nonlocal seen
            handled.update(o.ident for o in ph.out.rows[seen:])
            seen = len(ph.out.rows)
            return len(handled) >= count

        ph.wait(drained, timeout=max(120, count / 50), what=f"{count} handled messages")
        times = sorted(o.handled_at for o in ph.out.rows)
        first, last = times[0], times[-1]
        spec = ph.topics.stage("process")
        lag = -1
        caught_up = math.nan
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lag = committed_lag(ph.bootstrap, ph.app_id, spec.full_name, spec.partitions)
            if lag == 0:
                caught_up = time.time() - last
                break
            time.sleep(0.1)
        duplicates = len(ph.out.rows) - len(handled)
        cpu = ph.cpu_share(first, last)
    rate = (len(times) - 1) / (last - first) if last > first else math.nan
    rows.append(Row(f"throughput: {label}", count, note=(
        f"{rate:,.0f} msg/s over {last - first:.2f}s; worker cpu {cpu:.0%};"
        f" start->first {first - ph.started_at:.1f}s;"
        f" committed caught up {ms(caught_up)} ms after the last"
        + (f" (lag {lag} at 30s!)" if lag else "")
        + (f"; {duplicates} duplicate deliveries" if duplicates else ""))))
    log(f"throughput/{mode}: {rate:,.0f} msg/s")


# --- 3./4. hold lateness ------------------------------------------------------------------


@dataclass
class HoldResult:
    label: str
    lateness: list[float]
    sched: list[float]  # redelivered record timestamp - due
    consume: list[float]  # redelivery handler start - its record timestamp
    ratio: list[float]  # lateness / delay
    early: int
    sched_early: int
    on_target: int
    missing: int
    peak_held: int
    first_pass: float
    delay_range: tuple[float, float]
    cpu: float = math.nan  # worker CPU use, first hold to last redelivery (1.0 = one core)
    tier_messages: int = 0  # produced into the delay tiers: the holds and every hop


def start_hold_phase(args: argparse.Namespace, ph: Phase, count: int,
                     delays: tuple[float, float], seed: int,
                     rate: float = 0.0) -> dict[str, float]:
    """Start the worker, warm it up (a hold made the round trip), then produce the holds.
    Returns the delay of each id."""
    ph.start_worker()
    for n in range(args.warmup):
        warm = f"warm:100:{n}"
        produce_process(ph.bootstrap, ph.topics, [warm])
        ph.wait(lambda: warm in ph.ids("again"), timeout=90,  # noqa: B023 - called here
                what="a warm-up hold to come back")
    log(f"{ph.name}: worker ready after {time.time() - ph.started_at:.1f}s; producing {count}"
        f" holds of {delays[0]:g}-{delays[1]:g}s"
        + (f", {rate:g}/s" if rate > 0 else ", all at once"))
    rng = random.Random(seed)
    delay_ms = [round(rng.uniform(*delays) * 1000) for _ in range(count)]
    ids = [f"h:{d}:{n}" for n, d in enumerate(delay_ms)]
    produce_process(ph.bootstrap, ph.topics, ids, rate=rate,
                    tick=lambda: ph.cpu_samples.append((time.time(), ph.cpu_seconds())))
    return {i: d / 1000 for i, d in zip(ids, delay_ms, strict=True)}


def finish_hold_phase(ph: Phase, label: str, delays: dict[str, float],
                      delay_range: tuple[float, float]) -> HoldResult:
    ph.wait(lambda: set(delays) <= ph.ids("again", "h:"), timeout=delay_range[1] + 120,
            what=f"{len(delays)} holds to come back")
    first: dict[str, Observation] = {}
    again: dict[str, Observation] = {}
    for o in ph.out.rows:
        if o.ident in delays:
            target = first if o.event == "first" else again
            target.setdefault(o.ident, o)
    res = HoldResult(label, [], [], [], [], 0, 0, 0, 0, 0, 0.0, delay_range)
    for ident, delay in delays.items():
        if ident not in first or ident not in again:
            res.missing += 1
            continue
        f, a = first[ident], again[ident]
        late = a.handled_at - (f.handled_at + delay)
        res.lateness.append(late)
        res.ratio.append(late / delay)
        res.early += late < 0
        res.on_target += late <= max(0.25, 0.1 * delay)
        due = float(f.extra) + delay  # the Hold left the handler at f.extra
        res.sched.append(a.record_ts - due)
        # record timestamps are whole ms, rounded down: earlier than due - 1 ms is early
        res.sched_early += a.record_ts < due - 0.001
        res.consume.append(a.handled_at - a.record_ts)
    events = sorted([(first[i].handled_at, 1) for i in first]
                    + [(again[i].handled_at, -1) for i in again])
    level = 0
    for _, step in events:
        level += step
        res.peak_held = max(res.peak_held, level)
    firsts = [first[i].handled_at for i in first]
    res.first_pass = max(firsts) - min(firsts) if firsts else math.nan
    if firsts and again:
        res.cpu = ph.cpu_share(min(firsts), max(a.handled_at for a in again.values()))
    res.tier_messages = end_offsets(ph.bootstrap, [(t.full_name, t.partitions)
                                                   for t in ph.topics.delay_tiers])
    return res


def hold_rows(res: HoldResult) -> list[Row]:
    lo, hi = res.delay_range
    n = len(res.lateness)
    head = (f"{res.label}, {lo:g}-{hi:g}s")
    note = (f"EARLY {res.early}; within max(250ms,10%) {res.on_target}/{n}; peak held"
            f" {res.peak_held}; first pass {res.first_pass:.1f}s ({n / res.first_pass:.0f}/s);"
            f" p99 late/delay {pct(res.ratio, 99):.1%}; worker cpu {res.cpu:.0%};"
            f" tier messages/hold {res.tier_messages / max(1, n):.1f}")
    if res.sched_early:
        note += f"; scheduler produced {res.sched_early} before due!"
    if res.missing:
        note += f"; {res.missing} missing"
    return [
        Row(f"hold lateness: {head}", n, ms(pct(res.lateness, 50)), ms(pct(res.lateness, 99)),
            ms(max(res.lateness, default=math.nan)), note),
        Row("  of which scheduler (re-produce - due)", n, ms(pct(res.sched, 50)),
            ms(pct(res.sched, 99)), ms(max(res.sched, default=math.nan))),
        Row("  of which stage (handler - re-produce)", n, ms(pct(res.consume, 50)),
            ms(pct(res.consume, 99)), ms(max(res.consume, default=math.nan))),
    ]


def tier_variants(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    variants: list[tuple[str, list[str]]] = [("shipped tiers", [])]
    for tier in filter(None, (t.strip() for t in args.short_tiers.split(","))):
        variants.append((f"+{tier} tier", [tier]))
    return variants


def run_holds(args: argparse.Namespace, ctx: dict, rows: list[Row]) -> None:
    for n, (label, extra) in enumerate(tier_variants(args)):
        with phase(f"hold{n}", "hold", extra_tiers=extra, **ctx) as ph:
            delays = start_hold_phase(args, ph, args.holds, args.hold_delays, args.seed,
                                      rate=args.hold_rate)
            if args.hold_rate > 0:
                label += f", {args.hold_rate:g}/s"
            res = finish_hold_phase(ph, label, delays, args.hold_delays)
        rows.extend(hold_rows(res))
        log(f"{ph.name} ({label}): p50 {ms(pct(res.lateness, 50))} ms, p99"
            f" {ms(pct(res.lateness, 99))} ms, early {res.early}")


def run_long_holds(args: argparse.Namespace, ctx: dict, rows: list[Row]) -> None:
    """Both tier variants at once (two workers): the long wait dominates and is idle."""
    with contextlib.ExitStack() as stack:
        started = []
        for n, (label, extra) in enumerate(tier_variants(args)):
            ph = stack.enter_context(phase(f"long{n}", "hold", extra_tiers=extra, **ctx))
            delays = start_hold_phase(args, ph, args.long_holds, args.long_delays,
                                      args.seed + 1)
            started.append((ph, label, delays))
        for ph, label, delays in started:
            res = finish_hold_phase(ph, label, delays, args.long_delays)
            rows.extend(hold_rows(res))
            log(f"{ph.name} ({label}): p50 {ms(pct(res.lateness, 50))} ms, p99"
                f" {ms(pct(res.lateness, 99))} ms, early {res.early}")


# --- main -----------------------------------------------------------------------------------


def print_table(rows: list[Row], header: str) -> None:
    print()
    print(header)
    width = max(len(r.what) for r in rows)
    print(f"{'measurement':<{width}}  {'n':>6}  {'p50 ms':>8}  {'p99 ms':>8}  {'max ms':>8}  note")
    for r in rows:
        print(f"{r.what:<{width}}  {r.n:>6}  {r.p50:>8}  {r.p99:>8}  {r.maxv:>8}  {r.note}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="pipeline,throughput,hold,long",
                    help="comma-separated measurements to run (default: %(default)s)")
    ap.add_argument("--pipeline-messages", type=int, default=200)
    ap.add_argument("--pipeline-spacing-ms", type=float, default=20)
    ap.add_argument("--pipeline-idle-messages", type=int, default=25,
                    help="then this many, far apart (default: %(default)s)")
    ap.add_argument("--pipeline-idle-spacing-ms", type=float, default=200)
    ap.add_argument("--throughput-messages", type=int, default=20_000,
                    help="backlog of the no-op run (default: %(default)s)")
    ap.add_argument("--throughput-db-messages", type=int, default=10_000,
                    help="backlog of the PostgreSQL run (default: %(default)s)")
    ap.add_argument("--holds", type=int, default=2000)
    ap.add_argument("--hold-delays", type=parse_range, default=(1.0, 10.0),
                    metavar="LOW:HIGH", help="seconds (default: 1:10)")
    ap.add_argument("--hold-rate", type=float, default=0.0,
                    help="produce the holds at this many per second; 0: all at once, so"
                         " the stage's backlog adds to the lateness (default: %(default)s)")
    ap.add_argument("--short-tiers", default="100ms",
                    help="extra shortest tiers, one variant each, e.g. 100ms,250ms;"
                         " empty: shipped tiers only (default: %(default)s)")
    ap.add_argument("--long-holds", type=int, default=2000,
                    help="holds of the long run; 0 skips it (default: %(default)s)")
    ap.add_argument("--long-delays", type=parse_range, default=(30.0, 130.0),
                    metavar="LOW:HIGH", help="seconds; >= 120 reaches the 2m tier"
                                             " (default: 30:130)")
    ap.add_argument("--partitions", type=int, default=None,
                    help="partitions of every topic (default: as in topics.yaml)")
    ap.add_argument("--worker-loglevel", choices=["debug", "info", "warn", "error"],
                    default="info", help="the workers' log level (default: %(default)s, as"
                                         " `stovepipe worker`); warn/error turn Faust's"
                                         " spinner on, which sets the root logger to DEBUG")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up messages per worker")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true",
                    help="keep the schema, topics and worker logs (for debugging)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    bootstrap, base_dsn = endpoints()
    settings = load_settings()
    header = (f"stovepipe runtime bench — {os.cpu_count()} cores ({platform.machine()},"
              f" {platform.system()}); kafka {bootstrap}; {versions(base_dsn)}")
    load_before = os.getloadavg()[0]
    log(header)
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="stovepipe-bench-"))
    started = time.monotonic()
    with psycopg.connect(base_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        from store.migrations import migrate

        dsn = make_conninfo(base_dsn, options=f"-c search_path={schema}")
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEMA_SQL)
        ctx = {"bootstrap": bootstrap, "dsn": dsn, "base_topics": settings.topics_file,
               "workdir": workdir, "partitions": args.partitions, "keep": args.keep,
               "loglevel": args.worker_loglevel}
        if "pipeline" in only:
            run_pipeline(args, ctx, rows)
        if "throughput" in only:
            run_throughput(args, ctx, rows, "noop", args.throughput_messages)
            run_throughput(args, ctx, rows, "db", args.throughput_db_messages)
        if "hold" in only:
            run_holds(args, ctx, rows)
        if "long" in only and args.long_holds > 0:
            run_long_holds(args, ctx, rows)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            log(f"kept schema {schema} and worker logs in {workdir}")
        else:
            with psycopg.connect(base_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        if rows:
            print_table(rows, f"{header}\n{time.monotonic() - started:.0f}s in all; load average"
                              f" (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
