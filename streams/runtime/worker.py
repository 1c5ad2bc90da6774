"""A Faust worker running stages over the delivery runtime.

One agent per stage topic, each a thin loop: wait until the runtime is started, then hand
each event to the stage's lanes (`streams.runtime.lanes`), which run `Delivery.deliver`
for many events at once, one key at a time, and acknowledge each event once it and every
earlier event of its partition are done. Acks are manual (``noack``) so that an event
interrupted by shutdown or a crash is never acknowledged, and in order per partition,
which keeps Faust's committed offset from skipping an event still in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode import Service
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from store import Database
from streams.config.kafka_security import faust_conf
from streams.config.settings import load_settings
from streams.runtime import logs, metrics, timings
from streams.runtime.config import WorkerConfig
from streams.runtime.delay import DelayScheduler, DelayTiers
from streams.runtime.kafka import KafkaPublisher
from streams.runtime.lanes import Lanes, LanesHalted
from streams.runtime.periodic import PeriodicTask, run_periodically
from streams.runtime.stage import (
    Delivery,
    Incoming,
    Park,
    Stage,
    park_into,
)

log = logging.getLogger("stovepipe.worker")

FETCH_MAX_WAIT_MS = 100
REVOKE_DEADLINE = timings.REVOKE_DEADLINE
AGENT_RESTART_FIRST, AGENT_RESTART_CAP = 1.0, 60.0  # seconds before a crashed agent's rebalance


D = TypeVar("D")  # what the worker's handlers share, e.g. streams.stages.deps.Deps
Close = Callable[[], Awaitable[None]]
OpenDeps = Callable[[], Awaitable[tuple[D, Park, Close]]]


class _Consumer(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust hard-codes a 1.5 s fetch long-poll; a partition left out of an in-flight
    fetch then waits that long. We shorten it: latency per hop matters more here than
    the few extra fetch requests an idle worker sends."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer

    async def _request_rejoin(self) -> None:
        # on the consumer's own thread: aiokafka's coordinator is not thread-safe
        self._ensure_consumer()._coordinator.request_rejoin()

    async def seek_to_committed(self) -> Mapping[Any, int]:
        return await self.call_thread(seek_to_committed_or_start, self._ensure_consumer())


async def seek_to_committed_or_start(consumer: Any) -> Mapping[Any, int]:
    """Put every assigned partition back at its committed offset — or at its start when
    nothing was committed yet. Faust calls this after a rebalance, and whenever it throws
    away records fetched while its flow was stopped (a rebalance under way); aiokafka's
    own `seek_to_committed` moves only partitions whose committed offset is above 0, so a
    partition that never committed kept its fetch position *after* the thrown-away
    records: they were not delivered until the next rebalance, and a later commit on that
    partition would have skipped them for good. The worker reads from the earliest offset
    when nothing is committed (`consumer_auto_offset_reset`), so that is where it goes;
    offset 0 past the log's start resets to the earliest offset the same way."""
    committed: Mapping[Any, int] = await consumer.seek_to_committed()
    for tp, offset in committed.items():
        if not offset:  # None (nothing committed) or 0: aiokafka left it where it was
            consumer.seek(tp, 0)
    return committed


class _ConsumerDelegate(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return _Consumer(self, loop=self.loop, beacon=self.beacon)

    async def request_rejoin(self) -> None:
        """Have the group rebalance: every member's partitions are revoked and assigned
        again, each read again from its committed offset."""
        thread: Any = self._thread
        await thread.call_thread(thread._request_rejoin)


class _Transport(faust_aiokafka.Transport):
    Consumer = _ConsumerDelegate


class RuntimeService(Generic[D]):
    """Owns what the agents share: the producer, the delay scheduler and the deps."""

    def __init__(self, config: WorkerConfig, open_deps: OpenDeps[D],
                 periodic: Sequence[PeriodicTask[D]] = ()) -> None:
        self.config = config
        self.open_deps = open_deps
        self.periodic = tuple(periodic)
        self._timers: list[asyncio.Task[None]] = []
        self.ready = asyncio.Event()
        self.delivery: Delivery[D] | None = None
        self._publisher: KafkaPublisher | None = None
        self._scheduler: DelayScheduler | None = None
        self._close_deps: Callable[[], Awaitable[None]] | None = None
        self.lanes: dict[str, Lanes] = {}  # each stage's, while its agent runs

    async def revoke(self, partitions: set[Any]) -> None:
        """The group moved ``partitions`` away: stop their messages in every stage now,
        before this member rejoins (`Lanes.revoke`), within `REVOKE_DEADLINE`."""
        stopped = 0
        async with asyncio.timeout(REVOKE_DEADLINE):
            for lanes in list(self.lanes.values()):
                stopped += await lanes.revoke(partitions)
        if stopped:
            log.info("partitions_revoked partitions=%d messages_stopped=%d",
                     len(partitions), stopped)

    async def start(self) -> None:
        cfg = self.config
        logs.install()  # logging is configured by now: bound every line, damp floods
        deps, park, close = await self.open_deps()
        self._close_deps = close
        self._publisher = KafkaPublisher(cfg.bootstrap, cfg.topics, security=cfg.security)
        await self._publisher.start()
        tiers = DelayTiers(cfg.delay_tiers)
        producer = self._publisher.producer
        self.delivery = Delivery(producer=producer, tiers=tiers, routes=cfg.routes,
                                 publish=self._publisher, park=park, deps=deps)
        self._scheduler = DelayScheduler(bootstrap=cfg.bootstrap, group_id=f"{cfg.app_id}-delay",
                                         tiers=tiers, producer=producer, security=cfg.security,
                                         group_instance_id=cfg.group_instance_id,
                                         session_timeout=cfg.session_timeout)
        await self._scheduler.start()
        self._timers = [asyncio.create_task(run_periodically(t, deps, self._publisher),
                                            name=f"periodic-{t.name}")
                        for t in self.periodic]
        self.ready.set()

    async def stop(self) -> None:
        self.ready.clear()
        for timer in self._timers:
            timer.cancel()
        for timer in self._timers:
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        if self._scheduler is not None:
            await self._scheduler.stop()
        if self._publisher is not None:
            await self._publisher.stop()
        if self._close_deps is not None:
            await self._close_deps()


def build_app(config: WorkerConfig, stages: Sequence[Stage[Any]], open_deps: OpenDeps[D],
              periodic: Sequence[PeriodicTask[D]] = (), **faust_settings: Any) -> faust.App:
    """The Faust application for ``stages``. It declares and creates no topic: they come
    from ``stovepipe topics create``."""
    settings: dict[str, Any] = {
        # the broker URLs and credentials of Faust's consumer, producer and admin client
        **faust_conf(config.bootstrap, config.security),
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "consumer_auto_offset_reset": "earliest",
        "broker_commit_interval": config.commit_interval,
        # a worker killed without leaving its group — or any static member stopped —
        # holds its partitions until the session times out: 10 s bounds that stall after
        # a crash by default; a static member's is longer (timings, relation 7)
        "broker_session_timeout": config.session_timeout,
        "broker_request_timeout": max(timings.REQUEST_TIMEOUT, config.session_timeout),
        "consumer_group_instance_id": config.group_instance_id,
        "broker_heartbeat_interval": timings.HEARTBEAT_INTERVAL,
        "broker_rebalance_timeout": timings.REBALANCE_TIMEOUT,
        # a rebalance does not wait for the messages under way to finish (a handler may
        # wait out an outage for minutes): the revoked partitions' messages are stopped
        # by RuntimeService.revoke, and delivered again to their new owner
        "stream_wait_empty": False,
        "web_enabled": config.web_port is not None,
        "store": "memory://",
        # Faust's default data directory is relative to the current directory
        "datadir": str(load_settings().home / "faust"),
    }
    if config.web_port is not None:
        settings["web_port"] = config.web_port
    settings.update(faust_settings)
    app = faust.App(config.app_id, **settings)
    app.transport = _Transport(app.conf.broker_consumer, app)
    runtime = RuntimeService(config, open_deps, periodic)
    app.service(_bind(runtime))

    async def on_revoked(app: Any, revoked: set[Any], **kwargs: Any) -> None:
        await runtime.revoke(revoked)

    app.on_partitions_revoked.connect(on_revoked)  # type: ignore[arg-type]

    async def on_assigned(app: Any, assigned: set[Any], **kwargs: Any) -> None:
        metrics.PARTITION_ASSIGNMENTS.inc()

    app.on_partitions_assigned.connect(on_assigned)  # type: ignore[arg-type]

    for stage in stages:
        route = config.topics[stage.key]
        topic = app.topic(route.topic, partitions=route.partitions, value_serializer="raw",
                          key_serializer="raw", internal=False)
        app.agent(topic, name=f"stage.{stage.key}")(_agent_for(stage, runtime, app))
    if config.web_port is not None:
        _add_metrics_page(app)
    app.stovepipe_runtime = runtime  # type: ignore[attr-defined]
    return app


def _add_metrics_page(app: faust.App) -> None:

    @app.page("/metrics")
    async def metrics_page(web: Any, request: Any) -> Any:
        return web.bytes(generate_latest(), content_type=CONTENT_TYPE_LATEST.split(";")[0])


def _bind(runtime: RuntimeService[Any]) -> Any:
    class _Bound(Service):
        async def on_start(self) -> None:
            await runtime.start()

        async def on_stop(self) -> None:
            await runtime.stop()

    return _Bound


def _agent_for(stage: Stage[Any], runtime: RuntimeService[Any],
               app: faust.App) -> Callable[[Any], Awaitable[None]]:
    crashes = 0

    async def run_stage(stream: Any) -> None:
        nonlocal crashes
        await runtime.ready.wait()
        delivery = runtime.delivery
        assert delivery is not None

        async def deliver(event: Any) -> None:
            message = event.message
            await delivery.deliver(stage, Incoming(
                topic=message.topic, partition=message.partition, offset=message.offset,
                key=message.key, value=message.value,
                headers=[(k, bytes(v)) for k, v in (message.headers or ())],
                timestamp=message.timestamp or 0.0,
            ))

        # each stage its own window, so a backlog of one stage never starves another
        lanes = Lanes(deliver, limit=runtime.config.max_in_flight, name=stage.key,
                      key_of=lambda event: event.message.key,
                      partition_of=lambda event: event.message.tp,
                      ack=lambda event: event.ack())
        runtime.lanes[stage.key] = lanes

        async def take_events() -> None:
            async for event in stream.noack().events():
                await lanes.submit(event)

        try:
            # taking events, until a failure halts the lanes (however quiet the topic)
            taking = asyncio.ensure_future(take_events())
            halted = asyncio.ensure_future(lanes.halted.wait())
            try:
                await asyncio.wait({taking, halted}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (taking, halted):
                    task.cancel()
                await asyncio.gather(taking, halted, return_exceptions=True)
            if taking.done() and not taking.cancelled() and taking.exception() is not None:
                raise taking.exception()  # type: ignore[misc]
            failure = lanes.failure()
            if failure is not None:
                raise failure
        except LanesHalted as exc:
            # a bug outside the runtime's error handling: the messages under way were
            # never acknowledged, and nothing commits past them. Faust restarts this
            # agent; a rebalance has every partition read again from its committed
            # offset, so they are delivered again (after a pause that grows with
            # repeated crashes, so a bug that always strikes does not storm the group)
            crashes += 1
            pause = min(AGENT_RESTART_FIRST * 2 ** (crashes - 1), AGENT_RESTART_CAP)
            metrics.AGENT_RESTARTS.labels(stage=stage.key).inc()
            log.critical("agent_crashed stage=%s crashes=%d error=%r: restarting it; its "
                         "uncommitted messages are delivered again after a rebalance in "
                         "%.0fs", stage.key, crashes, exc.__cause__, pause)
            await asyncio.sleep(pause)
            await app.consumer.request_rejoin()  # type: ignore[attr-defined]
            raise
        finally:
            if runtime.lanes.get(stage.key) is lanes:
                del runtime.lanes[stage.key]
            await lanes.close()

    run_stage.__name__ = f"stage_{stage.key}"
    return run_stage


def database_deps(dsn: str, *, max_size: int = 10) -> OpenDeps[Database]:
    """Deps for a worker whose stages use only the store: the Database is the deps."""
    async def open_deps() -> tuple[Database, Park, Close]:
        db = await Database.open(dsn, max_size=max_size, name="stovepipe-worker")
        return db, park_into(db), db.close

    return open_deps


def run_worker(app: faust.App, *, loglevel: str = "info") -> None:
    """Run ``app`` as a worker process until SIGTERM/SIGINT.

    Faust's terminal spinner, shown at levels above info, sets the root logger to DEBUG,
    so every aiokafka debug call then builds a log record: measurably slower. No spinner.
    """
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.spinner = None
    worker.execute_from_commandline()
