"""`stovepipe demo` end to end, twice: the README's run command must work on every run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streams.config.settings import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_demo_runs_end_to_end_twice(kafka_bootstrap: str, postgres_dsn: str,
                                    tmp_path: Path) -> None:
    env = dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=kafka_bootstrap,
               STOVEPIPE_POSTGRES_DSN=postgres_dsn, STOVEPIPE_HOME=str(tmp_path))
    for run in (1, 2):
        result = subprocess.run(
            [sys.executable, "-m", "streams.cli", "demo", "--exit",
             "--web-port", str(_free_port())],
            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        out = result.stdout
        assert result.returncode == 0, f"run {run}: {result.stderr[-3000:]}\n{out[-3000:]}"
        table = out[out.index("Greenness of demo/main"):]
        rows = [line for line in table.splitlines()
                if "request/demo/main/" in line and "bookmark" not in line]
        assert len(rows) == 6, table
        assert "refactor, and break the build" in rows[2] and " red" in rows[2]
        assert "(rewritten away)" in rows[2] and "(rewritten away)" in rows[3]
        assert " full " in rows[4], "the force-pushed head must build in full"
        assert all(" green" in r for i, r in enumerate(rows) if i != 2)
        head = subprocess.run(["git", "-C", str(tmp_path / "demo" / "repo"), "rev-parse",
                               "main", "verified-main"], capture_output=True, text=True,
                              check=True).stdout.split()
        assert head[0] == head[1], "verified-main must point at the green head"
        assert f"promotion ref verified-main: {head[0]}" in table
        assert "dashboard: http://127.0.0.1:" in table
