"""The worker process of `bench/runtime_bench.py`: real stages over the delivery runtime.

Not a benchmark by itself: `runtime_bench.py` starts it as ``python -m bench.bench_worker``
with its environment set, one process per measurement. Environment:

  BENCH_MODE       pipeline | noop | db | hold
  BENCH_BOOTSTRAP  Kafka bootstrap servers
  BENCH_DSN        PostgreSQL DSN (its search_path names the run's schema)
  BENCH_TOPICS     the topics.yaml of the run; BENCH_PREFIX its topic prefix
  BENCH_APP_ID     the Faust app id (consumer group)
  BENCH_OUT        file the handlers append their observations to
  BENCH_DATADIR    Faust's data directory (kept out of the repository)
  BENCH_LOGLEVEL   the worker's log level (default info, as `stovepipe worker`)

Each observation is one tab-separated line: ``event id stage handled_at record_ts extra``,
times in epoch seconds (``handled_at`` is taken when the handler starts; ``record_ts`` is
the consumed record's Kafka timestamp). Lines are buffered and flushed every 50 ms by a
task of the worker's own event loop, so the handlers never wait on the file.

Modes:
  pipeline  ingest -> process -> build -> buildsignal -> record, each publishing the next
            payload with ``ctx.publish``; every stage writes a ``hop`` line.
  noop      ``process`` acks at once (``handled`` line).
  db        ``process`` does one INSERT ... ON CONFLICT round trip (``handled`` line).
  hold      ``process`` ids are ``<tag>:<delay_ms>:<n>``: the first delivery writes a
            ``first`` line and holds for delay_ms (``extra`` = the time just before it
            returns the Hold); the redelivery writes an ``again`` line and acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import IO, Any

import faust

from contract import BuildRequest, BuildSignal, IngestRequest, ProcessRequest, Record
from streams.config.topics import load_topics
from streams.runtime import ACK, Hold, Outcome
from streams.runtime.config import worker_config
from streams.runtime.stage import Context, Park, Stage
from streams.runtime.worker import OpenDeps, build_app, database_deps

FLUSH_INTERVAL = 0.05

class Recorder:
    """Observation lines, buffered in memory and flushed by a task of the event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lines: list[str] = []
        self._file: IO[str] | None = None
        self._task: asyncio.Task[None] | None = None

    def note(self, event: str, ident: str, stage: str, handled_at: float, record_ts: float,
             extra: float | str = "") -> None:
        self._lines.append(f"{event}\t{ident}\t{stage}\t{handled_at:.6f}\t{record_ts:.3f}"
                           f"\t{extra}\n")

    def start(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in stop
        self._task = asyncio.create_task(self._flush_loop(), name="bench-recorder")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._flush()
        if self._file is not None:
            self._file.close()

    def _flush(self) -> None:
        if self._lines and self._file is not None:
            lines, self._lines = self._lines, []
            self._file.write("".join(lines))
            self._file.flush()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            self._flush()


RECORDER = Recorder(os.environ.get("BENCH_OUT", os.devnull))


# --- pipeline: five hops, each publishing the next payload ---------------------------


async def ingest(payload: IngestRequest, ctx: Context) -> Outcome:
    _hop(ctx, payload.queue)
    await ctx.publish("process", ProcessRequest(id=payload.queue, queue_name=payload.queue))
    return ACK


async def process_pipeline(payload: ProcessRequest, ctx: Context) -> Outcome:
    _hop(ctx, payload.id)
    await ctx.publish("build", BuildRequest(id=payload.id, queue_name=payload.queue_name))
    return ACK


async def build(payload: BuildRequest, ctx: Context) -> Outcome:
    _hop(ctx, payload.id)
    await ctx.publish("buildsignal", BuildSignal(id=payload.id, queue_name=payload.queue_name))
    return ACK


async def buildsignal(payload: BuildSignal, ctx: Context) -> Outcome:
    _hop(ctx, payload.id)
    await ctx.publish("record", Record(id=payload.id, queue_name=payload.queue_name))
    return ACK


async def record(payload: Record, ctx: Context) -> Outcome:
    _hop(ctx, payload.id)
    return ACK


def _hop(ctx: Context, ident: str) -> None:
    RECORDER.note("hop", ident, ctx.stage, time.time(), ctx.message.timestamp)


# --- one stage's throughput ------------------------------------------------------------


async def process_noop(payload: ProcessRequest, ctx: Context) -> Outcome:
    RECORDER.note("handled", payload.id, ctx.stage, time.time(), ctx.message.timestamp)
    return ACK


async def process_db(payload: ProcessRequest, ctx: Context) -> Outcome:
    started = time.time()
    async with ctx.deps.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO bench_sink (id) VALUES (%s)"
            " ON CONFLICT (id) DO UPDATE SET deliveries = bench_sink.deliveries + 1",
            (payload.id,))
    RECORDER.note("handled", payload.id, ctx.stage, started, ctx.message.timestamp)
    return ACK


# --- holds -----------------------------------------------------------------------------

_held: set[str] = set()  # ids already held once (one process, no crash: memory will do)


async def process_hold(payload: ProcessRequest, ctx: Context) -> Outcome:
    started = time.time()
    if payload.id in _held:
        RECORDER.note("again", payload.id, ctx.stage, started, ctx.message.timestamp)
        return ACK
    _held.add(payload.id)
    delay = int(payload.id.split(":")[1]) / 1000
    RECORDER.note("first", payload.id, ctx.stage, started, ctx.message.timestamp,
                  f"{time.time():.6f}")
    return Hold(delay)


STAGES: dict[str, list[Stage[Any]]] = {
    "pipeline": [
        Stage("ingest", IngestRequest, ingest),
        Stage("process", ProcessRequest, process_pipeline),
        Stage("build", BuildRequest, build),
        Stage("buildsignal", BuildSignal, buildsignal),
        Stage("record", Record, record),
    ],
    "noop": [Stage("process", ProcessRequest, process_noop)],
    "db": [Stage("process", ProcessRequest, process_db)],
    "hold": [Stage("process", ProcessRequest, process_hold)],
}


def with_recorder(open_db: OpenDeps) -> OpenDeps:
    """The database deps, plus the recorder started on the worker's event loop."""

    async def open_deps() -> tuple[Any, Park, Callable[[], Awaitable[None]]]:
        db, park, close_db = await open_db()
        RECORDER.start()

        async def close() -> None:
            await RECORDER.stop()
            await close_db()

        return db, park, close

    return open_deps


def main() -> None:
    if "BENCH_MODE" not in os.environ:
        # `make bench` runs every bench/*.py; this one is only a helper of runtime_bench.py
        print("bench_worker: started by bench/runtime_bench.py; nothing to do on its own")
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    env = os.environ
    stages = STAGES[env["BENCH_MODE"]]
    topics = load_topics(env["BENCH_TOPICS"], prefix=env["BENCH_PREFIX"])
    config = worker_config(topics, app_id=env["BENCH_APP_ID"], bootstrap=env["BENCH_BOOTSTRAP"],
                           consumed=[s.key for s in stages])
    app = build_app(config, stages, with_recorder(database_deps(env["BENCH_DSN"])),
                    datadir=env["BENCH_DATADIR"])
    # started as `stovepipe worker` starts it (streams/cli/worker.py). The level matters:
    # at warn or above Faust's spinner sets the root logger to DEBUG (see runtime_bench.py)
    faust.Worker(app, loglevel=env.get("BENCH_LOGLEVEL", "info"),
                 quiet=True).execute_from_commandline()


if __name__ == "__main__":
    main()
