"""`stovepipe db …`: apply and inspect the schema migrations."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from store import migrations
from store.errors import StoreError
from streams.cli.failures import postgres_endpoint, postgres_unreachable
from streams.config import settings as settings_mod

T = TypeVar("T")

dsn_option = click.option(
    "--dsn",
    envvar=settings_mod.ENV_POSTGRES_DSN,
    default=None,
    metavar="DSN",
    help=(
        f"PostgreSQL connection string [env {settings_mod.ENV_POSTGRES_DSN}; "
        f"default: the local stack, {settings_mod.LOCAL_POSTGRES_DSN}]"
    ),
)


def _resolve_dsn(dsn: str | None) -> str:
    return dsn or settings_mod.load_settings().postgres_dsn


def _run(dsn: str, action: Callable[[str], T]) -> T:
    """Run `action(dsn)`, turning the failures a user can cause into clear messages."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise click.ClickException(f"not a PostgreSQL connection string: {exc}") from exc
    try:
        return action(dsn)
    except psycopg.OperationalError as exc:
        raise postgres_unreachable(dsn, exc) from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    except psycopg.Error as exc:
        raise click.ClickException(
            f"database error on {postgres_endpoint(dsn)}: {type(exc).__name__}: {exc}"
        ) from exc


@click.group("db")
def db_group() -> None:
    """Manage the PostgreSQL schema."""


@db_group.command("migrate")
@dsn_option
def migrate_command(dsn: str | None) -> None:
    """Apply pending schema migrations (safe to run again, and concurrently)."""
    applied = _run(_resolve_dsn(dsn), migrations.migrate)
    if not applied:
        click.echo("database schema is up to date")
        return
    names = {m.version: m.name for m in migrations.available()}
    for version in applied:
        click.echo(f"applied migration {version}_{names[version]}")


@db_group.command("status")
@dsn_option
def status_command(dsn: str | None) -> None:
    """List the schema migrations and whether each is applied."""
    for entry in _run(_resolve_dsn(dsn), migrations.status):
        when = entry.applied_at.isoformat(timespec="seconds") if entry.applied_at else "pending"
        click.echo(f"{entry.version}  {entry.name:<30} {when}")
