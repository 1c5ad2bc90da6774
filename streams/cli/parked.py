"""`stovepipe parked`: list, delete and redrive the messages a reconciler parked in
PostgreSQL because they can never be reconciled.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
import psycopg
from confluent_kafka import (
    ConsumerGroupState,
    KafkaError,
)

from store import NotFound, ParkedMessage, StoreError, Stores
from store.parked import ParkedStore
from streams.cli.common import CONNECT_DEADLINE
from streams.cli.db import dsn_option
from streams.cli.failures import postgres_unreachable
from streams.cli.kafka import (
    broker_options,
    json_option,
    load_topics_or_fail,
    open_kafka,
    resolve_dead_letter,
    topics_options,
    yes_option,
)
from streams.cli.messages import (
    TopicMessage,
    blob,
    produce_all,
    redrive_headers,
    safe_text,
)
from streams.config import settings as settings_mod
from streams.runtime import headers as h

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# librdkafka logs (one line per failed connect, ...) go here, not to the terminal: the
# user gets one message from us instead.
_kafka_log = logging.getLogger("stovepipe.operator.kafka")
_kafka_log.addHandler(logging.NullHandler())

FAILURE_HEADERS = (h.DLQ_SOURCE_TOPIC, h.DLQ_SOURCE_PARTITION, h.DLQ_SOURCE_OFFSET,
                   h.DLQ_ATTEMPTS, h.DLQ_ERROR_CLASS, h.DLQ_ERROR_MESSAGE, h.DLQ_TIME)
REDRIVEN_FROM_TOPIC = "redriven-from-topic"
REDRIVEN_FROM_PARTITION = "redriven-from-partition"
REDRIVEN_FROM_OFFSET = "redriven-from-offset"
REDRIVEN_FROM_ERROR = "redriven-from-error-class"
REDRIVEN_FROM_PARKED_ID = "redriven-from-parked-id"
REDRIVEN_AT = "redriven-at"
REDRIVEN_PREFIX = "redriven-"

# Broker answers to an offset change while the group has members (classic and KIP-848).
_ACTIVE_GROUP_ERRORS = frozenset({
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION, KafkaError.STALE_MEMBER_EPOCH,
    KafkaError.FENCED_MEMBER_EPOCH, KafkaError.NON_EMPTY_GROUP,
})
_IDLE_STATES = (ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD)
_NO_OFFSET = -1001  # librdkafka's OFFSET_INVALID: the group never committed here
_PREVIEW_LIMIT = 300


# --- parked ------------------------------------------------------------------------------


class _OneConnection:
    """A store connection source over one autocommit connection: a CLI needs no pool,
    and an unreachable database then fails at once with the driver's reason."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        yield self._conn


def _with_parked(dsn: str | None, action: Callable[[ParkedStore], Awaitable[T]]) -> T:
    """Run ``action`` on the parked-message store; database failures become messages."""
    resolved = dsn or settings_mod.load_settings().postgres_dsn

    async def run() -> T:
        conn = await psycopg.AsyncConnection.connect(resolved, autocommit=True,
                                                     connect_timeout=int(CONNECT_DEADLINE))
        async with conn:
            return await action(Stores(_OneConnection(conn)).parked)

    try:
        return asyncio.run(run())
    except psycopg.errors.UndefinedTable:
        raise click.ClickException(
            "the database has no parked_message table: run `stovepipe db migrate`") from None
    except psycopg.OperationalError as exc:
        raise postgres_unreachable(resolved, exc) from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _parked_json(msg: ParkedMessage) -> dict[str, Any]:
    return {"id": msg.id, "topic": msg.topic, "partition": msg.partition,
            "offset": msg.offset, "key": blob(msg.key), "value": blob(msg.value),
            "headers": [{"key": k, "value": blob(v)} for k, v in msg.headers],
            "error": msg.error, "parked_at": msg.parked_at.isoformat()}


def _parked_lines(msg: ParkedMessage) -> list[str]:
    lines = [f"#{msg.id}  {msg.topic} [{msg.partition}] @{msg.offset}  parked "
             f"{msg.parked_at.isoformat(timespec='seconds')}  key {safe_text(msg.key, 80)}",
             f"  error   {safe_text(msg.error)}",
             f"  value   {safe_text(msg.value)}"]
    if msg.headers:
        lines.append("  headers " + ", ".join(f"{k}={safe_text(v, 80)}"
                                              for k, v in msg.headers))
    return lines


def _parked_topic(topic: str | None, topics_file: Path | None, prefix: str | None
                  ) -> str | None:
    """The dead-letter topic name to filter on: topics.yaml names resolved, other text
    taken as a full Kafka name (rows parked under an older prefix stay reachable)."""
    if topic is None:
        return None
    config = load_topics_or_fail(topics_file, prefix)
    try:
        return resolve_dead_letter(config, topic).full_name
    except click.ClickException:
        return topic


def _list_parked(topic: str | None, limit: int, after_id: int, as_json: bool,
                 topics_file: Path | None, prefix: str | None, dsn: str | None) -> None:
    name = _parked_topic(topic, topics_file, prefix)

    async def fetch(store: ParkedStore) -> tuple[list[ParkedMessage], int]:
        return (await store.list_messages(topic=name, after_id=after_id, limit=limit),
                await store.count(topic=name))

    rows, total = _with_parked(dsn, fetch)
    if as_json:
        click.echo(json.dumps({"topic": name, "total": total, "shown": len(rows),
                               "messages": [_parked_json(m) for m in rows]},
                              indent=2, ensure_ascii=False))
        return
    for msg in rows:
        for line in _parked_lines(msg):
            click.echo(line)
    more = ""
    if rows and len(rows) == limit:
        more = f" (next page: --after-id {rows[-1].id})"
    click.echo(f"{len(rows)} shown, {total} parked{' in ' + name if name else ''}{more}")


def _parked_list_options(func: F) -> F:
    for option in reversed((
        click.option("--topic", metavar="TOPIC",
                     help="Only messages parked from this dead-letter topic (process, "
                          "process_dlq or a full name)."),
        click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True,
                     metavar="N",
                     help="Show at most this many."),
        click.option("--after-id", type=click.IntRange(min=0), default=0, metavar="ID",
                     help="Show messages with an id above this (the next page)."),
        json_option, topics_options, dsn_option,
    )):
        func = option(func)
    return func


@click.group("parked", invoke_without_command=True)
@_parked_list_options
@click.pass_context
def parked_group(ctx: click.Context, topic: str | None, limit: int, after_id: int,
                 as_json: bool, topics_file: Path | None, prefix: str | None,
                 dsn: str | None) -> None:
    """Messages a reconciler parked in PostgreSQL because it can never reconcile them: an
    undecodable payload, an unknown or malformed id, a queue its id does not name, an
    invariant violation.

    Without a subcommand, lists them (like `parked list`).
    """
    if ctx.invoked_subcommand is None:
        _list_parked(topic, limit, after_id, as_json, topics_file, prefix, dsn)


@parked_group.command("list")
@_parked_list_options
def parked_list_command(topic: str | None, limit: int, after_id: int, as_json: bool,
                        topics_file: Path | None, prefix: str | None,
                        dsn: str | None) -> None:
    """List parked messages, oldest first, with the error that parked them."""
    _list_parked(topic, limit, after_id, as_json, topics_file, prefix, dsn)


def _get_parked(parked_id: int, dsn: str | None) -> ParkedMessage:
    async def get(store: ParkedStore) -> ParkedMessage | None:
        try:
            return await store.get(parked_id)
        except NotFound:
            return None

    msg = _with_parked(dsn, get)
    if msg is None:
        raise click.ClickException(f"no parked message #{parked_id} (see `stovepipe parked`)")
    return msg


@parked_group.command("delete")
@click.argument("parked_id", metavar="ID", type=click.IntRange(min=1))
@yes_option
@dsn_option
def parked_delete_command(parked_id: int, yes: bool, dsn: str | None) -> None:
    """Forget parked message ID once you have dealt with it."""
    msg = _get_parked(parked_id, dsn)
    for line in _parked_lines(msg):
        click.echo(line)
    if not yes:
        click.confirm(f"Delete parked message #{parked_id}?", abort=True, err=True)

    async def delete(store: ParkedStore) -> bool:
        return await store.delete(parked_id)

    if not _with_parked(dsn, delete):
        raise click.ClickException(f"parked message #{parked_id} was deleted meanwhile")
    click.echo(f"deleted parked message #{parked_id}")


@parked_group.command("redrive")
@click.argument("parked_id", metavar="ID", type=click.IntRange(min=1))
@yes_option
@dsn_option
@broker_options
def parked_redrive_command(parked_id: int, yes: bool, dsn: str | None,
                           bootstrap: str | None, timeout: float) -> None:
    """Re-produce parked message ID to the topic it was parked from (its dead-letter
    topic), with its key, value and headers (attempt reset to 0), then delete it.

    Useful once the workers can read it (e.g. after a contract fix): the reconciler then
    handles it. Still undecodable, it is parked again under a new id.
    """
    msg = _get_parked(parked_id, dsn)
    for line in _parked_lines(msg):
        click.echo(line)
    with open_kafka(bootstrap, timeout) as kafka:
        kafka.partitions(msg.topic)
        if not yes:
            click.confirm(f"Redrive parked message #{parked_id} to {msg.topic}?",
                          abort=True, err=True)
        record = TopicMessage(msg.topic, msg.partition, msg.offset, None, msg.key, msg.value,
                        msg.headers)
        # back to its dead-letter topic: it keeps the headers saying why it failed
        headers = redrive_headers(record, {REDRIVEN_FROM_PARKED_ID: msg.id},
                                   keep_failure=True)
        produce_all(kafka, [(msg.topic, msg.key, msg.value, headers)],
                     f"redriving #{parked_id}")

    async def delete(store: ParkedStore) -> bool:
        return await store.delete(parked_id)

    deleted = _with_parked(dsn, delete)
    click.echo(f"redriven parked message #{parked_id} to {msg.topic}"
               + ("; deleted it" if deleted else "; it was already deleted"))
