"""The session's check that no test leaves a process behind (tests/conftest.py), run on a
small suite of its own whose one test starts a process and forgets it: the session fails,
names the test, and stops the process — alone and under xdist (as `make test` runs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
import tests.conftest as checked
from tests.conftest import (pytest_collection_modifyitems, pytest_runtest_protocol,
                            pytest_sessionfinish, pytest_terminal_summary,
                            pytest_testnodedown)

checked.LEFTOVER_GRACE = 1.0
'''

LEAKY = '''
import subprocess
from pathlib import Path


def test_starts_a_process_and_forgets_it(tmp_path):
    proc = subprocess.Popen(["sleep", "600"])
    Path({pid_file!r}).write_text(str(proc.pid))


def test_cleans_up_after_itself():
    proc = subprocess.Popen(["sleep", "600"])
    proc.kill()
    proc.wait()
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["alone", "xdist"])
def test_a_forgotten_process_fails_the_session_and_names_its_test(
        tmp_path: Path, xdist: list[str]) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    pid_file = tmp_path / "pid"
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_leaky.py").write_text(LEAKY.format(pid_file=str(pid_file)))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(suite), *xdist, str(suite)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "2 passed" in output, output  # the tests pass; the session fails
    assert "processes left behind by tests" in output, output
    assert "test_leaky.py::test_starts_a_process_and_forgets_it: pid" in output, output
    assert "test_cleans_up_after_itself" not in output.split("left behind")[1], output
    pid = int(pid_file.read_text())
    assert not _alive(pid), "the forgotten process should have been stopped"
    assert time.monotonic() - began < 120
