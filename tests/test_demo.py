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
        rows = table.split("\n\n")[0].splitlines()[2:]
        assert len(rows) == 10, table
        assert "refactor, and break the build" in rows[2] and " red" in rows[2]
        assert "(rewritten away)" in rows[2] and "(rewritten away)" in rows[3]
        assert " full " in rows[4], "the force-pushed head must build in full"
        assert all(" green" in rows[i] for i in (0, 1, 3, 4, 5, 6)), table
        # one push of four commits; the head is red; the search built the three others,
        # newest first, to name the break and confirm it is the head's
        assert "tidy the docs" in rows[6] and "request/demo/main/6~1" in rows[6]
        assert "speed up the parser" in rows[7] and "request/demo/main/6~2" in rows[7]
        assert rows[7].endswith(" red")
        assert "add logging" in rows[8] and "request/demo/main/6~3" in rows[8]
        assert rows[8].endswith(" red")
        assert "bump the version" in rows[9] and "request/demo/main/7 " in rows[9]
        assert rows[9].endswith(" red")
        culprit = rows[7].split()[0]
        assert (f"red since: {culprit} 'speed up the parser' by Demo — the culprit, "
                f"confirmed (every commit after it is red), found among 3 commits nobody "
                f"built with 3 backfill builds") in table
        repo = tmp_path / "demo" / "repo"
        shas = subprocess.run(["git", "-C", str(repo), "rev-parse", "verified-main",
                               "main~3"], capture_output=True, text=True,
                              check=True).stdout.split()
        assert shas[0] == shas[1], "verified-main must point at the newest green commit"
        assert f"promotion ref verified-main: {shas[0]}" in table
        assert f"last-green bookmark: {shas[0]} (request/demo/main/6~1)" in table
        assert "dashboard: http://127.0.0.1:" in table
