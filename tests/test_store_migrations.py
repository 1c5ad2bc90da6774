"""Schema migrations and `stovepipe db`: versioned, idempotent, safe to run concurrently,
and applied to the schema the connection's search_path names."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.conninfo import make_conninfo

from store import MigrationError
from store.migrations import available, migrate, status
from streams.cli.db import db_group

pytestmark = pytest.mark.postgres

TABLES = {
    "culprit_search",
    "request_plan",
    "project_answer",
    "project_state",
    "commit_info",
    "greenness_change",
    "promotion_pin",
    "promotion_problem",
    "worker_host",
    "ingest_lease",
    "queue",
    "request",
    "request_uri",
    "build",
    "validation_fact",
    "queue_counter",
    "parked_message",
    "command_build",
    "webhook_delivery",
    "schema_migrations",
    "notification",  # 0006: commit statuses and alerts
    "queue_health",
    "retention_round",  # 0019: the workers' periodic pruning
    "worker_process",  # 0013: the hosted APIs' budgets shared among worker processes
    "credential_pause",
}


def _tables(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        ).fetchall()
    return {r[0] for r in rows}


def test_shipped_migrations_are_numbered_in_order() -> None:
    migrations = available()
    assert migrations[0].version == "0001"
    versions = [m.version for m in migrations]
    assert versions == sorted(set(versions))
    assert all(re.fullmatch(r"\d{4}", v) for v in versions)


def test_migrate_creates_the_schema_in_the_search_path_schema(schema_dsn: str) -> None:
    assert _tables(schema_dsn) == set()
    assert migrate(schema_dsn) == [m.version for m in available()]
    assert _tables(schema_dsn) == TABLES
    with psycopg.connect(schema_dsn) as conn:
        rows = conn.execute("SELECT version, name FROM schema_migrations").fetchall()
    assert rows[0] == ("0001", "initial")


def test_migrating_twice_applies_nothing_and_keeps_data(migrated_dsn: str) -> None:
    with psycopg.connect(migrated_dsn) as conn:
        conn.execute("INSERT INTO queue (name) VALUES ('monorepo/main')")
        conn.execute("INSERT INTO queue_counter VALUES ('monorepo/main', 7)")
    assert migrate(migrated_dsn) == []
    assert migrate(migrated_dsn) == []
    with psycopg.connect(migrated_dsn) as conn:
        assert conn.execute("SELECT name FROM queue").fetchall() == [("monorepo/main",)]
        assert conn.execute("SELECT value FROM queue_counter").fetchall() == [(7,)]
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone() == (
            len(available()),
        )


def test_concurrent_migrations_apply_each_version_once(schema_dsn: str) -> None:
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda _: migrate(schema_dsn), range(6)))
    applied = [v for result in results for v in result]
    assert sorted(applied) == [m.version for m in available()]
    assert _tables(schema_dsn) == TABLES


def test_an_edited_migration_is_refused(migrated_dsn: str) -> None:
    with psycopg.connect(migrated_dsn) as conn:
        conn.execute("UPDATE schema_migrations SET checksum = 'edited' WHERE version = '0001'")
    with pytest.raises(MigrationError, match="0001_initial was edited"):
        migrate(migrated_dsn)


def test_a_search_path_without_a_schema_is_refused(postgres_dsn: str) -> None:
    dsn = make_conninfo(postgres_dsn, options="-c search_path=no_such_schema_here")
    with pytest.raises(MigrationError, match="names no existing schema"):
        migrate(dsn)


def test_status_lists_pending_then_applied(schema_dsn: str) -> None:
    assert [(s.version, s.applied_at) for s in status(schema_dsn)] == [
        (m.version, None) for m in available()
    ]
    assert _tables(schema_dsn) == set()  # status only reads
    migrate(schema_dsn)
    assert all(s.applied_at is not None for s in status(schema_dsn))


def test_cli_migrate_reports_what_it_applied_then_up_to_date(schema_dsn: str) -> None:
    runner = CliRunner()
    first = runner.invoke(db_group, ["migrate", "--dsn", schema_dsn])
    assert first.exit_code == 0, first.output
    assert "applied migration 0001_initial" in first.output
    # The DSN also comes from the environment.
    second = runner.invoke(db_group, ["migrate"], env={"STOVEPIPE_POSTGRES_DSN": schema_dsn})
    assert second.exit_code == 0, second.output
    assert "up to date" in second.output
    listed = runner.invoke(db_group, ["status", "--dsn", schema_dsn])
    assert listed.exit_code == 0, listed.output
    assert re.search(r"^0001\s+initial\s+\d{4}-", listed.output, re.MULTILINE)


def test_cli_connection_failure_is_a_clear_message(schema_dsn: str) -> None:
    result = CliRunner().invoke(
        db_group, ["migrate", "--dsn", "postgresql://someone:secret@127.0.0.1:1/stovepipe"]
    )
    assert result.exit_code == 1
    assert "cannot reach PostgreSQL" in result.output
    assert "stovepipe dev up" in result.output
    assert "secret" not in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)

    garbled = CliRunner().invoke(db_group, ["migrate", "--dsn", "host=x port"])
    assert garbled.exit_code == 1
    assert "not a PostgreSQL connection string" in garbled.output
