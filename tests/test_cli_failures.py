"""The first failures a user meets: the broker down, the database down, a home directory
that does not exist yet. Every command answers with one line naming the endpoint and what
to do, exits non-zero, prints no traceback, and does so within 10 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streams.config.settings import REPO_ROOT
from tests.stack_support import free_ports

STOVEPIPE = [sys.executable, "-m", "streams.cli"]
COMMANDS = [
    ("worker",), ("ingest", "demo/main"), ("poll", "--once"),
    ("request", "request/demo/main/1"), ("queue", "demo/main"),
    ("fact", "demo/main", "fake://demo/main/a1"), ("parked",), ("db", "status"),
    ("db", "migrate"), ("topics", "verify"), ("topics", "create"),
    ("replay", "process", "--to-beginning", "--dry-run"), ("dlq", "list", "process"),
    ("retry", "demo/main"), ("last-green", "demo/main"),
]


def _run(args: tuple[str, ...], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                              float]:
    started = time.monotonic()
    out = subprocess.run([*STOVEPIPE, *args], env=env, capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)
    return out, time.monotonic() - started


def _env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    dead = free_ports(1)[0]  # nothing listens there
    env = dict(os.environ, STOVEPIPE_HOME=str(tmp_path / "not" / "yet" / "there"),
               STOVEPIPE_KAFKA_BOOTSTRAP=f"127.0.0.1:{dead}",
               STOVEPIPE_POSTGRES_DSN=f"postgresql://stovepipe@127.0.0.1:{dead}/stovepipe")
    env.update(overrides)
    return env


def _assert_one_clear_line(out: subprocess.CompletedProcess[str], seconds: float,
                           endpoint: str) -> None:
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode != 0, lines
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    assert endpoint in lines[0], lines[0]
    assert seconds < 10, f"{seconds:.1f}s"


@pytest.mark.parametrize("args", COMMANDS, ids=["-".join(a[:2]) for a in COMMANDS])
def test_everything_down(args: tuple[str, ...], tmp_path: Path) -> None:
    env = _env(tmp_path)
    out, seconds = _run(args, env)
    kafka, dsn = env["STOVEPIPE_KAFKA_BOOTSTRAP"], env["STOVEPIPE_POSTGRES_DSN"]
    endpoint = kafka if args[0] in ("topics", "replay", "dlq") else dsn.split("@")[1]
    _assert_one_clear_line(out, seconds, endpoint)


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.parametrize("args", [("worker",), ("ingest", "demo/main"), ("poll", "--once")],
                         ids=["worker", "ingest", "poll"])
def test_only_the_broker_down(args: tuple[str, ...], migrated_dsn: str,
                              tmp_path: Path) -> None:
    env = _env(tmp_path, STOVEPIPE_POSTGRES_DSN=migrated_dsn)
    out, seconds = _run(args, env)
    _assert_one_clear_line(out, seconds, env["STOVEPIPE_KAFKA_BOOTSTRAP"])


@pytest.mark.kafka
@pytest.mark.postgres
def test_the_worker_makes_its_home(kafka_bootstrap: str, migrated_dsn: str,
                                   tmp_path: Path) -> None:
    """Up to the point where it needs its topics: the home is made first."""
    env = _env(tmp_path, STOVEPIPE_POSTGRES_DSN=migrated_dsn,
               STOVEPIPE_KAFKA_BOOTSTRAP=kafka_bootstrap,
               STOVEPIPE_TOPIC_PREFIX=f"nosuch{time.time_ns()}.")
    out, seconds = _run(("worker",), env)
    assert Path(env["STOVEPIPE_HOME"]).is_dir()
    _assert_one_clear_line(out, seconds, "stovepipe topics create")


def test_a_home_that_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = _env(tmp_path, STOVEPIPE_HOME=str(blocker / "home"))
    out, seconds = _run(("worker",), env)
    _assert_one_clear_line(out, seconds, "STOVEPIPE_HOME")
