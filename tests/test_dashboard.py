"""The dashboard a worker serves at `/`, rendered by headless Chromium against a real
worker: what a person opening the page sees once its script has fetched the API, and what
pressing "Validate again" does (Chromium driven over its DevTools protocol).

Needs Debian's `chromium` (apt-get install -y chromium fonts-liberation). The
screenshots are kept in test-artifacts/ (dashboard.png, dashboard-request.png).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import aiohttp
import pytest

from streams.config.settings import REPO_ROOT
from tests.waiting import wait_until, wait_until_async
from tests.web_support import TOKEN, WebPipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed to test the dashboard and is not installed: "
                "run `apt-get update && apt-get install -y chromium fonts-liberation` "
                "(as root)", pytrace=False)


def run_chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,900",
         "--virtual-time-budget=5000", *args, url],
        capture_output=True, text=True, timeout=120, check=False)


def test_the_page_and_its_assets_are_served(web: WebPipeline) -> None:
    web.add_queue("team/main")
    web.start_web_worker()
    web.wait_healthy()
    for path in ("/", "/dashboard"):
        page = web.get(path)
        assert page.status == 200
        assert page.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        assert '<script src="/dashboard/dashboard.js"' in page.text
        assert "http://" not in page.text and "https://" not in page.text  # nothing remote
    script = web.get("/dashboard/dashboard.js")
    assert script.status == 200 and script.headers["Content-Type"].startswith("text/javascript")
    assert "/api/queues" in script.text and "innerHTML" not in script.text
    style = web.get("/dashboard/dashboard.css")
    assert style.status == 200 and style.headers["Content-Type"].startswith("text/css")
    assert web.get("/dashboard/nothing.js").status == 404


def test_the_dashboard_shows_queues_requests_and_facts(web: WebPipeline,
                                                       tmp_path: Path) -> None:
    chromium()  # fail first, before starting anything, if it is missing
    main = web.add_queue("team/main")
    app = web.add_queue("web/app", promotion_ref=None)
    web.add_queue("idle")
    web.repo.push(main, "a1")
    web.repo.push(app, "w1")
    web.start_web_worker()
    web.wait_healthy()
    web.post("/api/queues/team/main/ingest", token=None)
    web.post("/api/queues/web/app/ingest", token=None)
    web.wait_quiet()
    web.repo.push(main, "b2-fail")
    web.post("/api/queues/team/main/ingest", token=None)
    web.wait_quiet()
    web.repo.push(app, "w2-latchW2")  # building while the page is looked at (never released)
    web.post("/api/queues/web/app/ingest", token=None)
    wait_until(lambda: web.states().get("request/web/app/2") == "processing", timeout=60,
               what="web/app's second Request to be building")

    dumped = run_chromium(web.url("/"), tmp_path / "profile-dom", "--dump-dom")
    dom = html.unescape(dumped.stdout)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    assert "Loading queues" not in dom, f"the script did not render the queues:\n{dom}"
    for queue in ("team/main", "web/app", "idle"):
        assert f'data-queue="{queue}"' in dom, queue
    for request_id in ("request/team/main/1", "request/team/main/2",
                       "request/web/app/1", "request/web/app/2"):
        assert f'data-request="{request_id}"' in dom, request_id
    team = _section(dom, "team/main")
    assert re.search(r'data-request="request/team/main/2".*?state-failed">failed<.*?'
                     r'fact-red"[^>]*>red<', team), team
    assert re.search(r'data-request="request/team/main/1".*?state-succeeded">succeeded<.*?'
                     r'fact-green"[^>]*>green<', team), team
    assert "fake://r/team/main-main/a1" in team  # the bookmark
    assert f"{main}-verified-main" in team  # the promotion ref
    web_app = _section(dom, "web/app")
    assert "in flight 1 / 1" in web_app
    assert 'state-processing">processing<' in web_app
    assert "none configured" in web_app  # no promotion ref
    assert "No Requests yet" in _section(dom, "idle")
    assert "worker healthy" in dom
    assert re.search(r"process_dlq <b>0</b>", dom), "the dead-letter depths are missing"

    # one Request in detail, as the links of commit statuses and alerts open it
    dumped = run_chromium(web.url("/#request=request/team/main/2"), tmp_path / "profile-req",
                          "--dump-dom")
    detail = html.unescape(dumped.stdout)
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    match = re.search(r'<section id="request"[^>]*>(.*?)</section>', detail, re.DOTALL)
    assert match and "request/team/main/2" in match.group(1), detail
    shown = match.group(1)
    assert 'state-failed">failed<' in shown and 'fact-red"' in shown
    assert "red verdict" in shown and "head of the branch" in shown and "1 attempt" in shown
    assert 'id="retry-button">Validate again<' in shown  # shown: the commit is not green
    assert "fake://r/team/main-main/b2-fail" in shown
    [build_id] = [b["id"] for b in web.request("request/team/main/2")["builds"]]
    assert re.search(rf'data-build="{re.escape(build_id)}".*?state-failed">failed<.*?'
                     r'fact-red">red<', shown)
    assert 'href="#request=request%2Fteam%2Fmain%2F1"' in detail  # rows link to their view

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    taken = run_chromium(web.url("/dashboard"), tmp_path / "profile-shot",
                         f"--screenshot={shot}")
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def _section(dom: str, queue: str) -> str:
    match = re.search(rf'<section class="queue" data-queue="{re.escape(queue)}">(.*?)</section>',
                      dom, re.DOTALL)
    assert match, f"no section for {queue}"
    return match.group(1)


# --- "Validate again", clicked --------------------------------------------------------


@contextlib.contextmanager
def chromium_with_devtools(url: str, profile: Path) -> Iterator[int]:
    """Headless Chromium showing ``url``; yields the port of its DevTools protocol."""
    process = subprocess.Popen(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--window-size=1280,900",
         "--remote-debugging-port=0", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"  # written once it listens

        def listening() -> bool:
            assert process.poll() is None, f"Chromium exited {process.returncode}"
            return port_file.exists() and bool(port_file.read_text().strip())

        wait_until(listening, timeout=60, what="Chromium's DevTools port", interval=0.1)
        yield int(port_file.read_text().split()[0])
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


class Page:
    """The tab of a Chromium started by `chromium_with_devtools`, over its DevTools
    protocol: evaluate JavaScript in it. Use as ``async with Page(port) as page``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._session: aiohttp.ClientSession | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._next_id = 0

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession()
        try:
            async with self._session.get(f"http://127.0.0.1:{self.port}/json/list") as answer:
                targets = await answer.json()
            [target] = [t for t in targets if t["type"] == "page"]
            self._socket = await self._session.ws_connect(target["webSocketDebuggerUrl"],
                                                          max_msg_size=0)
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._session is not None:
            await self._session.close()

    async def evaluate(self, expression: str) -> Any:
        result = await self._call("Runtime.evaluate", expression=expression,
                                  returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        shot = await self._call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))  # noqa: ASYNC240 - a test's file

    async def _call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._socket is not None, "use the Page as an async context manager"
        self._next_id += 1
        await self._socket.send_json({"id": self._next_id, "method": method,
                                      "params": params})
        while True:  # events may come first; the answer carries the call's id
            message = await self._socket.receive_json(timeout=30)
            if message.get("id") == self._next_id:
                break
        assert "error" not in message, message["error"]
        result: dict[str, Any] = message["result"]
        return result

    async def wait_for(self, expression: str, what: str, within: float = 30) -> Any:
        """The value of ``expression`` once it is truthy."""
        found: list[Any] = []

        async def truthy() -> bool:
            found[:] = [await self.evaluate(expression)]
            return bool(found[0])

        await wait_until_async(truthy, within=within, what=what, interval=0.1)
        return found[0]


def _text(selector: str) -> str:
    """JavaScript: the visible text of the first element ``selector`` matches ('' if none)."""
    return f"(document.querySelector({json.dumps(selector)}) || {{innerText: ''}}).innerText"


def test_validate_again_from_the_request_view(web: WebPipeline, tmp_path: Path) -> None:
    chromium()
    ref = web.add_queue("team/main", poll_deadline="2s", retry={"unvalidated": 0})
    web.repo.push(ref, "a1")
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()
    assert web.post("/api/queues/team/main/ingest").status == 201
    web.wait_quiet()
    web.repo.push(ref, "b2-queued100")  # never starts: it cannot be validated
    failed = web.post("/api/queues/team/main/ingest").body["request_id"]
    web.wait_terminal([failed])
    why = ("could not be validated (1 attempt): at the start deadline (2s since its trigger, "
           "never started) it was queued for an agent")

    async def drive(port: int) -> str:
        async with Page(port) as page:
            row = f'#queues tr[data-request="{failed}"] .state-unvalidated'
            assert await page.wait_for(_text(row), "the queue table") == "could not validate"
            assert await page.evaluate(
                f"document.querySelector({json.dumps(row)}).title") == why
            view = await page.wait_for(_text("#request-view"), "the Request view")
            assert why in view and "head of the branch" in view
            assert "could not validate: at the start deadline" in view  # its attempt's line
            assert await page.evaluate("document.getElementById('token-field').hidden")

            await page.wait_for("!document.getElementById('retry-button').hidden",
                                "the Validate again button")
            await page.evaluate("document.getElementById('retry-button').click()")
            asked = await page.wait_for(_text("#retry-result .error"), "the token request")
            assert "needs its API token" in asked
            assert not await page.evaluate("document.getElementById('token-field').hidden")
            await page.evaluate(
                "const field = document.getElementById('api-token');"
                f"field.value = {json.dumps(TOKEN)};"
                "field.dispatchEvent(new Event('input'));"
                "document.getElementById('retry-button').click()")
            retried = await page.wait_for(_text("#retry-result [data-retried]"),
                                          "the new Request's id")
            assert "Validating again" in await page.evaluate(_text("#retry-result"))
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(ARTIFACTS / "dashboard-request.png")
            assert await page.evaluate(
                "sessionStorage.getItem('stovepipe.apiToken')") == TOKEN
            # the commit is being validated again: no second button
            await page.wait_for("document.getElementById('retry-button').hidden",
                                "the button to go once the commit is being validated")
            await page.evaluate("document.querySelector('#retry-result a').click()")
            heading = await page.wait_for(
                f"{_text('#request-view h3')} === {json.dumps(retried)} && "
                f"{_text('#request-view')}", "the new Request's view")
            assert "retry: validates the commit again" in heading
            return str(retried)

    with chromium_with_devtools(web.url("/#request=" + failed), tmp_path / "profile") as port:
        retried = asyncio.run(drive(port))
    assert retried == f"{failed}.2"
    shown = web.get("/api/requests/" + retried).body["request"]
    assert (shown["kind"], shown["uri"]) == ("retry", f"fake://r/{ref}/b2-queued100")
