"""What showing a monorepo's projects costs (issue 24, "Where people look"): the reads
behind the per-project gauges (`ProjectViewStore.standings`, every worker every sweep
interval) and the dashboard's grid (`streams.web.grid.project_grid`, every open dashboard
every 2 s), on a real PostgreSQL with a queue of P projects and H heads already decided
— each head building one project and every other project inheriting, so the
project_answer table holds P times H rows — and R projects red (each red project's culprit is
read for the grid's cards).

Prints the median and p90 of each read in milliseconds, for each number of projects, and
the grid's size in bytes of JSON.

    python bench/project_views_bench.py [--projects 3 50 200] [--heads 2000] [--red 5]
        [--rounds 40] [--limit 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store import Database
from store.migrations import migrate
from streams.config.queues import Extensions, load_queues
from streams.config.settings import load_settings
from streams.stages.deps import Deps
from streams.web import grid
from streams.web.queries import jsonable
from streams.web.story import StoredDescriptions

QUEUE = "mono/main"

SEED = """
INSERT INTO queue (name, latest_request_id)
VALUES (%(queue)s, 'request/' || %(queue)s || '/' || %(heads)s);
INSERT INTO request (queue, id, uri, state, verdict, kind, attempt)
SELECT %(queue)s, 'request/' || %(queue)s || '/' || n, 'fake://r/main/c' || n, 'succeeded',
       'green', 'head', 1
  FROM generate_series(1, %(heads)s) AS n;
INSERT INTO commit_info (queue, uri, sha, subject, author)
SELECT %(queue)s, 'fake://r/main/c' || n, 'c' || n, 'commit ' || n, 'Ada <ada@example.invalid>'
  FROM generate_series(1, %(heads)s) AS n;
-- each head builds project (n mod P) in its scope, and every other project inherits
INSERT INTO request_plan (queue, request_id, affected, completed)
SELECT %(queue)s, 'request/' || %(queue)s || '/' || n, ARRAY['p' || (n %% %(projects)s)], true
  FROM generate_series(1, %(heads)s) AS n;
INSERT INTO request (queue, id, uri, state, verdict, kind, attempt)
SELECT %(queue)s || '#p' || (n %% %(projects)s),
       'request/' || %(queue)s || '#p' || (n %% %(projects)s) || '/' || n,
       'fake://r/main/c' || n, 'succeeded', 'green', 'head', 1
  FROM generate_series(1, %(heads)s) AS n;
INSERT INTO build (queue, id, request_id, status, verdict)
SELECT %(queue)s || '#p' || (n %% %(projects)s), 'b' || n,
       'request/' || %(queue)s || '#p' || (n %% %(projects)s) || '/' || n, 'succeeded', 'green'
  FROM generate_series(1, %(heads)s) AS n;
INSERT INTO project_answer (queue, request_id, project, uri, degree, inherited,
                            source_request_id, source_uri)
SELECT %(queue)s, 'request/' || %(queue)s || '/' || n, 'p' || p, 'fake://r/main/c' || n,
       CASE WHEN p < %(red)s AND n > %(heads)s / 2 THEN 1 ELSE 0 END,
       (n %% %(projects)s) <> p,
       'request/' || %(queue)s || '#p' || p || '/' || n, 'fake://r/main/c' || n
  FROM generate_series(1, %(heads)s) AS n, generate_series(0, %(projects)s - 1) AS p;
INSERT INTO queue_health (queue, greenness, decided_request_id)
SELECT %(queue)s || '#p' || p, CASE WHEN p < %(red)s THEN 'red' ELSE 'green' END,
       'request/' || %(queue)s || '/' || %(heads)s
  FROM generate_series(0, %(projects)s - 1) AS p;
INSERT INTO greenness_change (queue, at, greenness, request_id)
SELECT %(queue)s || '#p' || p, now() - interval '1 hour',
       CASE WHEN p < %(red)s THEN 'red' ELSE 'green' END,
       'request/' || %(queue)s || '/' || %(heads)s
  FROM generate_series(0, %(projects)s - 1) AS p;
ANALYZE;
"""


def _queues_file(directory: Path, projects: int) -> Path:
    path = directory / "queues.yaml"
    path.write_text(
        f"queues:\n  {QUEUE}:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: main}\n"
        "    build_runner: {kind: fake}\n"
        "    projects:\n"
        + "".join(f"      p{p}: {{paths: ['p{p}/**']}}\n" for p in range(projects)))
    return path


def _figures(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(ordered):7.1f} ms  p90 {p90:7.1f} ms"


async def _measure(dsn: str, projects: int, rounds: int, limit: int,
                   directory: Path) -> tuple[list[float], list[float], int]:
    queues = load_queues(_queues_file(directory, projects))
    names = [f"p{p}" for p in range(projects)]
    async with await Database.open(dsn, max_size=4) as db:
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
        standings, grids, size = [], [], 0
        for _ in range(rounds):
            start = time.perf_counter()
            await db.project_views.standings(QUEUE, names)
            standings.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            answer = await grid.project_grid(deps, QUEUE, limit, StoredDescriptions())
            grids.append((time.perf_counter() - start) * 1000)
            size = len(json.dumps(jsonable(answer)))
    return standings, grids, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--projects", type=int, nargs="+", default=[3, 50, 200])
    parser.add_argument("--heads", type=int, default=2000)
    parser.add_argument("--red", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--limit", type=int, default=grid.DEFAULT_LIMIT)
    args = parser.parse_args()
    base = load_settings().postgres_dsn
    print(f"{args.heads} heads, {args.red} red projects, grid of {args.limit} rows, "
          f"{args.rounds} rounds each")
    for projects in args.projects:
        schema = f"bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            dsn = make_conninfo(base, options=f"-c search_path={schema}")
            migrate(dsn)
            seed = {"queue": QUEUE, "heads": args.heads, "projects": projects,
                    "red": min(args.red, projects)}
            with psycopg.connect(dsn, autocommit=True) as conn:
                for statement in filter(str.strip, SEED.split(";\n")):
                    conn.execute(statement, seed if "%(" in statement else None)
            with tempfile.TemporaryDirectory() as directory:
                standings, grids, size = asyncio.run(
                    _measure(dsn, projects, args.rounds, args.limit, Path(directory)))
            print(f"{projects:4d} projects ({projects * args.heads:7d} answers): "
                  f"standings {_figures(standings)} | grid {_figures(grids)}, "
                  f"{size / 1024:.0f} KiB")
        finally:
            with psycopg.connect(base, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
