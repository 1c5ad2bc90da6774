"""Long outages (design §6, "outages are not message failures"): the broker or PostgreSQL
down for minutes — 10 by default — while builds run and Requests wait, then back.

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
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--service", choices=["kafka", "postgres"], default="kafka")
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    outage = args.minutes * 60

    root = Path(tempfile.mkdtemp(prefix="outage-bench-"))
    (root / "stack").mkdir()
    stack = ThrowawayStack(root / "stack")
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
        pipeline.stop_workers()
    finally:
        stack.teardown()


def _counts(states: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states.values():
        out[state] = out.get(state, 0) + 1
    return out


if __name__ == "__main__":
    main()
