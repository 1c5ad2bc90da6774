"""The outbox of commit statuses and alerts, on the real database (migration 0006): what
the pipeline's statements write into it, the queue's greenness transitions, staleness,
and the lag the gauges show. Driven through the store and the real ingest, without Kafka.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from store import BuildStatus, BuildStrategy, Database, Request, RequestState
from store.notifications import StaleRule
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol.fake import FakeRepo
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_queue
from tests.waiting import wait_until_async

pytestmark = pytest.mark.postgres

ALERTS = ["webhook", "slack"]
STATUSES = ["github_status"]


async def _sink(key: str, payload: Any) -> None:
    """Publishes go nowhere: the stages' statements are driven by hand here."""


class Queue:
    """A fake repository and a queue over it, with Requests settled by hand."""

    def __init__(self, deps: Deps, repo: FakeRepo, name: str) -> None:
        self.deps, self.repo, self.name = deps, repo, name
        self.db: Database = deps.db

    async def head(self, sha: str) -> Request:
        self.repo.push(f"{self.name}-main", sha)
        request_id = await ingest_queue(self.deps, self.name, _sink)
        return await self.db.requests.get(self.name, request_id)

    async def settled(self, sha: str, outcome: RequestState) -> Request:
        """A head whose build ended with ``outcome`` (what process and buildsignal do)."""
        request = await self.head(sha)
        async with self.db.transaction() as tx:
            await tx.queues.take_slot(await tx.queues.get(self.name))
            request = await tx.requests.transition(request, RequestState.PROCESSING,
                                                   strategy=BuildStrategy.FULL)
        async with self.db.transaction() as tx:
            await tx.queues.release_slot(await tx.queues.get(self.name))
            return await tx.requests.transition(request, outcome)

    async def record(self, request: Request) -> None:
        degree = 0.0 if request.state is RequestState.SUCCEEDED else 1.0
        await self.db.steps.record_fact(self.name, request.uri, request_id=request.id,
                                        degree=degree, status_channels=STATUSES,
                                        alert_channels=ALERTS)

    async def rows(self, prefix: str = "") -> list[tuple[str, dict[str, Any]]]:
        return [(n.key, n.event) for n in await self.db.notifications.list_for_queue(self.name)
                if n.key.startswith(prefix)]


def _run(tmp_path: Path, dsn: str, names: list[str],
         body: Callable[..., Awaitable[None]]) -> None:
    repo = FakeRepo(tmp_path / "repo.json")
    (tmp_path / "queues.yaml").write_text("queues:\n" + "".join(
        f"  {n}:\n    source_control: {{kind: fake, path: repo.json, repo: r, ref: {n}-main}}\n"
        f"    build_runner: {{kind: fake}}\n" for n in names))
    queues = load_queues(tmp_path / "queues.yaml")

    async def run() -> None:
        async with await Database.open(dsn, max_size=4) as db:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            await body(*(Queue(deps, repo, n) for n in names))

    asyncio.run(run())


def _alert(event: str, queue: str, request: Request, previous: str | None) -> dict[str, Any]:
    return {"kind": "alert", "event": event, "queue": queue, "request_id": request.id,
            "uri": request.uri, "previous": previous, "flaky": False, "attempts": 1}


def test_greenness_transitions_alert_once_each(migrated_dsn: str, tmp_path: Path) -> None:
    async def body(q: Queue, first_red: Queue) -> None:
        r1 = await q.settled("c1", RequestState.SUCCEEDED)
        await q.record(r1)
        assert await q.rows("alert:") == []  # unknown -> green: nothing to say
        r2 = await q.settled("c2-fail", RequestState.FAILED)
        await q.record(r2)
        r3 = await q.settled("c3-fail", RequestState.FAILED)
        await q.record(r3)  # red -> red: nothing
        await q.record(r3)  # a redelivery: nothing
        await q.record(r2)
        r4 = await q.settled("c4-fail", RequestState.FAILED)
        r5 = await q.settled("c5", RequestState.SUCCEEDED)
        await q.record(r5)  # red -> green
        await q.record(r4)  # an older commit's fact, recorded late: greenness stays green
        alerts = await q.rows("alert:")
        assert [key for key, _ in alerts] == [
            "alert:webhook:greenness:2", "alert:slack:greenness:2",
            "alert:webhook:greenness:3", "alert:slack:greenness:3"]
        for (_, event), expected in zip(alerts, [
                _alert("red", "q", r2, "green"), _alert("red", "q", r2, "green"),
                _alert("green", "q", r5, "red"), _alert("green", "q", r5, "red")], strict=True):
            assert {k: v for k, v in event.items() if k != "at"} == expected
        # every fact got its Request's one final status, whatever the redeliveries
        finals = {key: event["state"] for key, event in await q.rows("status:")}
        assert finals == {f"status:github_status:{r.id}:final": state for r, state in [
            (r1, "success"), (r2, "failure"), (r3, "failure"), (r4, "failure"),
            (r5, "success")]}
        assert (await q.db.queues.get("q")).last_green_request_id == r5.id

        r1 = await first_red.settled("x1-fail", RequestState.FAILED)
        await first_red.record(r1)  # unknown -> red: a queue that starts red alerts
        assert [event["previous"] for _, event in await first_red.rows("alert:")] \
            == [None, None]

    _run(tmp_path, migrated_dsn, ["q", "first_red"], body)


def test_admission_and_cancellation_write_statuses(migrated_dsn: str, tmp_path: Path) -> None:
    async def body(q: Queue) -> None:
        request = await q.head("c1")
        admitted = await q.db.steps.admit(request, strategy=BuildStrategy.FULL,
                                          base_uri=None, max_concurrent=1,
                                          last_green_request_id=None,
                                          status_channels=STATUSES)
        assert admitted is not None and admitted.state is RequestState.PROCESSING
        assert [(k, e["state"], e["uri"]) for k, e in await q.rows()] == [
            (f"status:github_status:{request.id}:pending", "pending", request.uri)]
        build = await q.db.builds.create(q.name, "b1", request.id)
        settled = await q.db.steps.settle(build, BuildStatus.CANCELLED, STATUSES)
        assert settled.request is not None
        assert settled.request.state is RequestState.CANCELLED
        again = await q.db.steps.settle(build, BuildStatus.CANCELLED, STATUSES)
        assert again.request is None
        rows = await q.rows()
        assert [(k, e["state"], e.get("description")) for k, e in rows] == [
            (f"status:github_status:{request.id}:pending", "pending", None),
            (f"status:github_status:{request.id}:final", "error",
             "its build was cancelled")]

    _run(tmp_path, migrated_dsn, ["q"], body)


def test_a_reconciled_request_s_status_is_written(migrated_dsn: str, tmp_path: Path) -> None:
    """A reconciler that fails an admitted Request sets its commit's status to `error`
    (once), so the commit does not stay `pending`."""
    async def body(q: Queue) -> None:
        request = await q.head("c1")
        for _ in range(2):
            await q.db.notifications.add_status(
                q.name, request.id, request.uri, state="error",
                description="could not be validated: its build step failed for good",
                channels=STATUSES)
        assert [(k, e["state"], e["uri"], e["description"]) for k, e in await q.rows()] == [
            (f"status:github_status:{request.id}:final", "error", request.uri,
             "could not be validated: its build step failed for good")]

    _run(tmp_path, migrated_dsn, ["q"], body)


async def _db_age(db: Database, request: Request) -> float:
    async with db.pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT EXTRACT(EPOCH FROM now() - created_at)::float8 FROM validation_fact"
            " WHERE queue = %s AND request_id = %s", (request.queue, request.id))
        row = await cursor.fetchone()
        assert row is not None
        return float(row[0])


def test_stale_once_per_bookmark_and_reset_when_it_moves(migrated_dsn: str,
                                                         tmp_path: Path) -> None:
    threshold = 1.0
    rule = [StaleRule("q", threshold, ALERTS)]

    async def body(q: Queue) -> None:
        notifications = q.db.notifications
        r1 = await q.settled("c1", RequestState.SUCCEEDED)
        await q.record(r1)
        assert await notifications.judge_staleness(rule) == (0, 0)  # no newer head
        # a quiet branch: the bookmark grows older than the threshold with nothing newer
        await wait_until_async(lambda: _older(q, r1, threshold * 1.5), within=30,
                               what="the bookmark to age")
        assert await notifications.judge_staleness(rule) == (0, 0)
        r2 = await q.head("c2")  # a new head: behind from now on, not since the bookmark
        assert await notifications.judge_staleness(rule) == (0, 0)
        lag = (await notifications.lags(["q"]))[0]
        assert lag.heads_since_green == 1 and lag.bookmark_age is not None \
            and lag.bookmark_age >= threshold * 1.5

        async def went_stale() -> bool:
            return (await notifications.judge_staleness(rule))[0] == 1

        await wait_until_async(went_stale, within=30, what="the queue to go stale")
        await q.head("c3")  # another newer head changes nothing
        for _ in range(5):  # judges again (every worker, every round): nothing more
            assert await notifications.judge_staleness(rule) == (0, 0)
        stale = await q.rows("alert:")
        assert sorted(key for key, _ in stale) == ["alert:slack:stale:1",
                                                   "alert:webhook:stale:1"]
        event = stale[0][1]
        assert (event["event"], event["request_id"], event["uri"], event["latest_request_id"]) \
            == ("stale", r1.id, r1.uri, r2.id)  # the newest head when it went stale

        # the bookmark moves: fresh again, and the clock restarts from the new green fact
        await _green(q, r2)
        assert await notifications.judge_staleness(rule) == (0, 1)
        await wait_until_async(went_stale, within=30,
                               what="the queue to go stale again behind its new bookmark")
        assert sorted(key for key, _ in await q.rows("alert:"))[2:] == [
            "alert:webhook:stale:1", "alert:webhook:stale:2"]
        assert len(await q.rows("alert:")) == 4
        assert (await notifications.lags(["q"]))[0].heads_since_green == 1

    _run(tmp_path, migrated_dsn, ["q"], body)


async def _older(q: Queue, request: Request, seconds: float) -> bool:
    return await _db_age(q.db, request) > seconds


async def _green(q: Queue, request: Request) -> None:
    """Settle an `accepted` Request green and record its fact."""
    async with q.db.transaction() as tx:
        await tx.queues.take_slot(await tx.queues.get(q.name))
        request = await tx.requests.transition(request, RequestState.PROCESSING,
                                               strategy=BuildStrategy.FULL)
    async with q.db.transaction() as tx:
        await tx.queues.release_slot(await tx.queues.get(q.name))
        request = await tx.requests.transition(request, RequestState.SUCCEEDED)
    await q.record(request)


def test_notifications_cost_no_round_trip(migrated_dsn: str, tmp_path: Path) -> None:
    """A queue with every channel configured costs a Request exactly the round trips a
    queue without any does: the outbox rows ride in the statements the Request makes
    anyway (tests/test_round_trips.py counts those)."""
    import logging
    import tempfile

    from psycopg_pool import AsyncConnectionPool

    from streams.runtime import ACK
    from streams.runtime.stage import Context, Incoming
    from tests.test_round_trips import HANDLERS, Wire

    repo = FakeRepo(tmp_path / "repo.json")
    notify = ("    notify: {github_status: {repository: a/b, token_env: T},"
              " webhook: {url_env: W}, slack: {url_env: S}, stale_after: 1h}\n")
    (tmp_path / "queues.yaml").write_text("queues:\n" + "".join(
        f"  {n}:\n    source_control: {{kind: fake, path: repo.json, repo: r, ref: {n}-main,"
        f" promotion_ref: {n}-verified}}\n    build_runner: {{kind: fake}}\n"
        + (notify if n == "loud" else "") for n in ("quiet", "loud")))
    queues = load_queues(tmp_path / "queues.yaml")

    async def run() -> dict[str, list[int]]:
        wire = Wire(Path(tempfile.mkdtemp(dir=tmp_path)))
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            migrated_dsn, min_size=1, max_size=1,
            # statements are never prepared here: psycopg prepares one on its sixth run,
            # which would land on whichever queue's Request happens to run it
            kwargs={"autocommit": True, "prepare_threshold": None},
            configure=wire.configure, open=False)
        await pool.open(wait=True)
        db = Database(pool)
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
        costs: dict[str, list[int]] = {"quiet": [], "loud": []}
        try:
            for n, sha in enumerate(("c1", "c2-fail", "c3", "c4"), start=1):
                for queue in costs:
                    repo.push(f"{queue}-main", f"{queue}-{sha}")
                    outbox: list[tuple[str, Any]] = []

                    async def publish(key: str, payload: Any,
                                      outbox: list[Any] = outbox) -> None:
                        outbox.append((key, payload))

                    before = wire.round_trips()
                    await ingest_queue(deps, queue, publish)
                    while outbox:
                        key, payload = outbox.pop(0)
                        ctx = Context(stage=key, message=Incoming(
                            topic=key, partition=0, offset=n, key=None, value=None,
                            headers=[]), publish=publish, deps=deps,
                            log=logging.LoggerAdapter(logging.getLogger("test"), {}))
                        assert await HANDLERS[key][1](payload, ctx) is ACK
                    costs[queue].append(wire.round_trips() - before)
            rows = await deps.db.notifications.list_for_queue("loud")
            assert len([r for r in rows if r.key.startswith("status:")]) == 8
            assert [r.key for r in rows if r.key.startswith("alert:")] == [
                "alert:webhook:greenness:2", "alert:slack:greenness:2",
                "alert:webhook:greenness:3", "alert:slack:greenness:3"]
            assert await deps.db.notifications.list_for_queue("quiet") == []
        finally:
            await pool.close()
        return costs

    costs = asyncio.run(run())
    assert costs["loud"] == costs["quiet"], costs
