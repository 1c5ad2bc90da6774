"""One-line answers for the failures a user meets first: the broker or the database not
there, a home directory that cannot be made. Each names the endpoint (never a password)
and what to do, and ends the command with a non-zero exit; never a traceback."""

from __future__ import annotations

import re
from pathlib import Path

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from streams.config import settings as settings_mod

# what libpq says when TLS, not the server's absence, failed the connection
_TLS_WORDS = re.compile(r"SSL|certificate|sslrootcert|sslmode", re.IGNORECASE)


def first_line(exc: BaseException) -> str:
    """The gist of an error: its first line, whitespace squashed."""
    text = " ".join(str(exc).strip().splitlines()[:1][0].split()) if str(exc).strip() else ""
    return text or type(exc).__name__


def postgres_endpoint(dsn: str) -> str:
    """``user@host:port/dbname`` of a DSN, without its password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DSN>"
    host = params.get("host") or "localhost"
    user = f"{params['user']}@" if params.get("user") else ""
    return f"{user}{host}:{params.get('port') or 5432}/{params.get('dbname') or ''}"


def postgres_unreachable(dsn: str, exc: BaseException) -> click.ClickException:
    reason = first_line(exc)
    if _TLS_WORDS.search(reason):
        return click.ClickException(
            f"TLS with PostgreSQL at {postgres_endpoint(dsn)} failed ({reason}): check "
            f"sslmode and sslrootcert (the CA that signed the server's certificate) in "
            f"{settings_mod.ENV_POSTGRES_DSN}")
    return click.ClickException(
        f"cannot reach PostgreSQL at {postgres_endpoint(dsn)} ({first_line(exc)}): start it "
        f"(`stovepipe dev up` runs a local one) or point {settings_mod.ENV_POSTGRES_DSN} at "
        f"a running database")


def kafka_unreachable(bootstrap: str, exc: BaseException | str) -> click.ClickException:
    reason = exc if isinstance(exc, str) else first_line(exc)
    return click.ClickException(
        f"cannot reach Kafka at {bootstrap} ({reason}): start it (`stovepipe dev up` runs a "
        f"local one) or point {settings_mod.ENV_KAFKA_BOOTSTRAP} at a running broker")


def ensure_home(home: Path) -> Path:
    """Create Stovepipe's home directory if it does not exist yet."""
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.ClickException(
            f"cannot create {settings_mod.ENV_HOME} {home} ({exc.strerror or exc}): set "
            f"{settings_mod.ENV_HOME} to a directory this user may write") from None
    return home
