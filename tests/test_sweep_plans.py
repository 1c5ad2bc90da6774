"""The sweeper's queries read live rows only, never a scan of history (design §6,
Liveness): with 20,000 terminal Requests and builds in the tables, each query the sweeper
runs reads its table through the live-rows partial index and does no sequential scan,
counted by PostgreSQL itself (pg_stat_xact_user_tables, inside one transaction)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from store import Database, Transaction

pytestmark = pytest.mark.postgres

HISTORY = 20_000
_SCANS = ("SELECT relname, seq_scan, idx_scan FROM pg_stat_xact_user_tables"
          " WHERE schemaname = current_schema() AND relname IN ('request', 'build')")


def _fill_history(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO queue (name) SELECT 'q' || g FROM generate_series(1, 100) g")
        conn.execute(
            "INSERT INTO request (queue, id, uri, state, build_strategy, version,"
            "                     created_at, updated_at, attempt, verdict, recorded)"
            " SELECT 'q' || (g %% 100 + 1), 'request/q' || (g %% 100 + 1) || '/' || g,"
            "        'fake://r/' || g, CASE WHEN g %% 2 = 0 THEN 'succeeded' ELSE 'failed' END,"
            "        'full', 3, now() - interval '2 days', now() - interval '2 days', 1,"
            "        CASE WHEN g %% 2 = 0 THEN 'green' ELSE 'red' END, true"
            " FROM generate_series(1, %s) g", (HISTORY,))
        conn.execute(
            "INSERT INTO build (queue, id, request_id, status, verdict, created_at,"
            "                   updated_at)"
            " SELECT queue, 'b-' || id, id, CASE WHEN state = 'succeeded' THEN 'succeeded'"
            "        ELSE 'failed' END, verdict, created_at, updated_at FROM request")
        # a few live rows, long unseen, so each query has something to find
        conn.execute(
            "INSERT INTO request (queue, id, uri, state, build_strategy, attempt, verdict,"
            "                     recorded) VALUES"
            " ('q1', 'request/q1/a', 'fake://r/a', 'accepted', NULL, 0, NULL, false),"
            " ('q2', 'request/q2/p', 'fake://r/p', 'processing', 'full', 1, NULL, false),"
            " ('q3', 'request/q3/b', 'fake://r/b', 'processing', 'full', 1, NULL, false),"
            " ('q4', 'request/q4/u', 'fake://r/u', 'succeeded', 'full', 1, 'green', false)")
        conn.execute("INSERT INTO build (queue, id, request_id, status)"
                     " VALUES ('q3', 'b-live', 'request/q3/b', 'running')")
        conn.execute("UPDATE request SET loop_seen_at = now() - interval '1 hour',"
                     " updated_at = now() - interval '1 hour'"
                     " WHERE state IN ('accepted', 'processing') OR NOT recorded")
        conn.execute("UPDATE build SET loop_seen_at = now() - interval '1 hour'"
                     " WHERE status IN ('accepted', 'running')")
        conn.execute("ANALYZE request")
        conn.execute("ANALYZE build")


def _scans_of(dsn: str, query: Callable[[Transaction], Awaitable[list[Any]]]
              ) -> tuple[list[Any], dict[str, tuple[int, int]]]:
    async def main() -> tuple[list[Any], dict[str, tuple[int, int]]]:
        async with await Database.open(dsn) as db, db.transaction() as tx:
            found = await query(tx)
            rows = await (await tx.connection.execute(_SCANS)).fetchall()
            return found, {name: (seq, idx) for name, seq, idx in rows}

    return asyncio.run(main())


@pytest.mark.parametrize("what, query, table, expected", [
    ("accepted, unseen", lambda tx: tx.requests.list_unseen_accepted(5, 100),
     "request", ["request/q1/a"]),
    ("processing without a build", lambda tx: tx.requests.list_processing_without_build(5, 100),
     "request", ["request/q2/p"]),
    ("live builds, unseen", lambda tx: tx.builds.list_unseen_live(5, 100),
     "build", ["b-live"]),
    ("verdicts without a fact", lambda tx: tx.requests.list_unrecorded(5, 100),
     "request", ["request/q4/u"]),
])
def test_each_sweep_query_reads_live_rows_only(migrated_dsn: str, what: str, query: Any,
                                               table: str, expected: list[str]) -> None:
    _fill_history(migrated_dsn)
    found, scans = _scans_of(migrated_dsn, query)
    ids = sorted(item[0].id if isinstance(item, tuple) else item.id for item in found)
    assert ids == expected, what
    seq, idx = scans.get(table, (0, 0))
    assert (seq, idx >= 1) == (0, True), f"{what}: {table} seq scans {seq}, index scans {idx}"
    assert all(s == 0 for s, _ in scans.values()), f"{what}: a sequential scan: {scans}"
