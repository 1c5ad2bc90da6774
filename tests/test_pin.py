"""Issue 18: pin the promotion ref during an incident. A real worker serving HTTP, a real
git repository with a real promotion branch: a pin holds `verified-main` at a green
commit while the bookmark keeps moving, says who, when and why wherever the ref is shown,
refuses red or unknown commits, and unpin moves the ref to the bookmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.culprit_support import QUEUE, Branch, add_culprit_queue, promoted
from tests.waiting import wait_until
from tests.web_support import TOKEN, WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
ENCODED = QUEUE.replace("/", "%2F")


def _green(web: WebPipeline, branch: Branch, name: str, outcome: str = "green") -> str:
    branch.commit(name, outcome)
    request_id = web.ingest(QUEUE)
    web.wait_terminal([request_id], timeout=120)
    web.wait_quiet(timeout=60)
    return request_id


def test_pin_holds_the_ref_while_the_bookmark_moves_then_unpin(web: WebPipeline,
                                                               tmp_path: Path) -> None:
    branch = Branch(tmp_path)
    add_culprit_queue(web, branch, backfill="off")
    branch.commit("c0", "green")
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()
    first = web.ingest(QUEUE)
    web.wait_terminal([first], timeout=120)
    _green(web, branch, "c1")
    red = _green(web, branch, "c2", "red")
    assert promoted(branch) == branch.shas["c1"]

    # the CLI pins c0 (older than the bookmark c1): the ref goes back to it, on purpose
    pinned = json.loads(web.cli("pin", QUEUE, branch.shas["c0"][:10], "--reason",
                                "deploy of c1 broke checkout", "--by", "ops@example",
                                "--json").stdout)
    assert pinned["pinned_uri"] == branch.uri("c0")
    assert pinned["pinned_by"] == "ops@example"
    assert pinned["previous_target"] == branch.uri("c1")
    assert promoted(branch) == branch.shas["c0"]

    # the bookmark keeps moving underneath; the ref stays
    fixed = _green(web, branch, "c3")
    [(bookmark,)] = web.query("SELECT last_green_request_id FROM queue")
    assert bookmark == fixed
    assert promoted(branch) == branch.shas["c0"]

    # shown wherever the ref is: the API's queue and `stovepipe queue`
    overview = web.get(f"/api/queues/{ENCODED}").body
    pin = overview["promotion_ref"]["pinned"]
    assert (pin["uri"], pin["by"], pin["reason"]) == (
        branch.uri("c0"), "ops@example", "deploy of c1 broke checkout")
    assert overview["promotion_ref"]["target"] == branch.uri("c0")
    shown = web.cli("queue", QUEUE).stdout
    assert f"promotion ref held at {branch.uri('c0')} by ops@example" in shown
    assert "deploy of c1 broke checkout" in shown

    # refused: a red commit, a commit never validated, and no reason
    refused = web.cli("pin", QUEUE, branch.shas["c2"], "--reason", "x", check=False)
    assert refused.returncode == 4 and f"is red on {QUEUE!r} (fact of {red})" in refused.stderr
    branch.commit("c4", "green")
    refused = web.cli("pin", QUEUE, branch.shas["c4"], "--reason", "x", check=False)
    assert refused.returncode == 4 and "was never validated" in refused.stderr
    unknown = web.cli("pin", QUEUE, "f" * 40, "--reason", "x", check=False)
    assert unknown.returncode == 4 and "was never validated" in unknown.stderr
    ambiguous = web.cli("pin", QUEUE, "zz", "--reason", "x", check=False)
    assert ambiguous.returncode == 1 and "not a commit sha" in ambiguous.stderr
    assert "Traceback" not in unknown.stderr + ambiguous.stderr
    assert promoted(branch) == branch.shas["c0"]

    # the API: the write token, the body's fields, refusals as JSON
    path = f"/api/queues/{ENCODED}/pin"
    assert_error(web.post_json(path, {"commit": branch.shas["c1"], "reason": "r", "by": "b"},
                               token=None), 401)
    assert_error(web.post_json(path, {"commit": branch.shas["c1"]}), 400, "reason")
    assert_error(web.post_json(path, b"{not json"), 400, "not JSON")
    assert_error(web.post_json(path, {"commit": branch.shas["c2"], "reason": "r", "by": "b"}),
                 409, "is red")
    moved = web.post_json(path, {"commit": branch.shas["c1"], "reason": "roll forward",
                                 "by": "ops@example"})
    assert moved.status == 200, moved.text
    assert moved.body["pinned_uri"] == branch.uri("c1")
    assert promoted(branch) == branch.shas["c1"]

    # unpin: the ref follows the bookmark again, at once and afterwards
    unpinned = web.post_json(f"/api/queues/{ENCODED}/unpin", {"by": "ops@example"})
    assert unpinned.status == 200, unpinned.text
    assert (unpinned.body["was_pinned"], unpinned.body["target"]) == (
        branch.uri("c1"), branch.uri("c3"))
    assert promoted(branch) == branch.shas["c3"]
    assert web.get(f"/api/queues/{ENCODED}").body["promotion_ref"]["pinned"] is None
    again = web.ingest(QUEUE)  # c4, green: promoted as usual
    web.wait_terminal([again], timeout=120)
    wait_until(lambda: promoted(branch) == branch.shas["c4"], timeout=60,
               what="the promotion ref to follow the bookmark to c4")
    nothing = web.cli("unpin", QUEUE, "--by", "ops@example")
    assert "was not pinned" in nothing.stderr

    # every pin and unpin is kept
    history = web.query("SELECT uri, pinned_by, reason, unpinned_by IS NOT NULL"
                        " FROM promotion_pin ORDER BY id")
    assert history == [(branch.uri("c0"), "ops@example", "deploy of c1 broke checkout", True),
                       (branch.uri("c1"), "ops@example", "roll forward", True)]
    assert web.invariant_violations() == []
