"""The dashboard's history of a queue (issue 18, Deliver 6), in headless Chromium over its
DevTools protocol, against a real worker building a real git repository where a culprit
was found (tests.culprit_support): the strip's order (oldest on the left, newest on the
right) and colours, each colour said in words too, the culprit shown, the cells' details
by mouse and keyboard, the build links answering, and no console errors.

The screenshot is kept in test-artifacts/dashboard-history.png; with
STOVEPIPE_UPDATE_SCREENSHOTS=1 the test also copies it to docs/dashboard.png, the one the
README shows.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from streams.config.settings import REPO_ROOT
from tests.culprit_support import QUEUE, Branch, add_culprit_queue, wait_search
from tests.test_dashboard import ARTIFACTS, Page, chromium, chromium_with_devtools
from tests.waiting import wait_until
from tests.web_support import WebPipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

SCREENSHOT = ARTIFACTS / "dashboard-history.png"
README_SCREENSHOT = REPO_ROOT / "docs" / "dashboard.png"
# the strip's colours (dashboard.css, --cell-*), as the browser computes them
COLOURS = {"green": "rgb(26, 127, 55)", "red": "rgb(207, 34, 46)",
           "running": "rgb(9, 105, 218)", "superseded": "rgb(208, 215, 222)",
           "waiting": "rgb(221, 244, 255)"}
WORDS = {"green": "green", "red": "red", "running": "running", "superseded": "superseded",
         "waiting": "waiting"}


class Tab(Page):
    """A `Page` that also keeps the events Chromium sends: console messages, uncaught
    exceptions and log entries (failed loads, CSP violations)."""

    def __init__(self, port: int) -> None:
        super().__init__(port)
        self.events: list[dict[str, Any]] = []

    async def _call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._socket is not None, "use the Tab as an async context manager"
        self._next_id += 1
        await self._socket.send_json({"id": self._next_id, "method": method,
                                      "params": params})
        while True:
            message = await self._socket.receive_json(timeout=30)
            if message.get("id") == self._next_id:
                break
            if "method" in message:
                self.events.append(message)
        assert "error" not in message, message["error"]
        result: dict[str, Any] = message["result"]
        return result

    async def watch(self) -> None:
        """Report the page's console and log from now on, and load it again so that
        nothing it said before is missed."""
        await self._call("Runtime.enable")
        await self._call("Log.enable")
        await self._call("Page.reload", ignoreCache=True)

    def errors(self) -> list[str]:
        found = []
        for event in self.events:
            params = event.get("params", {})
            if event["method"] == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif event["method"] == "Runtime.consoleAPICalled" and params.get("type") in (
                    "error", "assert"):
                found.append(json.dumps(params.get("args"))[:500])
            elif event["method"] == "Log.entryAdded" and params["entry"]["level"] == "error":
                entry = params["entry"]
                found.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
        return found

    async def key(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            await self._call("Input.dispatchKeyEvent", type=kind, key=key, code=key,
                             windowsVirtualKeyCode=code)

    async def full_page_screenshot(self, path: Path) -> None:
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self._call("Emulation.setDeviceMetricsOverride", width=1280,
                         height=min(int(height), 3000), deviceScaleFactor=1, mobile=False)
        await asyncio.sleep(0.3)  # a frame at the new size
        shot = await self._call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))  # noqa: ASYNC240 - a test's file


def _js(expression: str, **values: Any) -> str:
    """``expression`` with ``$name`` replaced by JSON values."""
    for name, value in values.items():
        expression = expression.replace(f"${name}", json.dumps(value))
    return expression


STRIP = _js("Array.from(document.querySelectorAll("
            "'[data-history-of=' + $q + '] [data-history]')).map((cell) => ({"
            "id: cell.dataset.history, outcome: cell.dataset.outcome,"
            "colour: getComputedStyle(cell).backgroundColor,"
            "label: cell.getAttribute('aria-label'), mark: cell.innerText,"
            "selected: cell.getAttribute('aria-selected'), left: cell.getBoundingClientRect().left,"
            "culprit: cell.classList.contains('is-culprit')}))", q=json.dumps(QUEUE))


def _start_red_branch(web: WebPipeline, branch: Branch) -> None:
    """c0 green; one push of c1..c8 where c5 breaks the build: the culprit search names c5,
    confirmed, after backfilling c4, then c7, c6 and c5. Then c9 is building (held by latch
    "c9"), c10 was superseded by c11, which waits for the slot."""
    add_culprit_queue(web, branch)
    branch.commit("c0", "green")
    web.start_web_worker()
    web.wait_healthy()
    first = web.ingest(QUEUE)
    web.wait_terminal([first], timeout=120)
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 5 else "red")
    head = web.ingest(QUEUE)
    web.wait_terminal([head], timeout=120)
    wait_search(web, "found")
    web.wait_quiet(timeout=120)
    branch.commit("c9", "red", hold="c9")
    building = web.ingest(QUEUE)
    wait_until(lambda: ("c9", building) in branch.started(), timeout=120,
               what="c9's build to start")
    branch.commit("c10", "green")
    web.ingest(QUEUE)
    branch.commit("c11", "red")
    waiting = web.ingest(QUEUE)
    wait_until(lambda: web.states(QUEUE).get(f"request/{QUEUE}/4") == "superseded",
               timeout=60, what="c10's Request to be superseded by c11's")
    assert web.states(QUEUE)[waiting] == "accepted"


def test_the_history_strip_the_culprit_and_the_links(web: WebPipeline,
                                                     tmp_path: Path) -> None:
    chromium()
    branch = Branch(tmp_path)
    try:
        _check_the_page(web, branch, tmp_path)
    finally:  # a held build ends by itself once released: no process outlives the test
        branch.release("c9")
    web.wait_quiet(timeout=120)


def _check_the_page(web: WebPipeline, branch: Branch, tmp_path: Path) -> None:
    _start_red_branch(web, branch)
    short = {name: sha[:7] for name, sha in branch.shas.items()}
    ids = [f"request/{QUEUE}/{n}"
           for n in ("1", "1~4", "1~5", "1~6", "1~7", "2", "3", "4", "5")]
    names = ["c0", "c4", "c5", "c6", "c7", "c8", "c9", "c10", "c11"]
    outcomes = ["green", "green", "red", "red", "red", "red", "running", "superseded",
                "waiting"]

    # the API answers the same history, newest first
    answer = web.get(f"/api/queues/{QUEUE}/history?limit=30").body
    assert [e["request_id"] for e in answer["entries"]] == ids[::-1]
    assert [e["outcome"] for e in answer["entries"]] == outcomes[::-1]
    assert answer["culprit_search"]["state"] == "found"
    assert answer["culprit_search"]["subject"] == "c5: make it red"
    assert answer["culprit_search"]["confirmed"] is True

    async def drive(port: int) -> list[str]:
        async with Tab(port) as tab:
            await tab.watch()
            count = _js("document.querySelectorAll('[data-history-of=' + $q + '] "
                        "[data-history]').length", q=json.dumps(QUEUE))
            await tab.wait_for(f"{count} === {len(ids)}", "the history strip")
            cells = await tab.evaluate(STRIP)
            # order: oldest on the left, newest on the right
            assert [c["id"] for c in cells] == ids
            assert [c["left"] for c in cells] == sorted(c["left"] for c in cells)
            # colours, and the same said in words and a symbol
            for cell, outcome, name in zip(cells, outcomes, names, strict=True):
                assert cell["outcome"] == outcome, cell
                assert cell["colour"] == COLOURS[outcome], cell
                assert WORDS[outcome] in cell["label"] and short[name] in cell["label"], cell
                assert cell["mark"].strip(), cell
            assert [c["culprit"] for c in cells] == [c == f"request/{QUEUE}/1~5" for c in ids]
            assert "backfill" in cells[2]["label"] and "the culprit" in cells[2]["label"]
            legend = await tab.evaluate(
                "Array.from(document.querySelectorAll('.legend li')).map((li) => li.innerText)")
            for word in ("green", "red", "could not validate", "superseded", "running"):
                assert any(word in item for item in legend), legend

            # the culprit, prominently: red since c5, its subject, its author, its build
            culprit = await tab.wait_for(
                "(document.querySelector('.culprit[data-culprit]') || {}).innerText",
                "the culprit banner")
            assert "red since" in culprit and short["c5"] in culprit
            assert "c5: make it red" in culprit and "Ada Lovelace" in culprit
            assert "4 backfill builds" in culprit and "build log" in culprit

            # the story since the last green commit, newest first, in words
            story = await tab.wait_for(
                "Array.from(document.querySelectorAll('.story-list li')).map((li) => li.innerText)",
                "the explain story")
            assert story[0].startswith("… waiting") and "c11: make it red" in story[0], story
            assert any("c7: make it red" in line and "broken since the culprit" in line
                       for line in story)
            assert any("c5: make it red" in line and "culprit" in line for line in story)
            assert "c4: make it green" in story[-1] and "last green" in story[-1], story

            # time to signal: one bar per commit with a fact, and the queue's figures
            bars = await tab.evaluate(
                "Array.from(document.querySelectorAll('.signal-chart [data-signal]'))"
                ".map((bar) => bar.dataset.signal)")
            assert bars == ids[:6]
            assert "median" in await tab.evaluate(
                "document.querySelector('.signal-chart').getAttribute('aria-label')")
            figures = await tab.evaluate("document.querySelector('.health-figures').innerText")
            assert "p50" in figures and "bookmark behind" in figures, figures

            ARTIFACTS.mkdir(exist_ok=True)
            await tab.full_page_screenshot(SCREENSHOT)  # as a person first sees it

            # the details: the culprit's cell is picked first; a click picks another
            detail = await tab.evaluate("document.querySelector('.cell-detail').innerText")
            assert "c5: make it red" in detail and "backfill" in detail
            assert "Ada Lovelace" in detail and "signal after" in detail
            await tab.evaluate(_js("document.querySelector('[data-history=' + $id + ']')"
                                   ".click()", id=json.dumps(ids[5])))
            detail = await tab.evaluate("document.querySelector('.cell-detail').innerText")
            assert "c8: make it red" in detail and "head of the branch" in detail
            # and the keyboard: the picked cell takes the focus, arrows move it
            await tab.evaluate(_js("document.querySelector('[data-history=' + $id + ']')"
                                   ".focus()", id=json.dumps(ids[5])))
            await tab.key("ArrowRight", 39)
            await tab.key("ArrowRight", 39)
            assert await tab.evaluate("document.activeElement.dataset.history") == ids[7]
            detail = await tab.evaluate("document.querySelector('.cell-detail').innerText")
            assert "c10: make it green" in detail and "superseded" in detail
            await tab.key("Home", 36)
            assert await tab.evaluate("document.activeElement.dataset.history") == ids[0]
            # the focus and the pick outlive the page's redraws
            await asyncio.sleep(4.5)
            assert await tab.evaluate("document.activeElement.dataset.history") == ids[0]
            assert "c0: make it green" in await tab.evaluate(
                "document.querySelector('.cell-detail').innerText")

            links = await tab.evaluate(
                "Array.from(document.querySelectorAll('a[data-build-link]')).map((a) => a.href)")
            errors = tab.errors()
            assert errors == [], errors
            return list(links)

    with chromium_with_devtools(web.url("/"), tmp_path / "profile") as port:
        links = asyncio.run(drive(port))

    assert links, "no build links on the page"
    for link in set(links):
        path = urllib.parse.urlsplit(link).path
        assert path.startswith("/api/builds/"), link
        answer = web.get(path)
        assert answer.status == 200, (link, answer.status, answer.text[:300])
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("STOVEPIPE_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(SCREENSHOT, README_SCREENSHOT)
