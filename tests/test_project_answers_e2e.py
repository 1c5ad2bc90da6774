"""Issue 24, Deliver 5 (and `explain --project` of Deliver 6) on a real worker, broker,
database and git repository, with command builds: a deploy gate asks whether a commit is
green for one project (`stovepipe fact --project`, `/api/facts?project=`,
`/api/queues/{queue}/green?project=`), release tooling asks for the newest commit green
for several (`stovepipe last-green`, `/api/queues/{queue}/last-green`), each project's
state at the head and its last green commit as a bare sha; bad input is refused with a
message naming the problem and the known projects.

The history (api, web blocking; docs bring-up):

    c1  every project built, green                      r1 succeeded
    c2  api breaks (built red; web, docs inherit green)  r2 failed
    c3  web changes (built green; api inherits red)      r3 failed
    c4  docs breaks (built red; api still red)           r4 failed
    c5  api fixed (built green; docs inherits red)       r5 succeeded
    c6  pushed, never ingested
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue, answers
from tests.pipeline_support import Pipeline
from tests.web_support import WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

PLAIN = "plain/main"  # a queue without projects
Q = quote(QUEUE, safe="")


def _settle(pipeline: Pipeline, request_id: str) -> str:
    pipeline.wait_terminal([request_id], timeout=180)
    pipeline.wait_quiet(timeout=180)
    return pipeline.states()[request_id]


def _cli(pipeline: Pipeline, *args: str) -> tuple[int, dict[str, Any] | None, str, str]:
    """(exit status, the JSON answer when there is one, stdout, stderr)."""
    result = pipeline.cli(*args, check=False)
    body = None
    if "--json" in args and result.returncode in (0, 3):
        body = json.loads(result.stdout)
    return result.returncode, body, result.stdout, result.stderr


def test_gates_and_release_tooling_ask_about_projects(web: WebPipeline,
                                                       tmp_path: Path) -> None:
    repo = Monorepo(tmp_path)
    add_projects_queue(web, repo)
    web.add_queue(PLAIN)
    repo.commit("c1", {**repo.outcome("api", "green"), **repo.outcome("web", "green"),
                       **repo.outcome("docs", "green")})
    web.start_web_worker()
    web.wait_healthy()
    sha = repo.shas

    r1 = web.ingest(QUEUE)
    assert _settle(web, r1) == "succeeded"
    repo.commit("c2", repo.outcome("api", "red"))
    r2 = web.ingest(QUEUE)
    assert _settle(web, r2) == "failed"
    repo.commit("c3", {"web/app.js": "1\n"})
    r3 = web.ingest(QUEUE)
    assert _settle(web, r3) == "failed"
    repo.commit("c4", repo.outcome("docs", "red"))
    r4 = web.ingest(QUEUE)
    assert _settle(web, r4) == "failed"
    assert answers(web, r4) == {"api": (1.0, True), "web": (0.0, True),
                                "docs": (1.0, False)}

    # while api is red: its story tells the heads that left it alone, inheriting red
    code, told, _, _ = _cli(web, "explain", QUEUE, "--project", "api", "--json")
    assert code == 0 and told is not None
    assert told["queue"] == f"{QUEUE}#api"
    by_id = {entry["request_id"]: entry for entry in told["story"]}
    for head in (r3, r4):
        assert by_id[head]["state"] == "unaffected"
        assert by_id[head]["verdict"] == "red"
        assert by_id[head]["words"].startswith(
            f"unaffected, inherits red from {sha['c2'][:12]}")
        assert f"request/{QUEUE}#api/2" in by_id[head]["words"]
    assert by_id[f"request/{QUEUE}#api/2"]["verdict"] == "red"
    order = [entry["request_id"] for entry in told["story"]]
    assert order.index(r4) < order.index(r3) < order.index(f"request/{QUEUE}#api/2")
    assert told["head"]["request_id"] == r4
    assert told["summary"].startswith(f"At the newest head {sha['c4'][:12]}")
    assert f"api is unaffected: it inherits red from {sha['c2'][:12]}" in told["summary"]
    text = web.cli("explain", QUEUE, "--project", "api").stdout
    assert f"unaffected, inherits red from {sha['c2'][:12]}" in text

    repo.commit("c5", repo.outcome("api", "green"))
    r5 = web.ingest(QUEUE)
    assert _settle(web, r5) == "succeeded"
    assert answers(web, r5) == {"api": (0.0, False), "web": (0.0, True),
                                "docs": (1.0, True)}
    repo.commit("c6", {"web/app.js": "2\n"})  # never ingested
    assert web.states(QUEUE) == {r1: "succeeded", r2: "failed", r3: "failed",
                                 r4: "failed", r5: "succeeded"}

    # --- stovepipe fact --project: the exit contract of a gate -----------------------
    code, built_green, _, _ = _cli(web, "fact", QUEUE, sha["c1"], "--project", "api",
                                   "--json")
    assert code == 0 and built_green is not None
    assert (built_green["project"], built_green["green"], built_green["unaffected"],
            built_green["inherited_from"]) == ("api", True, False, None)
    assert built_green["fact"]["source_request_id"] == f"request/{QUEUE}#api/1"
    assert built_green["fact"]["request_id"] == r1

    code, built_red, _, _ = _cli(web, "fact", QUEUE, sha["c2"][:10], "--project", "api",
                                 "--json")
    assert code == 3 and built_red is not None
    assert (built_red["green"], built_red["unaffected"], built_red["fact"]["degree"]) == (
        False, False, 1.0)
    assert built_red["prior_green"]["uri"] == repo.uri("c1")
    assert built_red["next_green"]["uri"] == repo.uri("c5")

    code, inherited_green, _, _ = _cli(web, "fact", QUEUE, sha["c2"], "--project", "web",
                                       "--json")
    assert code == 0 and inherited_green is not None
    assert (inherited_green["green"], inherited_green["unaffected"],
            inherited_green["inherited_from"]) == (True, True, sha["c1"])
    assert inherited_green["fact"]["source_request_id"] == f"request/{QUEUE}#web/1"

    code, inherited_red, out, _ = _cli(web, "fact", QUEUE, sha["c3"], "--project", "api",
                                       "--json")
    assert code == 3 and inherited_red is not None
    assert (inherited_red["green"], inherited_red["unaffected"],
            inherited_red["inherited_from"]) == (False, True, sha["c2"])
    assert inherited_red["prior_green"]["uri"] == repo.uri("c1")
    assert inherited_red["next_green"]["uri"] == repo.uri("c5")
    said = web.cli("fact", QUEUE, sha["c3"], "--project", "api", check=False)
    assert said.returncode == 3
    assert said.stdout.splitlines()[0] == (
        f"{repo.uri('c3')}: project api unaffected, inherits red from {sha['c2']} "
        f"(request/{QUEUE}#api/2), at {r3}")

    code, never, _, _ = _cli(web, "fact", QUEUE, sha["c6"], "--project", "api", "--json")
    assert code == 3 and never is not None
    assert (never["green"], never["known"], never["fact"], never["unaffected"]) == (
        False, True, None, False)

    code, _, _, err = _cli(web, "fact", QUEUE, sha["c1"], "--project", "nope")
    assert code == 1
    assert "no project 'nope'" in err and "its projects are api, docs, web" in err
    assert "Traceback" not in err
    code, _, _, err = _cli(web, "fact", QUEUE, sha["c1"], "--project", "no good")
    assert code == 1 and "invalid project name 'no good'" in err
    code, _, _, err = _cli(web, "fact", PLAIN, sha["c1"], "--project", "api")
    assert code == 1 and f"queue '{PLAIN}' has no projects" in err

    # --- stovepipe last-green: the newest commit green for every listed project --------
    def last_green(*projects: str) -> tuple[int, dict[str, Any] | None]:
        flags = [arg for p in projects for arg in ("--project", p)]
        code, body, _, _ = _cli(web, "last-green", QUEUE, *flags, "--json")
        return code, body

    code, api_docs = last_green("api", "docs")
    assert code == 0 and api_docs is not None
    assert (api_docs["sha"], api_docs["request_id"]) == (sha["c1"], r1)
    assert {p: (f["unaffected"], f["source_request_id"])
            for p, f in api_docs["facts"].items()} == {
        "api": (False, f"request/{QUEUE}#api/1"), "docs": (False, f"request/{QUEUE}#docs/1")}
    code, web_docs = last_green("web", "docs")
    assert code == 0 and web_docs is not None
    assert (web_docs["sha"], web_docs["request_id"]) == (sha["c3"], r3)
    assert web_docs["facts"]["web"]["unaffected"] is False
    assert (web_docs["facts"]["docs"]["unaffected"],
            web_docs["facts"]["docs"]["inherited_from"]) == (True, sha["c1"])
    code, api_web = last_green("api", "web")
    assert code == 0 and api_web is not None
    assert api_web["sha"] == sha["c5"]
    assert api_web["facts"]["web"]["inherited_from"] == sha["c3"]
    code, bookmark = last_green()
    assert code == 0 and bookmark is not None
    assert (bookmark["sha"], bookmark["projects"], bookmark["fact"]["request_id"]) == (
        sha["c5"], [], r5)
    text = web.cli("last-green", QUEUE, "-p", "docs", "-p", "web").stdout.splitlines()
    assert text[0] == sha["c3"]
    code, _, out, _ = _cli(web, "last-green", PLAIN)
    assert code == 3 and "has no green commit yet" in out
    code, _, _, err = _cli(web, "last-green", QUEUE, "-p", "api", "-p", "nope")
    assert code == 1 and "no project 'nope'" in err and "Traceback" not in err

    # --- HTTP: the same answers -------------------------------------------------------
    fact = web.get(f"/api/facts?queue={Q}&sha={sha['c2']}&project=web")
    assert fact.status == 200, fact.text
    assert (fact.body["project"], fact.body["green"], fact.body["unaffected"],
            fact.body["inherited_from"], fact.body["known"]) == (
        "web", True, True, sha["c1"], True)
    whole = web.get(f"/api/facts?queue={Q}&sha={sha['c2']}")
    assert whole.body["green"] is False and "unaffected" not in whole.body
    red = web.get(f"/api/queues/{Q}/green?sha={sha['c3']}&project=api")
    assert red.status == 200, red.text
    assert (red.body["green"], red.body["unaffected"], red.body["inherited_from"]) == (
        False, True, sha["c2"])
    assert (red.body["prior_green"]["uri"], red.body["next_green"]["uri"]) == (
        repo.uri("c1"), repo.uri("c5"))

    both = web.get(f"/api/queues/{Q}/last-green?projects=api,docs")
    assert both.status == 200, both.text
    assert (both.body["found"], both.body["sha"], sorted(both.body["facts"])) == (
        True, sha["c1"], ["api", "docs"])
    bare = web.get(f"/api/queues/{Q}/last-green?projects=docs,web&format=text")
    assert (bare.status, bare.text, bare.headers["Content-Type"].split(";")[0]) == (
        200, f"{sha['c3']}\n", "text/plain")
    assert web.get(f"/api/queues/{Q}/last-green").body["sha"] == sha["c5"]

    states = web.get(f"/api/queues/{Q}/projects")
    assert states.status == 200, states.text
    shown = {p["project"]: p for p in states.body["projects"]}
    assert {p: (v["state"], v["green"], v["head_request_id"]) for p, v in shown.items()} == {
        "api": ("green", True, r5), "web": ("unaffected", True, r5),
        "docs": ("unaffected", False, r5)}
    assert shown["web"]["fact"]["inherited_from"] == sha["c3"]
    assert shown["docs"]["words"] == f"unaffected, inherits red from {sha['c4'][:12]}"
    assert {p: v["bookmark"]["sha"] for p, v in shown.items()} == {
        "api": sha["c5"], "web": sha["c5"], "docs": sha["c3"]}
    assert {p: (v["greenness"], v["red_streak_s"] is not None) for p, v in shown.items()} == {
        "api": ("green", False), "web": ("green", False), "docs": ("red", True)}
    assert shown["api"]["build"]["verdict"] == "green"
    assert (shown["web"]["build"], shown["web"]["request_id"]) == (
        None, f"request/{QUEUE}#web/3")
    assert (shown["api"]["blocking"], shown["docs"]["blocking"]) == (True, False)
    one = web.get(f"/api/queues/{Q}/projects/docs")
    assert one.status == 200, one.text
    assert (one.body["queue"], one.body["project"], one.body["state"]) == (
        QUEUE, "docs", "unaffected")
    docs_sha = web.get(f"/api/queues/{Q}/projects/docs?format=text")
    assert (docs_sha.status, docs_sha.text) == (200, f"{sha['c3']}\n")

    # --- bad input: a message naming the problem and the known projects -------------
    assert_error(web.get(f"/api/queues/{Q}/last-green?projects=web,nope"), 404,
                 "no project 'nope'", "its projects are api, docs, web")
    assert_error(web.get(f"/api/queues/{Q}/last-green?projects=no%20good"), 400,
                 "invalid project name")
    assert_error(web.get(f"/api/queues/{Q}/last-green?projects=api,,web"), 400,
                 "comma-separated list of project names")
    assert_error(web.get(f"/api/queues/{quote(PLAIN, safe='')}/last-green?projects=api"),
                 404, f"queue '{PLAIN}' has no projects")
    assert_error(web.get(f"/api/queues/{Q}/projects/nope"), 404, "no project 'nope'")
    assert_error(web.get(f"/api/queues/{quote(PLAIN, safe='')}/projects"), 404,
                 "has no projects")
    assert_error(web.get(f"/api/facts?queue={Q}&sha={sha['c1']}&project=nope"), 404,
                 "its projects are api, docs, web")
    assert_error(web.get(f"/api/queues/{Q}/green?sha={sha['c1']}&project="), 400,
                 "name one project")
    assert_error(web.get(f"/api/queues/{Q}/last-green?format=xml"), 400, "'format'")
    assert web.invariant_violations(strict_bookmark=True) == []
    assert web.dead_letters() == 0
