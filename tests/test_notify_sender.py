"""The sender of commit statuses and alerts (streams/stages/notify.py) on the real
database, against local HTTP servers standing in for GitHub and the webhooks: what is
retried (5xx, 429 with Retry-After, a hanging service, a refused connection, a missing
secret), what is given up (401), in which order a commit's statuses go, and that no
secret reaches a row, a log line or a metric."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from store import Database
from streams.config.queues import Extensions, load_queues
from streams.extensions.notify import http as notify_http
from streams.stages import notify
from streams.stages.deps import Deps
from tests.notify_http import GITHUB, SLACK, WEBHOOK, FakeServices, fake_services
from tests.stack_support import free_ports

pytestmark = pytest.mark.postgres

TOKEN_ENV, WEBHOOK_ENV, SLACK_ENV = ("STOVEPIPE_TEST_GH_TOKEN", "STOVEPIPE_TEST_WEBHOOK_URL",
                                     "STOVEPIPE_TEST_SLACK_URL")
URI = "fake://r/q-main/c1"


async def _sink(key: str, payload: Any) -> None:
    """The sender publishes nothing."""


@pytest.fixture
def fake() -> Iterator[FakeServices]:
    with fake_services() as running:
        yield running


def _queues(tmp_path: Path, api_url: str) -> Path:
    path = tmp_path / "queues.yaml"
    path.write_text(
        "queues:\n  q:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: q-main}\n"
        "    build_runner: {kind: fake}\n"
        "    notify:\n"
        f"      github_status: {{repository: acme/mono, token_env: {TOKEN_ENV},"
        f" api_url: '{api_url}'}}\n"
        f"      webhook: {{url_env: {WEBHOOK_ENV}}}\n"
        f"      slack: {{url_env: {SLACK_ENV}}}\n")
    return path


def _run(dsn: str, queues_file: Path,
         body: Callable[[Deps], Awaitable[None]]) -> None:
    queues = load_queues(queues_file)

    async def run() -> None:
        async with await Database.open(dsn, max_size=4) as db:
            await body(Deps(db=db, queues=queues, extensions=Extensions(queues, db)))

    asyncio.run(run())


async def _insert(db: Database, key: str, channel: str, stream: str,
                  event: dict[str, Any]) -> None:
    """A row as the pipeline's statements write it."""
    async with db.pool.connection() as conn:
        await conn.execute(
            "INSERT INTO notification (queue, key, channel, stream, event)"
            " VALUES ('q', %s, %s, %s, %s::jsonb)", (key, channel, stream, json.dumps(event)))


async def _status(db: Database, request: str, state: str, suffix: str,
                  uri: str = URI) -> str:
    key = f"status:github_status:{request}:{suffix}"
    await _insert(db, key, "github_status", request,
                  {"kind": "status", "state": state, "request_id": request, "uri": uri,
                   "at": "2026-01-01T00:00:00+00:00"})
    return key


async def _row(db: Database, key: str) -> dict[str, Any]:
    async with db.pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT outcome, attempts, last_error,"
            " EXTRACT(EPOCH FROM due_at - now())::float8 FROM notification"
            " WHERE queue = 'q' AND key = %s", (key,))
        row = await cursor.fetchone()
        assert row is not None
        return dict(zip(("outcome", "attempts", "last_error", "due_in"), row, strict=True))


async def _make_due(db: Database) -> None:
    async with db.pool.connection() as conn:
        await conn.execute("UPDATE notification SET due_at = now() WHERE done_at IS NULL")


def _count(channel: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("stovepipe_notifications_total",
                                     {"channel": channel, "outcome": outcome}) or 0.0


def _env(monkeypatch: pytest.MonkeyPatch, fake: FakeServices, token: str) -> None:
    monkeypatch.setenv(TOKEN_ENV, token)
    monkeypatch.setenv(WEBHOOK_ENV, fake.webhook_url)
    monkeypatch.setenv(SLACK_ENV, fake.slack_url)
    monkeypatch.setenv("STOVEPIPE_PUBLIC_URL", "https://stovepipe.example/")


def test_a_bad_token_is_given_up_with_its_reason_and_never_shown(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    wrong = "ghp_wrong_token_SECRET_42"
    _env(monkeypatch, fake, wrong)
    before = _count("github_status", "given_up")

    async def body(deps: Deps) -> None:
        key = await _status(deps.db, "request/q/1", "pending", "pending")
        with caplog.at_level(logging.DEBUG):
            report = await notify.send_notifications(deps, _sink)
        assert report.results == [(key, "given_up")]
        row = await _row(deps.db, key)
        assert row["outcome"] == "given_up" and row["attempts"] == 1
        assert row["last_error"] == 'GitHub answered HTTP 401: {"message": "Bad credentials"}'
        assert (await notify.send_notifications(deps, _sink)).results == []  # never again

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    assert [r.answered for r in fake.requests(GITHUB)] == [401]
    assert fake.requests(GITHUB)[0].headers["Authorization"] == f"Bearer {wrong}"
    assert _count("github_status", "given_up") == before + 1
    assert wrong not in caplog.text and "given_up" in caplog.text


def test_rate_limits_outages_hangs_and_missing_secrets_are_retried(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch, fake, fake.token)
    monkeypatch.setattr(notify_http, "DEFAULT_TIMEOUT", 0.5)

    async def body(deps: Deps) -> None:
        key = await _status(deps.db, "request/q/1", "pending", "pending")

        async def attempt(expected_error: str) -> dict[str, Any]:
            await _make_due(deps.db)
            assert (await notify.send_notifications(deps, _sink)).results \
                == [(key, "retried")]
            row = await _row(deps.db, key)
            assert row["outcome"] is None and row["last_error"] == expected_error
            return row

        fake.set(GITHUB, status=429, retry_after="7")
        row = await attempt('GitHub answered HTTP 429: {"message": "scripted failure"}')
        assert 5 < row["due_in"] <= 7.5  # the service's Retry-After, not our backoff
        fake.set(GITHUB, status=502)
        row = await attempt('GitHub answered HTTP 502: {"message": "scripted failure"}')
        assert row["due_in"] <= notify.backoff(2) + 0.5
        fake.set(GITHUB, hang=True)
        await attempt("GitHub did not answer within 0.5 s")
        fake.release()
        fake.set(GITHUB)
        monkeypatch.delenv(TOKEN_ENV)
        deps.extensions._notifiers.clear()
        await attempt(f"github_status: environment variable {TOKEN_ENV} is not set")
        monkeypatch.setenv(TOKEN_ENV, fake.token)
        await _make_due(deps.db)
        assert (await notify.send_notifications(deps, _sink)).results == [(key, "sent")]
        row = await _row(deps.db, key)
        assert row["outcome"] == "sent" and row["attempts"] == 5

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    # the post that timed out reached GitHub all the same once it stopped hanging: a
    # timeout cannot tell, so the status is posted again (the same status; harmless)
    assert [r.answered for r in fake.requests(GITHUB)] == [429, 502, 201, 201]


def test_a_refused_connection_is_retried(migrated_dsn: str, tmp_path: Path,
                                         fake: FakeServices,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch, fake, fake.token)
    closed = f"http://127.0.0.1:{free_ports(1)[0]}/github"

    async def body(deps: Deps) -> None:
        key = await _status(deps.db, "request/q/1", "pending", "pending")
        assert (await notify.send_notifications(deps, _sink)).results == [(key, "retried")]
        row = await _row(deps.db, key)
        assert row["last_error"] == "GitHub unreachable (ClientConnectorError)"
        assert 0 < row["due_in"] <= notify.backoff(1) + 0.5

    _run(migrated_dsn, _queues(tmp_path, closed), body)


def test_a_commits_final_status_waits_for_its_pending_one(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GitHub shows the last status posted: `success` must never be overtaken by the
    `pending` before it, so a stream's rows go out one after another, in order."""
    _env(monkeypatch, fake, fake.token)

    async def body(deps: Deps) -> None:
        pending = await _status(deps.db, "request/q/1", "pending", "pending")
        final = await _status(deps.db, "request/q/1", "success", "final")
        other = await _status(deps.db, "request/q/2", "pending", "pending",
                              uri="fake://r/q-main/c2")
        fake.set(GITHUB, status=500)
        report = await notify.send_notifications(deps, _sink)
        assert sorted(report.results) == [(pending, "retried"), (other, "retried")]
        await _make_due(deps.db)
        assert {k for k, _ in (await notify.send_notifications(deps, _sink)).results} \
            == {pending, other}  # the final status still waits
        assert (await _row(deps.db, final))["attempts"] == 0
        fake.set(GITHUB)
        await _make_due(deps.db)
        assert sorted((await notify.send_notifications(deps, _sink)).results) \
            == [(pending, "sent"), (other, "sent")]
        assert (await notify.send_notifications(deps, _sink)).results == [(final, "sent")]

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    posted = [r.body["state"] for r in fake.requests(GITHUB, answered=201)
              if r.path == "/github/repos/acme/mono/statuses/c1"]
    assert posted == ["pending", "success"]


def test_alert_bodies(migrated_dsn: str, tmp_path: Path, fake: FakeServices,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch, fake, fake.token)
    event = {"kind": "alert", "event": "red", "queue": "q", "request_id": "request/q/2",
             "uri": "fake://r/q-main/c2-fail", "previous": "green",
             "at": "2026-01-01T00:00:00+00:00"}

    async def body(deps: Deps) -> None:
        for channel in ("webhook", "slack"):
            await _insert(deps.db, f"alert:{channel}:greenness:2", channel, "alerts", event)
        assert sorted(r for _, r in (await notify.send_notifications(deps, _sink)).results) \
            == ["sent", "sent"]

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    link = "https://stovepipe.example/#request=request/q/2"
    assert fake.delivered(WEBHOOK) == [{
        "event": "red", "queue": "q", "uri": "fake://r/q-main/c2-fail", "sha": "c2-fail",
        "request_id": "request/q/2", "previous": "green", "at": "2026-01-01T00:00:00+00:00",
        "link": link}]
    assert fake.delivered(SLACK) == [{
        "text": f":red_circle: Stovepipe: q is RED at c2-fail (request/q/2; was green). "
                f"<{link}|details>"}]
