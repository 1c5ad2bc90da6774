"""`stovepipe worker | ingest | request | queue | fact`: run and query the pipeline."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
import psycopg
import psycopg_pool

from store import Database, NotFound, StoreError
from streams import queries
from streams import settings as settings_mod

T = TypeVar("T")

ENV_APP_ID = "STOVEPIPE_APP_ID"
DEFAULT_APP_ID = "stovepipe"
ENV_WEB_PORT = "STOVEPIPE_WEB_PORT"
ENV_API_TOKEN = "STOVEPIPE_API_TOKEN"  # noqa: S105 - the variable's name, not a token
DEFAULT_WEB_PORT = 6066


def _settings() -> settings_mod.Settings:
    return settings_mod.load_settings()


def _run_async(action: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``action``; failures a user can cause become one-line messages."""
    from streams.queueconfig import InvalidQueueName, QueueConfigError, UnknownQueue
    from streams.sourcecontrol import SourceControlError

    try:
        return asyncio.run(action())
    except (UnknownQueue, InvalidQueueName, QueueConfigError, SourceControlError) as exc:
        raise click.ClickException(str(exc)) from None
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
        raise click.ClickException(
            f"cannot reach PostgreSQL: {str(exc).strip()}\nStart the local stack with "
            f"`stovepipe dev up`, or set {settings_mod.ENV_POSTGRES_DSN}.") from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _emit(as_json: bool, data: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(queries.jsonable(data), indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


async def _open_db(pool_size: int = 2) -> Database:
    return await Database.open(_settings().postgres_dsn, max_size=pool_size,
                               acquire_timeout=10, name="stovepipe-cli")


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
queues_option = click.option(
    "--queues", "queues_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Queue configuration YAML [env STOVEPIPE_QUEUES_FILE; default queues.yaml].")


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
    from streams.pipeline import build_worker
    from streams.queueconfig import QueueConfigError, load_queues
    from streams.runtime.worker import run_worker
    from streams.topics import TopicsConfigError, load_topics

    settings = _settings()
    try:
        load_queues(queues_file)  # fail fast on a bad file, before joining the group
        topics = load_topics(settings.topics_file)
    except (QueueConfigError, TopicsConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    app = build_worker(topics, app_id=app_id, bootstrap=settings.kafka_bootstrap,
                       dsn=settings.postgres_dsn,
                       queues_file=str(queues_file) if queues_file else None,
                       web_port=_web_port(web_port, no_web), api_token=api_token or None)
    run_worker(app, loglevel=loglevel)


def _web_port(web_port: int, no_web: bool) -> int | None:
    """The port to serve on, None for none. A port asked for explicitly must be free; the
    default one is skipped with a warning, so several workers can share a machine."""
    from click.core import ParameterSource

    from streams import http

    if no_web or web_port == 0:
        return None
    if http.port_is_free(web_port):
        return web_port
    explicit = click.get_current_context().get_parameter_source("web_port")
    if explicit is not ParameterSource.DEFAULT:
        raise click.ClickException(f"port {web_port} is in use: pick another --web-port "
                                   f"(or {ENV_WEB_PORT}), or pass --no-web")
    click.echo(f"warning: port {web_port} is in use (another worker on this machine?); "
               f"this worker serves no HTTP API, dashboard or /metrics. Pass --web-port "
               f"to choose a free port.", err=True)
    return None


@click.command("ingest")
@click.argument("queue")
@queues_option
def ingest_command(queue: str, queues_file: Path | None) -> None:
    """Validate QUEUE's current head: prints the Request id (the same id for the same
    head, however often you ask)."""
    from streams.poller import IngestClient
    from streams.queueconfig import load_queues
    from streams.topics import load_topics

    settings = _settings()

    async def run() -> str:
        queues = load_queues(queues_file)
        async with IngestClient(settings, queues, load_topics(settings.topics_file)) as client:
            return (await client.ingest(queue)).request_id

    click.echo(_run_async(run))


@click.command("request")
@click.argument("request_id")
@json_option
def request_command(request_id: str, as_json: bool) -> None:
    """Show a Request: state, strategy, builds and its fact."""
    try:
        queries.parse_request_path(request_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None

    async def run() -> dict[str, Any]:
        db = await _open_db()
        try:
            try:
                detail = await queries.request_detail(db, request_id)
            except NotFound:
                raise click.ClickException(f"no request {request_id!r}") from None
            return {"request": detail.request, "builds": detail.builds, "fact": detail.fact}
        finally:
            await db.close()

    data = _run_async(run)
    r = data["request"]
    lines = [f"{r.id}  {r.state}", f"  uri       {r.uri}",
             f"  strategy  {r.build_strategy or '-'}" + (f" (base {r.base_uri})"
                                                          if r.base_uri else ""),
             f"  updated   {r.updated_at.isoformat()}"]
    lines += [f"  build     {b.id}  {b.status}" for b in data["builds"]]
    fact = data["fact"]
    lines.append(f"  fact      degree {fact.degree:g} ({'green' if fact.is_green else 'red'})"
                 if fact else "  fact      none")
    _emit(as_json, data, lines)


@click.command("queue")
@click.argument("name")
@json_option
def queue_command(name: str, as_json: bool) -> None:
    """Show a queue: last-green bookmark, in-flight builds, latest Request."""

    async def run() -> Any:
        db = await _open_db()
        try:
            return await db.queues.get(name)
        except NotFound:
            raise click.ClickException(
                f"queue {name!r} has no state yet (nothing was ingested for it)") from None
        finally:
            await db.close()

    q = _run_async(run)
    _emit(as_json, {"queue": q}, [
        f"{q.name}",
        f"  last green  {q.last_green_uri or '-'}"
        + (f"  ({q.last_green_request_id})" if q.last_green_request_id else ""),
        f"  in flight   {q.in_flight_count}",
        f"  latest      {q.latest_request_id or '-'}",
    ])


@click.command("fact")
@click.argument("queue")
@click.argument("uri")
@json_option
def fact_command(queue: str, uri: str, as_json: bool) -> None:
    """Is URI green on QUEUE? Exit status 0 when green, 3 when red or unknown (no fact
    means not green), so a deploy gate can use it directly."""

    async def run() -> Any:
        db = await _open_db()
        try:
            return await queries.fact_or_none(db, queue, uri)
        finally:
            await db.close()

    fact = _run_async(run)
    if fact is None:
        _emit(as_json, {"fact": None, "green": False},
              [f"{uri}: no fact (not green)"])
    else:
        _emit(as_json, {"fact": fact, "green": fact.is_green},
              [f"{uri}: degree {fact.degree:g} ({'green' if fact.is_green else 'red'}), "
               f"by {fact.request_id} at {fact.created_at.isoformat()}"])
    if fact is None or not fact.is_green:
        raise SystemExit(3)
