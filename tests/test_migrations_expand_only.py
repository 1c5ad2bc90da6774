"""Issue 25, item 5: every migration since the release this one upgrades from (3cbbf76,
which shipped up to 0010) is expand-only, so that release's workers keep running while
the new one migrates and rolls out: no dropped or renamed column or table, no NOT NULL
without a default, no narrowing of a column's type, no new constraint that rows it
writes could break (a CHECK or foreign key added to an existing table), no trigger that
refuses what it does. Contracting (dropping what nothing reads any more) waits for a
later release, and says so in its file with `-- contract:` and the release it follows."""

from __future__ import annotations

import re

import pytest

from store.migrations import Migration, available

BASELINE = "0010"  # the newest migration of release 3cbbf76
FORBIDDEN = [
    (r"\bDROP\s+(COLUMN|TABLE)\b", "drops a column or table"),
    (r"\bRENAME\b", "renames"),
    (r"\bALTER\s+COLUMN\s+\w+\s+(SET\s+NOT\s+NULL|TYPE)\b", "narrows a column"),
    (r"\bADD\s+COLUMN\s+\w+\s+[\w\[\]\s]*?\bNOT\s+NULL\b(?![^,;]*\bDEFAULT\b)",
     "adds a NOT NULL column without a default"),
    (r"\bALTER\s+TABLE\s+\w+\s+ADD\s+CONSTRAINT\b", "adds a constraint to an existing table"),
    (r"\bCREATE\s+TRIGGER\s+\w+\s+BEFORE\s+(INSERT|UPDATE)[^;]*\bON\s+(request|build|queue|"
     r"validation_fact|request_uri|command_build|notification)\b",
     "adds a trigger that could refuse the release before's writes"),
]


def _statements(sql: str) -> str:
    """The migration without its comments, one line."""
    return " ".join(re.sub(r"--[^\n]*", "", sql).split())


NEW = [m for m in available() if m.version > BASELINE]


@pytest.mark.parametrize("migration", NEW, ids=lambda m: f"{m.version}_{m.name}")
def test_a_migration_since_the_last_release_only_expands(migration: Migration) -> None:
    if "-- contract:" in migration.sql:
        pytest.skip("a contract step, allowed a release after what it removes was unused")
    text = _statements(migration.sql)
    found = [why for pattern, why in FORBIDDEN if re.search(pattern, text, re.IGNORECASE)]
    assert found == [], f"{migration.version}_{migration.name} {', '.join(found)}"


@pytest.mark.parametrize(("sql", "why"), [
    ("ALTER TABLE request DROP COLUMN reason;", "drops a column or table"),
    ("ALTER TABLE build RENAME COLUMN reason TO why;", "renames"),
    ("ALTER TABLE request ADD COLUMN x integer NOT NULL;", "adds a NOT NULL column"),
    ("ALTER TABLE build ADD CONSTRAINT build_attempt_positive CHECK (attempt > 0);",
     "adds a constraint to an existing table"),
    ("ALTER TABLE request ALTER COLUMN reason SET NOT NULL;", "narrows a column"),
])
def test_the_check_catches_what_breaks_running_workers(sql: str, why: str) -> None:
    text = _statements(sql)
    assert any(re.search(pattern, text, re.IGNORECASE) and why in reason
               for pattern, reason in FORBIDDEN)


def test_what_only_expands_passes() -> None:
    text = _statements("ALTER TABLE request ADD COLUMN revalidations integer NOT NULL "
                       "DEFAULT 0; ALTER TABLE build ADD COLUMN started_at timestamptz; "
                       "CREATE TABLE x (a text NOT NULL);")
    assert [why for pattern, why in FORBIDDEN if re.search(pattern, text, re.IGNORECASE)] == []
