"""The dashboard a worker serves at `/`, rendered by headless Chromium against a real
worker: what a person opening the page sees once its script has fetched the API.

Needs Debian's `chromium` (apt-get install -y chromium fonts-liberation). The
screenshot is kept in test-artifacts/dashboard.png.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from streams.config.settings import REPO_ROOT
from tests.waiting import wait_until
from tests.web_support import WebPipeline

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
    assert "fake://r/team/main-main/b2-fail" in shown
    [build_id] = [b["id"] for b in web.request("request/team/main/2")["builds"]]
    assert re.search(rf'data-build="{re.escape(build_id)}".*?state-failed">failed<', shown)
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
