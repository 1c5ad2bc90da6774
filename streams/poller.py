"""Ingest from outside a worker: `stovepipe ingest` once, `stovepipe poll` on a timer.

The poller is the simplest producer of design §3: every period it ingests each queue
(all configured queues, or the ones named), printing one line per ingest. Ingest is
idempotent, so polling an unchanged branch only answers the same Request id again. A
queue that fails is reported and the others go on; SIGINT or SIGTERM stop it between two
ingests, after the ones in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Self

import click
from aiokafka import AIOKafkaProducer
from google.protobuf.message import Message

from store import Database
from streams import queries
from streams.commands import queues_option
from streams.deps import Deps
from streams.queueconfig import Extensions, QueuesConfig
from streams.runtime.stage import publish_payload
from streams.settings import Settings
from streams.topics import TopicsConfig, format_duration, parse_duration

DEFAULT_EVERY = "30s"
INGEST_DEADLINE = 60.0  # per queue per round: a hung repository must not stall the poller
CONCURRENT_INGESTS = 4


class IngestClient:
    """The database, a producer and the queues' extensions, opened once for any number
    of ingests. Use as ``async with IngestClient(...) as client``."""

    def __init__(self, settings: Settings, queues: QueuesConfig, topics: TopicsConfig, *,
                 pool_size: int = 2) -> None:
        self.settings = settings
        self.queues = queues
        self.topics = topics
        self.pool_size = pool_size
        self._db: Database | None = None
        self._producer: AIOKafkaProducer | None = None
        self._deps: Deps | None = None

    async def __aenter__(self) -> Self:
        self._db = await Database.open(self.settings.postgres_dsn, max_size=self.pool_size,
                                       acquire_timeout=10, name="stovepipe-ingest")
        try:
            self._producer = AIOKafkaProducer(
                bootstrap_servers=self.settings.kafka_bootstrap, acks="all",
                enable_idempotence=True, request_timeout_ms=30000)
            await self._producer.start()
        except BaseException:
            await self.close()
            raise
        self._deps = Deps(db=self._db, queues=self.queues, extensions=Extensions(self.queues))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        db, self._db = self._db, None
        try:
            if producer is not None:
                await producer.stop()
        finally:
            if db is not None:
                await db.close()

    async def _publish(self, key: str, payload: Message) -> None:
        assert self._producer is not None
        spec = self.topics.stage(key)
        await publish_payload(self._producer, spec.full_name, payload, spec.key_field)

    async def ingest(self, queue: str) -> queries.Ingested:
        """Ingest ``queue``'s head. Raises what `streams.queries.ingest` raises."""
        if self._deps is None:
            raise RuntimeError("IngestClient is not open")
        return await queries.ingest(self._deps, queue, self._publish)


# --- polling ----------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Poller:
    """Rounds of ingests over ``queues``, ``every`` seconds apart (start to start; a
    round that overruns is followed at once by the next, never overlapped)."""

    def __init__(self, client: IngestClient, queues: Sequence[str], *,
                 every: float) -> None:
        self.client = client
        self.queues = list(queues)
        self.every = every
        self.stopping = asyncio.Event()
        self._slots = asyncio.Semaphore(CONCURRENT_INGESTS)

    async def run(self, *, once: bool) -> int:
        """Poll until stopped (or one round with ``once``). The number of queues that
        failed in the last round."""
        while True:
            started = time.monotonic()
            failures = await self.round()
            if once or self.stopping.is_set():
                return failures
            remaining = self.every - (time.monotonic() - started)
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), timeout=remaining)
            if self.stopping.is_set():
                return failures

    async def round(self) -> int:
        outcomes = await asyncio.gather(*(self._ingest_one(q) for q in self.queues))
        return sum(1 for ok in outcomes if not ok)

    async def _ingest_one(self, queue: str) -> bool:
        async with self._slots:
            if self.stopping.is_set():
                return True  # not attempted: the poller is stopping
            try:
                async with asyncio.timeout(INGEST_DEADLINE):
                    done = await self.client.ingest(queue)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one queue's failure must not stop the rest
                click.echo(f"{_now()} {queue}: error: {_one_line(exc)}", err=True)
                return False
        click.echo(f"{_now()} {queue} -> {done.request_id} ({'new' if done.new else 'same'})")
        return True


def parse_every(ctx: click.Context | None, param: click.Parameter | None, text: str) -> float:
    """The period in seconds (a click callback, so errors name the option)."""
    try:
        every = parse_duration(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if every <= timedelta(0):
        raise click.BadParameter(f"must be longer than zero, got {text!r}")
    return every.total_seconds()


@click.command("poll")
@click.argument("queue_names", metavar="[QUEUE]...", nargs=-1)
@click.option("--every", default=DEFAULT_EVERY, show_default=True, metavar="DURATION",
              callback=parse_every,
              help="Time between the starts of two rounds, e.g. 10s, 1m, 1m30s.")
@click.option("--once", is_flag=True,
              help="One round, then exit: status 1 if any queue failed.")
@queues_option
def poll_command(queue_names: tuple[str, ...], every: float, once: bool,
                 queues_file: Path | None) -> None:
    """Ingest every configured queue (or each QUEUE) now and then every DURATION, printing
    one line per ingest: the queue, its Request id, and whether that Request is new.
    A failing queue is reported on stderr and the others go on. Stop with Ctrl-C or
    SIGTERM."""
    import psycopg
    import psycopg_pool
    from aiokafka.errors import KafkaError

    from streams import settings as settings_mod
    from streams.queueconfig import (
        InvalidQueueName,
        QueueConfigError,
        UnknownQueue,
        load_queues,
        validate_queue_name,
    )
    from streams.topics import TopicsConfigError, load_topics

    period = every
    settings = settings_mod.load_settings()
    try:
        queues = load_queues(queues_file)
        topics = load_topics(settings.topics_file)
        names = list(dict.fromkeys(queue_names)) or list(queues.names())
        for name in names:
            validate_queue_name(name)
            queues.get(name)
    except (QueueConfigError, TopicsConfigError, InvalidQueueName, UnknownQueue) as exc:
        raise click.ClickException(str(exc)) from None

    async def run() -> int:
        poller: Poller | None = None

        def stop(signum: int) -> None:
            click.echo(f"{_now()} poll: {signal.Signals(signum).name}, stopping after the "
                       f"ingests in flight", err=True)
            if poller is not None:
                poller.stopping.set()

        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop, signum)
        async with IngestClient(settings, queues, topics) as client:
            poller = Poller(client, names, every=period)
            cadence = "once" if once else f"every {format_duration(timedelta(seconds=period))}"
            click.echo(f"{_now()} poll: {len(names)} queue(s), {cadence}", err=True)
            return await poller.run(once=once)

    try:
        failures = asyncio.run(run())
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
        raise click.ClickException(
            f"cannot reach PostgreSQL: {str(exc).strip()}\nStart the local stack with "
            f"`stovepipe dev up`, or set {settings_mod.ENV_POSTGRES_DSN}.") from None
    except KafkaError as exc:
        raise click.ClickException(
            f"cannot reach Kafka at {settings.kafka_bootstrap}: {exc}\nStart the local "
            f"stack with `stovepipe dev up`, or set {settings_mod.ENV_KAFKA_BOOTSTRAP}."
        ) from None
    if once and failures:
        sys.exit(1)
