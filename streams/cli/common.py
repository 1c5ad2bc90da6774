"""What the command groups share: running a coroutine with user errors turned into
one-line messages, printing text or JSON, the database for a CLI call, common options."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click
import psycopg
import psycopg_pool
from aiokafka.errors import KafkaError

from store import Database, StoreError
from streams.config import settings as settings_mod
from streams.config.queues import InvalidQueueName, QueueConfigError, UnknownQueue
from streams.extensions.sourcecontrol import SourceControlError
from streams.web import queries

T = TypeVar("T")

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")
queues_option = click.option(
    "--queues", "queues_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Queue configuration YAML [env STOVEPIPE_QUEUES_FILE; default queues.yaml].")


def settings() -> settings_mod.Settings:
    return settings_mod.load_settings()


def run_async(action: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``action``; failures a user can cause become one-line messages."""
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
    except KafkaError as exc:
        raise click.ClickException(
            f"cannot reach Kafka at {settings().kafka_bootstrap}: {exc}\nStart the local "
            f"stack with `stovepipe dev up`, or set {settings_mod.ENV_KAFKA_BOOTSTRAP}."
        ) from None


def emit(as_json: bool, data: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(queries.jsonable(data), indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


async def open_db(pool_size: int = 2) -> Database:
    return await Database.open(settings().postgres_dsn, max_size=pool_size,
                               acquire_timeout=10, name="stovepipe-cli")
