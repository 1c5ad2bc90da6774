"""Benchmark of `last-green` over projects (issue 24, Deliver 7): how long the newest commit
green for 20 projects takes to answer with 1,000,000 facts in the tables, side by side
with the queue's own bookmark read. Prints figures; asserts nothing about timing.

    .venv/bin/python bench/last_green_bench.py [--answers 1000000] [--facts 1000000]
        [--projects 25] [--subset 20] [--queries 300] [--seed 7] [--covering] [--keep]

It makes its own PostgreSQL schema (migrated) and topic prefix, and fills them with COPY:

- queue ``bench/mono`` with ``--projects`` projects and ``--answers / --projects`` heads:
  for each head each project is affected with its profile's probability — then built in
  its scope (`bench/mono#pNN`: a Request and a fact), green or red by its profile's chance
  of breaking and of being fixed — or unaffected, inheriting its last built answer; one
  `project_answer` per head and project (``--answers`` rows), the whole repository's fact
  per head (green when every blocking project is), plans, commit mappings and bookmarks.
  Profiles: most projects are steady (rarely affected, quickly fixed); three stay red for
  long stretches (hundreds to thousands of heads) and are red at the head, broken an
  eighth, a fiftieth and a seven-hundredth of the history ago; one bring-up project (not
  blocking) is red about half the time;
- queue ``bench/plain``, without projects, whose green and red facts fill
  `validation_fact` up to ``--facts`` rows.

Then VACUUM ANALYZE (as autovacuum would have), a real `stovepipe worker` serving HTTP,
and ``--queries`` rounds, each with its own random ``--subset`` of the projects:
``GET /api/queues/bench%2Fmono/last-green?projects=…`` (a new connection each time, as
`curl` would) and `ProjectAnswerStore.last_green` (this process's own pool), next to the
bookmark reads: ``GET …/last-green`` without projects for both queues, and
`QueueStore.get`. Prints p50/p99/max of each, the steps the walk took and how far behind
the head its answers lay. Everything created is removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import yaml
from psycopg import sql
from psycopg.conninfo import make_conninfo

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from pipeline_bench import endpoints, free_port  # noqa: E402 - the bench's own helpers

from store import Database, request_order  # noqa: E402
from streams.config.topics import load_topics  # noqa: E402
from streams.runtime.topic_admin import ensure_topics  # noqa: E402

MONO = "bench/mono"
PLAIN = "bench/plain"
WORKER_READY_TIMEOUT = 180.0


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# --- the data ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    name: str
    affected: float  # chance a head touches the project
    breaks: float  # chance a build of a green project is red
    fixes: float  # chance a build of a red project is green
    blocking: bool = True


STEADY = Profile("steady", affected=0.06, breaks=0.03, fixes=0.6)
LONG_RED = Profile("long red", affected=0.05, breaks=0.005, fixes=0.02)
BRING_UP = Profile("bring-up", affected=0.08, breaks=0.1, fixes=0.1, blocking=False)


# breakages still open at the head, as shares of the history: p03 broke an eighth of the
# history ago, p11 a fiftieth, p17 a few commits ago (each red from then on)
RED_AT_THE_HEAD = {"p03": 1 / 8, "p11": 1 / 50, "p17": 1 / 700}


def profiles(count: int) -> dict[str, Profile]:
    """Project name -> profile: three long-red projects, one bring-up, the rest steady."""
    chosen = {}
    for i in range(count):
        profile = LONG_RED if i in (3, 11, 17) else BRING_UP if i == 7 else STEADY
        chosen[f"p{i:02d}"] = profile
    return chosen


def sha(queue: str, n: int) -> str:
    return hashlib.sha1(f"{queue}:{n}".encode()).hexdigest()


def uri(queue: str, n: int) -> str:
    return f"git+/srv/git/{queue.split('/')[1]}#main@{sha(queue, n)}"


def request_id(queue: str, n: int) -> str:
    return f"request/{queue}/{n}"


@dataclass
class Filled:
    heads: int
    answers: int
    scope_facts: int
    facts: int
    red_share: dict[str, float]  # share of heads at which each project is red
    mono_bookmark: int | None
    plain_bookmark: int | None


def fill(dsn: str, *, answers: int, facts: int, project_count: int, seed: int) -> Filled:
    """COPY the rows (see the module's doc)."""
    rng = random.Random(seed)
    projects = profiles(project_count)
    heads = answers // project_count
    last: dict[str, tuple[float, int]] = {}  # project -> (degree, n of its last build)
    red_heads = dict.fromkeys(projects, 0)
    whole_green: list[bool] = []
    built: list[list[str]] = []
    answer_rows: list[tuple[Any, ...]] = []
    scope_rows: list[tuple[str, str, str, float]] = []  # (scope, id, uri, degree)
    broken_at = {p: heads - int(heads * share) for p, share in RED_AT_THE_HEAD.items()
                 if p in projects}
    for n in range(1, heads + 1):
        touched = []
        for project, profile in projects.items():
            previous = last.get(project)
            breaking = broken_at.get(project) == n
            if previous is None or breaking or rng.random() < profile.affected:
                was_green = previous is None or previous[0] == 0
                red = rng.random() < (profile.breaks if was_green else 1 - profile.fixes)
                red = red or n >= broken_at.get(project, heads + 1)
                degree = 1.0 if red else 0.0
                last[project] = (degree, n)
                touched.append(project)
                scope = f"{MONO}#{project}"
                scope_rows.append((scope, request_id(scope, n), uri(MONO, n), degree))
                answer_rows.append((MONO, request_id(MONO, n), project, uri(MONO, n), degree,
                                    False, request_id(scope, n), uri(MONO, n), 1))
            else:
                degree, source = previous
                scope = f"{MONO}#{project}"
                answer_rows.append((MONO, request_id(MONO, n), project, uri(MONO, n), degree,
                                    True, request_id(scope, source), uri(MONO, source), 0))
            red_heads[project] += degree > 0
        whole_green.append(all(last[p][0] == 0 for p, prof in projects.items()
                               if prof.blocking))
        built.append(touched)
    plain = max(0, facts - heads - len(scope_rows))
    epoch = datetime.now(UTC) - timedelta(days=60)

    def at(n: int) -> datetime:
        return epoch + timedelta(seconds=n)

    plain_green = [rng.random() > 0.1 for _ in range(plain)]

    with psycopg.connect(dsn, autocommit=True) as conn:
        def copy(table: str, columns: str, rows: Iterator[tuple[Any, ...]]) -> None:
            started = time.monotonic()
            count = 0
            with conn.cursor() as cur, cur.copy(
                    f"COPY {table} ({columns}) FROM STDIN") as out:  # type: ignore[arg-type]
                for row in rows:
                    out.write_row(row)
                    count += 1
            log(f"  {table}: {count:,} rows in {time.monotonic() - started:.1f}s")

        def requests() -> Iterator[tuple[Any, ...]]:
            for n in range(1, heads + 1):
                green = whole_green[n - 1]
                yield (MONO, request_id(MONO, n), uri(MONO, n),
                       "succeeded" if green else "failed", "green" if green else "red",
                       1, True, at(n))
            for scope, rid, commit, degree in scope_rows:
                yield (scope, rid, commit, "failed" if degree else "succeeded",
                       "red" if degree else "green", 1, True, at(request_order(rid)[0]))
            for n, green in enumerate(plain_green, start=1):
                yield (PLAIN, request_id(PLAIN, n), uri(PLAIN, n),
                       "succeeded" if green else "failed", "green" if green else "red",
                       1, True, at(n))

        # recorded, and made before the health figures' windows: the worker's sweeper and
        # gauges find nothing to do, as in a deployment whose history is months old
        copy("request", "queue, id, uri, state, verdict, attempt, recorded, created_at",
             requests())
        copy("request_uri", "queue, uri, request_id", (
            (q, commit, rid) for q, rid, commit, *_ in requests()))

        def fact_rows() -> Iterator[tuple[Any, ...]]:
            for n in range(1, heads + 1):
                yield (MONO, uri(MONO, n), "", 0.0 if whole_green[n - 1] else 1.0,
                       request_id(MONO, n), at(n))
            for scope, rid, commit, degree in scope_rows:
                yield (scope, commit, scope.split("#")[1], degree, rid,
                       at(request_order(rid)[0]))
            for n, green in enumerate(plain_green, start=1):
                yield (PLAIN, uri(PLAIN, n), "", 0.0 if green else 1.0, request_id(PLAIN, n),
                       at(n))

        copy("validation_fact", "queue, uri, project, degree, request_id, created_at",
             fact_rows())
        copy("project_answer", "queue, request_id, project, uri, degree, inherited,"
             " source_request_id, source_uri, attempts, created_at",
             ((*row, at(request_order(row[1])[0])) for row in answer_rows))
        copy("request_plan", "queue, request_id, affected, completed", (
            (MONO, request_id(MONO, n), built[n - 1], True) for n in range(1, heads + 1)))

        def newest_green(greens: list[bool]) -> int | None:
            return next((n for n in range(len(greens), 0, -1) if greens[n - 1]), None)

        mono_bookmark, plain_bookmark = newest_green(whole_green), newest_green(plain_green)
        for queue, count, bookmark in ((MONO, heads, mono_bookmark),
                                       (PLAIN, plain, plain_bookmark)):
            conn.execute(
                "INSERT INTO queue (name, latest_request_id, last_green_uri,"
                " last_green_request_id) VALUES (%s, %s, %s, %s)",
                (queue, request_id(queue, count),
                 uri(queue, bookmark) if bookmark else None,
                 request_id(queue, bookmark) if bookmark else None))
        for project in projects:
            scope = f"{MONO}#{project}"
            greens = [n for s, rid, _, d in scope_rows if s == scope and d == 0
                      for n in [request_order(rid)[0]]]
            newest = max(greens) if greens else None
            conn.execute(
                "INSERT INTO queue (name, latest_request_id, last_green_uri,"
                " last_green_request_id) VALUES (%s, %s, %s, %s)",
                (scope, request_id(scope, last[project][1]),
                 uri(MONO, newest) if newest else None,
                 request_id(scope, newest) if newest else None))
        started = time.monotonic()
        for table in ("request", "request_uri", "validation_fact", "project_answer",
                      "request_plan", "queue"):
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
        log(f"  VACUUM ANALYZE in {time.monotonic() - started:.1f}s")
    return Filled(heads=heads, answers=len(answer_rows), scope_facts=len(scope_rows),
                  facts=heads + len(scope_rows) + plain,
                  red_share={p: red_heads[p] / heads for p in projects},
                  mono_bookmark=mono_bookmark, plain_bookmark=plain_bookmark)


# --- the deployment ---------------------------------------------------------------------


def queues_yaml(root: Path, project_count: int) -> dict[str, Any]:
    fake = {"kind": "fake", "path": str(root / "repo.json"), "repo": "r", "ref": "main"}
    runner = {"kind": "fake", "state_dir": str(root / "builds")}
    return {"queues": {
        MONO: {"source_control": fake, "build_runner": runner,
               "projects": {name: {"paths": [f"{name}/**"], "blocking": profile.blocking}
                            for name, profile in profiles(project_count).items()}},
        PLAIN: {"source_control": fake, "build_runner": runner},
    }}


class Worker:
    """A `stovepipe worker` serving HTTP on this run's schema and topics."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log_path = root / "worker.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streams.cli", "worker", "--loglevel", "warn",
                 "--web-port", str(self.port)],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root,
                start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited:\n{self.log_path.read_text()[-3000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError("the worker did not become healthy")

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                    timeout=30) as resp:
            return resp.read()  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


# --- the measurements -------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def figures(name: str, seconds: list[float]) -> str:
    ms = [s * 1000 for s in seconds]
    return (f"{name:<58} p50 {statistics.median(ms):7.2f} ms  p99 {quantile(ms, 0.99):7.2f} ms"
            f"  max {max(ms):7.2f} ms  (n={len(ms)})")


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


async def store_timings(dsn: str, subsets: list[list[str]],
                        rounds: int) -> tuple[list[float], list[float], list[float],
                                              list[int], list[int]]:
    db = await Database.open(dsn, max_size=2)
    try:
        walk, mono, plain, steps, behind = [], [], [], [], []
        head = int((await db.queues.get(MONO)).latest_request_id.rsplit("/", 1)[1])  # type: ignore[union-attr]
        for i in range(rounds):
            started = time.perf_counter()
            found = await db.project_answers.last_green(MONO, subsets[i])
            walk.append(time.perf_counter() - started)
            steps.append(found.steps)
            if found.request_id is not None:
                behind.append(head - request_order(found.request_id)[0])
            started = time.perf_counter()
            await db.queues.get(MONO)
            mono.append(time.perf_counter() - started)
            started = time.perf_counter()
            await db.queues.get(PLAIN)
            plain.append(time.perf_counter() - started)
        return walk, mono, plain, steps, behind
    finally:
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=1_000_000,
                        help="project_answer rows (heads = answers / projects)")
    parser.add_argument("--facts", type=int, default=1_000_000,
                        help="validation_fact rows (the queue without projects fills up)")
    parser.add_argument("--projects", type=int, default=25)
    parser.add_argument("--subset", type=int, default=20,
                        help="projects named in each last-green query")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--covering", action="store_true",
                        help="an experiment: add project_answer_green's columns to an index "
                             "that also covers request_id (index-only probes) before measuring")
    parser.add_argument("--keep", action="store_true", help="keep the schema and topics")
    args = parser.parse_args()
    if not 1 <= args.subset <= args.projects:
        parser.error("--subset must be between 1 and --projects")

    bootstrap, admin_dsn = endpoints()
    tag = uuid.uuid4().hex[:8]
    schema, prefix = f"lg_{tag}", f"lg{tag}."
    dsn = make_conninfo(admin_dsn, options=f"-c search_path={schema}")
    root = Path(tempfile.mkdtemp(prefix="last-green-bench-"))
    worker: Worker | None = None
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        from store.migrations import migrate

        migrate(dsn)
        topics_file = REPO_ROOT / "topics.yaml"
        report = ensure_topics({"bootstrap.servers": bootstrap},
                               load_topics(topics_file, prefix=prefix))
        if not report.ok:
            raise RuntimeError("topics not created")
        log(f"filling schema {schema}: {args.answers:,} answers over {args.projects} "
            f"projects, {args.facts:,} facts")
        filled = fill(dsn, answers=args.answers, facts=args.facts,
                      project_count=args.projects, seed=args.seed)
        log(f"filled: {filled.heads:,} heads, {filled.answers:,} project answers "
            f"({filled.scope_facts:,} built), {filled.facts:,} validation facts")
        reds = sorted(filled.red_share.items(), key=lambda kv: -kv[1])
        log("red share of heads, reddest first: " + ", ".join(
            f"{p} {share:.0%}" for p, share in reds[:6]) + f"; median "
            f"{statistics.median(filled.red_share.values()):.1%}")

        if args.covering:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE INDEX project_answer_green_covering ON project_answer"
                             " (queue, project, request_rank(request_id)) INCLUDE (request_id)"
                             " WHERE degree = 0")
                conn.execute("VACUUM ANALYZE project_answer")
            log("added the covering index project_answer_green_covering")
        queues_file = root / "queues.yaml"
        queues_file.write_text(yaml.safe_dump(queues_yaml(root, args.projects)))
        env = dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=bootstrap,
                   STOVEPIPE_POSTGRES_DSN=dsn, STOVEPIPE_TOPIC_PREFIX=prefix,
                   STOVEPIPE_TOPICS_FILE=str(topics_file),
                   STOVEPIPE_QUEUES_FILE=str(queues_file),
                   STOVEPIPE_APP_ID=f"{prefix}stovepipe", STOVEPIPE_HOME=str(root / "home"),
                   PYTHONPATH=str(REPO_ROOT))
        worker = Worker(root, env)
        worker.wait_ready()

        rng = random.Random(args.seed + 1)
        names = list(profiles(args.projects))
        subsets = [rng.sample(names, args.subset) for _ in range(args.queries)]
        mono_path = f"/api/queues/{quote(MONO, safe='')}/last-green"
        plain_path = f"/api/queues/{quote(PLAIN, safe='')}/last-green"
        for subset in subsets[:10]:  # warm the worker's pool and the caches
            worker.get(f"{mono_path}?projects={','.join(subset)}")
        http_walk, http_mono, http_plain = [], [], []
        for subset in subsets:
            http_walk.append(timed(lambda s=subset: worker.get(  # type: ignore[misc]
                f"{mono_path}?projects={','.join(s)}")))
            http_mono.append(timed(lambda: worker.get(mono_path)))
            http_plain.append(timed(lambda: worker.get(plain_path)))
        walk, mono, plain, steps, behind = asyncio.run(
            store_timings(dsn, subsets, args.queries))

        print()
        print(f"last-green over {args.subset} of {args.projects} projects, "
              f"{filled.answers:,} project answers, {filled.facts:,} facts "
              f"({args.queries} queries, load average {os.getloadavg()[0]:.1f}"
              f"{'; with the covering index' if args.covering else ''})")
        print(figures(f"HTTP  last-green?projects=<{args.subset}>", http_walk))
        print(figures("HTTP  last-green (the queue's bookmark), bench/mono", http_mono))
        print(figures("HTTP  last-green (the queue's bookmark), bench/plain", http_plain))
        print(figures(f"store ProjectAnswerStore.last_green(<{args.subset}>)", walk))
        print(figures("store QueueStore.get (the bookmark), bench/mono", mono))
        print(figures("store QueueStore.get (the bookmark), bench/plain", plain))
        print(f"walk steps: median {statistics.median(steps):g}, max {max(steps)}; "
              f"answers found {len(behind)}/{args.queries}, heads behind the head: "
              f"min {min(behind, default=0)}, median "
              f"{statistics.median(behind) if behind else 0:g}, max {max(behind, default=0)}")
    finally:
        if worker is not None:
            worker.stop()
        if not args.keep:
            with contextlib.suppress(Exception):
                from confluent_kafka.admin import AdminClient

                admin = AdminClient({"bootstrap.servers": bootstrap})
                names_ = [t for t in admin.list_topics(timeout=10).topics
                          if t.startswith(prefix)]
                if names_:
                    for fut in admin.delete_topics(names_, operation_timeout=30).values():
                        with contextlib.suppress(Exception):
                            fut.result(timeout=30)
                for fut in admin.delete_consumer_groups(
                        [f"{prefix}stovepipe", f"{prefix}stovepipe-delay"],
                        request_timeout=15).values():
                    with contextlib.suppress(Exception):
                        fut.result(timeout=15)
            with psycopg.connect(admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        else:
            log(f"kept schema {schema}, topic prefix {prefix}, {root}")


if __name__ == "__main__":
    main()
