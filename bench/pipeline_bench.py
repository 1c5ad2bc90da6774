"""End-to-end benchmark of the Stovepipe pipeline: real `stovepipe worker`, real broker and
database, instant fake builds. Prints figures; asserts nothing about timing.

    .venv/bin/python bench/pipeline_bench.py [--queues 100] [--requests 1000]
        [--latency-requests 50] [--variants shipped,3] [--delay 50ms] [--loglevel info]
        [--profile auto|py-spy|cprofile|none] [--plain-worker] [--keep]
        [--experiments serial|isolated-partitions] [--workers 2] [--hosted-latency] [--runs 3]

For each variant of the topic layout (``shipped`` = topics.yaml as it is; ``N`` = the same
file with N partitions per stage topic and delay tier) the script creates its own topics
(fresh prefix), its own PostgreSQL schema (migrated), a queues file with one fake
repository file per queue, and starts ONE worker process. Then:

0. idle        the idle worker's CPU for --idle-seconds (its polling cost);
1. throughput  --requests Requests over --queues queues. Per queue: push head k, ingest it,
               and ingest head k+1 only once Request k is terminal (queues run in
               parallel); every Request is validated (no supersession) and reaches a fact.
               Requests/s = facts / (last fact's created_at - first ingest's start).
2. latency     one queue, --latency-requests sequential Requests, each ingested once the
               previous one has its fact: ingest start -> validation_fact.created_at.

Ingest is in-process, `streams.stages.ingest.ingest_queue` (as the e2e test of 100 concurrent
ingests does), on this process's own pool and producer, not through the `ingest` topic.

Where the time goes, per phase:
- hops from the Kafka timestamps of each Request's ProcessRequest, BuildRequest,
  BuildSignal and Record messages (CreateTime, stamped when the previous stage published)
  and the fact's created_at: ingest -> process -> build -> buildsignal -> record -> fact;
- the worker's Prometheus histograms (`--web-port` /metrics), scraped before and after:
  stovepipe_handle_seconds, stovepipe_delivery_seconds, stovepipe_deliveries_total;
- counters the worker wrapper `bench/pipeline_worker.py` adds (the same Click command run
  in-process with hooks; --plain-worker runs `python -m streams.cli worker` instead): DB
  statements, transactions, produces and thread hops per stage, and the receive lag
  (handler start - record timestamp) per stage;
- the time a handler spends awaiting statements, transactions, produces and thread hops,
  and one statement's / one produce's latency as the worker sees it;
- CPU of the worker (event loop vs other threads), this driver, PostgreSQL, Kafka, other
  processes and the whole machine, also per Request: the machine may be shared, and
  other tenants' load moves every figure here;
- a py-spy profile of the worker during the first variant's throughput phase (py-spy from
  PyPI, `.venv/bin/pip install py-spy`), or cProfile of the worker's main thread on its
  CPU clock with --profile cprofile (slows the worker down: figures then are not
  comparable).

--experiments patch candidate changes to streams/ into the worker (see
bench/pipeline_worker.py; streams/ itself is untouched) to measure what they would gain.

Endpoints come from `streams.config.settings.load_settings()`; without STOVEPIPE_KAFKA_BOOTSTRAP /
STOVEPIPE_POSTGRES_DSN the local stack is started with `streams.devstack.ensure_up`.
Everything created is removed afterwards (worker stopped, topics and consumer groups
deleted, schema dropped, temp dir removed) unless --keep. With the defaults a run takes
about 3.5-4.5 minutes on 2 cores (most of it the throughput phases).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pipeline_analysis as pa
import pipeline_worker
import psycopg
import yaml
from psycopg import sql
from psycopg.conninfo import make_conninfo

from contract import BuildRequest, BuildSignal, ProcessRequest, Record, unmarshal
from streams.config.kafka_security import aiokafka_conf, librdkafka_conf
from streams.config.settings import REPO_ROOT, load_settings
from streams.config.topics import TopicsConfig, load_topics
from streams.runtime.topic_admin import ensure_topics

BENCH_DIR = Path(__file__).resolve().parent
STAGES = ("process", "build", "buildsignal", "record")
HOPS = ("ingest", "process", "build", "buildsignal", "record")
TERMINAL = ["superseded", "succeeded", "failed", "cancelled"]
REF = "main"
WAIT_TIMEOUT = 120.0
DRIVER_INGEST = "driver-ingest"  # the counters' stage label of in-process ingest calls
# --hosted-latency: what a remote git server and a hosted CI answer in (issue 10)
SOURCE_LATENCY = {"head": "100ms", "is_ancestor": "50ms"}
RUNNER_LATENCY = {"trigger": "300ms", "status": "200ms"}


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def endpoints() -> tuple[str, str]:
    settings = load_settings()
    if settings.kafka_from_env and settings.postgres_from_env:
        return settings.kafka_bootstrap, settings.postgres_dsn
    from streams.devstack import ensure_up

    stack = ensure_up(load_settings(), quiet=True)
    return (settings.kafka_bootstrap if settings.kafka_from_env else stack.kafka_bootstrap,
            settings.postgres_dsn if settings.postgres_from_env else stack.postgres_dsn)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pyspy_path() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


# --- one deployment: topics, schema, queues, worker ----------------------------------------


@dataclass(frozen=True)
class Variant:
    name: str
    partitions: int | None  # None: as topics.yaml ships

    @classmethod
    def parse(cls, text: str) -> Variant:
        return cls("shipped", None) if text == "shipped" else cls(f"{int(text)}p", int(text))


class Deployment:
    """An isolated Stovepipe: its topics, schema, queues file, repositories and worker."""

    def __init__(self, args: argparse.Namespace, bootstrap: str, admin_dsn: str,
                 variant: Variant, root: Path) -> None:
        self.args, self.bootstrap, self.admin_dsn = args, bootstrap, admin_dsn
        self.variant, self.root = variant, root
        tag = uuid.uuid4().hex[:8]
        self.prefix = f"pb{tag}."
        self.schema = f"pb_{tag}"
        self.app_id = f"{self.prefix}stovepipe"
        self.dsn = make_conninfo(admin_dsn, options=f"-c search_path={self.schema}")
        self.topics_file = root / "topics.yaml"
        self.queues_file = root / "queues.yaml"
        self.repos = root / "repos"
        self.queues: dict[str, dict[str, Any]] = {}
        self.topics: TopicsConfig | None = None
        self.worker: subprocess.Popen[bytes] | None = None
        self.web_port = free_port()
        self.extra: list[tuple[subprocess.Popen[bytes], int]] = []  # --workers beyond one
        self.schema_created = False

    # setup / teardown
    def setup(self) -> None:
        from store.migrations import migrate

        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
        self.schema_created = True
        migrate(self.dsn)
        raw = yaml.safe_load((REPO_ROOT / "topics.yaml").read_text())
        if self.variant.partitions is not None:
            raw["defaults"]["partitions"] = self.variant.partitions
            raw["dlq_defaults"]["partitions"] = min(self.variant.partitions,
                                                    raw["dlq_defaults"]["partitions"])
        self.topics_file.write_text(yaml.safe_dump(raw))
        self.topics = load_topics(self.topics_file, prefix=self.prefix)
        report = ensure_topics(librdkafka_conf(self.bootstrap), self.topics)
        if not report.ok:
            raise RuntimeError(f"topics not created: {[s.detail for s in report if not s.ok]}")
        self.repos.mkdir()

    def describe_topics(self) -> str:
        assert self.topics is not None
        stage = self.topics.stage("process").partitions
        dlq = self.topics.dead_letter("process").partitions
        tiers = "/".join(f"{t.delay.total_seconds():g}s" for t in self.topics.delay_tiers)
        tier_parts = self.topics.delay_tiers[0].partitions
        return (f"stage topics {stage} partitions, dlq {dlq}, delay tiers {tiers} "
                f"({tier_parts} partitions each)")

    def teardown(self) -> None:
        self.stop_worker()
        with contextlib.suppress(Exception):
            self._delete_kafka_state()
        if self.schema_created:
            with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(
                    sql.Identifier(self.schema)))

    def _delete_kafka_state(self) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(librdkafka_conf(self.bootstrap))
        with contextlib.suppress(Exception):
            for fut in admin.delete_consumer_groups(
                    [self.app_id, f"{self.app_id}-delay"], request_timeout=15).values():
                with contextlib.suppress(Exception):
                    fut.result(timeout=15)
        names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(self.prefix)]
        if names:
            for fut in admin.delete_topics(names, operation_timeout=30).values():
                with contextlib.suppress(Exception):
                    fut.result(timeout=30)

    # queues
    def add_queues(self, names: Sequence[str]) -> None:
        delay = self.args.delay
        for name in names:
            path = self.repos / (name.replace("/", "_") + ".json")
            self.queues[name] = {
                "source_control": {"kind": "fake", "path": str(path), "repo": "r", "ref": REF,
                                   "promotion_ref": "verified",
                                   **({"latency": SOURCE_LATENCY}
                                      if self.args.hosted_latency else {})},
                "build_runner": {"kind": "fake",
                                 **({"latency": RUNNER_LATENCY}
                                    if self.args.hosted_latency else {})},
                "max_concurrent": 1,
                "gate_delay": delay,
                "poll_delay_queued": delay,
                "poll_delay_running": delay,
                "poll_deadline": "60s",
            }
        self.queues_file.write_text(yaml.safe_dump({"queues": self.queues}))

    def repo(self, queue: str) -> Any:
        from streams.extensions.sourcecontrol.fake import FakeRepo

        return FakeRepo(self.queues[queue]["source_control"]["path"])

    # worker
    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=self.bootstrap,
                    STOVEPIPE_POSTGRES_DSN=self.dsn, STOVEPIPE_TOPIC_PREFIX=self.prefix,
                    STOVEPIPE_TOPICS_FILE=str(self.topics_file),
                    STOVEPIPE_QUEUES_FILE=str(self.queues_file), STOVEPIPE_APP_ID=self.app_id,
                    PYTHONPATH=os.pathsep.join(
                        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))

    def start_worker(self, cprofile_out: Path | None) -> None:
        self.worker = self._spawn(self.web_port, "worker.log", cprofile_out)
        for i in range(1, self.args.workers):
            port = free_port()
            self.extra.append((self._spawn(port, f"worker{i + 1}.log", None), port))

    def _spawn(self, web_port: int, log_name: str,
               cprofile_out: Path | None) -> subprocess.Popen[bytes]:
        if self.args.plain_worker:
            cmd = [sys.executable, "-m", "streams.cli", "worker"]
        else:
            cmd = [sys.executable, str(BENCH_DIR / "pipeline_worker.py")]
        cmd += ["--loglevel", self.args.loglevel, "--web-port", str(web_port)]
        env = self.env
        if cprofile_out is not None:
            env[pipeline_worker.ENV_CPROFILE] = str(cprofile_out)
        if self.args.experiments:
            env[pipeline_worker.ENV_EXPERIMENTS] = self.args.experiments
        if self.args.switch_interval:
            env[pipeline_worker.ENV_SWITCH_INTERVAL] = str(self.args.switch_interval)
        # cwd: Faust writes its data directory (<app id>-data) there
        with open(self.root / log_name, "wb") as out:
            return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=self.root)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in [self.worker, *(w for w, _ in self.extra)] if p is not None]

    def stop_worker(self) -> None:
        procs = [self.worker, *(w for w, _ in self.extra)]
        self.worker, self.extra = None, []
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def check_worker(self) -> None:
        if self.worker is None or self.worker.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{self.worker_log()}")
        for proc, _ in self.extra:
            if proc.poll() is not None:
                raise RuntimeError("a second worker exited")

    def worker_log(self, tail: int = 4000) -> str:
        path = self.root / "worker.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def scrape(self) -> dict[pa.Sample, float]:
        """Every worker's metrics, summed."""
        total: dict[pa.Sample, float] = defaultdict(float)
        for port in [self.web_port, *(p for _, p in self.extra)]:
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                for sample, value in pa.parse_metrics(resp.read().decode()).items():
                    total[sample] += value
        return dict(total)

    def wait_metrics(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_worker()
            try:
                self.scrape()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)


# --- the driver: in-process ingest and a watcher of terminal states and facts ---------------


def _keys(request_ids: Iterable[str]) -> tuple[list[str], list[str]]:
    """(queues, ids) of Request ids `request/<queue>/<n>`."""
    ids = list(request_ids)
    return [rid.removeprefix("request/").rsplit("/", 1)[0] for rid in ids], ids


def fact_latencies(dsn: str, started: dict[str, float], ids: list[str],
                   window: tuple[float, float] | None = None) -> list[float]:
    """Ingest start → whole-repository fact of each Request of ``ids`` that has one (only
    those ingested within ``window``, epoch seconds, when given)."""
    with psycopg.connect(dsn) as conn:
        facts = dict(conn.execute(
            "SELECT f.request_id, EXTRACT(EPOCH FROM f.created_at)::float8"
            " FROM unnest(%s::text[], %s::text[]) AS k(queue, id)"
            " JOIN validation_fact f ON f.queue = k.queue AND f.request_id = k.id"
            " AND f.project = ''", _keys(ids)).fetchall())
    return [facts[rid] - started[rid] for rid in ids if rid in facts
            and (window is None or window[0] <= started[rid] <= window[1])]


class Watcher:
    """Resolves futures when Requests become terminal or get their fact (one poller)."""

    def __init__(self, dsn: str, interval: float) -> None:
        self.dsn, self.interval = dsn, interval
        self.terminal: dict[str, asyncio.Future[None]] = {}
        self.facts: dict[str, asyncio.Future[None]] = {}

    async def run(self) -> None:
        pipeline_worker.STAGE.set("watcher")  # this task's statements are not ingest's
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            while True:
                # by primary key (queue first): a scan of a large history on every poll
                # would load the machine that is measured
                if self.terminal:
                    cur = await conn.execute(
                        "SELECT r.id FROM unnest(%s::text[], %s::text[]) AS k(queue, id)"
                        " JOIN request r ON r.queue = k.queue AND r.id = k.id"
                        " WHERE r.state = ANY(%s)", (*_keys(self.terminal), TERMINAL))
                    for (rid,) in await cur.fetchall():
                        self._resolve(self.terminal, rid)
                if self.facts:
                    cur = await conn.execute(
                        "SELECT f.request_id FROM unnest(%s::text[], %s::text[]) AS k(queue, id)"
                        " JOIN validation_fact f ON f.queue = k.queue AND f.request_id = k.id"
                        " AND f.project = ''", _keys(self.facts))
                    for (rid,) in await cur.fetchall():
                        self._resolve(self.facts, rid)
                await asyncio.sleep(self.interval)

    @staticmethod
    def _resolve(waiting: dict[str, asyncio.Future[None]], rid: str) -> None:
        fut = waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait(self, kind: str, rid: str) -> None:
        waiting = self.terminal if kind == "terminal" else self.facts
        fut = waiting.setdefault(rid, asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait_for(asyncio.shield(fut), WAIT_TIMEOUT)
        except TimeoutError:
            raise TimeoutError(f"{rid}: no {kind} within {WAIT_TIMEOUT:g}s") from None


class Driver:
    """Ingests in-process like `stovepipe ingest` and watches the outcome."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.ingest_started: dict[str, float] = {}

    async def __aenter__(self) -> Driver:
        from aiokafka import AIOKafkaProducer

        from store import Database
        from streams.config.queues import Extensions, load_queues
        from streams.stages.deps import Deps

        queues = load_queues(self.dep.queues_file)
        self.db = await Database.open(self.dep.dsn, max_size=20, name="pipeline-bench")
        self.producer = AIOKafkaProducer(**aiokafka_conf(self.dep.bootstrap), acks="all",
                                         enable_idempotence=True, linger_ms=0)
        await self.producer.start()
        self.deps = Deps(db=self.db, queues=queues, extensions=Extensions(queues, self.db))
        self.watcher = Watcher(self.dep.dsn, self.dep.args.poll_interval)
        self._watch_task = asyncio.create_task(self.watcher.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._watch_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._watch_task
        await self.producer.stop()
        await self.db.close()

    async def publish(self, key: str, payload: Any) -> None:
        from streams.runtime.stage import publish_payload

        assert self.dep.topics is not None
        spec = self.dep.topics.stage(key)
        await publish_payload(self.producer, spec.full_name, payload, spec.key_field)

    async def push_and_ingest(self, queue: str, sha: str) -> str:
        from streams.stages.ingest import ingest_queue

        await asyncio.to_thread(self.dep.repo(queue).push, REF, sha)
        started = time.time()
        token = pipeline_worker.STAGE.set(DRIVER_INGEST)
        try:
            rid = await ingest_queue(self.deps, queue, self.publish)
        finally:
            pipeline_worker.STAGE.reset(token)
        self.ingest_started[rid] = started
        return rid


# --- measurements ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    metrics: dict[pa.Sample, float]
    driver: dict[pa.Sample, float]
    worker_cpu: float
    worker_threads: dict[int, float]
    driver_cpu: float
    machine: tuple[float, float]
    groups: dict[str, float]


def snapshot(dep: Deployment, spy: Profiler | None = None) -> Snapshot:
    from prometheus_client import REGISTRY, generate_latest

    assert dep.worker is not None
    named = {pid: "worker" if i == 0 else f"worker {i + 1}"
             for i, pid in enumerate(dep.worker_pids)}
    named[os.getpid()] = "driver (this script)"
    if spy is not None:
        named[spy.proc.pid] = "py-spy"
    return Snapshot(time.time(), dep.scrape(),
                    pa.parse_metrics(generate_latest(REGISTRY).decode()),
                    sum(pa.process_cpu_seconds(pid) for pid in dep.worker_pids),
                    pa.thread_cpu_seconds(dep.worker.pid), time.process_time(),
                    pa.machine_cpu(), pa.cpu_by_group(named))


@dataclass
class Phase:
    name: str
    requests: list[str]
    started: float = 0.0
    before: Snapshot | None = None
    after: Snapshot | None = None
    profile: Path | None = None
    worker_pid: int | None = None
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


class Profiler:
    """py-spy attached to the worker for one phase (on-CPU samples of every thread)."""

    def __init__(self, pid: int, out: Path, rate: int) -> None:
        exe = pyspy_path()
        assert exe is not None
        self.out = out
        self.proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
             "--output", str(out), "--nonblocking", "--threads"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)

    def stop(self) -> Path | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None
        if not self.out.exists():
            log(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
            return None
        return self.out


async def run_throughput(drv: Driver, queues: list[str], total: int) -> list[str]:
    per_queue = [total // len(queues) + (1 if i < total % len(queues) else 0)
                 for i in range(len(queues))]
    ids: list[str] = []

    async def one_queue(queue: str, n: int) -> None:
        for k in range(n):
            rid = await drv.push_and_ingest(queue, f"t{k}")
            ids.append(rid)
            await drv.watcher.wait("terminal", rid)

    await asyncio.gather(*(one_queue(q, n) for q, n in zip(queues, per_queue, strict=True)))
    await asyncio.gather(*(drv.watcher.wait("fact", rid) for rid in ids))
    return ids


async def run_latency(drv: Driver, queue: str, n: int) -> list[str]:
    ids = []
    for k in range(n):
        rid = await drv.push_and_ingest(queue, f"l{k}")
        ids.append(rid)
        await drv.watcher.wait("fact", rid)
    return ids


async def run_warmup(drv: Driver, queue: str, n: int) -> None:
    for k in range(n):
        rid = await drv.push_and_ingest(queue, f"w{k}")
        await drv.watcher.wait("fact", rid)


def load_rows(dep: Deployment) -> dict[str, dict[str, Any]]:
    """Per Request: state, fact time, build ids."""
    with psycopg.connect(dep.dsn) as conn:
        rows = conn.execute(
            "SELECT r.id, r.state, f.created_at, f.degree FROM request r "
            "LEFT JOIN validation_fact f ON f.queue = r.queue AND f.request_id = r.id"
        ).fetchall()
        builds = conn.execute("SELECT id, request_id FROM build").fetchall()
    out: dict[str, dict[str, Any]] = {
        rid: {"state": state, "fact_at": _epoch(fact_at), "degree": degree, "builds": []}
        for rid, state, fact_at, degree in rows}
    for build_id, rid in builds:
        out[rid]["builds"].append(build_id)
    return out


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def read_stage_timestamps(dep: Deployment) -> dict[str, dict[str, list[float]]]:
    """stage -> payload id -> Kafka timestamps (s) of every message on that stage's topic."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    assert dep.topics is not None
    payloads = {"process": ProcessRequest, "build": BuildRequest, "buildsignal": BuildSignal,
                "record": Record}
    names = {dep.topics.stage(s).full_name: s for s in payloads}
    consumer = Consumer(librdkafka_conf(dep.bootstrap, **{"group.id": f"{dep.app_id}-read",
                         "enable.auto.commit": False}))
    out: dict[str, dict[str, list[float]]] = {s: defaultdict(list) for s in payloads}
    try:
        metadata = consumer.list_topics(timeout=10)
        parts, remaining = [], set()
        for name in names:
            for p in metadata.topics[name].partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)
                if high > low:
                    parts.append(TopicPartition(name, p, OFFSET_BEGINNING))
                    remaining.add((name, p, high))
        consumer.assign(parts)
        ends = {(n, p): h for n, p, h in remaining}
        deadline = time.monotonic() + 60
        while ends and time.monotonic() < deadline:
            for msg in consumer.consume(1000, timeout=1.0):
                if msg.error():
                    continue
                stage = names[msg.topic()]
                payload = unmarshal(msg.value() or b"", payloads[stage])
                out[stage][payload.id].append(msg.timestamp()[1] / 1000)
                if msg.offset() + 1 >= ends.get((msg.topic(), msg.partition()), math.inf):
                    ends.pop((msg.topic(), msg.partition()), None)
    finally:
        consumer.close()
    return out


def hop_table(phase: Phase, started: dict[str, float],
              stamps: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per hop, the seconds each Request of the phase spent in it."""
    hops: dict[str, list[float]] = defaultdict(list)
    for rid in phase.requests:
        row = phase.rows.get(rid)
        if row is None or row["fact_at"] is None:
            continue
        build_stamps = [t for b in row["builds"] for t in stamps["buildsignal"].get(b, [])]
        marks = [started[rid], min(stamps["process"].get(rid, [math.nan])),
                 min(stamps["build"].get(rid, [math.nan])), min(build_stamps or [math.nan]),
                 min(stamps["record"].get(rid, [math.nan])), row["fact_at"]]
        for name, (a, b) in zip(HOPS, itertools.pairwise(marks), strict=True):
            if not (math.isnan(a) or math.isnan(b)):
                hops[name].append(b - a)
        hops["total"].append(row["fact_at"] - started[rid])
    return hops


def redeliveries(phase: Phase, stamps: dict[str, dict[str, list[float]]]) -> dict[str, int]:
    """Messages beyond the first per Request and stage: holds, retries, duplicates."""
    out = {}
    for stage in STAGES:
        extra = 0
        for rid in phase.requests:
            row = phase.rows.get(rid, {"builds": []})
            keys = row["builds"] if stage == "buildsignal" else [rid]
            extra += sum(max(0, len(stamps[stage].get(k, [])) - 1) for k in keys)
        out[stage] = extra
    return out


# --- report ---------------------------------------------------------------------------------


def report_cpu(phase: Phase, n_facts: int) -> None:
    assert phase.before is not None and phase.after is not None
    b, a = phase.before, phase.after
    wall = a.at - b.at
    busy = (a.machine[0] - b.machine[0]) / max(1e-9, a.machine[1] - b.machine[1])
    ncpu = os.cpu_count() or 1
    worker = a.worker_cpu - b.worker_cpu
    per_request = f", {1000 * worker / n_facts:.1f} ms CPU per Request" if n_facts else ""
    print(f"  CPU over {wall:.1f} s: worker {100 * worker / wall:.0f}% of one core"
          f"{per_request}; machine busy {100 * busy * ncpu:.0f}% of {100 * ncpu}% "
          f"({ncpu} cores)")
    groups = {g: a.groups.get(g, 0.0) - b.groups.get(g, 0.0) for g in a.groups}
    groups["unaccounted (exited processes, e.g. other sessions' tests; kernel)"] = max(
        0.0, busy * ncpu * wall - sum(c for c in groups.values() if c > 0))
    ranked = sorted(((g, c) for g, c in groups.items() if c > 0), key=lambda x: -x[1])
    print("    by process, % of one core" + (" (ms CPU per Request)" if n_facts else "")
          + ": " + ", ".join(f"{g} {100 * c / wall:.0f}%"
                             + (f" ({1000 * c / n_facts:.1f})" if n_facts else "")
                             for g, c in ranked))
    assert phase.worker_pid is not None
    threads = {tid: cpu - b.worker_threads.get(tid, 0.0) for tid, cpu in a.worker_threads.items()}
    main_cpu = threads.pop(phase.worker_pid, 0.0)
    others = sorted(threads.values(), reverse=True)
    print(f"    worker threads: event loop (main) {100 * main_cpu / wall:.0f}%, other threads "
          f"{100 * sum(others) / wall:.0f}% (busiest: "
          + ", ".join(f"{100 * c / wall:.0f}%" for c in others[:3] if c > 0) + ")")


COUNTERS = ("db_statements", "db_transactions", "produces", "threads")


def _per_msg(samples: dict[pa.Sample, float], key: str, stage: str, n: float) -> float:
    """A bench counter per message of ``stage``: nan without the counters (plain worker),
    0 when ``stage`` never touched it."""
    counts = pa.by_label(samples, f"bench_{key}_total", "stage")
    if not counts or not n:
        return math.nan
    return counts.get(stage, 0.0) / n


def _num(value: float, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if math.isnan(value) else f"{value:>{width}.{digits}f}"


def report_phase(phase: Phase, hops: dict[str, list[float]], extra: dict[str, int],
                 n_facts: int) -> dict[str, float]:
    assert phase.before is not None and phase.after is not None
    b, a = phase.before, phase.after
    m = pa.delta(a.metrics, b.metrics)
    d = pa.delta(a.driver, b.driver)
    report_cpu(phase, n_facts)
    stmt = pa.histogram(m, "bench_db_statement_seconds")
    prod = pa.histogram(m, "bench_produce_seconds")
    if stmt.count:
        print(f"  one DB statement as the worker awaits it: p50 {pa.ms(stmt.quantile(.5))} p90 "
              f"{pa.ms(stmt.quantile(.9))} p99 {pa.ms(stmt.quantile(.99))} mean "
              f"{pa.ms(stmt.mean)} ms; one produce (acks=all): p50 {pa.ms(prod.quantile(.5))} "
              f"p90 {pa.ms(prod.quantile(.9))} p99 {pa.ms(prod.quantile(.99))} mean "
              f"{pa.ms(prod.mean)} ms")
    outcomes = {}
    for (name, labels), value in m.items():
        if name == "stovepipe_deliveries_total" and value:
            lab = dict(labels)
            outcomes.setdefault(lab["stage"], []).append(f"{lab['outcome']} {value:.0f}")
    print("  per stage (worker /metrics over the phase; times in ms, counts per message):")
    print(f"    {'stage':<13}{'msgs':>5}{'handle mean':>12}{'p50':>7}{'p99':>7}"
          f"{'deliv mean':>11}{'recv lag p50':>13}{'p99':>7}{'DB stmts':>9}{'tx':>5}"
          f"{'produces':>9}{'threads':>8}  outcomes")
    split_rows = []
    per_request: dict[str, float] = defaultdict(float)
    for stage in ("ingest", *STAGES, DRIVER_INGEST):
        src = d if stage == DRIVER_INGEST else m
        handle = pa.histogram(m, "stovepipe_handle_seconds", stage=stage)
        n = len(phase.requests) if stage == DRIVER_INGEST else handle.count
        if not n:
            continue
        c = {k: _per_msg(src, k, stage, n) for k in COUNTERS}
        t = {k: _per_msg(src, f"{k}_seconds", stage, n) for k in COUNTERS}
        if stage == DRIVER_INGEST:
            note = "(in-process ingest_queue, not the worker)"
            print(f"    {'ingest (drv)':<13}{n:>5.0f}{note:>57}"
                  f"{_num(c['db_statements'], 9, 1)}{_num(c['db_transactions'], 5, 1)}"
                  f"{_num(c['produces'], 9, 1)}{_num(c['threads'], 8, 1)}")
        else:
            deliv = pa.histogram(m, "stovepipe_delivery_seconds", stage=stage)
            lag = pa.histogram(m, "bench_receive_lag_seconds", stage=stage)
            for k in COUNTERS:
                per_request[k] += 0.0 if math.isnan(c[k]) else c[k] * n / max(1, n_facts)
            print(f"    {stage:<13}{n:>5.0f}{pa.ms(handle.mean):>12}"
                  f"{pa.ms(handle.quantile(.5)):>7}{pa.ms(handle.quantile(.99)):>7}"
                  f"{pa.ms(deliv.mean):>11}{pa.ms(lag.quantile(.5)):>13}"
                  f"{pa.ms(lag.quantile(.99)):>7}{_num(c['db_statements'], 9, 1)}"
                  f"{_num(c['db_transactions'], 5, 1)}{_num(c['produces'], 9, 1)}"
                  f"{_num(c['threads'], 8, 1)}  {', '.join(outcomes.get(stage, []))}")
        parts = [t["db_statements"], t["db_transactions"], t["produces"], t["threads"]]
        rest = handle.mean - sum(parts) if stage != DRIVER_INGEST else math.nan
        split_rows.append((stage, *parts, rest))
    counted = bool(pa.by_label(m, "bench_db_statements_total", "stage"))  # not --plain-worker
    if counted:
        rt = per_request["db_statements"] + 2 * per_request["db_transactions"]
        print(f"  worker per Request: {per_request['db_statements']:.1f} DB statements + "
              f"{per_request['db_transactions']:.1f} transactions = {rt:.1f} DB round trips, "
              f"{per_request['produces']:.1f} produces (acks=all), "
              f"{per_request['threads']:.1f} thread hops (fake repository file I/O)")
    if split_rows and not all(math.isnan(r[1]) for r in split_rows):
        print("  where a handler's time goes (ms per message, means): statements outside a "
              "transaction | transactions (BEGIN..COMMIT) | produce (acks=all) | thread hops | "
              "rest = handle - those (Python CPU, event-loop waits, pool checkout)")
        for stage, db, tx, prod, thr, rest in split_rows:
            if all(math.isnan(v) for v in (db, tx, prod, thr)):
                continue
            print(f"    {stage:<13} stmts {pa.ms(db):>6}  tx {pa.ms(tx):>6}  produce "
                  f"{pa.ms(prod):>6}  threads {pa.ms(thr):>6}  rest {pa.ms(rest):>6}")
    lateness = pa.histogram(m, "stovepipe_delay_lateness_seconds")
    if lateness.count:
        print(f"  delay tiers: {lateness.count:.0f} redeliveries, lateness mean "
              f"{pa.ms(lateness.mean)} ms")
    if any(extra.values()):
        print("  extra messages per stage topic (holds/retries/duplicates): "
              + ", ".join(f"{s} {n}" for s, n in extra.items() if n))
    print("  hops per Request (ms; Kafka CreateTime of each stage's input, fact created_at):")
    print(f"    {'hop':<26}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}")
    labels = {"ingest": "ingest call -> process msg", "process": "process -> build msg",
              "build": "build -> buildsignal msg", "buildsignal": "buildsignal -> record msg",
              "record": "record -> fact", "total": "ingest -> fact"}
    summary = {}
    for hop in (*HOPS, "total"):
        vals = hops.get(hop, [])
        print(f"    {labels[hop]:<26}{pa.ms(pa.percentile(vals, .5)):>8}"
              f"{pa.ms(pa.percentile(vals, .9)):>8}{pa.ms(pa.percentile(vals, .99)):>8}"
              f"{pa.ms(max(vals) if vals else math.nan):>8}")
        summary[hop] = pa.percentile(vals, .5)
    summary["p99"] = pa.percentile(hops.get("total", []), .99)
    return summary


def report_profile(path: Path, kind: str, phase: Phase | None = None,
                   rate: int = 100) -> None:
    if kind == "cprofile":
        for line in pa.cprofile_report(path, 25):
            print(f"    {line}")
        return
    prof = pa.read_pyspy_raw(path)
    total = max(1, prof.samples)
    print(f"  py-spy samples of non-idle threads: {prof.samples}")
    if phase is not None and phase.before is not None and phase.after is not None:
        wall = phase.after.at - phase.before.at
        cpu = phase.after.worker_cpu - phase.before.worker_cpu
        sampled = prof.samples / rate
        print(f"    sampled busy thread-seconds {sampled:.1f} vs CPU seconds used {cpu:.1f} over "
              f"{wall:.1f} s: {100 * max(0.0, 1 - cpu / sampled) if sampled else 0:.0f}% of the "
              f"'busy' samples are a thread runnable but waiting for a core (py-spy counts "
              f"state R), so syscall frames (select, socket write, libpq send) look costlier "
              f"than they are on a saturated machine")
    print("    by thread: " + ", ".join(f"{t} {100 * n / total:.0f}%"
                                         for t, n in prof.by_thread.most_common(6)))
    print("    own time by area: " + ", ".join(f"{a} {100 * n / total:.1f}%"
                                               for a, n in prof.by_area.most_common(14)))
    print("    inclusive: " + ", ".join(f"{f} {100 * n / total:.1f}%"
                                        for f, n in prof.inclusive.most_common(20)))
    print("    top own-time functions:")
    for func, n in prof.by_leaf.most_common(15):
        print(f"      {100 * n / total:5.1f}%  {func}")


# --- main -----------------------------------------------------------------------------------


def run_variant(args: argparse.Namespace, bootstrap: str, admin_dsn: str, variant: Variant,
                profile: str) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix=f"pipeline-bench-{variant.name}-"))
    dep = Deployment(args, bootstrap, admin_dsn, variant, root)
    try:
        dep.setup()
        tp_queues = [f"tp{i:03d}/main" for i in range(args.queues)]
        dep.add_queues([*tp_queues, "lat/main", "warm/main"])
        log(f"variant {variant.name}: {dep.describe_topics()}; schema {dep.schema}")
        cprofile_out = root / "worker.prof" if profile == "cprofile" else None
        dep.start_worker(cprofile_out)
        dep.wait_metrics()
        idle, tp, lat, started = asyncio.run(_drive(args, dep, tp_queues, profile))
        dep.stop_worker()  # also writes the cProfile dump
        return report_variant(args, dep, idle, tp, lat, started, cprofile_out)
    except BaseException:
        log(f"worker log tail:\n{dep.worker_log()}")
        raise
    finally:
        dep.teardown()
        if args.keep:
            log(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


async def _drive(args: argparse.Namespace, dep: Deployment, tp_queues: list[str],
                 profile: str) -> tuple[Phase, Phase, Phase, dict[str, float]]:
    async with Driver(dep) as drv:
        t = time.monotonic()
        await run_warmup(drv, "warm/main", 3)
        log(f"worker ready (warm-up Requests validated in {time.monotonic() - t:.1f} s)")
        dep.check_worker()

        idle = Phase("idle", [], worker_pid=dep.worker.pid if dep.worker else None)
        idle.before = snapshot(dep)
        await asyncio.sleep(args.idle_seconds)
        idle.after = snapshot(dep)
        tp = Phase("throughput", [], worker_pid=idle.worker_pid)
        spy = (Profiler(dep.worker.pid, dep.root / "pyspy.txt", args.spy_rate)
               if profile == "py-spy" and dep.worker is not None else None)
        tp.before = snapshot(dep, spy)
        if args.requests:
            tp.requests = await run_throughput(drv, tp_queues, args.requests)
        tp.after = snapshot(dep, spy)
        tp.profile = spy.stop() if spy else None
        dep.check_worker()
        log(f"throughput phase done in {tp.after.at - tp.before.at:.1f} s")

        await asyncio.sleep(1.0)  # let the tail settle (commits, delay tiers)
        lat = Phase("latency", [], worker_pid=tp.worker_pid)
        lat.before = snapshot(dep)
        lat.requests = await run_latency(drv, "lat/main", args.latency_requests)
        lat.after = snapshot(dep)
        dep.check_worker()
        log("latency phase done")
        return idle, tp, lat, dict(drv.ingest_started)


def report_variant(args: argparse.Namespace, dep: Deployment, idle: Phase, tp: Phase,
                   lat: Phase,
                   started: dict[str, float], cprofile_out: Path | None) -> dict[str, float]:
    stamps = read_stage_timestamps(dep)
    rows = load_rows(dep)
    for phase in (tp, lat):
        phase.rows = {rid: rows[rid] for rid in phase.requests if rid in rows}

    print(f"\n=== variant {dep.variant.name}: {dep.describe_topics()}; gate/poll delays "
          f"{args.delay}; worker loglevel {args.loglevel}"
          f"{'; plain worker' if args.plain_worker else ''}"
          f"{'; EXPERIMENTS ' + args.experiments if args.experiments else ''} ===")
    print(f"IDLE  worker with nothing to do for {args.idle_seconds:g} s:")
    report_cpu(idle, 0)
    facts = [r for r in tp.rows.values() if r["fact_at"] is not None]
    states: dict[str, int] = defaultdict(int)
    for r in tp.rows.values():
        states[r["state"]] += 1
    rate, tp_sum = math.nan, {"total": math.nan}
    if tp.requests:
        first = min(started[rid] for rid in tp.requests)
        last = max(r["fact_at"] for r in facts) if facts else math.nan
        rate = len(facts) / (last - first) if facts else 0.0
        print(f"THROUGHPUT  {len(tp.requests)} Requests over {args.queues} queues, 1 worker: "
              f"{len(facts)} facts in {last - first:.2f} s (first ingest -> last fact) = "
              f"{rate:.1f} Requests/s; states {dict(states)}")
        tp_sum = report_phase(tp, hop_table(tp, started, stamps), redeliveries(tp, stamps),
                              len(facts))
    lat_facts = [r for r in lat.rows.values() if r["fact_at"] is not None]
    lat_hops = hop_table(lat, started, stamps)
    totals = lat_hops.get("total", [])
    print(f"\nLATENCY  {len(lat.requests)} sequential Requests on one queue, {len(lat_facts)} "
          f"facts: ingest -> fact p50 {pa.ms(pa.percentile(totals, .5))} ms, p99 "
          f"{pa.ms(pa.percentile(totals, .99))} ms (min {pa.ms(min(totals, default=math.nan))}"
          f", max {pa.ms(max(totals, default=math.nan))})")
    lat_sum = report_phase(lat, lat_hops, redeliveries(lat, stamps), len(lat_facts))
    if tp.profile is not None:
        print("\nPROFILE  worker during the throughput phase")
        report_profile(tp.profile, "py-spy", tp, args.spy_rate)
    if cprofile_out is not None and cprofile_out.exists():
        print("\nPROFILE  worker main thread, whole run, CPU clock (cProfile slows the "
              "worker down: the figures above are not comparable)")
        report_profile(cprofile_out, "cprofile")
    return {"rate": rate, "facts": len(facts), "lat_p50": lat_sum["total"],
            "lat_p99": lat_sum["p99"], "tp_p50": tp_sum["total"]}


def one_worker_deployment(delay: str, name: str) -> Deployment:
    """A deployment of one plain `stovepipe worker` (logging warnings), its queues' gate
    and poll delays ``delay``, in a temporary directory named after the benchmark."""
    bootstrap, admin_dsn = endpoints()
    ns = parse_args([])
    ns.delay, ns.loglevel, ns.plain_worker, ns.experiments = delay, "warn", True, ""
    ns.workers, ns.hosted_latency = 1, False
    root = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    return Deployment(ns, bootstrap, admin_dsn, Variant("shipped", None), root)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queues", type=int, default=100)
    p.add_argument("--requests", type=int, default=1000,
                   help="throughput phase, in all (0: skip the phase)")
    p.add_argument("--latency-requests", type=int, default=50)
    p.add_argument("--variants", default="shipped,3",
                   help="comma-separated: 'shipped' (topics.yaml) or a partition count")
    p.add_argument("--delay", default="50ms", help="gate and poll delays of every queue")
    p.add_argument("--loglevel", default="info", choices=["debug", "info", "warn", "error"])
    p.add_argument("--profile", default="auto", choices=["auto", "py-spy", "cprofile", "none"],
                   help="auto: py-spy when installed (first variant only)")
    p.add_argument("--profile-all", action="store_true", help="profile every variant")
    p.add_argument("--spy-rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--plain-worker", action="store_true",
                   help="run `python -m streams.cli worker` (no per-stage counters)")
    p.add_argument("--poll-interval", type=float, default=0.01,
                   help="how often the driver looks for terminal Requests and facts (s)")
    p.add_argument("--experiments", default="",
                   help="what-if: comma-separated candidate changes patched into the worker "
                        f"(bench/pipeline_worker.py): {', '.join(pipeline_worker.EXPERIMENTS)}")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="experiment: the worker's sys.setswitchinterval (default 0.005 s)")
    p.add_argument("--idle-seconds", type=float, default=5.0,
                   help="measure the idle worker's CPU this long before the throughput phase")
    p.add_argument("--workers", type=int, default=1, help="worker processes (same group)")
    p.add_argument("--hosted-latency", action="store_true",
                   help="fake call latencies: source control head 100ms, is_ancestor 50ms; "
                        "build runner trigger 300ms, status 200ms")
    p.add_argument("--runs", type=int, default=1,
                   help="repeat each variant; the summary gives each run and the median")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, profile)")
    args = p.parse_args(argv)
    unknown = set(filter(None, args.experiments.split(","))) - set(pipeline_worker.EXPERIMENTS)
    if unknown:
        p.error(f"unknown experiments {sorted(unknown)}")
    if args.experiments and args.plain_worker:
        p.error("--experiments need the wrapper worker, not --plain-worker")
    if args.queues < 1 or 0 < args.requests < args.queues:
        p.error("need --queues >= 1 and --requests >= --queues (or 0: no throughput phase)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    profile = args.profile
    if profile == "auto":
        profile = "py-spy" if pyspy_path() else "none"
    if profile == "py-spy" and not pyspy_path():
        sys.exit("py-spy not found: .venv/bin/pip install py-spy, or --profile cprofile")
    bootstrap, admin_dsn = endpoints()
    load1, load5, _ = os.getloadavg()
    log(f"{os.cpu_count()} cores, load average {load1:.2f} (1 min) {load5:.2f} (5 min); "
        f"kafka {bootstrap}; python {sys.version.split()[0]}")
    results: dict[str, list[dict[str, float]]] = defaultdict(list)
    pipeline_worker.install_hooks()  # the driver counts its own ingest calls the same way
    for i, text in enumerate(args.variants.split(",")):
        variant = Variant.parse(text.strip())
        for run in range(args.runs):
            use = profile if ((i == 0 and run == 0) or args.profile_all) else "none"
            load = os.getloadavg()[0]
            result = run_variant(args, bootstrap, admin_dsn, variant, use)
            result["load"] = load
            results[variant.name].append(result)
    load1, load5, _ = os.getloadavg()
    target_rate = 100 if args.hosted_latency else 150
    print(f"\n=== SUMMARY ({os.cpu_count()} cores, {args.workers} worker(s), "
          f"{'hosted-CI latencies' if args.hosted_latency else 'instant fakes'}; load "
          f"average now {load1:.2f} / {load5:.2f}; targets: >= {target_rate} Requests/s, "
          f"low-load ingest->fact p50 <= 25 ms, p99 <= 60 ms) ===")
    for name, runs in results.items():
        for n, r in enumerate(runs, start=1):
            print(f"  {name:<8} run {n}: throughput {r['rate']:7.1f} Requests/s "
                  f"({r['facts']:.0f} facts), under load ingest->fact p50 "
                  f"{pa.ms(r['tp_p50'])} ms; low load p50 {pa.ms(r['lat_p50'])} ms, p99 "
                  f"{pa.ms(r['lat_p99'])} ms; load average at start {r['load']:.2f}")
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("rate", "lat_p50", "lat_p99", "load")}
        print(f"  {name:<8} MEDIAN of {len(runs)}: {med['rate']:.1f} Requests/s "
              f"({'met' if med['rate'] >= target_rate else 'MISSED'}), low load p50 "
              f"{pa.ms(med['lat_p50'])} ms ({'met' if med['lat_p50'] <= 0.025 else 'MISSED'})"
              f", p99 {pa.ms(med['lat_p99'])} ms "
              f"({'met' if med['lat_p99'] <= 0.060 else 'MISSED'}); median load average "
              f"{med['load']:.2f}")


if __name__ == "__main__":
    main()
