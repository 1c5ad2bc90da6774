"""The Stovepipe pipeline: every stage and reconciler, and the worker that runs them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import faust

from contract import BuildRequest, BuildSignal, IngestRequest, ProcessRequest, Record
from streams import build, buildsignal, ingest, process, reconcile, record
from streams.deps import Deps
from streams.runtime.config import worker_config
from streams.runtime.stage import Park, Stage
from streams.runtime.worker import build_app, park_into
from streams.topics import TopicsConfig

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


def pipeline_deps(dsn: str, queues_file: str | None = None,
                  pool_size: int = 10) -> Callable[[], Awaitable[tuple[Deps, Park, Any]]]:
    """Opens the database and the queue configuration when the worker starts."""
    from store import Database
    from streams.queueconfig import Extensions, load_queues

    async def open_deps() -> tuple[Deps, Park, Any]:
        queues = load_queues(queues_file)
        db = await Database.open(dsn, max_size=pool_size, name="stovepipe-worker")
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues))
        return deps, park_into(db), db.close

    return open_deps


def build_worker(topics: TopicsConfig, *, app_id: str, bootstrap: str, dsn: str,
                 queues_file: str | None = None, web_port: int | None = None,
                 api_token: str | None = None) -> faust.App:
    """The worker; with a ``web_port`` it also serves the HTTP API and the dashboard
    (streams.http), whose POST endpoints need ``api_token`` when one is given."""
    from streams import http

    config = worker_config(topics, app_id=app_id, bootstrap=bootstrap,
                           consumed=[s.key for s in STAGES], web_port=web_port)
    web_settings = http.faust_settings() if web_port is not None else {}
    app = build_app(config, STAGES, pipeline_deps(dsn, queues_file), **web_settings)
    if web_port is not None:
        http.mount(app, app.stovepipe_runtime, api_token=api_token)  # type: ignore[attr-defined]
    return app
