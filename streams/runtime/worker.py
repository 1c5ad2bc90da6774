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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from mode import Service
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from store import Database
from streams.config.settings import load_settings
from streams.runtime import logs
from streams.runtime.config import WorkerConfig
from streams.runtime.delay import DelayScheduler, DelayTiers
from streams.runtime.kafka import KafkaPublisher
from streams.runtime.lanes import Lanes
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


class _ConsumerDelegate(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> Any:
        return _Consumer(self, loop=self.loop, beacon=self.beacon)


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

    async def start(self) -> None:
        cfg = self.config
        logs.install()  # logging is configured by now: bound every line, damp floods
        deps, park, close = await self.open_deps()
        self._close_deps = close
        self._publisher = KafkaPublisher(cfg.bootstrap, cfg.topics)
        await self._publisher.start()
        tiers = DelayTiers(cfg.delay_tiers)
        producer = self._publisher.producer
        self.delivery = Delivery(producer=producer, tiers=tiers, routes=cfg.routes,
                                 publish=self._publisher, park=park, deps=deps)
        self._scheduler = DelayScheduler(bootstrap=cfg.bootstrap, group_id=f"{cfg.app_id}-delay",
                                         tiers=tiers, producer=producer)
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
        "broker": f"kafka://{config.bootstrap}",
        "topic_allow_declare": False,
        "topic_disable_leader": True,
        "consumer_auto_offset_reset": "earliest",
        "broker_commit_interval": config.commit_interval,
        # a worker killed without leaving its group holds its partitions until the
        # session times out; 10 s bounds that stall after a crash
        "broker_session_timeout": 10.0,
        "broker_heartbeat_interval": 1.0,
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

    for stage in stages:
        route = config.topics[stage.key]
        topic = app.topic(route.topic, partitions=route.partitions, value_serializer="raw",
                          key_serializer="raw", internal=False)
        app.agent(topic, name=f"stage.{stage.key}")(_agent_for(stage, runtime))
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


def _agent_for(stage: Stage[Any],
               runtime: RuntimeService[Any]) -> Callable[[Any], Awaitable[None]]:
    async def run_stage(stream: Any) -> None:
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
        try:
            async for event in stream.noack().events():
                await lanes.submit(event)
        finally:
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
