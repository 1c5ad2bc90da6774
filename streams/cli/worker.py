"""`stovepipe worker`: every stage and reconciler in one process, with the HTTP API, the
dashboard and /metrics on the same web server. Scale out by starting more."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import click
import psycopg
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from click.core import ParameterSource

from store import migrations
from streams.cli.common import CONNECT_DEADLINE, queues_option, settings
from streams.cli.failures import (
    ensure_home,
    first_line,
    kafka_unreachable,
    postgres_endpoint,
    postgres_unreachable,
)
from streams.config.queues import QueueConfigError, load_queues
from streams.config.settings import (
    DEFAULT_APP_ID,
    DEFAULT_DB_POOL,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_WEB_PORT,
    DEFAULT_WEBHOOK_BODIES,
    DEFAULT_WEBHOOK_READ_TIMEOUT,
    ENV_API_TOKEN,
    ENV_APP_ID,
    ENV_DB_POOL,
    ENV_MAX_IN_FLIGHT,
    ENV_SWEEP_INTERVAL,
    ENV_WEB_PORT,
    ENV_WEBHOOK_BODIES,
    ENV_WEBHOOK_READ_TIMEOUT,
    Settings,
)
from streams.config.topics import TopicsConfig, TopicsConfigError, load_topics

if TYPE_CHECKING:
    import faust

    from streams.web.webhooks import WebhookLimits


def build_worker(topics: TopicsConfig, *, app_id: str, bootstrap: str, dsn: str,
                 queues_file: Path | str | None = None, web_port: int | None = None,
                 api_token: str | None = None, sweep_interval: float | None = None,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, db_pool: int = DEFAULT_DB_POOL,
                 webhook_limits: WebhookLimits | None = None) -> faust.App:
    """The worker's Faust app; with a ``web_port`` it also serves the HTTP API and the
    dashboard (`streams.web.api`), whose POST endpoints need ``api_token`` when given,
    and the push webhooks within ``webhook_limits`` (the defaults when None)."""
    # Deferred: Faust and aiohttp take a while to import, and only `worker` needs them.
    from streams.runtime.config import worker_config
    from streams.runtime.worker import build_app
    from streams.stages.pipeline import (
        DEFAULT_SWEEP_INTERVAL,
        STAGES,
        open_pipeline_deps,
        periodic_tasks,
    )
    from streams.web import api
    from streams.web.webhooks import WebhookLimits

    config = worker_config(topics, app_id=app_id, bootstrap=bootstrap,
                           consumed=[s.key for s in STAGES], web_port=web_port,
                           max_in_flight=max_in_flight)
    web_settings = api.faust_settings() if web_port is not None else {}
    periodic = periodic_tasks(sweep_interval or DEFAULT_SWEEP_INTERVAL)
    app = build_app(config, STAGES, open_pipeline_deps(dsn, queues_file, pool_size=db_pool),
                    periodic, **web_settings)
    if web_port is not None:
        api.mount(app, app.stovepipe_runtime,  # type: ignore[attr-defined]
                  api_token=api_token, webhook_limits=webhook_limits or WebhookLimits())
    return app


@click.command("worker")
@click.option("--app-id", envvar=ENV_APP_ID, default=DEFAULT_APP_ID, show_default=True,
              help=f"Kafka consumer group of the workers; workers sharing it share the "
                   f"partitions [env {ENV_APP_ID}].")
@click.option("--web-port", type=click.IntRange(0, 65535), default=DEFAULT_WEB_PORT,
              envvar=ENV_WEB_PORT, show_default=True,
              help=f"Serve the HTTP API, the dashboard and /metrics on this port; 0 serves "
                   f"nothing [env {ENV_WEB_PORT}]. When the default port is taken "
                   f"(another worker on this machine) the worker runs without them.")
@click.option("--no-web", is_flag=True, help="Serve no HTTP at all (same as --web-port 0).")
@click.option("--api-token", envvar=ENV_API_TOKEN, default=None,
              help=f"Bearer token the HTTP API's POST endpoints require; reads stay open "
                   f"[env {ENV_API_TOKEN}].")
@click.option("--sweep-interval", type=click.FloatRange(min=0.1), default=None,
              envvar=ENV_SWEEP_INTERVAL, metavar="SECONDS",
              help=f"Seconds between two sweeps for Requests and builds whose messages "
                   f"were lost [default: 5; env {ENV_SWEEP_INTERVAL}].")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=DEFAULT_MAX_IN_FLIGHT,
              envvar=ENV_MAX_IN_FLIGHT, show_default=True, metavar="N",
              help=f"Messages each stage works on at once in this worker (one at a time "
                   f"per Kafka key); beyond it the stage stops fetching "
                   f"[env {ENV_MAX_IN_FLIGHT}].")
@click.option("--db-pool", type=click.IntRange(min=1), default=DEFAULT_DB_POOL,
              envvar=ENV_DB_POOL, show_default=True, metavar="N",
              help=f"PostgreSQL connections this worker keeps at most [env {ENV_DB_POOL}].")
@click.option("--webhook-bodies", type=click.IntRange(min=1), default=DEFAULT_WEBHOOK_BODIES,
              envvar=ENV_WEBHOOK_BODIES, show_default=True, metavar="N",
              help=f"Push webhook bodies this worker reads at once, per provider; one more "
                   f"is answered 503 with Retry-After [env {ENV_WEBHOOK_BODIES}].")
@click.option("--webhook-read-timeout", type=click.FloatRange(min=0.1),
              default=DEFAULT_WEBHOOK_READ_TIMEOUT, envvar=ENV_WEBHOOK_READ_TIMEOUT,
              show_default=True, metavar="SECONDS",
              help=f"Seconds a push webhook's body may take to arrive after its headers; "
                   f"then 408 and the connection is closed [env {ENV_WEBHOOK_READ_TIMEOUT}].")
@click.option("--loglevel", type=click.Choice(["debug", "info", "warn", "error"]),
              default="info", show_default=True)
@queues_option
def worker_command(app_id: str, web_port: int, no_web: bool, api_token: str | None,
                   sweep_interval: float | None, max_in_flight: int, db_pool: int,
                   webhook_bodies: int, webhook_read_timeout: float, loglevel: str,
                   queues_file: Path | None) -> None:
    """Run every stage and reconciler in this process (scale out: start more)."""

    # Deferred: Faust (and aiohttp) take a while to import, and only `worker` needs them.
    from streams.runtime.worker import run_worker
    from streams.web.webhooks import WebhookLimits

    current = settings()
    try:
        load_queues(queues_file)  # fail fast on a bad file, before joining the group
        topics = load_topics(current.topics_file)
    except (QueueConfigError, TopicsConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    ensure_home(current.home)
    check_dependencies(current, topics)
    app = build_worker(topics, app_id=app_id, bootstrap=current.kafka_bootstrap,
                       dsn=current.postgres_dsn, queues_file=queues_file,
                       web_port=_web_port(web_port, no_web), api_token=api_token or None,
                       sweep_interval=sweep_interval, max_in_flight=max_in_flight,
                       db_pool=db_pool, webhook_limits=WebhookLimits(
                           bodies=webhook_bodies, read_timeout=webhook_read_timeout))
    run_worker(app, loglevel=loglevel)


def check_dependencies(current: Settings, topics: TopicsConfig) -> None:
    """Before joining the group: the database answers and is migrated, the broker
    answers and has the topics. Each failure is one line saying what to do."""
    dsn = current.postgres_dsn
    try:
        pending = [m for m in migrations.status(dsn, connect_timeout=CONNECT_DEADLINE)
                   if m.applied_at is None]
    except psycopg.OperationalError as exc:
        raise postgres_unreachable(dsn, exc) from None
    except psycopg.Error as exc:
        raise click.ClickException(f"PostgreSQL at {postgres_endpoint(dsn)} refused: "
                                   f"{first_line(exc)}") from None
    if pending:
        names = ", ".join(f"{m.version}_{m.name}" for m in pending)
        raise click.ClickException(f"the database at {postgres_endpoint(dsn)} lacks the "
                                   f"migrations {names}: run `stovepipe db migrate`")
    missing = _missing_topics(current.kafka_bootstrap, topics)
    if missing:
        raise click.ClickException(
            f"Kafka at {current.kafka_bootstrap} lacks {len(missing)} topic(s) of "
            f"{topics.path} (first: {missing[0]}): run `stovepipe topics create`")


def _missing_topics(bootstrap: str, topics: TopicsConfig) -> list[str]:
    """The topics of ``topics`` the broker lacks; a one-line error when it does not answer.
    Asked through aiokafka, the client the worker itself runs on."""

    async def ask() -> set[str]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        try:
            async with asyncio.timeout(CONNECT_DEADLINE):
                await consumer.start()
                return set(await consumer.topics())
        finally:
            await consumer.stop()

    try:
        existing = asyncio.run(ask())
    except (KafkaError, TimeoutError, OSError) as exc:
        raise kafka_unreachable(bootstrap, exc if not isinstance(exc, TimeoutError) else
                                f"no answer within {CONNECT_DEADLINE:g}s") from None
    return [t.full_name for t in topics.all_topics() if t.full_name not in existing]


def _web_port(web_port: int, no_web: bool) -> int | None:
    """The port to serve on, None for none. A port asked for explicitly must be free; the
    default one is skipped with a warning, so several workers can share a machine."""
    # Deferred: streams.web.api imports Faust (slow), only the worker needs it.
    from streams.web.api import port_is_free

    if no_web or web_port == 0:
        return None
    if port_is_free(web_port):
        return web_port
    explicit = click.get_current_context().get_parameter_source("web_port")
    if explicit is not ParameterSource.DEFAULT:
        raise click.ClickException(f"port {web_port} is in use: pick another --web-port "
                                   f"(or {ENV_WEB_PORT}), or pass --no-web")
    click.echo(f"warning: port {web_port} is in use (another worker on this machine?); "
               f"this worker serves no HTTP API, dashboard or /metrics. Pass --web-port "
               f"to choose a free port.", err=True)
    return None
