"""A worker over the delivery runtime with test handlers, run as a real process.

Environment: RT_BOOTSTRAP, RT_DSN (its search_path names the test's schema), RT_TOPICS
(a topics.yaml), RT_PREFIX, RT_APP_ID; RT_LOGLEVEL (warn by default) to look into one.
The payload id says what the handler does:

  ack:N            record N and ack
  hold:MS:N        the first time hold for MS ms, then record N
  retry:K:N        raise a retryable error until K attempts failed, then record N
  retryforever:N   always retryable (exhausts its attempts, then the DLQ)
  fatal:N          raise a non-retryable error
  pipe:N           publish N to `build`; the build stage records it
  pipehold:MS:N    hold once for MS ms, then publish N to `build`
  pipelatch:N / pipeholdlatch:MS:N   the same, but `build` holds N (200 ms at a time,
                   counted in runtime_arrived) until the row 'build' is in runtime_latch
  recon:K:N        (on process_dlq) fail retryably until K attempts failed, then record N
  reconfatal:N     (on process_dlq) always fail for good: parked after park_after attempts
  outage:N         the database seems away (an outage, retried in place) until the row
                   'outage' is in runtime_latch, then record N; every call is logged in
                   runtime_calls with the worker (RT_WORKER) and the time
  bugonce:N        the first call raises past the runtime's error handling (a bug: the
                   agent crashes), later ones record N

"Record" inserts (id, stage, attempt) into runtime_sink; duplicates are absorbed by its
key and counted in runtime_sink.deliveries.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from contract import BuildRequest, ProcessRequest
from streams.config.topics import load_topics
from streams.runtime import ACK, Hold, Outcome, RetryableError
from streams.runtime.config import worker_config
from streams.runtime.stage import Context, Stage
from streams.runtime.worker import build_app, database_deps, run_worker

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS runtime_sink (
    id text PRIMARY KEY, stage text NOT NULL, attempt int NOT NULL,
    deliveries int NOT NULL DEFAULT 1, received_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS runtime_held (
    id text PRIMARY KEY, delay_ms int NOT NULL,
    held_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS runtime_arrived (id text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS runtime_latch (name text PRIMARY KEY);
CREATE TABLE IF NOT EXISTS runtime_calls (
    id text NOT NULL, worker text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
    done boolean NOT NULL DEFAULT false);
"""


async def _record(ctx: Context, ident: str) -> None:
    async with ctx.deps.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO runtime_sink (id, stage, attempt) VALUES (%s, %s, %s)"
            " ON CONFLICT (id) DO UPDATE SET deliveries = runtime_sink.deliveries + 1",
            (ident, ctx.stage, ctx.attempt))


async def _hold_once(ctx: Context, ident: str, delay_ms: int) -> bool:
    """True the first time: the caller holds; a redelivery finds the row and goes on."""
    async with ctx.deps.pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO runtime_held (id, delay_ms) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            (ident, delay_ms))
        return cur.rowcount == 1


class Boom(ValueError):
    """A non-retryable failure."""


class HandlerBug(BaseException):
    """A failure the runtime does not handle: a bug outside its error handling."""


async def _outage_until_latched(ctx: Context, ident: str) -> None:
    async with ctx.deps.pool.connection() as conn:
        await conn.execute("INSERT INTO runtime_calls (id, worker) VALUES (%s, %s)",
                           (ident, os.environ.get("RT_WORKER", "?")))
        cur = await conn.execute("SELECT 1 FROM runtime_latch WHERE name = 'outage'")
        latched = await cur.fetchone() is not None
    if not latched:
        raise ConnectionRefusedError("the database seems away (a test's outage)")
    await _record(ctx, ident)


async def _bug_once(ctx: Context, ident: str) -> None:
    async with ctx.deps.pool.connection() as conn:
        cur = await conn.execute("INSERT INTO runtime_calls (id, worker) VALUES (%s, %s)"
                                 " RETURNING (SELECT count(*) FROM runtime_calls"
                                 "            WHERE id = %s)", (ident, "-", ident))
        row = await cur.fetchone()
    if row is not None and row[0] == 0:
        raise HandlerBug(f"a bug while handling {ident}")
    await _record(ctx, ident)


async def handle_process(payload: ProcessRequest, ctx: Context) -> Outcome:
    kind, *rest = payload.id.split(":")
    if kind == "ack":
        await _record(ctx, payload.id)
    elif kind == "hold":
        if await _hold_once(ctx, payload.id, int(rest[0])):
            return Hold(int(rest[0]) / 1000)
        await _record(ctx, payload.id)
    elif kind == "retry":
        if ctx.attempt < int(rest[0]):
            raise RetryableError(f"attempt {ctx.attempt} fails on purpose")
        await _record(ctx, payload.id)
    elif kind == "retryforever":
        raise RetryableError("always fails, retryably")
    elif kind == "fatal":
        raise Boom("fails for good")
    elif kind == "outage":
        await _outage_until_latched(ctx, payload.id)
    elif kind == "bugonce":
        await _bug_once(ctx, payload.id)
    elif kind in ("pipe", "pipelatch"):
        await ctx.publish("build", BuildRequest(id=payload.id, queue_name=payload.queue_name))
    elif kind in ("pipehold", "pipeholdlatch"):
        if await _hold_once(ctx, payload.id, int(rest[0])):
            return Hold(int(rest[0]) / 1000)
        await ctx.publish("build", BuildRequest(id=payload.id, queue_name=payload.queue_name))
    else:
        raise Boom(f"unknown test id {payload.id!r}")
    return ACK


async def handle_build(payload: BuildRequest, ctx: Context) -> Outcome:
    if "latch" in payload.id.split(":")[0]:
        async with ctx.deps.pool.connection() as conn:
            await conn.execute("INSERT INTO runtime_arrived (id) VALUES (%s)"
                               " ON CONFLICT DO NOTHING", (payload.id,))
            cur = await conn.execute("SELECT 1 FROM runtime_latch WHERE name = 'build'")
            if await cur.fetchone() is None:
                return Hold(0.2)  # in flight until the test releases the latch
    await _record(ctx, payload.id)
    return ACK


async def handle_process_dlq(payload: ProcessRequest, ctx: Context) -> Outcome:
    kind, *rest = payload.id.split(":")
    if kind == "recon" and ctx.attempt < int(rest[0]):
        raise RetryableError(f"reconciler attempt {ctx.attempt} fails on purpose")
    if kind == "reconfatal":
        raise Boom(f"reconciler attempt {ctx.attempt} fails for good")
    await _record(ctx, payload.id)
    return ACK


STAGES: list[Stage[Any]] = [
    Stage("process", ProcessRequest, handle_process),
    Stage("build", BuildRequest, handle_build),
    Stage("process_dlq", ProcessRequest, handle_process_dlq),
]


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    topics = load_topics(os.environ["RT_TOPICS"], prefix=os.environ["RT_PREFIX"])
    config = worker_config(topics, app_id=os.environ["RT_APP_ID"],
                           bootstrap=os.environ["RT_BOOTSTRAP"],
                           consumed=[s.key for s in STAGES])
    app = build_app(config, STAGES, database_deps(os.environ["RT_DSN"]))
    run_worker(app, loglevel=os.environ.get("RT_LOGLEVEL", "warn"))


if __name__ == "__main__":
    main()
