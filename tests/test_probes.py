"""Issue 25, item 3 on a real worker: the three probes mean different things. /livez
fails only when a delivery makes no progress past its bound (a handler stuck in a call
that never returns), /readyz says whether the API and gate can answer now, /startupz that
the migrations and topics were verified and the runtime started. (A two-minute broker
outage keeping /livez 200 is in tests/test_faults.py, on a stack of its own.)"""

from __future__ import annotations

import pytest

from streams import __version__
from tests.waiting import wait_until
from tests.web_support import WebPipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def test_a_stuck_handler_turns_livez_503_and_only_livez(web: WebPipeline) -> None:
    ref = web.add_queue("q")
    web.start_web_worker(env={"STOVEPIPE_LIVENESS_STUCK_AFTER": "3"})
    web.wait_healthy()
    for path in ("/livez", "/readyz", "/startupz"):
        assert web.get(path).status == 200, path
    assert web.get("/livez").body == {"status": "ok", "underway": 0, "stuck": [],
                                      "version": __version__}
    # the release is said wherever an operator looks: the API, /metrics, the command
    assert web.get("/health").body["version"] == __version__
    assert f'stovepipe_build_info{{version="{__version__}"}} 1.0' in web.get("/metrics").text
    assert web.cli("--version").stdout.strip() == f"stovepipe {__version__}"

    # the runner's trigger call never returns (until the latch is released): the build
    # stage's handler is stuck in it
    web.repo.push(ref, "c1-triggerlatchT")
    web.ingest("q")
    wait_until(lambda: web.get("/livez").status == 503, timeout=60,
               what="/livez to say the build stage is stuck", interval=0.5)
    reply = web.get("/livez")
    assert reply.body["status"] == "stuck"
    [stuck] = reply.body["stuck"]
    assert stuck["stage"] == "build" and stuck["for_s"] > 3
    # it can still answer the API and gate: ready; and it started
    assert web.get("/readyz").status == 200 and web.get("/startupz").status == 200

    web.release("T")
    wait_until(lambda: web.get("/livez").status == 200, timeout=60,
               what="/livez to recover once the call returns", interval=0.5)
    web.wait_quiet()
    assert web.states() == {"request/q/1": "succeeded"}
