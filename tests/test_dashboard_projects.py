"""The dashboard's grid of a queue with projects (issue 24, "Where people look"), in headless
Chromium over its DevTools protocol, against a real worker building a real git monorepo
with command builds (tests.monorepo_support): one row per head, newest first, one column
per project, each cell the project's answer there in words, a symbol and a colour —
built green or red with its build's log, unaffected and inheriting green or red (drawn
apart, with the commit it inherits from), pending, could not validate — and above it each
project's bookmark and culprit. The API answers the same grid, a project's Request and
build log open from it, and /metrics carries each project's gauges labelled by queue and
project.

The screenshot is kept in test-artifacts/dashboard-projects.png; with
STOVEPIPE_UPDATE_SCREENSHOTS=1 the test also copies it to docs/dashboard-projects.png, the
one the README shows.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from streams.config.settings import REPO_ROOT
from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue
from tests.test_dashboard import ARTIFACTS, chromium, chromium_with_devtools
from tests.test_dashboard_history import Tab
from tests.waiting import wait_until
from tests.web_support import WebPipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

SCREENSHOT = ARTIFACTS / "dashboard-projects.png"
README_SCREENSHOT = REPO_ROOT / "docs" / "dashboard-projects.png"
ALL_GREEN = {"services/api/outcome": "green\n", "web/outcome": "green\n",
             "docs/outcome": "green\n"}
# the grid's colours (dashboard.css), as the browser computes them
BACKGROUNDS = {("green", False): "rgb(26, 127, 55)", ("red", False): "rgb(207, 34, 46)",
               ("green", True): "rgb(218, 251, 225)", ("red", True): "rgb(255, 235, 233)",
               ("pending", False): "rgb(9, 105, 218)",
               ("unvalidated", False): "rgb(251, 239, 255)"}
GRID = ("Array.from(document.querySelectorAll('[data-grid-of] tbody tr')).map((row) => ({"
        "id: row.dataset.gridRow, head: row.querySelector('th').innerText,"
        "whole: row.querySelector('[data-whole]').dataset.whole,"
        "cells: Object.fromEntries(Array.from(row.querySelectorAll('[data-cell]')).map("
        "(cell) => [cell.dataset.cell, {state: cell.dataset.state,"
        " inherited: cell.dataset.inherited === 'true', text: cell.innerText,"
        " label: cell.getAttribute('aria-label'),"
        " colour: getComputedStyle(cell).backgroundColor,"
        " links: Array.from(cell.querySelectorAll('a')).map((a) => a.getAttribute('href'))}]))"
        "}))")
CARDS = ("Object.fromEntries(Array.from(document.querySelectorAll('.project-card')).map("
         "(card) => [card.dataset.project, card.innerText]))")


def _monorepo_queue(web: WebPipeline, repo: Monorepo, tmp_path: Path) -> None:
    """api and web on the queue's command runner; docs (bring-up) on a runner of its own
    whose repository does not exist: its builds can never check out, so they cannot
    validate anything."""
    add_projects_queue(web, repo, backfill="bisect", retry={"unvalidated": 0}, projects={
        "api": {"paths": ["services/api/**", "libs/common/**"]},
        "web": {"paths": ["web/**", "libs/common/**"]},
        "docs": {"paths": ["docs/**"], "blocking": False,
                 "build_runner": {"kind": "command", "command": f"sh {repo.script}",
                                  "repository": str(tmp_path / "no-such-repository")}}})


def _settle(web: WebPipeline, request_id: str) -> str:
    web.wait_terminal([request_id], timeout=180)
    web.wait_quiet(timeout=180)
    return web.states()[request_id]


def test_the_grid_of_heads_by_projects(web: WebPipeline, tmp_path: Path) -> None:
    chromium()
    repo = Monorepo(tmp_path)
    _monorepo_queue(web, repo, tmp_path)
    try:
        _check_the_grid(web, repo)
    finally:  # the held build ends by itself once released: no process outlives the test
        repo.release("L5")
    web.wait_quiet(timeout=180)


def _check_the_grid(web: WebPipeline, repo: Monorepo) -> None:
    repo.commit("c1", {**ALL_GREEN, "libs/common/lib.txt": "1\n"})
    web.start_web_worker()
    web.wait_healthy()
    ids = [web.ingest(QUEUE)]
    assert _settle(web, ids[-1]) == "succeeded"  # api, web green; docs could not validate
    steps = [("c2", {"web/app.js": "1\n"}, "succeeded"),  # web built, api inherits
             ("c3", {"libs/common/lib.txt": "2\n", **repo.outcome("api", "red")}, "failed"),
             ("c4", {"docs/guide.md": "x\n"}, "failed")]  # api inherits red, web green
    for name, files, outcome in steps:
        repo.commit(name, files)
        ids.append(web.ingest(QUEUE))
        assert _settle(web, ids[-1]) == outcome, name
    wait_until(lambda: web.query("SELECT state FROM culprit_search") == [("found",)],
               timeout=120, what="api's culprit search to find c3")
    web.wait_quiet(timeout=180)
    repo.commit("c5", repo.outcome("api", "hold:L5"))  # api builds while the page is read
    ids.append(web.ingest(QUEUE))
    wait_until(lambda: ("api" in repo.built("c5")
                        and web.states().get(f"request/{QUEUE}#docs/5") == "failed"),
               timeout=120, what="c5's api build to start and its docs build to end")
    sha = repo.shas

    def child(n: int, project: str) -> str:
        return f"request/{QUEUE}#{project}/{n}"

    # the API: newest first, each cell the project's answer at that head, or why not
    grid = web.get(f"/api/queues/{QUEUE}/grid?limit=10").body
    assert [r["request_id"] for r in grid["rows"]] == ids[::-1]
    assert [r["outcome"] for r in grid["rows"]] == ["running", "red", "red", "green", "green"]
    cells = {(r["request_id"], p): (c["state"], c["inherited"], c["request_id"],
                                    c["source_sha"])
             for r in grid["rows"] for p, c in r["cells"].items()}
    expected = {
        (ids[0], "api"): ("green", False, child(1, "api"), None),
        (ids[0], "web"): ("green", False, child(1, "web"), None),
        (ids[1], "api"): ("green", True, child(1, "api"), sha["c1"]),
        (ids[1], "web"): ("green", False, child(2, "web"), None),
        (ids[2], "api"): ("red", False, child(3, "api"), None),
        (ids[2], "web"): ("green", False, child(3, "web"), None),
        (ids[3], "api"): ("red", True, child(3, "api"), sha["c3"]),
        (ids[3], "web"): ("green", True, child(3, "web"), sha["c3"]),
        (ids[4], "api"): ("pending", False, child(5, "api"), None),
        (ids[4], "web"): ("green", True, child(3, "web"), sha["c3"]),
        **{(ids[n - 1], "docs"): ("unvalidated", False, child(n, "docs"), None)
           for n in range(1, 6)}}
    assert cells == expected
    docs_cell = grid["rows"][0]["cells"]["docs"]
    assert docs_cell["reason"].startswith("could not be validated"), docs_cell
    columns = {p["project"]: p for p in grid["projects"]}
    assert [p["project"] for p in grid["projects"]] == ["api", "docs", "web"]  # file order
    assert (columns["api"]["greenness"], columns["api"]["bookmark"]["request_id"],
            columns["api"]["bookmark"]["inherited"], columns["api"]["bookmark"]["source_sha"],
            columns["api"]["heads_since_green"]) == ("red", ids[1], True, sha["c1"], 3)
    assert (columns["api"]["culprit"]["sha"], columns["api"]["culprit"]["subject"],
            columns["api"]["culprit"]["confirmed"]) == (sha["c3"], "c3", True)
    assert (columns["web"]["greenness"], columns["web"]["bookmark"]["request_id"],
            columns["web"]["culprit"]) == ("green", ids[4], None)
    assert (columns["docs"]["greenness"], columns["docs"]["bookmark"],
            columns["docs"]["blocking"]) == (None, None, False)

    # what the grid links to opens: a project's Request, a project's build log
    shown = web.get("/api/requests/" + urllib.parse.quote(child(3, "api"), safe=""))
    assert shown.status == 200 and shown.body["request"]["verdict"] == "red", shown.text
    build = grid["rows"][2]["cells"]["api"]["build"]["url"]
    log = web.get(build)
    assert log.status == 200 and log.headers["X-Build-Status"] == "failed", (build, log.text)

    async def drive(port: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
        async with Tab(port) as tab:
            await tab.watch()
            await tab.wait_for(f"document.querySelectorAll('[data-grid-of] tbody tr').length"
                               f" === {len(ids)}", "the grid")
            rows = await tab.evaluate(GRID)
            cards = await tab.evaluate(CARDS)
            banner = await tab.evaluate("document.querySelector('.culprit').innerText")
            assert "red projects: api" in banner, banner
            await tab.full_page_screenshot(SCREENSHOT)
            errors = tab.errors()
            assert errors == [], errors
            return rows, cards

    ARTIFACTS.mkdir(exist_ok=True)
    with chromium_with_devtools(web.url("/"), web.root / "profile") as port:
        rows, cards = asyncio.run(drive(port))

    # the page: the same rows, newest first, every cell's state in words and in colour
    assert [r["id"] for r in rows] == ids[::-1]
    assert [r["whole"] for r in rows] == ["running", "red", "red", "green", "green"]
    for row in rows:
        request_id = row["id"]
        assert sha[f"c{ids.index(request_id) + 1}"][:7] in row["head"], row
        for project, shown_cell in row["cells"].items():
            state, inherited, source_request, source_sha = expected[(request_id, project)]
            assert (shown_cell["state"], shown_cell["inherited"]) == (state, inherited)
            assert shown_cell["colour"] == BACKGROUNDS[(state, inherited)], shown_cell
            word = {"unvalidated": "could not validate"}.get(state, state)
            assert word in shown_cell["text"], shown_cell
            if inherited:  # said so, with the commit it inherits from and its Request
                assert f"inherited from {source_sha[:7]}" in shown_cell["text"], shown_cell
                assert f"unaffected: inherits {state} from {source_sha[:7]}" \
                    in shown_cell["label"], shown_cell
                assert shown_cell["links"] == [
                    "#request=" + urllib.parse.quote(source_request, safe="")], shown_cell
            elif state in ("green", "red"):  # built here: its build's log
                assert "build log" in shown_cell["text"], shown_cell
                assert shown_cell["links"][0].startswith(
                    "/api/builds/" + urllib.parse.quote(f"{QUEUE}#{project}", safe="/")), \
                    shown_cell
    # the cards: each project's state, bookmark and culprit
    assert re.search(r"^api\s+✗ red for \d", cards["api"]), cards["api"]
    assert f"last green {sha['c2'][:7]} (inherits from {sha['c1'][:7]})" in cards["api"]
    assert f"red since {sha['c3'][:7]} c3 by Ada Lovelace" in cards["api"], cards["api"]
    assert "the culprit" in cards["api"]
    assert re.search(r"^web\s+✓ green", cards["web"]), cards["web"]
    assert f"last green {sha['c5'][:7]} (inherits from {sha['c3'][:7]})" in cards["web"]
    assert "no verdict yet" in cards["docs"] and "bring-up" in cards["docs"]
    assert "last green none yet" in cards["docs"]
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("STOVEPIPE_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(SCREENSHOT, README_SCREENSHOT)

    # the metrics a person graphs per project, labelled by queue and project
    def samples() -> dict[str, str]:
        text = web.get("/metrics").text
        return {line.split(" ")[0]: line.split(" ")[1] for line in text.splitlines()
                if line.startswith("stovepipe_project_")}

    def labelled(name: str, project: str) -> str:
        return f'{name}{{project="{project}",queue="{QUEUE}"}}'

    wait_until(lambda: samples().get(labelled("stovepipe_project_commits_since_green", "api"))
               == "3.0", timeout=30, what="the project gauges")
    found = samples()
    assert found[labelled("stovepipe_project_green", "api")] == "0.0"
    assert found[labelled("stovepipe_project_green", "web")] == "1.0"
    assert labelled("stovepipe_project_green", "docs") not in found  # no verdict yet
    assert float(found[labelled("stovepipe_project_red_streak_seconds", "api")]) > 0
    assert found[labelled("stovepipe_project_red_streak_seconds", "web")] == "0.0"
    assert found[labelled("stovepipe_project_commits_since_green", "web")] == "0.0"
    assert found[labelled("stovepipe_project_commits_since_green", "docs")] == "5.0"
    assert float(found[labelled("stovepipe_project_bookmark_age_seconds", "api")]) > 0
