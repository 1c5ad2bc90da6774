"""Commit statuses and alerts of a monorepo's projects (issue 24, "Where people look") on a
real worker, broker, database and git repository with command builds, against local HTTP
servers as GitHub, a JSON webhook and Slack (tests/notify_http.py).

Each project's status is `stovepipe/<project>`: pending then final at a head that builds
it; at a head that does not affect it, one final status saying what it inherits and from
which commit — only for the projects `notify.github_status.unaffected` names. A project's
own alert channel gets its project's transitions and nothing else, each naming the queue,
the project and its culprit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.monorepo_support import QUEUE, Monorepo, add_projects_queue
from tests.notify_http import GITHUB, SLACK, WEBHOOK, FakeServices, fake_services
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

TOKEN_ENV = "STOVEPIPE_TEST_GH_TOKEN"
TEAM_WEBHOOK_ENV, TEAM_SLACK_ENV = "STOVEPIPE_TEST_TEAM_HOOK", "STOVEPIPE_TEST_TEAM_SLACK"
API_WEBHOOK_ENV, API_SLACK_ENV = "STOVEPIPE_TEST_API_HOOK", "STOVEPIPE_TEST_API_SLACK"
PUBLIC = "https://stovepipe.example"
ALL_GREEN = {"services/api/outcome": "green\n", "web/outcome": "green\n",
             "docs/outcome": "green\n"}


def _settle(pipeline: Pipeline, request_id: str) -> str:
    pipeline.wait_terminal([request_id], timeout=180)
    pipeline.wait_quiet(timeout=180)
    return pipeline.states()[request_id]


def _link(request_id: str) -> str:
    return f"{PUBLIC}/#request={request_id.replace('#', '%23')}"


def _statuses(services: FakeServices) -> dict[tuple[str, str], list[tuple[str, str, str]]]:
    """(sha, context) → the (state, description, target_url)s GitHub accepted, in order."""
    posted: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
    for r in services.requests(GITHUB, answered=201):
        key = (r.path.rsplit("/", 1)[1], r.body["context"])
        posted.setdefault(key, []).append(
            (r.body["state"], r.body["description"], r.body.get("target_url", "")))
    return posted


def _sent_all(pipeline: Pipeline) -> Callable[[], bool]:
    return lambda: pipeline.query(
        "SELECT count(*) FROM notification WHERE done_at IS NULL") == [(0,)]


def test_a_project_the_head_does_not_affect_gets_a_status_naming_what_it_inherits(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = Monorepo(tmp_path)
    with fake_services() as services:
        add_projects_queue(pipeline, repo, notify={"github_status": {
            "repository": "acme/mono", "token_env": TOKEN_ENV,
            "api_url": services.github_api, "unaffected": ["api", "web"],
            # the test posts some 40 statuses in a minute: more than GitHub's content
            # limit allows (the default share, 400 an hour, would space them 9 s apart)
            "content_requests_per_hour": 36000}})
        repo.commit("c1", {**ALL_GREEN, "libs/common/lib.txt": "1\n"})
        pipeline.start_worker(env={TOKEN_ENV: services.token,
                                   "STOVEPIPE_PUBLIC_URL": PUBLIC})
        r1 = pipeline.ingest(QUEUE)
        assert _settle(pipeline, r1) == "succeeded"  # every project built
        repo.commit("c2", {"web/app.js": "1\n"})
        r2 = pipeline.ingest(QUEUE)
        assert _settle(pipeline, r2) == "succeeded"  # web built; api, docs inherit
        repo.commit("c3", {"libs/common/lib.txt": "2\n", **repo.outcome("api", "red")})
        r3 = pipeline.ingest(QUEUE)
        assert _settle(pipeline, r3) == "failed"  # api red, web green; docs inherits
        repo.commit("c4", {"docs/guide.md": "x\n"})
        r4 = pipeline.ingest(QUEUE)
        assert _settle(pipeline, r4) == "failed"  # docs built; api inherits its red
        wait_until(_sent_all(pipeline), timeout=60, what="every status sent")
        statuses = _statuses(services)

    sha = repo.shas
    short = {name: s[:12] for name, s in sha.items()}

    def built(request_id: str, final: str, words: str) -> list[tuple[str, str, str]]:
        return [("pending", f"Validating ({request_id})", _link(request_id)),
                (final, f"{words} ({request_id})" if final == "failure"
                 else f"Green: validated by {request_id}", _link(request_id))]

    def child(n: int, project: str) -> str:
        return f"request/{QUEUE}#{project}/{n}"

    red = "Red: the build failed"
    expected = {
        # c1: every project built, and the whole repository
        (sha["c1"], "stovepipe/validation"): built(r1, "success", ""),
        (sha["c1"], "stovepipe/api"): built(child(1, "api"), "success", ""),
        (sha["c1"], "stovepipe/web"): built(child(1, "web"), "success", ""),
        (sha["c1"], "stovepipe/docs"): built(child(1, "docs"), "success", ""),
        # c2: web built; api inherits green from c1 (a final status, never pending);
        # docs is not listed in `unaffected`: no status at all
        (sha["c2"], "stovepipe/validation"): built(r2, "success", ""),
        (sha["c2"], "stovepipe/web"): built(child(2, "web"), "success", ""),
        (sha["c2"], "stovepipe/api"): [
            ("success", f"Unaffected: inherits green from {short['c1']} ({child(1, 'api')})",
             _link(child(1, "api")))],
        # c3: api and web built (the shared library), api red
        (sha["c3"], "stovepipe/validation"): [
            ("pending", f"Validating ({r3})", _link(r3)),
            ("failure", f"{red} ({r3})", _link(r3))],
        (sha["c3"], "stovepipe/api"): built(child(3, "api"), "failure", red),
        (sha["c3"], "stovepipe/web"): built(child(3, "web"), "success", ""),
        # c4: docs built; api inherits its red from c3, web its green from c3
        (sha["c4"], "stovepipe/validation"): [
            ("pending", f"Validating ({r4})", _link(r4)),
            ("failure", f"{red} ({r4})", _link(r4))],
        (sha["c4"], "stovepipe/docs"): built(child(4, "docs"), "success", ""),
        (sha["c4"], "stovepipe/api"): [
            ("failure", f"Unaffected: inherits red from {short['c3']} ({child(3, 'api')})",
             _link(child(3, "api")))],
        (sha["c4"], "stovepipe/web"): [
            ("success", f"Unaffected: inherits green from {short['c3']} ({child(3, 'web')})",
             _link(child(3, "web")))],
    }
    assert statuses == expected
    # each status row once, keyed by its cause: the unaffected ones as the project's
    # Request at that head would have been
    keys = [k for (k,) in pipeline.query(
        "SELECT key FROM notification WHERE queue = %s ORDER BY key", f"{QUEUE}#api")]
    assert keys == [f"status:github_status:{child(n, 'api')}:{suffix}"
                    for n, suffix in ((1, "final"), (1, "pending"), (2, "final"),
                                      (3, "final"), (3, "pending"), (4, "final"))]
    assert pipeline.dead_letters() == 0


def _bodies(services: FakeServices, service: str) -> list[Any]:
    return services.delivered(service)


def test_a_project_s_own_alert_channel_gets_only_its_project_s_transitions(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """api's owners have channels of their own (`alerts` on the project); web and the
    whole repository use the queue's. api breaks, then web, then both are fixed: api's
    owners hear api's red (with its culprit) and green, nothing else; the team hears the
    whole repository's red (naming the red project) and green, and web's."""
    repo = Monorepo(tmp_path)
    with fake_services() as team, fake_services() as owners:
        add_projects_queue(
            pipeline, repo, backfill="bisect",
            notify={"webhook": {"url_env": TEAM_WEBHOOK_ENV},
                    "slack": {"url_env": TEAM_SLACK_ENV}},
            projects={
                "api": {"paths": ["services/api/**"],
                        "alerts": {"webhook": {"url_env": API_WEBHOOK_ENV},
                                   "slack": {"url_env": API_SLACK_ENV}}},
                "web": {"paths": ["web/**"]},
                "docs": {"paths": ["docs/**"], "blocking": False}})
        repo.commit("c1", ALL_GREEN)
        pipeline.start_worker(env={
            TEAM_WEBHOOK_ENV: team.webhook_url, TEAM_SLACK_ENV: team.slack_url,
            API_WEBHOOK_ENV: owners.webhook_url, API_SLACK_ENV: owners.slack_url,
            "STOVEPIPE_PUBLIC_URL": PUBLIC})
        ids = [pipeline.ingest(QUEUE)]
        assert _settle(pipeline, ids[-1]) == "succeeded"
        steps = [("c2", repo.outcome("api", "red"), "failed"),
                 ("c3", repo.outcome("web", "red"), "failed"),
                 ("c4", repo.outcome("api", "green"), "failed"),
                 ("c5", repo.outcome("web", "green"), "succeeded")]
        for name, files, outcome in steps:
            repo.commit(name, files)
            ids.append(pipeline.ingest(QUEUE))
            assert _settle(pipeline, ids[-1]) == outcome, name
        wait_until(_sent_all(pipeline), timeout=60, what="every alert sent")
        to_owners, to_team = _bodies(owners, WEBHOOK), _bodies(team, WEBHOOK)
        owners_text, team_text = _bodies(owners, SLACK), _bodies(team, SLACK)

    sha = repo.shas
    api_red, api_green = f"request/{QUEUE}#api/2", f"request/{QUEUE}#api/4"
    # api's owners: api's transitions only, naming the queue, the project and its culprit
    assert [(b["queue"], b["project"], b["event"], b["request_id"], b["sha"])
            for b in to_owners] == [(QUEUE, "api", "red", api_red, sha["c2"]),
                                    (QUEUE, "api", "green", api_green, sha["c4"])]
    culprit = to_owners[0]["culprit"]
    assert (culprit["sha"], culprit["subject"], culprit["confirmed"]) == (sha["c2"], "c2",
                                                                          True)
    assert to_owners[0]["link"] == _link(api_red)
    assert [b["text"] for b in owners_text] == [
        f":red_circle: Stovepipe: {QUEUE}, project api, is RED at {sha['c2'][:12]} "
        f"({api_red}; was green). Culprit: {sha['c2'][:12]} \"c2\" by Ada Lovelace "
        f"<ada@example.invalid>. <{_link(api_red)}|details>",
        f":large_green_circle: Stovepipe: {QUEUE}, project api, is GREEN at "
        f"{sha['c4'][:12]} ({api_green}; was red). <{_link(api_green)}|details>"]
    # the team: the whole repository's transitions and web's, never api's; web's culprit
    # was bisected (web was not built at c2), so it is a message of its own
    assert sorted((b["project"] or "", b["event"], b["request_id"]) for b in to_team) == [
        ("", "green", ids[4]), ("", "red", ids[1]),
        ("web", "culprit", f"request/{QUEUE}#web/3"),
        ("web", "green", f"request/{QUEUE}#web/5"), ("web", "red", f"request/{QUEUE}#web/3")]
    whole_red = next(b for b in to_team if b["project"] is None and b["event"] == "red")
    assert (whole_red["queue"], whole_red["red_projects"]) == (QUEUE, ["api"])
    assert "culprit" not in whole_red and "bisecting" not in whole_red
    texts = [b["text"] for b in team_text]
    assert f":red_circle: Stovepipe: {QUEUE} is RED at {sha['c2'][:12]} ({ids[1]}; was " \
           f"green). Red projects: api. <{_link(ids[1])}|details>" in texts
    assert any(t.startswith(f":red_circle: Stovepipe: {QUEUE}, project web, is RED at "
                            f"{sha['c3'][:12]}") for t in texts), texts
    assert any(t.startswith(f":mag: Stovepipe: {QUEUE}, project web, has been red since ")
               and f"the culprit is {sha['c3'][:12]} \"c3\" by Ada Lovelace" in t
               for t in texts), texts
    assert not any("project api" in t for t in texts), texts
    assert pipeline.dead_letters() == 0
