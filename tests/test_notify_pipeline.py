"""Commit statuses and transition alerts end to end: real workers on the real broker and
database, local HTTP servers as GitHub, a JSON webhook and Slack (tests/notify_http.py).

Each status and alert is posted exactly once however the pipeline is redelivered or
restarted; a GitHub outage delays statuses and nothing else; the gauges say how far a
queue's bookmark lags."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import pytest
from confluent_kafka import Producer

from contract import Record, marshal
from streams.runtime.kafka import producer_conf
from tests.notify_http import GITHUB, SLACK, WEBHOOK, FakeServices, fake_services
from tests.pipeline_support import Pipeline, group_lag
from tests.stack_support import free_ports
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

TOKEN_ENV, WEBHOOK_ENV, SLACK_ENV = ("STOVEPIPE_TEST_GH_TOKEN", "STOVEPIPE_TEST_WEBHOOK_URL",
                                     "STOVEPIPE_TEST_SLACK_URL")
PUBLIC = "https://stovepipe.example"


def _env(services: FakeServices) -> dict[str, str]:
    return {TOKEN_ENV: services.token, WEBHOOK_ENV: services.webhook_url,
            SLACK_ENV: services.slack_url, "STOVEPIPE_PUBLIC_URL": PUBLIC + "/"}


def _github(services: FakeServices) -> dict[str, Any]:
    return {"github_status": {"repository": "acme/mono", "token_env": TOKEN_ENV,
                              "api_url": services.github_api}}


def _validate(pipeline: Pipeline, queue: str, sha: str) -> str:
    pipeline.repo.push(f"{queue}-main", sha)
    request_id = pipeline.ingest(queue)
    pipeline.wait_quiet()
    return request_id


def _outbox(pipeline: Pipeline) -> list[tuple[str, str | None, int]]:
    return [(k, o, a) for k, o, a in pipeline.query(
        "SELECT key, outcome, attempts FROM notification ORDER BY id")]


def _status(state: str, request_id: str, description: str) -> dict[str, Any]:
    return {"state": state, "context": "stovepipe/validation", "description": description,
            "target_url": f"{PUBLIC}/#request={request_id}"}


def _statuses(services: FakeServices) -> dict[str, list[dict[str, Any]]]:
    """The statuses GitHub accepted, per commit, in order."""
    posted: dict[str, list[dict[str, Any]]] = {}
    for r in services.requests(GITHUB, answered=201):
        posted.setdefault(r.path.rsplit("/", 1)[1], []).append(r.body)
    return posted


def _republish_records(pipeline: Pipeline, request_ids: list[str]) -> None:
    producer = Producer(producer_conf(pipeline.bootstrap))
    topic = pipeline.topics.stage("record").full_name
    for request_id in request_ids:
        producer.produce(topic, key=request_id.encode(),
                         value=marshal(Record(id=request_id, queue_name="q")))
    assert producer.flush(30) == 0


def test_statuses_are_posted_once_each_across_redelivery_and_restart(
        pipeline: Pipeline) -> None:
    with fake_services() as services:
        pipeline.add_queue("q", notify=_github(services))
        worker = pipeline.start_worker(env=_env(services))
        green = _validate(pipeline, "q", "c1")
        red = _validate(pipeline, "q", "c2-fail")
        wait_until(lambda: [o for _, o, _ in _outbox(pipeline)] == ["sent"] * 4,
                   timeout=60, what="four statuses sent")
        expected = {
            "c1": [_status("pending", green, f"Validating ({green})"),
                   _status("success", green, f"Green: validated by {green}")],
            "c2-fail": [_status("pending", red, f"Validating ({red})"),
                        _status("failure", red, f"Red: the build failed ({red})")]}
        assert _statuses(services) == expected
        first = services.requests(GITHUB)[0]
        assert first.path == "/github/repos/acme/mono/statuses/c1"
        assert first.headers["Authorization"] == f"Bearer {services.token}"
        assert first.headers["Accept"] == "application/vnd.github+json"
        assert first.headers["X-GitHub-Api-Version"] == "2022-11-28"

        # record delivered again, by a worker that replaced one killed mid-flight
        pipeline.kill_worker(worker)
        _republish_records(pipeline, [green, red, green])
        pipeline.start_worker(env=_env(services))
        record_topic = pipeline.topics.stage("record").full_name
        wait_until(lambda: group_lag(pipeline.bootstrap, pipeline.app_id,
                                     [record_topic]) == 0,
                   timeout=60, what="the redelivered records handled")
        pipeline.wait_quiet()
        # nothing new to send: posts only ever come from these rows, all sent
        assert _outbox(pipeline) == [
            (f"status:github_status:{green}:pending", "sent", 1),
            (f"status:github_status:{green}:final", "sent", 1),
            (f"status:github_status:{red}:pending", "sent", 1),
            (f"status:github_status:{red}:final", "sent", 1)]
        assert _statuses(services) == expected
        assert len(services.requests(GITHUB)) == 4
        assert services.token not in pipeline.full_logs()


def test_a_github_outage_delays_statuses_and_nothing_else(pipeline: Pipeline) -> None:
    with fake_services() as services:
        services.set(GITHUB, status=503)
        pipeline.add_queue("q", notify=_github(services))
        pipeline.start_worker(env=_env(services))
        ids = [_validate(pipeline, "q", sha) for sha in ("c1", "c2-fail", "c3")]
        # the pipeline finished every Request while GitHub refused every status
        assert pipeline.exact_outcome_problems() == []
        assert services.delivered(GITHUB) == []
        wait_until(lambda: len(services.requests(GITHUB, answered=503)) >= 4, timeout=60,
                   what="statuses retried")
        refused = 'GitHub answered HTTP 503: {"message": "scripted failure"}'
        wait_until(lambda: pipeline.query(
            "SELECT DISTINCT last_error FROM notification WHERE last_error <> ''")
            == [(refused,)], timeout=30, what="the refusal recorded on the rows")
        assert pipeline.query("SELECT count(*) FROM notification WHERE done_at IS NOT NULL") \
            == [(0,)]
        services.set(GITHUB)  # GitHub is back
        wait_until(lambda: [o for _, o, _ in _outbox(pipeline)] == ["sent"] * 6,
                   timeout=90, what="every status sent once GitHub is back")
        assert {sha: [s["state"] for s in posted]
                for sha, posted in _statuses(services).items()} == {
            "c1": ["pending", "success"], "c2-fail": ["pending", "failure"],
            "c3": ["pending", "success"]}
        assert len(ids) == 3


def _alert_events(services: FakeServices) -> list[tuple[str, str, str | None]]:
    return [(b["event"], b["request_id"], b["previous"]) for b in services.delivered(WEBHOOK)]


def test_greenness_transitions_alert_once_each_on_both_channels(pipeline: Pipeline) -> None:
    with fake_services() as services:
        pipeline.add_queue("q", notify={"webhook": {"url_env": WEBHOOK_ENV},
                                        "slack": {"url_env": SLACK_ENV}})
        worker = pipeline.start_worker(env=_env(services))
        ids = [_validate(pipeline, "q", sha)
               for sha in ("c1", "c2-fail", "c3-fail", "c4-fail", "c5")]
        wait_until(lambda: len(services.delivered(SLACK)) == 2
                   and len(services.delivered(WEBHOOK)) == 2, timeout=60,
                   what="two alerts on each channel")
        assert _alert_events(services) == [("red", ids[1], "green"), ("green", ids[4], "red")]
        red = services.delivered(WEBHOOK)[0]
        assert {k: v for k, v in red.items() if k != "at"} == {
            "event": "red", "queue": "q", "project": None, "uri": "fake://r/q-main/c2-fail",
            "sha": "c2-fail", "request_id": ids[1], "previous": "green",
            "link": f"{PUBLIC}/#request={ids[1]}"}
        assert [b["text"] for b in services.delivered(SLACK)] == [
            f":red_circle: Stovepipe: q is RED at c2-fail ({ids[1]}; was green). "
            f"<{PUBLIC}/#request={ids[1]}|details>",
            f":large_green_circle: Stovepipe: q is GREEN at c5 ({ids[4]}; was red). "
            f"<{PUBLIC}/#request={ids[4]}|details>"]

        pipeline.kill_worker(worker)
        _republish_records(pipeline, ids)
        pipeline.start_worker(env=_env(services))
        record_topic = pipeline.topics.stage("record").full_name
        wait_until(lambda: group_lag(pipeline.bootstrap, pipeline.app_id,
                                     [record_topic]) == 0,
                   timeout=60, what="the redelivered records handled")
        assert sorted(k for k, o, _ in _outbox(pipeline) if o == "sent") == [
            "alert:slack:greenness:2", "alert:slack:greenness:3",
            "alert:webhook:greenness:2", "alert:webhook:greenness:3"]
        assert len(_outbox(pipeline)) == 4
        assert len(services.requests(WEBHOOK)) == 2 and len(services.requests(SLACK)) == 2


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        return str(answer.read().decode())


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in Prometheus' text format."""
    for match in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
        if dict(re.findall(r'(\w+)="([^"]*)"', match[1])) == labels:
            return float(match[2])
    return None


def test_a_stale_queue_alerts_once_and_again_after_a_new_green(pipeline: Pipeline) -> None:
    port = free_ports(1)[0]
    with fake_services() as services:
        pipeline.add_queue("q", notify={"webhook": {"url_env": WEBHOOK_ENV},
                                        "stale_after": "1s"})
        pipeline.start_worker(env=_env(services), web_port=port)
        green = _validate(pipeline, "q", "c1")
        wait_until(lambda: _sample(_metrics(port), "stovepipe_commits_since_green",
                                   queue="q") == 0, timeout=30, what="the gauges")
        pipeline.repo.push("q-main", "c2-latchA")  # a build held open by the test
        held = pipeline.ingest("q")
        wait_until(lambda: _alert_events(services) == [("stale", green, None)], timeout=30,
                   what="the stale alert")
        stale = services.delivered(WEBHOOK)[0]
        assert stale["latest_request_id"] == held and stale["uri"] == "fake://r/q-main/c1"
        text = _metrics(port)
        assert _sample(text, "stovepipe_commits_since_green", queue="q") == 1
        age = _sample(text, "stovepipe_bookmark_age_seconds", queue="q")
        assert age is not None and age > 0

        def rounds() -> float:
            return _sample(_metrics(port), "stovepipe_periodic_rounds_total", task="notify",
                           outcome="ok") or 0

        seen = rounds()
        wait_until(lambda: rounds() >= seen + 3, timeout=30, what="three more judge rounds")
        assert _alert_events(services) == [("stale", green, None)]  # still stale: once

        pipeline.release("A")  # c2 goes green: the bookmark moves, the queue is fresh
        pipeline.wait_quiet()
        wait_until(lambda: pipeline.query("SELECT stale FROM queue_health")
                   == [(False,)], timeout=30, what="the queue fresh again")
        pipeline.repo.push("q-main", "c3-latchB")
        behind = pipeline.ingest("q")
        wait_until(lambda: len(services.delivered(WEBHOOK)) == 2, timeout=30,
                   what="a second stale alert behind the new bookmark")
        assert _alert_events(services)[1] == ("stale", held, None)
        assert services.delivered(WEBHOOK)[1]["latest_request_id"] == behind
        pipeline.release("B")
        pipeline.wait_quiet()
