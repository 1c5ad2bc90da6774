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

from store import Database
from streams.cli.common import CONNECT_DEADLINE, open_db, queues_option, run_async, settings
from streams.config.kafka_access import check_aiokafka_access
from streams.config.kafka_security import KafkaSecurity
from streams.config.queues import (
    Extensions,
    InvalidQueueName,
    QueueConfigError,
    QueuesConfig,
    UnknownQueue,
    load_queues,
    validate_queue_name,
)
from streams.config.settings import Settings
from streams.config.topics import TopicsConfig, TopicsConfigError, load_topics
from streams.runtime.config import topic_routes
from streams.runtime.kafka import KafkaPublisher
from streams.schema.durations import format_duration, parse_duration
from streams.stages.deps import Deps
from streams.stages.ingest import Ingested, ingest_head

DEFAULT_EVERY = "30s"
INGEST_DEADLINE = 60.0  # per queue per round: a hung repository must not stall the poller
CONCURRENT_INGESTS = 4


class IngestClient:
    """The database, a publisher and the queues' extensions, opened once for any number
    of ingests. Use as ``async with IngestClient(...) as client``."""

    def __init__(self, settings: Settings, queues: QueuesConfig, topics: TopicsConfig, *,
                 pool_size: int = 2) -> None:
        self.settings = settings
        self.queues = queues
        self.topics = topics
        self.pool_size = pool_size
        self.security = KafkaSecurity.from_env()  # a bad variable is named before anything
        self._db: Database | None = None
        self._publisher: KafkaPublisher | None = None
        self._deps: Deps | None = None

    async def __aenter__(self) -> Self:
        self._db = await open_db(self.pool_size, self.settings.postgres_dsn)
        try:
            bootstrap = self.settings.kafka_bootstrap
            # a refused password or certificate is named, not reported as "Unable to
            # bootstrap" (aiokafka's words for every failure)
            await check_aiokafka_access(bootstrap, self.security,
                                        connect_within=CONNECT_DEADLINE)
            self._publisher = KafkaPublisher(bootstrap, topic_routes(self.topics),
                                             security=self.security)
            # an unreachable broker is a one-line error within seconds, not a long wait
            async with asyncio.timeout(CONNECT_DEADLINE):
                await self._publisher.start()
        except BaseException:
            await self.close()
            raise
        self._deps = Deps(db=self._db, queues=self.queues,
                          extensions=Extensions(self.queues, self._db))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        db, self._db = self._db, None
        try:
            if publisher is not None:
                await publisher.stop()
        finally:
            if db is not None:
                await db.close()

    @property
    def deps(self) -> Deps:
        """What the stages share, for other commands that act like ingest (retry)."""
        if self._deps is None:
            raise RuntimeError("IngestClient is not open")
        return self._deps

    @property
    def publisher(self) -> KafkaPublisher:
        if self._publisher is None:
            raise RuntimeError("IngestClient is not open")
        return self._publisher

    async def ingest(self, queue: str) -> Ingested:
        """Ingest ``queue``'s head. Raises what `streams.stages.ingest.ingest_head` raises."""
        if self._deps is None or self._publisher is None:
            raise RuntimeError("IngestClient is not open")
        return await ingest_head(self._deps, queue, self._publisher)


@click.command("ingest")
@click.argument("queue")
@queues_option
def ingest_command(queue: str, queues_file: Path | None) -> None:
    """Validate QUEUE's current head: prints the Request id (the same id for the same
    head, however often you ask)."""
    current = settings()

    async def run() -> str:
        queues = load_queues(queues_file)
        async with IngestClient(current, queues, load_topics(current.topics_file)) as client:
            return (await client.ingest(queue)).request_id

    click.echo(run_async(run))


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
    period = every
    current = settings()
    try:
        queues = load_queues(queues_file)
        topics = load_topics(current.topics_file)
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
        async with IngestClient(current, queues, topics) as client:
            poller = Poller(client, names, every=period)
            cadence = "once" if once else f"every {format_duration(timedelta(seconds=period))}"
            click.echo(f"{_now()} poll: {len(names)} queue(s), {cadence}", err=True)
            return await poller.run(once=once)

    failures = run_async(run)
    if once and failures:
        sys.exit(1)
