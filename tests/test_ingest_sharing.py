"""Ingests of one queue in a worker share head resolutions (`Coalesced`): the ingests that
share a resolve get its Request, but only the ingest that ran it may say it minted one —
a webhook answers 201 for a new Request once, 200 for every other push of that head. Real
PostgreSQL; the fake repository's resolve held by a latch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from store import Database
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol import SourceControl, SourceControlError
from streams.extensions.sourcecontrol.fake import FakeRepo
from streams.stages.deps import Deps
from streams.stages.ingest import Ingested, ingest_head
from tests.waiting import wait_until_async

pytestmark = pytest.mark.postgres

LATE = 5  # ingests arriving while the first resolve runs


class HeldResolve:
    """The queue's source control, whose resolves wait for ``release`` and whose first
    resolve fails (the repository refused it) when ``fail_first``."""

    def __init__(self, inner: SourceControl, *, fail_first: bool) -> None:
        self.inner, self.fail_first = inner, fail_first
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.resolves = 0

    async def head(self) -> str:
        self.resolves += 1
        self.started.set()
        await self.release.wait()
        if self.fail_first and self.resolves == 1:
            raise SourceControlError("the repository refused the first resolve")
        return await self.inner.head()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("fail_first", [False, True])
def test_only_the_ingest_that_ran_a_shared_resolve_minted(
        migrated_dsn: str, tmp_path: Path, fail_first: bool) -> None:
    repo = FakeRepo(tmp_path / "repo.json")
    (tmp_path / "queues.yaml").write_text(
        "queues:\n  q:\n    source_control: {kind: fake, path: repo.json, repo: r, ref: main}\n"
        "    build_runner: {kind: fake}\n")
    queues = load_queues(tmp_path / "queues.yaml")

    async def run() -> list[Ingested | BaseException]:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            migrated_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False)
        await pool.open(wait=True)
        try:
            db = Database(pool)
            extensions = Extensions(queues, db)
            held = HeldResolve(extensions.source_control("q"), fail_first=fail_first)
            arrivals = 0

            def arrive(queue: str) -> HeldResolve:
                # called as an ingest enters the shared resolve, in the same step
                nonlocal arrivals
                arrivals += 1
                return held

            extensions.source_control = arrive  # type: ignore[method-assign]
            deps = Deps(db=db, queues=queues, extensions=extensions)
            repo.push("main", "c1")

            async def publish(key: str, payload: Any) -> None:
                pass

            first = asyncio.create_task(ingest_head(deps, "q", publish))
            await held.started.wait()
            late = [asyncio.create_task(ingest_head(deps, "q", publish))
                    for _ in range(LATE)]

            async def all_waiting() -> bool:
                return arrivals == 1 + LATE

            await wait_until_async(all_waiting, within=10, what="every late ingest waiting")
            held.release.set()
            results = await asyncio.gather(first, *late, return_exceptions=True)
            assert held.resolves == 2  # the first, then one shared by every late ingest
            return results
        finally:
            await pool.close()

    first, *late = asyncio.run(run())
    if fail_first:
        assert isinstance(first, SourceControlError)
        assert all(isinstance(i, Ingested) for i in late), late
        # one of the late ingests ran the second resolve and minted; the others shared it
        assert sorted(i.new for i in late) == [False] * (LATE - 1) + [True]  # type: ignore[union-attr]
    else:
        assert isinstance(first, Ingested) and first.new
        assert all(isinstance(i, Ingested) and not i.new for i in late), late
    ids = {i.request_id for i in (first, *late) if isinstance(i, Ingested)}
    assert ids == {"request/q/1"}
