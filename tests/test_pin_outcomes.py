"""Issue 23, item 7: pins that hold or say so. A real worker serving HTTP, a real git
repository whose promotion branch `verified-main` is moved by `git update-ref` — refused
here by the repository's own `reference-transaction` hook, or slowed past the move's
deadline by it, exactly as a server-side hook or a slow disk would — and the real
database: a pin whose ref did not move is rolled back with the reason, shown beside the
ref's actual target; a commit no longer on the branch is refused before anything is
written; the sweeper settles a pinned queue whose ref was moved elsewhere."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from streams.stages.pins import MOVE_DEADLINE
from tests.culprit_support import QUEUE, Branch, add_culprit_queue, git, promoted
from tests.waiting import wait_until
from tests.web_support import TOKEN, WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
ENCODED = QUEUE.replace("/", "%2F")

# refuses, or holds for a minute, any change to verified-main while the switch file exists
HOOK = """#!/bin/sh
[ "$1" = prepared ] || exit 0
grep -q ' refs/heads/verified-main$' || exit 0
[ -e "{switch}-refuse" ] && {{ echo "verified-main is frozen" >&2; exit 1; }}
[ -e "{switch}-slow" ] && sleep 60
exit 0
"""


def _green(web: WebPipeline, branch: Branch, name: str, outcome: str = "green") -> str:
    branch.commit(name, outcome)
    request_id = web.ingest(QUEUE)
    web.wait_terminal([request_id], timeout=120)
    web.wait_quiet(timeout=60)
    return request_id


def _start(web: WebPipeline, tmp_path: Path) -> tuple[Branch, Path]:
    branch = Branch(tmp_path)
    add_culprit_queue(web, branch, backfill="off")
    switch = tmp_path / "switch"
    hook = branch.work / ".git" / "hooks" / "reference-transaction"
    hook.write_text(HOOK.format(switch=switch))
    hook.chmod(0o755)
    branch.commit("c0", "green")
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()
    first = web.ingest(QUEUE)
    web.wait_terminal([first], timeout=120)
    _green(web, branch, "c1")
    assert promoted(branch) == branch.shas["c1"]
    return branch, switch


def _pinned(web: WebPipeline) -> tuple[str | None, int]:
    [(pinned,)] = web.query("SELECT pinned_uri FROM queue WHERE name = %s", QUEUE)
    [(open_pins,)] = web.query("SELECT count(*) FROM promotion_pin WHERE queue = %s"
                               " AND unpinned_at IS NULL", QUEUE)
    return pinned, open_pins


def test_a_pin_whose_ref_cannot_move_is_rolled_back_and_says_why(
        web: WebPipeline, tmp_path: Path) -> None:
    branch, switch = _start(web, tmp_path)

    # the repository refuses the move: the CLI says so, nothing is pinned, the ref stays
    Path(f"{switch}-refuse").touch()
    done = web.cli("pin", QUEUE, branch.shas["c0"], "--reason", "incident", check=False)
    assert done.returncode == 1, done.stderr
    assert "the pin did not take, and was rolled back" in done.stderr
    assert "verified-main is frozen" in done.stderr and "Traceback" not in done.stderr
    assert _pinned(web) == (None, 0)
    assert promoted(branch) == branch.shas["c1"]
    [(rolled_back,)] = web.query("SELECT rolled_back_reason FROM promotion_pin")
    assert "verified-main is frozen" in rolled_back
    # said beside the ref's actual target, by the API and by `stovepipe queue`
    ref = web.get(f"/api/queues/{ENCODED}").body["promotion_ref"]
    assert (ref["target"], ref["wanted"], ref["differs"], ref["pinned"]) == (
        branch.uri("c1"), branch.uri("c1"), False, None)
    assert "verified-main is frozen" in ref["problem"]["reason"]
    shown = web.cli("queue", QUEUE).stdout
    assert f"promotion   verified-main at {branch.uri('c1')}" in shown
    assert "verified-main is frozen" in shown
    # over HTTP: a clear status, not 200 with a pin that did not take
    reply = web.post_json(f"/api/queues/{ENCODED}/pin",
                          {"commit": branch.shas["c0"], "reason": "incident", "by": "ops"})
    assert_error(reply, 502, "the pin did not take", "verified-main is frozen")
    assert _pinned(web) == (None, 0)

    # an earlier pin survives a failed one: pin c0, then fail to pin c1 over it
    Path(f"{switch}-refuse").unlink()
    web.cli("pin", QUEUE, branch.shas["c0"], "--reason", "first incident", "--by", "ops")
    assert promoted(branch) == branch.shas["c0"] and _pinned(web) == (branch.uri("c0"), 1)
    assert web.get(f"/api/queues/{ENCODED}").body["promotion_ref"]["problem"] is None
    Path(f"{switch}-refuse").touch()
    failed = web.cli("pin", QUEUE, branch.shas["c1"], "--reason", "second", check=False)
    assert failed.returncode == 1
    assert _pinned(web) == (branch.uri("c0"), 1)
    [(by, reason)] = web.query("SELECT pinned_by, pinned_reason FROM queue")
    assert (by, reason) == ("ops", "first incident")
    Path(f"{switch}-refuse").unlink()

    # a move slower than its deadline: rolled back too (and the ref did not move)
    web.cli("unpin", QUEUE, "--by", "ops")
    assert promoted(branch) == branch.shas["c1"] and _pinned(web) == (None, 0)
    Path(f"{switch}-slow").touch()
    slow = web.cli("pin", QUEUE, branch.shas["c0"], "--reason", "incident", check=False)
    Path(f"{switch}-slow").unlink()
    assert slow.returncode == 1
    assert f"within {MOVE_DEADLINE:g}s" in slow.stderr
    assert _pinned(web) == (None, 0) and promoted(branch) == branch.shas["c1"]

    # and record promotes as usual: nothing is left held
    fresh = _green(web, branch, "c2")
    wait_until(lambda: promoted(branch) == branch.shas["c2"], timeout=60,
               what="the ref to follow the bookmark")
    assert web.query("SELECT last_green_request_id FROM queue") == [(fresh,)]
    assert web.invariant_violations() == []


def test_a_commit_no_longer_on_the_branch_is_refused_before_anything_is_written(
        web: WebPipeline, tmp_path: Path) -> None:
    branch, _ = _start(web, tmp_path)
    gone = branch.shas["c1"]
    # the branch is rewritten: c1 (green) is left behind
    git(branch.work, "reset", "-q", "--hard", branch.shas["c0"])
    _green(web, branch, "c1b")
    done = web.cli("pin", QUEUE, gone, "--reason", "incident", check=False)
    assert done.returncode == 4, done.stderr
    assert "is no longer on the branch" in done.stderr
    assert _pinned(web) == (None, 0)
    assert web.query("SELECT count(*) FROM promotion_pin") == [(0,)]


def test_the_sweeper_settles_a_pinned_ref_moved_elsewhere(web: WebPipeline,
                                                          tmp_path: Path) -> None:
    branch, _ = _start(web, tmp_path)
    pinned = json.loads(web.cli("pin", QUEUE, branch.shas["c0"], "--reason", "incident",
                                "--json").stdout)
    assert pinned["pinned_uri"] == branch.uri("c0")
    # someone moves the ref by hand (or a move that timed out lands after all)
    subprocess.run(["git", "-C", str(branch.work), "update-ref", "refs/heads/verified-main",
                    branch.shas["c1"]], check=True)
    ref = web.get(f"/api/queues/{ENCODED}").body["promotion_ref"]
    assert (ref["target"], ref["wanted"], ref["differs"]) == (
        branch.uri("c1"), branch.uri("c0"), True)
    assert "not where it belongs" in web.cli("queue", QUEUE).stdout
    wait_until(lambda: promoted(branch) == branch.shas["c0"], timeout=120,
               what="the sweeper to put the ref back at the pin", interval=0.5)
    assert "sweeper_republished what=promotion" in web.full_logs()
    # unpinned, it follows the bookmark (c1), never a commit the queue does not name
    web.cli("unpin", QUEUE, "--by", "ops")
    assert promoted(branch) == branch.shas["c1"]
    assert web.get(f"/api/queues/{ENCODED}").body["promotion_ref"]["differs"] is False
