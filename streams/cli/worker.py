"""`stovepipe worker`: every stage and reconciler in one process, with the HTTP API, the
dashboard and /metrics on the same web server. Scale out by starting more."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from streams.cli.common import queues_option, settings
from streams.config.queues import QueueConfigError, load_queues
from streams.config.settings import (
    DEFAULT_APP_ID,
    DEFAULT_WEB_PORT,
    ENV_API_TOKEN,
    ENV_APP_ID,
    ENV_WEB_PORT,
)
from streams.config.topics import TopicsConfig, TopicsConfigError, load_topics

if TYPE_CHECKING:
    import faust


def build_worker(topics: TopicsConfig, *, app_id: str, bootstrap: str, dsn: str,
                 queues_file: Path | str | None = None, web_port: int | None = None,
                 api_token: str | None = None) -> faust.App:
    """The worker's Faust app; with a ``web_port`` it also serves the HTTP API and the
    dashboard (`streams.web.api`), whose POST endpoints need ``api_token`` when given."""
    # Deferred: Faust and aiohttp take a while to import, and only `worker` needs them.
    from streams.runtime.config import worker_config
    from streams.runtime.worker import build_app
    from streams.stages.pipeline import STAGES, open_pipeline_deps
    from streams.web import api

    config = worker_config(topics, app_id=app_id, bootstrap=bootstrap,
                           consumed=[s.key for s in STAGES], web_port=web_port)
    web_settings = api.faust_settings() if web_port is not None else {}
    app = build_app(config, STAGES, open_pipeline_deps(dsn, queues_file), **web_settings)
    if web_port is not None:
        api.mount(app, app.stovepipe_runtime, api_token=api_token)  # type: ignore[attr-defined]
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
@click.option("--loglevel", type=click.Choice(["debug", "info", "warn", "error"]),
              default="info", show_default=True)
@queues_option
def worker_command(app_id: str, web_port: int, no_web: bool, api_token: str | None,
                   loglevel: str, queues_file: Path | None) -> None:
    """Run every stage and reconciler in this process (scale out: start more)."""

    # Deferred: Faust takes a while to import, and only `worker` needs it.
    from streams.runtime.worker import run_worker

    current = settings()
    try:
        load_queues(queues_file)  # fail fast on a bad file, before joining the group
        topics = load_topics(current.topics_file)
    except (QueueConfigError, TopicsConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    app = build_worker(topics, app_id=app_id, bootstrap=current.kafka_bootstrap,
                       dsn=current.postgres_dsn, queues_file=queues_file,
                       web_port=_web_port(web_port, no_web), api_token=api_token or None)
    run_worker(app, loglevel=loglevel)


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
