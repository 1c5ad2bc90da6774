"""CommandBuildStore on the real database: the trigger key deduplicates across hosts, the
row keeps the head commit it builds, the owner's record and another host's "lost"
verdict are compare-and-sets where the first decides, and a terminal status is
write-once even for a hand-written UPDATE."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from store import Database
from store.command_builds import Observation
from store.entities import BuildStatus

pytestmark = pytest.mark.postgres

RUNNING = Observation(BuildStatus.RUNNING, "running", pid=41, pgid=41, proc_start_time=7,
                      log_tail="step one\n")


def test_the_first_to_decide_a_build_decides_it(migrated_dsn: str) -> None:
    async def run() -> None:
        async with await Database.open(migrated_dsn, max_size=2) as db:
            rows = db.command_builds
            made, created = await rows.create_or_get(
                "cmd-1", queue="q", request_id="request/q/1", trigger_key="request/q/1",
                host="host-a", work_dir="/w")
            assert created and (made.status, made.reason, made.host) == (
                BuildStatus.ACCEPTED, "queued", "host-a")
            again, created = await rows.create_or_get(
                "cmd-2", queue="q", request_id="request/q/1", trigger_key="request/q/1",
                host="host-b", work_dir="/elsewhere")
            assert not created and again.build_id == "cmd-1"  # host B's repeat: A's build

            running = await rows.record("cmd-1", "host-a", RUNNING)
            assert running is not None and running.started_at is not None
            assert await rows.record("cmd-1", "host-b", RUNNING) is None  # not B's build
            # host B judges, with its own heartbeats as evidence the database was up: it
            # has been up, without a gap, for 40 s
            assert await db.worker_hosts.heartbeat("host-b", 6.0) == pytest.approx(0, abs=1)
            async with db.pool.connection() as conn:
                await conn.execute("UPDATE worker_host SET up_since = now()"
                                   " - interval '40 seconds' WHERE host = 'host-b'")
            assert await rows.fail_if_silent("cmd-1", 30.0, declarer="host-b",
                                             gap=6.0) is None  # the heartbeat is fresh
            assert await rows.heartbeat("host-a", "/w") == 1
            assert await rows.heartbeat("host-a", "/other") == 0

            async with db.pool.connection() as conn:
                await conn.execute("UPDATE command_build SET heartbeat_at = now()"
                                   " - interval '40 seconds' WHERE build_id = 'cmd-1'")
            # host B's own heartbeats had a gap (the database was away): no evidence yet
            async with db.pool.connection() as conn:
                await conn.execute("UPDATE worker_host SET heartbeat_at = now()"
                                   " - interval '40 seconds' WHERE host = 'host-b'")
            assert await db.worker_hosts.heartbeat("host-b", 6.0) == pytest.approx(0, abs=1)
            assert await rows.fail_if_silent("cmd-1", 30.0, declarer="host-b",
                                             gap=6.0) is None
            async with db.pool.connection() as conn:  # and then up for 40 s
                await conn.execute("UPDATE worker_host SET up_since = now()"
                                   " - interval '40 seconds' WHERE host = 'host-b'")
            # a host whose own heartbeat is stale has no say either
            assert await rows.fail_if_silent("cmd-1", 30.0, declarer="host-b",
                                             gap=0.0) is None
            lost = await rows.fail_if_silent("cmd-1", 30.0, declarer="host-b", gap=6.0)
            assert lost is not None and (lost.status, lost.reason) == (BuildStatus.FAILED,
                                                                       "host_lost")
            assert lost.detail.startswith("host host-a stopped heartbeating (last seen ")
            assert lost.detail.endswith(" s before it was declared lost)")
            # the owner comes back with good news: too late
            done = Observation(BuildStatus.SUCCEEDED, "exit_code", exit_code=0)
            assert await rows.record("cmd-1", "host-a", done) is None
            assert (await rows.get("cmd-1")).status is BuildStatus.FAILED
            assert (await rows.request_cancel("cmd-1")).cancel_requested_at is None
            assert await rows.list_live("host-a", "/w") == []
            with pytest.raises(psycopg.errors.IntegrityError, match="write-once"):
                async with db.pool.connection() as conn:
                    await conn.execute("UPDATE command_build SET status = 'succeeded'"
                                       " WHERE build_id = 'cmd-1'")

    asyncio.run(run())


def test_a_build_keeps_its_head_commit(migrated_dsn: str) -> None:
    head, other = "a" * 40, "b" * 40

    async def run() -> None:
        async with await Database.open(migrated_dsn, max_size=2) as db:
            rows = db.command_builds
            made, created = await rows.create_or_get(
                "cmd-1", queue="q", request_id="request/q/1", trigger_key="request/q/1",
                host="host-a", work_dir="/w", head_sha=head)
            assert created and made.head_sha == head
            # another trigger of the key, for another commit: the build found is the
            # first one, with its own head, for the caller to compare
            found, created = await rows.create_or_get(
                "cmd-2", queue="q", request_id="request/q/1", trigger_key="request/q/1",
                host="host-b", work_dir="/w", head_sha=other)
            assert not created and (found.build_id, found.head_sha) == ("cmd-1", head)
            assert (await rows.find_by_trigger_key("request/q/1")) == made
            recorded = await rows.record("cmd-1", "host-a", RUNNING)
            assert recorded is not None and recorded.head_sha == head  # kept by writes
            # a row written before the column (or an adopted build without build.json's
            # head): no head
            adopted, _ = await rows.create_or_get(
                "cmd-3", queue="q", request_id="", trigger_key=None, host="host-a",
                work_dir="/w", observed=RUNNING)
            assert adopted.head_sha is None
            assert (await rows.get_many(["cmd-1", "cmd-3"]))["cmd-3"].head_sha is None

    asyncio.run(run())
