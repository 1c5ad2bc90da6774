"""Issue 24, Deliver 4: a project's own promotion ref and its pins, as for the queue — on a
real worker serving HTTP, the real broker, database and a real git monorepo. The ref
follows the project's bookmark (built or inherited green), holds at a pin while the
bookmark moves on, follows again on unpin; a pin of a commit not green for the project is
refused before anything is written; a pin whose ref cannot move is rolled back with the
reason; the sweeper puts back a pinned ref moved by hand. The whole repository's ref is
never held by a project's pin."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue, git
from tests.waiting import wait_until
from tests.web_support import TOKEN, WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]
ENCODED = QUEUE.replace("/", "%2F")
SCOPE = f"{QUEUE}#web"

# refuses any change to verified/web while the switch file exists
HOOK = """#!/bin/sh
[ "$1" = prepared ] || exit 0
grep -q ' refs/heads/verified/web$' || exit 0
[ -e "{switch}" ] && {{ echo "verified/web is frozen" >&2; exit 1; }}
exit 0
"""


def _ref(repo: Monorepo, ref: str = "verified/web") -> str:
    return git(repo.work, "rev-parse", ref)


def _push(web: WebPipeline, repo: Monorepo, name: str, files: dict[str, str],
          state: str = "succeeded") -> str:
    repo.commit(name, files)
    request_id = web.ingest(QUEUE)
    web.wait_terminal([request_id], timeout=180)
    web.wait_quiet(timeout=180)
    assert web.states()[request_id] == state
    return request_id


def _pin_row(web: WebPipeline) -> tuple[str | None, int]:
    rows = web.query("SELECT pinned_uri FROM project_state WHERE queue = %s"
                     " AND project = 'web'", QUEUE)
    [(open_pins,)] = web.query("SELECT count(*) FROM promotion_pin WHERE queue = %s"
                               " AND unpinned_at IS NULL", SCOPE)
    return (rows[0][0] if rows else None), open_pins


def _start(web: WebPipeline, tmp_path: Path) -> Monorepo:
    repo = Monorepo(tmp_path)
    add_projects_queue(web, repo)
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()
    r1 = web.ingest(QUEUE)
    web.wait_terminal([r1], timeout=180)
    web.wait_quiet(timeout=180)
    assert _ref(repo) == repo.shas["c1"] == _ref(repo, "verified-main")
    return repo


def test_a_project_pin_holds_its_ref_while_its_bookmark_moves_and_unpin_moves_it_on(
        web: WebPipeline, tmp_path: Path) -> None:
    repo = _start(web, tmp_path)
    _push(web, repo, "c2", {"web/app.js": "2\n"})
    assert _ref(repo) == repo.shas["c2"]

    pinned = json.loads(web.cli("pin", QUEUE, repo.shas["c1"], "--project", "web",
                                "--reason", "bad release of web", "--by", "ops",
                                "--json").stdout)
    assert (pinned["project"], pinned["pinned_uri"], pinned["previous_target"]) == (
        "web", repo.uri("c1"), repo.uri("c2"))
    assert _ref(repo) == repo.shas["c1"]
    assert _ref(repo, "verified-main") == repo.shas["c2"]  # the queue's ref is not held

    # web is built green at c3: its bookmark moves, its ref stays at the pin; the whole
    # repository's ref moves on
    r3 = _push(web, repo, "c3", {"web/app.js": "3\n"})
    assert _ref(repo) == repo.shas["c1"] and _ref(repo, "verified-main") == repo.shas["c3"]
    view = web.get(f"/api/queues/{ENCODED}/projects/web").body
    assert view["bookmark"]["request_id"] == r3
    assert view["promotion"] == {
        "ref": "verified/web", "wanted_uri": repo.uri("c1"), "pinned_uri": repo.uri("c1"),
        "pinned_by": "ops", "pinned_reason": "bad release of web",
        "pinned_at": view["promotion"]["pinned_at"], "problem": None}
    assert web.get(f"/api/queues/{ENCODED}/projects").body["projects"][0]["promotion"] \
        is None  # api has no promotion ref of its own

    # c4 does not touch web (it inherits green from c3): still held
    _push(web, repo, "c4", {"services/api/x.txt": "4\n"})
    assert _ref(repo) == repo.shas["c1"]

    # a pin of c4 over HTTP: green for web by inheritance, so it may hold the ref
    reply = web.post_json(f"/api/queues/{ENCODED}/pin", {
        "commit": repo.shas["c4"], "reason": "hold at c4", "by": "ops", "project": "web"})
    assert reply.status == 200, reply.text
    assert (reply.body["pinned_uri"], reply.body["inherited_from"]) == (
        repo.uri("c4"), repo.uri("c3"))
    assert _ref(repo) == repo.shas["c4"]

    _push(web, repo, "c5", {"web/app.js": "5\n"})
    assert _ref(repo) == repo.shas["c4"]
    unpinned = json.loads(web.cli("unpin", QUEUE, "--project", "web", "--by", "ops",
                                  "--json").stdout)
    assert (unpinned["was_pinned"], unpinned["target"]) == (repo.uri("c4"), repo.uri("c5"))
    assert _ref(repo) == repo.shas["c5"]
    assert _pin_row(web) == (None, 0)
    # every pin and unpin kept under the project's scope
    assert web.query("SELECT uri, pinned_by, unpinned_by FROM promotion_pin"
                     " WHERE queue = %s ORDER BY id", SCOPE) == [
        (repo.uri("c1"), "ops", "ops"), (repo.uri("c4"), "ops", "ops")]
    # and it follows web's bookmark again
    _push(web, repo, "c6", {"web/app.js": "6\n"})
    assert _ref(repo) == repo.shas["c6"]
    assert web.invariant_violations() == []


def test_a_project_pin_is_refused_unless_the_commit_is_green_for_the_project(
        web: WebPipeline, tmp_path: Path) -> None:
    repo = _start(web, tmp_path)
    _push(web, repo, "c2", repo.outcome("web", "red"), state="failed")

    red = web.cli("pin", QUEUE, repo.shas["c2"], "--project", "web", "--reason", "x",
                  check=False)
    assert red.returncode == 4, red.stderr
    assert "is red for project 'web'" in red.stderr and "Traceback" not in red.stderr
    reply = web.post_json(f"/api/queues/{ENCODED}/pin", {
        "commit": repo.shas["c2"], "reason": "x", "by": "ops", "project": "web"})
    assert_error(reply, 409, "is red for project 'web'")

    no_ref = web.cli("pin", QUEUE, repo.shas["c1"], "--project", "docs", "--reason", "x",
                     check=False)
    assert no_ref.returncode == 4 and "has no promotion ref" in no_ref.stderr

    unknown = web.cli("pin", QUEUE, repo.shas["c1"], "--project", "mobile", "--reason",
                      "x", check=False)
    assert unknown.returncode == 1 and "has no project 'mobile'" in unknown.stderr
    reply = web.post_json(f"/api/queues/{ENCODED}/pin", {
        "commit": repo.shas["c1"], "reason": "x", "by": "ops", "project": "mobile"})
    assert_error(reply, 404, "has no project 'mobile'")

    # a commit the project never answered: a commit made after the last ingest
    repo.commit("c3", {"web/app.js": "3\n"})
    never = web.cli("pin", QUEUE, repo.shas["c3"], "--project", "web", "--reason", "x",
                    check=False)
    assert never.returncode == 4, never.stderr
    assert "was never validated for project 'web'" in never.stderr
    assert _pin_row(web) == (None, 0)
    assert web.query("SELECT count(*) FROM promotion_pin") == [(0,)]
    assert _ref(repo) == repo.shas["c1"]


def test_a_project_pin_whose_ref_cannot_move_is_rolled_back_and_the_sweeper_settles(
        web: WebPipeline, tmp_path: Path) -> None:
    repo = _start(web, tmp_path)
    _push(web, repo, "c2", {"web/app.js": "2\n"})
    switch = tmp_path / "frozen"
    hook = repo.work / ".git" / "hooks" / "reference-transaction"
    hook.write_text(HOOK.format(switch=switch))
    hook.chmod(0o755)

    switch.touch()
    done = web.cli("pin", QUEUE, repo.shas["c1"], "--project", "web", "--reason", "x",
                   check=False)
    assert done.returncode == 1, done.stderr
    assert "the pin did not take, and was rolled back" in done.stderr
    assert "verified/web is frozen" in done.stderr
    assert _pin_row(web) == (None, 0) and _ref(repo) == repo.shas["c2"]
    [(rolled_back,)] = web.query("SELECT rolled_back_reason FROM promotion_pin"
                                 " WHERE queue = %s", SCOPE)
    assert "verified/web is frozen" in rolled_back
    problem = web.get(f"/api/queues/{ENCODED}/projects/web").body["promotion"]["problem"]
    assert "verified/web is frozen" in problem
    switch.unlink()

    # pinned at c1, then someone moves the ref by hand: the sweeper puts it back
    web.cli("pin", QUEUE, repo.shas["c1"], "--project", "web", "--reason", "incident")
    assert _ref(repo) == repo.shas["c1"] and _pin_row(web) == (repo.uri("c1"), 1)
    assert web.get(f"/api/queues/{ENCODED}/projects/web").body["promotion"]["problem"] \
        is None
    subprocess.run(["git", "-C", str(repo.work), "update-ref", "refs/heads/verified/web",
                    repo.shas["c2"]], check=True)
    wait_until(lambda: _ref(repo) == repo.shas["c1"], timeout=120, interval=0.5,
               what="the sweeper to put the project's ref back at its pin")
    assert "sweeper_republished what=promotion" in web.full_logs()
    assert _ref(repo, "verified-main") == repo.shas["c2"]
