"""What one Request costs the database: at most 12 round trips from ingest to its fact
(issue 10), counted on the wire — libpq's protocol trace of every pooled connection, one
round trip per Sync or simple Query the client sends — while the real stage handlers take
one Request through ingest, process, build, buildsignal and record."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from contract import BuildRequest, BuildSignal, ProcessRequest, Record
from store import Database
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol.fake import FakeRepo
from streams.runtime import ACK
from streams.runtime.stage import Context, Incoming
from streams.stages import build, buildsignal, process, record
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_queue

pytestmark = pytest.mark.postgres

MAX_ROUND_TRIPS = 12
HANDLERS: dict[str, Any] = {
    "process": (ProcessRequest, process.handle_process),
    "build": (BuildRequest, build.handle_build),
    "buildsignal": (BuildSignal, buildsignal.handle_buildsignal),
    "record": (Record, record.handle_record),
}


class Wire:
    """Round trips of every connection of a pool, read from libpq's trace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: list[Path] = []

    async def configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        path = self.root / f"conn{len(self.files)}.trace"
        self.files.append(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)

    def round_trips(self) -> int:
        count = 0
        for path in self.files:
            for line in path.read_text().splitlines():
                direction, _, kind = ([*line.split("\t"), "", ""])[:3]
                if direction == "F" and kind.split(" ")[0] in ("Sync", "Query"):
                    count += 1
        return count


def test_one_request_costs_at_most_twelve_round_trips(migrated_dsn: str,
                                                       tmp_path: Path) -> None:
    repo = FakeRepo(tmp_path / "repo.json")
    (tmp_path / "queues.yaml").write_text(
        "queues:\n  q:\n    source_control: {kind: fake, path: repo.json, repo: r, ref: main,"
        " promotion_ref: verified}\n"
        "    build_runner: {kind: fake}\n")
    queues = load_queues(tmp_path / "queues.yaml")

    async def run() -> list[int]:
        wire = Wire(Path(tempfile.mkdtemp(dir=tmp_path)))
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            migrated_dsn, min_size=1, max_size=1, kwargs={"autocommit": True},
            configure=wire.configure, open=False)
        await pool.open(wait=True)
        db = Database(pool)
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
        costs = []
        try:
            for n in range(1, 4):  # the first, and steady state after a green bookmark
                repo.push("main", f"c{n}")
                outbox: list[tuple[str, Any]] = []

                async def publish(key: str, payload: Any, outbox: list[Any] = outbox) -> None:
                    outbox.append((key, payload))

                before = wire.round_trips()
                request_id = await ingest_queue(deps, "q", publish)
                offset = 0
                while outbox:
                    key, payload = outbox.pop(0)
                    _, handle = HANDLERS[key]
                    offset += 1
                    ctx = Context(stage=key, message=Incoming(
                        topic=key, partition=0, offset=offset, key=None, value=None,
                        headers=[]), publish=publish, deps=deps,
                        log=logging.LoggerAdapter(logging.getLogger("test"), {}))
                    assert await handle(payload, ctx) is ACK, (key, payload)
                costs.append(wire.round_trips() - before)
                assert (await db.requests.get("q", request_id)).state.value == "succeeded"
                assert (await db.queues.get("q")).last_green_request_id == request_id
        finally:
            await pool.close()
        return costs

    costs = asyncio.run(run())
    assert repo.promoted("verified") == "c3"
    assert all(cost <= MAX_ROUND_TRIPS for cost in costs), costs
