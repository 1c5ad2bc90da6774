"""Issue 18, Deliver 3, 4, 8: the branch's story since its last green commit (`stovepipe
explain`, `GET /api/queues/{queue}/explain`), the culprit on `stovepipe queue` and `GET
/api/queues/{queue}`, the command runner's build log, and the green list (`GET
/api/queues/{queue}/greens`) — on a real worker, broker, database and git repository
whose commits decide their builds' outcomes (tests.culprit_support)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from tests.culprit_support import QUEUE, Branch, add_culprit_queue, wait_search
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until
from tests.web_support import WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

AUTHOR = "Ada Lovelace <ada@example.invalid>"


def _start(pipeline: Pipeline, tmp_path: Path, *, web: bool = False,
           **knobs: object) -> Branch:
    branch = Branch(tmp_path)
    add_culprit_queue(pipeline, branch, **knobs)
    branch.commit("c0", "green")
    if web:
        assert isinstance(pipeline, WebPipeline)
        pipeline.start_web_worker()
        pipeline.wait_healthy()
    else:
        pipeline.start_worker()
    first = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([first], timeout=120)
    return branch


def explain(pipeline: Pipeline) -> dict[str, Any]:
    return json.loads(pipeline.cli("explain", QUEUE, "--json").stdout)  # type: ignore[no-any-return]


def story_of(branch: Branch, told: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    """(commit name, request id, state) of each entry, newest first."""
    return [(branch.name_of(e["uri"]), e["request_id"], e["state"]) for e in told["story"]]


def words_of(branch: Branch, told: dict[str, Any]) -> dict[str, str]:
    return {branch.name_of(e["uri"]): e["words"] for e in told["story"]}


def test_explain_one_push_of_eight_the_fifth_breaks(web: WebPipeline, tmp_path: Path) -> None:
    """c0 green, then one push of c1..c8 where c5 breaks: while c4's backfill build runs
    the story says the range is being bisected (8 commits, the culprit among them; no
    build counted until one ran) and the build runs; once found — c7, c6 and c5 built
    newest first to confirm it — it names c5 the culprit, confirmed, c4 green and the
    bookmark, c6, c7 and c8 broken since c5; the API, the CLI and `stovepipe queue` say
    the same, the culprit's build links to its log, and the green list is c0, c4."""
    branch = _start(web, tmp_path, web=True)
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 5 else "red", hold="probe" if n == 4 else None)
    head = web.ingest(QUEUE)
    wait_until(lambda: any(name == "c4" for name, _ in branch.started()), timeout=120,
               what="the backfill build of c4 to start")

    def probe_building() -> bool:
        told = web.get(f"/api/queues/{QUEUE}/explain").body
        c4 = [e for e in told["story"] if e["request_id"] == "request/mono/main/1~4"]
        return bool(c4) and c4[0]["words"].startswith("building for")

    wait_until(probe_building, timeout=60, what="the story to say c4 is building")
    told = web.get(f"/api/queues/{QUEUE}/explain").body
    assert told["search"]["state"] == "bisecting"
    assert told["search"]["commits_left"] == 8 and told["search"]["builds"] == 0
    assert "bisecting: the culprit is among 8 commits" in told["search"]["words"]
    assert "0 backfill builds spent (at most 4)" in told["search"]["words"]
    assert told["culprit"] is None
    assert "is red; bisecting: the culprit is among 8 commits" in told["summary"]
    # newest first: the red head, the commits never built and the probe at their places
    assert story_of(branch, told) == [
        ("c8", head, "failed"), ("c7", None, "unbuilt"), ("c6", None, "unbuilt"),
        ("c5", None, "unbuilt"), ("c4", "request/mono/main/1~4", "processing"),
        ("c3", None, "unbuilt"), ("c2", None, "unbuilt"), ("c1", None, "unbuilt"),
        ("c0", "request/mono/main/1", "succeeded")]
    words = words_of(branch, told)
    assert words["c8"] == "red — finding the culprit: it is among 8 commits"
    assert words["c6"] == ("not built yet: the culprit may be this commit (it is among 8 "
                           "commits)")
    assert words["c4"].startswith("building for ") and "(attempt 1, started " in words["c4"]
    probe = next(e for e in told["story"] if e["request_id"] == "request/mono/main/1~4")
    assert probe["kind"] == "backfill" and probe["build"]["running_for_s"] >= 0
    assert probe["build"]["url"] == (f"/api/builds/mono/main/{probe['build']['id']}/log")
    assert words["c0"].startswith("green — the bookmark (the last green commit)")
    overview = web.get(f"/api/queues/{QUEUE}").body
    assert overview["search"]["state"] == "bisecting" and overview["culprit"] is None
    shown = web.cli("queue", QUEUE).stdout
    assert "culprit     bisecting: the culprit is among 8 commits" in shown

    branch.release("probe")
    wait_search(web, "found")
    web.wait_quiet(timeout=120)

    told = web.get(f"/api/queues/{QUEUE}/explain").body
    assert story_of(branch, told) == [
        ("c8", head, "failed"), ("c7", "request/mono/main/1~7", "failed"),
        ("c6", "request/mono/main/1~6", "failed"), ("c5", "request/mono/main/1~5", "failed"),
        ("c4", "request/mono/main/1~4", "succeeded")]
    words = words_of(branch, told)
    c5 = f'{branch.shas["c5"][:12]} "c5: make it red"'
    assert words == {
        "c8": f"red — broken since the culprit {c5}",
        "c7": f"red — broken since the culprit {c5}",
        "c6": f"red — broken since the culprit {c5}",
        "c5": "red — the culprit: its first parent is green and every commit after it is red",
        "c4": ("green — the bookmark (the last green commit); the promotion ref "
               "verified-main is here")}
    assert [e["culprit"] for e in told["story"]] == [False, False, False, True, False]
    assert [e["bookmark"] for e in told["story"]] == [False, False, False, False, True]
    culprit = told["culprit"]
    assert (culprit["sha"], culprit["subject"], culprit["author"]) == (
        branch.shas["c5"], "c5: make it red", AUTHOR)
    assert culprit["request_id"] == "request/mono/main/1~5"
    assert (culprit["confirmed"], culprit["unconfirmed_reason"]) == (True, None)
    assert culprit["build"]["url"] == f"/api/builds/mono/main/{culprit['build']['id']}/log"
    assert told["search"]["state"] == "found" and told["search"]["confirmed"] is True
    assert told["search"]["words"] == (f"found {c5} after 4 backfill builds; confirmed: "
                                       f"every commit from it to the head is red")
    assert told["bookmark"]["request_id"] == "request/mono/main/1~4"
    assert told["head"]["request_id"] == head
    assert told["promotion"] == {"ref": "verified-main", "uri": branch.uri("c4"),
                                 "known": True, "pinned": None}
    assert told["summary"].startswith(
        f"{QUEUE} is red since {c5} by {AUTHOR}, found after 4 backfill builds. The newest "
        f'head is {branch.shas["c8"][:12]} "c8: make it red" ({head}): red — broken since '
        f"the culprit {c5}. The bookmark, its last green commit, is "
        f'{branch.shas["c4"][:12]} "c4: make it green" (request/mono/main/1~4).')
    assert told["summary"].endswith("The promotion ref verified-main is at the bookmark.")
    assert told["cut"] is False

    # the CLI tells the same story (every build is over: no running time differs)
    assert explain(web) == told
    text = web.cli("explain", QUEUE).stdout
    assert text.startswith(f"{QUEUE} is red since {c5}")
    assert f"culprit    {branch.shas['c5']} by {AUTHOR}" in text
    assert f"  request/mono/main/1~7        backfill {branch.shas['c7'][:12]}" in text

    # "red since C" on the queue's overview and `stovepipe queue`
    overview = web.get(f"/api/queues/{QUEUE}").body
    assert overview["culprit"] == culprit and overview["search"] == told["search"]
    shown = web.cli("queue", QUEUE).stdout
    assert f"  red since   {branch.shas['c5']} by {AUTHOR}" in shown
    assert "              c5: make it red" in shown
    assert f"culprit     found {c5} after 4 backfill builds; confirmed" in shown
    queued = json.loads(web.cli("queue", QUEUE, "--json").stdout)
    assert queued["culprit"] == culprit

    # the culprit's build log, as text
    log = web.get(culprit["build"]["url"])
    assert log.status == 200 and log.headers["Content-Type"].startswith("text/plain")
    assert log.headers["X-Build-Status"] == "failed"
    assert_error(web.get(f"/api/builds/other/{culprit['build']['id']}/log"), 404, "'other'")
    assert_error(web.get("/api/builds/mono/main/cmd-0123/log"), 404, "no command build")

    # green commits in history order: c0, then the backfilled c4
    greens = web.get(f"/api/queues/{QUEUE}/greens").body
    assert [(g["sha"], g["request_id"]) for g in greens["greens"]] == [
        (branch.shas["c0"], "request/mono/main/1"),
        (branch.shas["c4"], "request/mono/main/1~4")]
    assert greens["next"] is None and greens["described"] is True
    since_c0 = web.get(f"/api/queues/{QUEUE}/greens?since={branch.shas['c0'][:8]}").body
    assert [g["uri"] for g in since_c0["greens"]] == [branch.uri("c4")]
    assert since_c0["since"] == branch.uri("c0")
    # after the culprit (never green itself) comes nothing green yet
    after = web.get(f"/api/queues/{QUEUE}/greens?since={branch.shas['c5']}").body
    assert after["greens"] == [] and after["next"] is None

    # bad input: JSON errors, never tracebacks
    for path in ("/api/queues/nope/explain", "/api/queues/nope/health",
                 "/api/queues/nope/greens"):
        assert_error(web.get(path), 404, "nope")
    assert_error(web.get("/api/queues/bad%20name/explain"), 400, "invalid queue name")
    for limit in ("0", "1001", "ten", "-1"):
        assert_error(web.get(f"/api/queues/{QUEUE}/greens?limit={limit}"), 400,
                     "'limit' must be an integer from 1 to 1000")
    assert_error(web.get(f"/api/queues/{QUEUE}/greens?since="), 400, "'since'")
    assert_error(web.get(f"/api/queues/{QUEUE}/greens?since=not-a-sha"), 400)
    assert_error(web.get(f"/api/queues/{QUEUE}/greens?since=" + "0" * 40), 404)
    # a commit of the repository the queue never validated: no place in its history
    assert_error(web.get(f"/api/queues/{QUEUE}/greens?since={branch.shas['c2']}"), 404,
                 "never validated")
    failed = web.cli("explain", "nope", check=False)
    assert failed.returncode == 1 and "nope" in failed.stderr
    assert "Traceback" not in failed.stderr

    health = web.get(f"/api/queues/{QUEUE}/health").body
    assert health["bookmark_lag"]["commits"] == 4  # c5..c8
    assert health["bookmark_lag"]["commits_more_than"] is False
    assert health["red"]["streak_s"] is not None and health["red"]["streak_s"] >= 0
    assert health["time_to_signal"]["facts"] == 2  # the heads c0 and c8, not backfills
    assert web.get(f"/api/queues/{quote(QUEUE, safe='')}/health").status == 200
    assert overview["health"]["bookmark_lag"]["commits"] == 4


def test_explain_waiting_building_superseded(pipeline: Pipeline, tmp_path: Path) -> None:
    """One slot: c1's build is held, so c2 waits for the slot behind it; c3 arrives and
    supersedes c2; once c1's build ends, c3 is built and is green: the bookmark."""
    branch = _start(pipeline, tmp_path)
    branch.commit("c1", "green", hold="one")
    building = pipeline.ingest(QUEUE)
    wait_until(lambda: any(name == "c1" for name, _ in branch.started()), timeout=120,
               what="c1's build to start")
    branch.commit("c2", "green")
    waiting = pipeline.ingest(QUEUE)

    def told_waiting() -> bool:
        told = explain(pipeline)
        return "waiting" in words_of(branch, told).get("c2", "")

    wait_until(told_waiting, timeout=60, what="c2 to wait")
    told = explain(pipeline)
    words = words_of(branch, told)
    c1 = f'{branch.shas["c1"][:12]} "c1: make it green"'
    assert words["c1"].startswith("building for ")
    assert "(attempt 1, started " in words["c1"]
    assert words["c2"].startswith("waiting ")
    assert f"for a slot behind {building} ({c1}, building for " in words["c2"]
    entry = next(e for e in told["story"] if e["request_id"] == building)
    assert entry["build"]["status"] == "running" and entry["build"]["running_for_s"] >= 0
    assert entry["build"]["attempt"] == 1
    assert told["summary"].startswith(f"{QUEUE} is green") is False
    assert f"The newest head is {branch.shas['c2'][:12]}" in told["summary"]

    branch.commit("c3", "green")
    newest = pipeline.ingest(QUEUE)
    wait_until(lambda: pipeline.states().get(waiting) == "superseded", timeout=60,
               what="c2 to be superseded")
    told = explain(pipeline)
    assert story_of(branch, told) == [
        ("c3", newest, "accepted"), ("c2", waiting, "superseded"),
        ("c1", building, "processing"), ("c0", "request/mono/main/1", "succeeded")]
    words = words_of(branch, told)
    c3 = f'{branch.shas["c3"][:12]} "c3: make it green"'
    assert words["c2"] == f"superseded by {newest} ({c3}), a newer head: never built"
    assert f"for a slot behind {building} ({c1}, building for " in words["c3"]

    branch.release("one")
    pipeline.wait_terminal([building, newest], timeout=120)
    pipeline.wait_quiet(timeout=120)
    told = explain(pipeline)
    assert story_of(branch, told) == [("c3", newest, "succeeded")]
    assert told["summary"].startswith(f'{QUEUE} is green at its newest head '
                                      f'{branch.shas["c3"][:12]} "c3: make it green".')
    assert told["culprit"] is None and told["search"] is None
    health = json.loads(pipeline.cli("queue", QUEUE, "--json").stdout)
    assert health["culprit"] is None and health["search"] is None


def test_explain_a_break_fixed_inside_the_range_and_greens_in_history_order(
        web: WebPipeline, tmp_path: Path) -> None:
    """c2 breaks, c4 fixes, c7 breaks again: the culprit is c7, the bookmark the
    backfilled c6; then a green head c9. The green list is c0, c4, c6 (backfills, between
    the heads) and c9, in history order, page by page."""
    branch = _start(web, tmp_path, web=True)
    outcomes = {1: "green", 2: "red", 3: "red", 4: "green", 5: "green", 6: "green",
                7: "red", 8: "red"}
    for n, outcome in outcomes.items():
        branch.commit(f"c{n}", outcome)
    head = web.ingest(QUEUE)
    wait_search(web, "found")
    web.wait_quiet(timeout=120)
    told = explain(web)
    c7 = f'{branch.shas["c7"][:12]} "c7: make it red"'
    assert story_of(branch, told) == [
        ("c8", head, "failed"), ("c7", "request/mono/main/1~7", "failed"),
        ("c6", "request/mono/main/1~6", "succeeded")]
    assert words_of(branch, told) == {
        "c8": f"red — broken since the culprit {c7}",
        "c7": "red — the culprit: its first parent is green and every commit after it is red",
        "c6": ("green — the bookmark (the last green commit); the promotion ref "
               "verified-main is here")}
    assert told["culprit"]["sha"] == branch.shas["c7"]

    branch.commit("c9", "green")
    fixed = web.ingest(QUEUE)
    web.wait_terminal([fixed], timeout=120)
    web.wait_quiet(timeout=120)
    told = explain(web)
    assert told["culprit"] is None and told["search"] is None  # the streak is over
    assert story_of(branch, told) == [("c9", fixed, "succeeded")]

    def page(**query: str) -> dict[str, Any]:
        reply = web.get(f"/api/queues/{QUEUE}/greens?{urlencode(query)}")
        assert reply.status == 200, reply.text
        return reply.body  # type: ignore[no-any-return]

    everything = page()
    assert [branch.name_of(g["uri"]) for g in everything["greens"]] == [
        "c0", "c4", "c6", "c9"]
    assert [g["request_id"] for g in everything["greens"]] == [
        "request/mono/main/1", "request/mono/main/1~4", "request/mono/main/1~6", fixed]
    assert [g["subject"] for g in everything["greens"]] == [
        "c0: make it green", "c4: make it green", "c6: make it green", "c9: make it green"]
    first = page(limit="2")
    assert [branch.name_of(g["uri"]) for g in first["greens"]] == ["c0", "c4"]
    assert first["next"] == branch.uri("c4")
    second = page(limit="2", since=first["next"])
    assert [branch.name_of(g["uri"]) for g in second["greens"]] == ["c6", "c9"]
    assert second["next"] is None
    # after a red commit: the green ones after it in the history
    assert [branch.name_of(g["uri"]) for g in page(since=branch.shas["c7"])["greens"]] == [
        "c9"]
    assert page(since=branch.shas["c9"])["greens"] == []


def test_explain_a_flaky_candidate_with_retry_red(pipeline: Pipeline, tmp_path: Path) -> None:
    """retry.red: 1 — a probe may run 2 builds, so max_builds 6 leaves room for 3 probes:
    c4 fails once and passes when run again: green and flaky, the bookmark; c6 and c5 red
    on both attempts. c5 is a break, but c7, between it and the head, was not built: the
    story names c5 as a break not confirmed as the head's, and says why."""
    branch = _start(pipeline, tmp_path, retry={"red": 1, "unvalidated": 0, "backoff": "1s"},
                    backfill={"mode": "bisect", "max_builds": 6})
    for n in range(1, 9):
        branch.commit(f"c{n}", "flaky" if n == 4 else ("green" if n < 5 else "red"))
    head = pipeline.ingest(QUEUE)
    wait_search(pipeline, "found")
    pipeline.wait_quiet(timeout=120)
    told = explain(pipeline)
    c5 = f'{branch.shas["c5"][:12]} "c5: make it red"'
    reason = ("backfill.max_builds (6) was spent with 1 commit between it and the head not "
              "built, and a later fix and break could hide there")
    assert story_of(branch, told) == [
        ("c8", head, "failed"), ("c7", None, "unbuilt"),
        ("c6", "request/mono/main/1~6", "failed"), ("c5", "request/mono/main/1~5", "failed"),
        ("c4", "request/mono/main/1~4", "succeeded")]
    assert words_of(branch, told) == {
        "c8": f"red after 2 attempts — after {c5}, a break not confirmed as the head's",
        "c7": (f"never built: between the break {c5} and the head, so a later fix and break "
               f"could hide here"),
        "c6": f"red after 2 attempts — after {c5}, a break not confirmed as the head's",
        "c5": (f"red after 2 attempts — a break (its first parent is green), not confirmed "
               f"as the head's: {reason}"),
        "c4": ("green (flaky: red first, green when run again) after 2 attempts — the "
               "bookmark (the last green commit); the promotion ref verified-main is here")}
    assert told["search"]["words"] == (f"a break, not confirmed as the head's: {c5}, found "
                                       f"after 6 backfill builds ({reason})")
    assert (told["culprit"]["confirmed"], told["culprit"]["unconfirmed_reason"]) == (
        False, reason)
    assert told["culprit"]["build"]["attempt"] == 2
    text = pipeline.cli("explain", QUEUE).stdout
    assert f"a break    {branch.shas['c5']} by {AUTHOR}" in text
    assert "           not confirmed as the head's: backfill.max_builds (6)" in text
    shown = json.loads(pipeline.cli("queue", QUEUE, "--json").stdout)
    assert (shown["culprit"]["sha"], shown["culprit"]["confirmed"]) == (
        branch.shas["c5"], False)


def test_explain_after_the_branch_went_green_again(pipeline: Pipeline,
                                                   tmp_path: Path) -> None:
    """While the first backfill build (c4) runs, a fix (c9) lands and is green: the
    search stops and the streak is over — the story is the fix, green at the head, with
    no culprit; before, it said the range was being bisected."""
    branch = _start(pipeline, tmp_path)
    for n in range(1, 9):
        branch.commit(f"c{n}", "green" if n < 6 else "red", hold="probe" if n == 4 else None)
    head = pipeline.ingest(QUEUE)
    wait_until(lambda: any(name == "c4" for name, _ in branch.started()), timeout=120,
               what="the backfill build of c4 to start")
    told = explain(pipeline)
    assert told["search"]["state"] == "bisecting" and told["culprit"] is None
    assert told["head"]["request_id"] == head
    branch.commit("c9", "green")
    fix = pipeline.ingest(QUEUE)
    pipeline.wait_terminal([head, fix], timeout=120)
    branch.release("probe")
    wait_search(pipeline, "fixed")
    pipeline.wait_quiet(timeout=120)
    told = explain(pipeline)
    assert told["culprit"] is None and told["search"] is None
    assert story_of(branch, told) == [("c9", fix, "succeeded")]
    assert told["summary"].startswith(f"{QUEUE} is green at its newest head "
                                      f'{branch.shas["c9"][:12]} "c9: make it green".')
    assert told["bookmark"]["request_id"] == fix
