"""`stovepipe worker` with measuring hooks, for `bench/pipeline_bench.py`.

Runs the very same Click command as ``python -m streams.cli worker`` (same arguments, same
environment), in-process, after installing hooks that only count and time:

- ``bench_db_statements_total{stage}``   cursor executes (one round trip each)
- ``bench_db_transactions_total{stage}`` ``Database.transaction()`` blocks (BEGIN+COMMIT)
- ``bench_produces_total{stage}``        ``send_and_wait`` calls (each waits for acks=all)
- ``bench_threads_total{stage}``         ``asyncio.to_thread`` hops (fake repository I/O)
- ``bench_<each of the above>_seconds_total{stage}``: the time spent awaiting them; a
  transaction's time includes its statements, BEGIN and COMMIT, and the statements' own
  time counts only statements outside transactions, so the parts add up
- ``bench_receive_lag_seconds{stage}``   handler start minus the record's Kafka timestamp
  (fetch long-poll, Faust's hand-off and the agent's own queue)

``stage`` is the stage whose delivery made the call (``-`` outside any delivery). They are
Prometheus metrics in the default registry, so ``--web-port``'s /metrics serves them with
the pipeline's own. The hooks cost about a microsecond per call.

With ``PIPELINE_BENCH_EXPERIMENTS=name,...`` candidate changes to streams/ are patched
in for a what-if measurement (see EXPERIMENTS below; streams/ itself is not edited).

With ``PIPELINE_BENCH_SWITCH_INTERVAL=<seconds>`` the interpreter's GIL switch interval
is set (default 0.005): an experiment on how long the event loop waits for the GIL held
by Faust's consumer thread or the to_thread pool.

With ``PIPELINE_BENCH_CPROFILE=<file>`` the worker's main thread (the event loop every
stage runs on) also runs under cProfile, timed by the thread's CPU clock, and the stats
are dumped to that file at exit (SIGTERM makes Faust stop and exit normally).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import sys
import time
from typing import Any

from prometheus_client import Counter, Histogram

ENV_CPROFILE = "PIPELINE_BENCH_CPROFILE"
ENV_SWITCH_INTERVAL = "PIPELINE_BENCH_SWITCH_INTERVAL"  # sys.setswitchinterval, seconds
ENV_EXPERIMENTS = "PIPELINE_BENCH_EXPERIMENTS"  # comma-separated names of EXPERIMENTS

STAGE: contextvars.ContextVar[str] = contextvars.ContextVar("bench_stage", default="-")
_IN_TX: contextvars.ContextVar[bool] = contextvars.ContextVar("bench_in_tx", default=False)

DB_STATEMENTS = Counter("bench_db_statements", "Cursor executes.", ["stage"])
DB_TRANSACTIONS = Counter("bench_db_transactions", "Database.transaction() blocks.", ["stage"])
PRODUCES = Counter("bench_produces", "Producer send_and_wait calls.", ["stage"])
THREADS = Counter("bench_threads", "asyncio.to_thread hops.", ["stage"])
DB_SECONDS = Counter("bench_db_statements_seconds",
                     "Time awaiting cursor executes outside transactions.", ["stage"])
TX_SECONDS = Counter("bench_db_transactions_seconds",
                     "Time from Database.transaction() entry to its COMMIT returning "
                     "(includes the statements inside).", ["stage"])
PRODUCE_SECONDS = Counter("bench_produces_seconds", "Time awaiting send_and_wait.", ["stage"])
THREAD_SECONDS = Counter("bench_threads_seconds", "Time awaiting to_thread.", ["stage"])
STATEMENT_SECONDS = Histogram(
    "bench_db_statement_seconds", "One cursor execute, awaited.", ["stage"],
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25))
PRODUCE_ONE_SECONDS = Histogram(
    "bench_produce_seconds", "One send_and_wait, awaited.", ["stage"],
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25))
RECEIVE_LAG = Histogram(
    "bench_receive_lag_seconds", "Handler start minus the record's Kafka timestamp.",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))


def install_hooks() -> None:
    import psycopg
    from aiokafka import AIOKafkaProducer

    from store.database import Database
    from streams.runtime.stage import Delivery

    deliver = Delivery.deliver

    @functools.wraps(deliver)
    async def timed_deliver(self: Any, stage: Any, msg: Any) -> None:
        token = STAGE.set(stage.key)
        try:
            if msg.timestamp:
                RECEIVE_LAG.labels(stage=stage.key).observe(
                    max(0.0, time.time() - msg.timestamp))
            await deliver(self, stage, msg)
        finally:
            STAGE.reset(token)

    Delivery.deliver = timed_deliver  # type: ignore[method-assign]

    execute = psycopg.AsyncCursor.execute

    @functools.wraps(execute)
    async def counted_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        stage = STAGE.get()
        DB_STATEMENTS.labels(stage=stage).inc()
        started = time.perf_counter()
        try:
            return await execute(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - started
            STATEMENT_SECONDS.labels(stage=stage).observe(took)
            if not _IN_TX.get():  # inside a transaction its time counts there
                DB_SECONDS.labels(stage=stage).inc(took)

    psycopg.AsyncCursor.execute = counted_execute  # type: ignore[method-assign]

    transaction = Database.transaction

    @contextlib.asynccontextmanager
    async def counted_transaction(self: Any) -> Any:
        stage = STAGE.get()
        DB_TRANSACTIONS.labels(stage=stage).inc()
        started = time.perf_counter()
        token = _IN_TX.set(True)
        try:
            async with transaction(self) as tx:
                yield tx
        finally:
            _IN_TX.reset(token)
            TX_SECONDS.labels(stage=stage).inc(time.perf_counter() - started)

    Database.transaction = counted_transaction  # type: ignore[method-assign]

    send_and_wait = AIOKafkaProducer.send_and_wait

    @functools.wraps(send_and_wait)
    async def counted_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        stage = STAGE.get()
        PRODUCES.labels(stage=stage).inc()
        started = time.perf_counter()
        try:
            return await send_and_wait(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - started
            PRODUCE_ONE_SECONDS.labels(stage=stage).observe(took)
            PRODUCE_SECONDS.labels(stage=stage).inc(took)

    AIOKafkaProducer.send_and_wait = counted_send  # type: ignore[method-assign]

    to_thread = asyncio.to_thread

    async def counted_to_thread(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        stage = STAGE.get()
        THREADS.labels(stage=stage).inc()
        started = time.perf_counter()
        try:
            return await to_thread(func, *args, **kwargs)
        finally:
            THREAD_SECONDS.labels(stage=stage).inc(time.perf_counter() - started)

    asyncio.to_thread = counted_to_thread


# --- what-if experiments: candidate changes to streams/, tried here without editing it ------


def _serial_agent(stage: Any, runtime: Any) -> Any:
    """An agent that handles its events one at a time, acking each after it (what
    streams.runtime.worker did before lanes)."""
    from streams.runtime.stage import Incoming

    async def run_stage(stream: Any) -> None:
        await runtime.ready.wait()
        delivery = runtime.delivery
        async for event in stream.noack().events():
            m = event.message
            await delivery.deliver(stage, Incoming(
                topic=m.topic, partition=m.partition, offset=m.offset, key=m.key,
                value=m.value, headers=[(k, bytes(v)) for k, v in (m.headers or ())],
                timestamp=m.timestamp or 0.0))
            event.ack()

    run_stage.__name__ = f"stage_{stage.key}"
    return run_stage


def serial() -> None:
    """Baseline: every stage one message at a time across all its partitions."""
    from streams.runtime import worker

    worker._agent_for = _serial_agent


def isolated_partitions() -> None:
    """Faust's own option: ``isolated_partitions=True`` gives each assigned partition an
    actor of its own, each handling its partition's events one at a time (acked in
    order), so partitions run concurrently but keys within one do not."""
    import faust

    from streams.runtime import worker

    worker._agent_for = _serial_agent
    agent = faust.App.agent

    def isolated(self: Any, channel: Any = None, **kwargs: Any) -> Any:
        return agent(self, channel, isolated_partitions=True, **kwargs)

    faust.App.agent = isolated  # type: ignore[method-assign]


EXPERIMENTS = {"serial": serial, "isolated-partitions": isolated_partitions}


def main() -> None:
    install_hooks()
    for name in filter(None, os.environ.get(ENV_EXPERIMENTS, "").split(",")):
        EXPERIMENTS[name]()
    if os.environ.get(ENV_SWITCH_INTERVAL):
        sys.setswitchinterval(float(os.environ[ENV_SWITCH_INTERVAL]))
    from streams.cli import main as stovepipe

    sys.argv = ["stovepipe", "worker", *sys.argv[1:]]
    out = os.environ.get(ENV_CPROFILE)
    if not out:
        stovepipe()
        return
    import cProfile

    # CPU time of the main thread (the event loop), not wall time: on a busy machine a
    # runnable thread waiting for a core would otherwise be charged to whatever it was in
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        stovepipe()
    finally:
        profiler.disable()
        profiler.dump_stats(out)


if __name__ == "__main__":
    main()
