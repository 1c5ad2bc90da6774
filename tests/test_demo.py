"""`stovepipe demo` end to end, twice: the README's run command must work on every run.
Both acts are checked: the repository validated as a whole, and the monorepo whose api
breaks and is fixed while web and docs stay green."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from streams.cli.demo import demo_names
from streams.config.settings import REPO_ROOT

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def demo_home(kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path) -> Iterator[Path]:
    """STOVEPIPE_HOME for the demo; its schema and topics are gone after the test."""
    yield tmp_path
    schema, stem = demo_names(tmp_path / "demo")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(stem)]
    if names:
        for done in admin.delete_topics(names, operation_timeout=30).values():
            done.result(timeout=30)


def _demo(home: Path, kafka_bootstrap: str, postgres_dsn: str, *args: str) -> str:
    env = dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=kafka_bootstrap,
               STOVEPIPE_POSTGRES_DSN=postgres_dsn, STOVEPIPE_HOME=str(home))
    result = subprocess.run(
        [sys.executable, "-m", "streams.cli", "demo", "--exit", "--web-port", str(_free_port()),
         *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{out[-3000:]}"
    return out


def test_demo_runs_end_to_end_twice(kafka_bootstrap: str, postgres_dsn: str,
                                    demo_home: Path) -> None:
    for run in (1, 2):
        out = _demo(demo_home, kafka_bootstrap, postgres_dsn)
        table = out[out.index("Greenness of demo/main"):out.index("A monorepo: three")]
        rows = table.split("\n\n")[0].splitlines()[2:]
        assert len(rows) == 10, f"run {run}: {table}"
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
        repo = demo_home / "demo" / "repo"
        shas = _git(repo, "rev-parse", "verified-main", "main~3").split()
        assert shas[0] == shas[1], "verified-main must point at the newest green commit"
        assert f"promotion ref verified-main: {shas[0]}" in table
        assert f"last-green bookmark: {shas[0]} (request/demo/main/6~1)" in table
        assert "dashboard: http://127.0.0.1:" in table
        _assert_monorepo_act(out, demo_home, postgres_dsn)


def test_the_monorepo_act_plays_alone(kafka_bootstrap: str, postgres_dsn: str,
                                      demo_home: Path) -> None:
    out = _demo(demo_home, kafka_bootstrap, postgres_dsn, "--act", "monorepo")
    assert "demo/main" not in out
    _assert_monorepo_act(out, demo_home, postgres_dsn)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _assert_monorepo_act(out: str, home: Path, postgres_dsn: str) -> None:
    """api breaks at 'api: /answer says 43' and is fixed by the last push; web and docs
    stay green; each project's last green commit is the last push's head."""
    repo = home / "demo" / "mono"
    log = _git(repo, "log", "--reverse", "--format=%H %s", "main").splitlines()
    sha = {subject: full[:8] for full, subject in (line.split(" ", 1) for line in log)}
    c1, c2, c3, c4, c5, c6, c7 = (sha[s] for s in (
        "import api, web and docs", "web: a new landing page", "docs: describe /answer",
        "api: /answer says 43", "libs/common: a faster parser", "web: dark mode",
        "api: /answer says 42 again"))
    act = out[out.index("A monorepo: three projects"):]

    pushes = act[act.index("   push  head"):act.index("\n\n")].splitlines()
    assert [line.split() for line in pushes if re.match(r"   \d ", line)] == [
        ["1", c1, "1", "api,", "web,", "docs", "green"],
        ["2", c2, "1", "web", "green"],
        ["3", c5, "3", "api,", "web,", "docs", "red:", "api", "is", "red"],
        ["4", c6, "1", "web", "red:", "api", "is", "still", "red", "(unaffected)"],
        ["5", c7, "1", "api", "green"]], act
    # api's own search, in its scope, names the commit that broke it; how many of the
    # commits between it built to get there is the bisection's business
    assert re.search(
        rf"api's own culprit search \(demo/mono#api\) builds api alone at the commits "
        rf"nobody built:\n +red since: {c4} 'api: /answer says 43' by Demo — the culprit, "
        rf"confirmed \(every commit after it is red\), found among 3 commits nobody built "
        rf"with \d backfill builds\n", act), act

    table = act[act.index("Greenness of demo/mono, per project"):]
    cells = {sha: cells for sha, _, *cells in (re.split(r" {2,}", line.strip())
                                               for line in table.splitlines()[2:9])}
    assert list(cells) == [c1, c2, c3, c4, c5, c6, c7], table
    # (api, web, docs, the whole repository); "-": not validated at that commit
    assert cells[c1] == ["green", "green", "green", "green"]
    assert cells[c2] == [f"green from {c1}", "green", f"green from {c1}", "green"]
    # inside the push of three, only api's culprit search built anything (api alone)
    assert cells[c3][0] in ("green", "-") and cells[c3][1:] == ["-", "-", "-"]
    assert cells[c4] == ["red", "-", "-", "-"]
    assert cells[c5] == ["red", "green", "green", "red"]
    assert cells[c6] == [f"red from {c5}", "green", f"green from {c5}", "red"]
    assert cells[c7] == ["green", f"green from {c6}", f"green from {c5}", "green"]
    assert (f"api broke at {c4} 'api: /answer says 43', then was fixed at {c7} "
            f"'api: /answer says 42 again'.\n  web and docs stayed green.") in table

    last = table[table.index("Last green commit of each project"):].splitlines()
    assert [line.split(None, 2) for line in last[2:5]] == [
        ["api", c7, "built green there"],
        ["web", c7, f"unaffected there: inherits green from {c6}"],
        ["docs", c7, f"unaffected there: inherits green from {c5}"]], table
    assert last[5].split()[:3] == ["the", "repository", c7], table
    assert _git(repo, "rev-parse", "verified-main")[:8] == c7

    # what the tables say is what the database holds: each Request's exact outcome
    schema, _ = demo_names(home / "demo")
    dsn = make_conninfo(postgres_dsn, options=f"-c search_path={schema}")
    with psycopg.connect(dsn) as conn:
        heads: dict[str, str] = dict(conn.execute(
            "SELECT id, state || ' ' || coalesce(verdict, '-') FROM request"
            " WHERE queue LIKE 'demo/mono%' AND id NOT LIKE '%~%'").fetchall())
    assert heads == {
        "request/demo/mono/1": "succeeded green", "request/demo/mono/2": "succeeded green",
        "request/demo/mono/3": "failed red", "request/demo/mono/4": "failed red",
        "request/demo/mono/5": "succeeded green",
        "request/demo/mono#api/1": "succeeded green", "request/demo/mono#web/1":
            "succeeded green", "request/demo/mono#docs/1": "succeeded green",
        "request/demo/mono#web/2": "succeeded green",
        "request/demo/mono#api/3": "failed red", "request/demo/mono#web/3": "succeeded green",
        "request/demo/mono#docs/3": "succeeded green",
        "request/demo/mono#web/4": "succeeded green",
        "request/demo/mono#api/5": "succeeded green"}
