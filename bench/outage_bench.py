"""Long outages (design §6, "outages are not message failures"): the broker, PostgreSQL or
the hosted CI down for minutes — 10 by default — while builds run and Requests wait, then
back.

On a throwaway stack of its own (free ports, its own STOVEPIPE_HOME; the shared local
stack is never touched) it starts one worker with its HTTP API, puts work in flight on a
few queues (builds held open by a latch, Requests waiting for the slot behind them),
SIGKILLs the service, lets the builds finish while it is away, tries an HTTP ingest during
the outage, and brings the service back. It prints how long after the return every
Request was terminal, whether every Request ended as its head says (nothing failed by the
outage, nothing dead-lettered or parked), how much the worker's log grew while the
service was away, and the worker's outage retries.

    python bench/outage_bench.py --service kafka --minutes 10
    python bench/outage_bench.py --service postgres --minutes 10
    python bench/outage_bench.py --service ci --minutes 10 [--poll 10]
    python bench/outage_bench.py --service ci --congestion [--builds 8] [--queued 100]
        [--runs 50] [--deadline 120] [--poll SECONDS]

``--service ci``: queues on a Buildkite organization played by a local HTTP server that
implements Buildkite's builds API (tests/hosted_ci.py), their builds running; the API then
answers 503 for the first third of the outage, 429 with ``Retry-After: 20`` for the second
and nothing at all (every request times out) for the last, while the builds finish (most
pass, one fails). It prints every Request's outcome against its build's, how many API calls
each build's poll loop made per minute during the outage (the healthy loop's rate is 60 /
the poll delay), and how long after the API came back every Request was terminal.

``--service ci --congestion`` (issue 23): no outage, a congested CI. ``--builds`` queues on
the same local Buildkite; every build waits ``--queued`` seconds for an agent (``scheduled``)
and then runs ``--runs`` seconds (``running``, Buildkite's ``started_at`` set when it
starts), under ``poll_deadline: --deadline`` — queued longer than the deadline minus its run
time, so a deadline counted from the trigger would end it before it ends. One build fails,
one hangs (runs for ever), the rest pass. Polls at the shipped delays unless ``--poll`` is
given. It prints every Request's outcome against its build's end, how long each build was
queued and ran, the number of red facts on passing builds (must be 0), and the API calls
per build per minute.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store.migrations import migrate
from tests.hosted_ci import FakeBuildkite
from tests.pipeline_support import Pipeline
from tests.stack_support import ThrowawayStack, free_ports
from tests.waiting import wait_until

QUEUES = 4


def _get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _metric(port: int, name: str) -> float:
    status, text = _get(port, "/metrics")
    if status != 200:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", choices=["kafka", "postgres", "ci"], default="kafka")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--poll", type=float, default=None,
                        help="--service ci: the queues' poll delays, seconds (default: 10 "
                             "for an outage, the shipped delays for --congestion)")
    parser.add_argument("--congestion", action="store_true",
                        help="--service ci: a congested CI instead of an outage")
    parser.add_argument("--builds", type=int, default=8,
                        help="--congestion: builds (queues), at least 3")
    parser.add_argument("--queued", type=float, default=100.0,
                        help="--congestion: seconds each build waits for an agent")
    parser.add_argument("--runs", type=float, default=50.0,
                        help="--congestion: seconds each build runs")
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="--congestion: the queues' poll_deadline, seconds")
    args = parser.parse_args()
    if args.congestion and (args.service != "ci" or args.builds < 3):
        parser.error("--congestion needs --service ci and --builds 3 or more")
    outage = args.minutes * 60

    root = Path(tempfile.mkdtemp(prefix="outage-bench-"))
    (root / "stack").mkdir()
    stack = ThrowawayStack(root / "stack")
    pipeline: Pipeline | None = None
    try:
        print(f"starting a throwaway stack under {root} ...", flush=True)
        stack.up()
        schema = f"b_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(stack.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        dsn = make_conninfo(stack.dsn, options=f"-c search_path={schema}")
        migrate(dsn)
        (root / "pipeline").mkdir()
        pipeline = Pipeline(bootstrap=stack.bootstrap, dsn=dsn, prefix="bench.",
                            root=root / "pipeline")
        if args.congestion:
            _ci_congestion(pipeline, root, args)
            return
        if args.service == "ci":
            _ci_outage(pipeline, root, outage, args.poll or 10.0)
            return
        refs = {f"o{i}": pipeline.add_queue(f"o{i}", poll_deadline="1h")
                for i in range(QUEUES)}
        port = free_ports(1)[0]
        pipeline.start_worker(web_port=port)
        wait_until(lambda: _get(port, "/health")[0] == 200, timeout=120, what="the worker")

        for queue, ref in refs.items():
            pipeline.repo.push(ref, f"{queue}-a1-latchO")
            pipeline.ingest(queue)
        wait_until(lambda: sorted(pipeline.states().values()) == ["processing"] * QUEUES,
                   timeout=120, what="every queue building")
        for i, (queue, ref) in enumerate(refs.items()):
            pipeline.repo.push(ref, f"{queue}-a2")
            pipeline.ingest(queue)
            pipeline.repo.push(ref, f"{queue}-a3" + ("-fail" if i % 2 else ""))
            pipeline.ingest(queue)

        retries_before = _metric(port, "stovepipe_outage_retries_total")
        log_before = pipeline.log_bytes()
        print(f"killing {args.service} for {args.minutes:g} min, with {QUEUES} builds in "
              f"flight and {QUEUES} Requests waiting for their slot", flush=True)
        (stack.kill_kafka if args.service == "kafka" else stack.kill_postgres)()
        pipeline.release("O")  # the builds finish while the service is away
        pipeline.repo.push(refs["o0"], "o0-a4")
        status, body = _get(port, "/api/queues/o0/ingest", method="POST")
        print(f"an HTTP ingest during the outage answered {status}: {body[:160]}", flush=True)
        threading.Event().wait(outage)
        log_during = pipeline.log_bytes() - log_before
        stack.up()
        back = time.monotonic()
        pipeline.wait_quiet(timeout=600)
        settled = time.monotonic() - back
        problems = pipeline.exact_outcome_problems()
        states = pipeline.states()
        retries = _metric(port, "stovepipe_outage_retries_total") - retries_before
        print(f"\n{args.service} down {args.minutes:g} min:")
        print(f"  every Request terminal {settled:.1f} s after it was back "
              f"({len(states)} Requests: "
              f"{', '.join(f'{n} {s}' for s, n in _counts(states).items())})")
        print(f"  outcomes as their heads say, nothing dead-lettered or parked: "
              f"{problems or 'yes'}")
        print(f"  invariants at rest: "
              f"{pipeline.invariant_violations(strict_bookmark=True) or 'hold'}")
        print(f"  worker log grew {log_during / 1000:.1f} kB during the outage "
              f"({log_during / outage:.0f} B/s); handler calls retried in place: "
              f"{retries:.0f}")
    finally:
        # whatever happened: no worker, broker or database outlives the bench
        if pipeline is not None:
            pipeline.stop_workers()
        stack.teardown()
        shutil.rmtree(root, ignore_errors=True)


CI_TOKEN = "bkua_bench-T0KEN"
CI_TOKEN_ENV = "STOVEPIPE_BENCH_BUILDKITE_TOKEN"
CI_QUEUES = 6


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=b", "-c", "user.email=b@b.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _ci_outage(pipeline: Pipeline, root: Path, outage: float, poll: float) -> None:
    """The hosted CI down for ``outage`` seconds while every queue's build runs."""
    fake = FakeBuildkite(CI_TOKEN)
    with fake.in_thread():
        repos = _ci_repos(root, CI_QUEUES, "ci")
        shas = {queue: sha for queue, (_, sha) in repos.items()}
        for queue, (work, _) in repos.items():
            pipeline.add_raw_queue(queue, {
                "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
                "build_runner": {"kind": "buildkite", "organization": "acme",
                                 "pipeline": "monorepo", "token_env": CI_TOKEN_ENV,
                                 "api_url": fake.url, "request_timeout": "5s"},
                "poll_delay_queued": f"{poll:g}s", "poll_delay_running": f"{poll:g}s",
                "poll_deadline": f"{outage + 3600:.0f}s"})
        port = free_ports(1)[0]
        pipeline.start_worker(web_port=port, env={CI_TOKEN_ENV: CI_TOKEN})
        wait_until(lambda: _get(port, "/health")[0] == 200, timeout=120, what="the worker")
        ids = {q: pipeline.ingest(q) for q in shas}

        def number(sha: str) -> int:
            builds = fake.builds_of(sha)
            return int(builds[0]["number"]) if builds else 0

        wait_until(lambda: all(number(s) for s in shas.values()), timeout=120,
                   what="a build of every head")
        numbers = {q: number(s) for q, s in shas.items()}
        for n in numbers.values():
            fake.set_state(n, "running")
        wait_until(lambda: pipeline.query("SELECT count(*) FROM build WHERE status"
                                          " = 'running'") == [(CI_QUEUES,)],
                   timeout=120, what="every build seen running")
        red = "ci0"
        expected = {ids[q]: ("failed" if q == red else "succeeded") for q in shas}
        print(f"the CI down for {outage / 60:g} min (503, then 429 Retry-After: 20, then "
              f"timeouts), {CI_QUEUES} builds running, polled every {poll:g}s", flush=True)
        phases = [("503", 503, {}, False), ("429", 429, {"Retry-After": "20"}, False),
                  ("timeouts", 0, {}, True)]
        began = time.time()
        bounds = []
        for i, (name, status, headers, hang) in enumerate(phases):
            start = time.time()
            fake.go_down(status or 503, headers=headers, hang=hang)
            if i == 1:  # the builds end during the outage, unseen
                for q, n in numbers.items():
                    fake.set_state(n, "failed" if q == red else "passed")
            threading.Event().wait(outage / len(phases))
            bounds.append((name, start, time.time()))
        ended = time.time()
        fake.come_back()
        back = time.monotonic()
        pipeline.wait_quiet(timeout=900)
        settled = time.monotonic() - back

        # every GET is a poll: one build asked alone (…/builds/N) or a pipeline's list
        # of builds (…/builds: batched polls, one call for all its running builds)
        polls = [s.at for s in fake.requests("GET")]
        states = pipeline.states()
        exact = {rid: (states.get(rid), want) for rid, want in expected.items()
                 if states.get(rid) != want}
        print(f"\nthe CI down {outage / 60:g} min:")
        print(f"  every Request ended as its build: {exact or 'yes'} ({len(states)} Requests:"
              f" {', '.join(f'{n} {s}' for s, n in _counts(states).items())}); dead "
              f"letters {pipeline.dead_letters()}, parked "
              f"{pipeline.query('SELECT count(*) FROM parked_message')[0][0]}")
        print(f"  healthy: {60 / poll:.1f} calls per build per minute polling each build, "
              f"{60 / poll / CI_QUEUES:.1f} with batched polls (one list call per pipeline "
              f"per {poll:g}s for its {CI_QUEUES} builds)")
        for name, start, stop in [("whole outage", began, ended), *bounds]:
            minutes = (stop - start) / 60
            calls = sum(1 for at in polls if start <= at <= stop)
            per_minute = [sum(1 for at in polls if m <= at < m + 60) / CI_QUEUES
                          for m in _minutes(start, stop)]
            print(f"  API calls per build per minute, {name}: {calls / CI_QUEUES / minutes:.2f}"
                  f" ({calls} GETs), the busiest minute {max(per_minute, default=0):.2f}")
        print(f"  every Request terminal {settled:.1f}s after the CI came back")
        print(f"  builds triggered: {len(fake.requests('POST'))} (one per Request: "
              f"{CI_QUEUES})")


def _ci_repos(root: Path, count: int, prefix: str) -> dict[str, tuple[Path, str]]:
    """``count`` git repositories of one commit each: queue name -> (path, head sha)."""
    repos = {}
    for n in range(count):
        work = root / f"repo-{prefix}{n}"
        work.mkdir()
        _git(work, "init", "-q")
        (work / "app.txt").write_text(f"{n}\n")
        _git(work, "add", "app.txt")
        _git(work, "commit", "-q", "-m", f"c{n}")
        repos[f"{prefix}{n}"] = (work, _git(work, "rev-parse", "HEAD"))
    return repos


def _ci_congestion(pipeline: Pipeline, root: Path, args: argparse.Namespace) -> None:
    """Builds queued for an agent longer than their poll deadline minus their run time."""
    queued, runs, deadline = args.queued, args.runs, args.deadline
    fake = FakeBuildkite(CI_TOKEN)
    fake.plan_new_builds(queued=queued, runs=runs)
    delays = ({"poll_delay_queued": f"{args.poll:g}s", "poll_delay_running": f"{args.poll:g}s"}
              if args.poll else {})
    with fake.in_thread():
        repos = _ci_repos(root, args.builds, "cg")
        for queue, (work, _) in repos.items():
            pipeline.add_raw_queue(queue, {
                "source_control": {"kind": "git", "repository": str(work), "ref": "main"},
                "build_runner": {"kind": "buildkite", "organization": "acme",
                                 "pipeline": "monorepo", "token_env": CI_TOKEN_ENV,
                                 "api_url": fake.url},
                "poll_deadline": f"{deadline:g}s", "retry": {"unvalidated": 0}, **delays})
        port = free_ports(1)[0]
        pipeline.start_worker(web_port=port, env={CI_TOKEN_ENV: CI_TOKEN})
        wait_until(lambda: _get(port, "/health")[0] == 200, timeout=120, what="the worker")
        print(f"{args.builds} builds, each queued {queued:g}s for an agent then running "
              f"{runs:g}s, poll_deadline {deadline:g}s, polls "
              f"{f'every {args.poll:g}s' if args.poll else 'at the shipped delays'}",
              flush=True)
        began = time.time()
        ids = {q: pipeline.ingest(q) for q in repos}

        def number(sha: str) -> int:
            builds = fake.builds_of(sha)
            return int(builds[0]["number"]) if builds else 0

        wait_until(lambda: all(number(sha) for _, sha in repos.values()), timeout=120,
                   what="a build of every head")
        numbers = {q: number(sha) for q, (_, sha) in repos.items()}
        ends = {q: "passes" for q in repos}
        ends["cg0"], ends["cg1"] = "fails", "hangs"
        fake.plan(numbers["cg0"], queued=queued, runs=runs, ends="failed")
        fake.plan(numbers["cg1"], queued=queued, runs=10 ** 9)  # runs for ever
        pipeline.wait_quiet(timeout=queued + deadline + 900)
        ended = time.time()

    wanted = {"passes": ("succeeded", "green"), "fails": ("failed", "red"),
              "hangs": ("failed", "red")}
    rows = {rid: (state, verdict, reason) for rid, state, verdict, reason in pipeline.query(
        "SELECT id, state, verdict, reason FROM request")}
    timing = {rid: (q, r) for rid, q, r in pipeline.query(
        "SELECT request_id, EXTRACT(EPOCH FROM started_at - created_at)::float8,"
        " EXTRACT(EPOCH FROM updated_at - started_at)::float8 FROM build")}
    facts = dict(pipeline.query("SELECT request_id, degree FROM validation_fact"))
    print(f"\n{'queue':6} {'build':7} {'queued':>7} {'ran':>7}  outcome")
    wrong = []
    for queue, rid in ids.items():
        state, verdict, reason = rows[rid]
        was_queued, ran = timing.get(rid, (None, None))
        ok = (state, verdict) == wanted[ends[queue]]
        wrong += [] if ok else [rid]
        print(f"{queue:6} {ends[queue]:7} {_secs(was_queued):>7} {_secs(ran):>7}  {state} "
              f"{verdict or '(no verdict)'}{'' if ok else '  <- NOT AS ITS BUILD ENDED'}"
              f"{'  (' + reason[:70] + ')' if reason and verdict != 'green' else ''}")
    passing = [ids[q] for q, e in ends.items() if e == "passes"]
    red_on_passing = sum(1 for rid in passing if facts.get(rid) == 1)
    polls = [s.at for s in fake.requests("GET")]
    minutes = (ended - began) / 60
    per_minute = [sum(1 for at in polls if m <= at < m + 60) / args.builds
                  for m in _minutes(began, ended)]
    print(f"\nevery Request ended as its build ended: {wrong or 'yes'} "
          f"({', '.join(f'{n} {s}' for s, n in _counts(pipeline.states()).items())})")
    print(f"red facts on passing builds: {red_on_passing} of {len(passing)}")
    print(f"API calls per build per minute: {len(polls) / args.builds / minutes:.2f} "
          f"({len(polls)} GETs in {minutes:.1f} min for {args.builds} builds), the busiest "
          f"minute {max(per_minute, default=0):.2f}; triggers {len(fake.requests('POST'))}, "
          f"cancels {len(fake.requests('PUT'))}")


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}s"


def _minutes(start: float, stop: float) -> list[float]:
    """The starts of the whole minutes from ``start`` that end by ``stop`` (at least one)."""
    count = max(int((stop - start) // 60), 1)
    return [start + 60 * m for m in range(count)]


def _counts(states: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states.values():
        out[state] = out.get(state, 0) + 1
    return out


if __name__ == "__main__":
    main()
