"""The Stovepipe pipeline: every stage and reconciler, and what they share when a worker
runs them (`open_pipeline_deps`). The worker process itself is assembled by
`streams.cli.worker` (the Faust app, plus the HTTP API on the same web server)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from contract import BuildRequest, BuildSignal, IngestRequest, ProcessRequest, Record
from store import Database
from store.worker_hosts import HEARTBEAT_GAP
from streams.config.queues import Extensions, load_queues
from streams.config.settings import DEFAULT_DB_POOL, load_settings
from streams.extensions import budget
from streams.runtime.classify import is_outage
from streams.runtime.logs import bounded
from streams.runtime.periodic import PeriodicTask
from streams.runtime.stage import Park, Publisher, Stage, park_into
from streams.stages import (
    budgets,
    build,
    buildsignal,
    gauges,
    ingest,
    notify,
    process,
    reconcile,
    record,
    retention,
    sweeper,
)
from streams.stages.deps import Deps

DEFAULT_SWEEP_INTERVAL = 5.0
# seconds between two tends of the build runners (a command runner's heartbeat, and the
# worker's own): three of them fit in store.worker_hosts.HEARTBEAT_GAP, well below any
# host_timeout (at least store.worker_hosts.MIN_HOST_TIMEOUT)
TEND_INTERVAL = 2.0

log = logging.getLogger("stovepipe.pipeline")

STAGES: tuple[Stage[Any], ...] = (
    Stage("ingest", IngestRequest, ingest.handle_ingest),
    Stage("process", ProcessRequest, process.handle_process),
    Stage("build", BuildRequest, build.handle_build),
    Stage("buildsignal", BuildSignal, buildsignal.handle_buildsignal),
    Stage("record", Record, record.handle_record),
    Stage("ingest_dlq", IngestRequest, reconcile.handle_ingest_dlq),
    Stage("process_dlq", ProcessRequest, reconcile.handle_process_dlq),
    Stage("build_dlq", BuildRequest, reconcile.handle_build_dlq),
    Stage("buildsignal_dlq", BuildSignal, reconcile.handle_buildsignal_dlq),
    Stage("record_dlq", Record, reconcile.handle_record_dlq),
)


def periodic_tasks(
        sweep_interval: float = DEFAULT_SWEEP_INTERVAL) -> tuple[PeriodicTask[Deps], ...]:
    """What a pipeline worker does on a timer: the sweeper (design §6, liveness), the
    tend of the build runners that run builds on this host, the sender of commit statuses
    and alerts with the staleness judge, the lag gauges, and retention (a round when one
    is due, at most one worker at a time; a no-op while retention is off)."""
    return (PeriodicTask("sweeper", sweep_interval, sweeper.sweep),
            PeriodicTask("tend_build_runners", TEND_INTERVAL, tend_build_runners),
            PeriodicTask("notify", notify.INTERVAL, notify.send_notifications),
            PeriodicTask("gauges", sweep_interval, gauges.refresh_gauges),
            PeriodicTask("retention", sweep_interval, retention.apply_retention))


async def tend_build_runners(deps: Deps, publish: Publisher) -> None:
    """Call ``tend()`` on every configured queue's build runner that has one (the command
    runner: launch, watch and heartbeat the builds this host owns). Runners are built
    here if need be, so a restarted worker resumes its builds before any message asks. A
    failing runner does not keep the others from their tend; an outage ends the round."""
    # this host's own sign of life: the evidence it needs before it may judge another
    # host lost (store.worker_hosts)
    host = load_settings().host_id
    await deps.db.worker_hosts.heartbeat(host, HEARTBEAT_GAP)
    # this process's: how the workers count each other to share the hosted APIs' budgets,
    # and tell each other of rate limits (streams.stages.budgets)
    await budgets.share_budgets(deps.db, host)
    for queue in deps.queues.names():
        try:
            tend = getattr(deps.extensions.build_runner(queue), "tend", None)
            if tend is not None:
                await tend()
        except Exception as exc:
            if is_outage(exc):
                raise
            log.error("tend_failed queue=%s error=%s", queue,
                      bounded(f"{type(exc).__name__}: {exc}"))


OpenPipelineDeps = Callable[[], Awaitable[tuple[Deps, Park, Callable[[], Awaitable[None]]]]]


def open_pipeline_deps(dsn: str, queues_file: Path | str | None = None,
                       pool_size: int = DEFAULT_DB_POOL) -> OpenPipelineDeps:
    """Opens the database and the queue configuration when the worker starts."""

    async def open_deps() -> tuple[Deps, Park, Callable[[], Awaitable[None]]]:
        # a worker: its hosted APIs' budgets take the conservative share until it has
        # counted the live workers (streams.stages.budgets)
        budget.start_counting()
        queues = load_queues(queues_file)
        # all connections up front: the pool grows one connection at a time, so under a
        # sudden backlog handlers would queue for connections for seconds (measured)
        db = await Database.open(dsn, min_size=pool_size, max_size=pool_size,
                                 name="stovepipe-worker")
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))

        async def close() -> None:
            await deps.extensions.aclose()
            await db.close()

        return deps, park_into(db), close

    return open_deps
