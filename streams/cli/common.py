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
from streams.cli.failures import kafka_unreachable, postgres_unreachable
from streams.config import settings as settings_mod
from streams.config.kafka_security import KafkaAccessError, KafkaSecurityError
from streams.config.names import InvalidQueueName, QueueConfigError, UnknownQueue
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
        raise postgres_unreachable(settings().postgres_dsn, exc) from None
    except (StoreError, KafkaSecurityError, KafkaAccessError) as exc:
        raise click.ClickException(str(exc)) from None
    except (KafkaError, TimeoutError) as exc:
        raise kafka_unreachable(settings().kafka_bootstrap, exc) from None


def emit(as_json: bool, data: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(queries.jsonable(data), indent=2, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


CONNECT_DEADLINE = 5.0  # seconds a command waits for PostgreSQL or Kafka to answer


async def open_db(pool_size: int = 2, dsn: str | None = None) -> Database:
    """The database for one command. A single connection is tried first, so a database
    that refuses is reported at once rather than after the pool's patience."""
    dsn = dsn or settings().postgres_dsn
    probe = await psycopg.AsyncConnection.connect(dsn, connect_timeout=int(CONNECT_DEADLINE))
    await probe.close()
    return await Database.open(dsn, max_size=pool_size, acquire_timeout=CONNECT_DEADLINE,
                               name="stovepipe-cli")
