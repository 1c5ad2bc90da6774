"""Versioned schema migrations: `NNNN_name.sql` files in this package, applied in order.

Each migration runs in its own transaction together with its row in `schema_migrations`,
under a transaction-level advisory lock scoped to the target schema, so concurrent
`migrate` calls (several workers starting at once) apply each migration exactly once.
Tables land in the connection's search_path schema; migrations never schema-qualify.
An applied migration must not be edited: its checksum is recorded and verified.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime
from importlib import resources

import psycopg

from store.errors import MigrationError

_FILENAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
# First half of the advisory lock key ("STVP"); the second is a hash of the schema name,
# so migrating one schema does not wait for another.
_LOCK_NAMESPACE = 0x53545650
_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


@dataclass(frozen=True)
class MigrationStatus:
    version: str
    name: str
    applied_at: datetime | None


def available() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    found = []
    for entry in resources.files(__name__).iterdir():
        match = _FILENAME.match(entry.name)
        if match:
            found.append(
                Migration(match["version"], match["name"], entry.read_text(encoding="utf-8"))
            )
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions in {versions}")
    return found


def _connect(dsn: str,
             connect_timeout: float = _CONNECT_TIMEOUT_S) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(dsn, autocommit=True, connect_timeout=max(1, int(connect_timeout)))


def _lock_schema(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Take the per-schema migration lock until the current transaction ends."""
    row = conn.execute("SELECT current_schema()").fetchone()
    if row is None or row[0] is None:
        raise MigrationError(
            "the connection's search_path names no existing schema to migrate; "
            "create the schema or fix the DSN's search_path"
        )
    conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(current_schema()))", (_LOCK_NAMESPACE,))


def _ensure_history_table(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    with conn.transaction():
        _lock_schema(conn)
        conn.execute(
            """
            CREATE TABLE IF NOT EXISTS schema_migrations (
                version    text        PRIMARY KEY,
                name       text        NOT NULL,
                checksum   text        NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now()
            )
            """
        )


def migrate(dsn: str) -> list[str]:
    """Apply every pending migration to the schema `dsn` selects; return their versions.

    Idempotent: a second call applies nothing and returns []. Raises `MigrationError`
    when an applied migration was edited, and psycopg's OperationalError when the
    database cannot be reached.
    """
    applied: list[str] = []
    with _connect(dsn) as conn:
        _ensure_history_table(conn)
        for migration in available():
            with conn.transaction():
                _lock_schema(conn)
                row = conn.execute(
                    "SELECT checksum FROM schema_migrations WHERE version = %s",
                    (migration.version,),
                ).fetchone()
                if row is not None:
                    if row[0] != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.version}_{migration.name} was edited "
                            "after it was applied; add a new migration instead"
                        )
                    continue
                # Bytes: a migration is a multi-statement script with no parameters.
                conn.execute(migration.sql.encode())
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (migration.version, migration.name, migration.checksum),
                )
            applied.append(migration.version)
    return applied


def status(dsn: str, *, connect_timeout: float = _CONNECT_TIMEOUT_S) -> list[MigrationStatus]:
    """Each shipped migration with the time it was applied (None while pending). Read-only."""
    applied_at: dict[str, datetime] = {}
    with _connect(dsn, connect_timeout) as conn:
        row = conn.execute("SELECT to_regclass('schema_migrations')").fetchone()
        if row is not None and row[0] is not None:
            for version, when in conn.execute(
                "SELECT version, applied_at FROM schema_migrations"
            ).fetchall():
                assert isinstance(when, datetime)
                applied_at[str(version)] = when
    return [MigrationStatus(m.version, m.name, applied_at.get(m.version)) for m in available()]
