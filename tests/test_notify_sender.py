"""The sender of commit statuses and alerts (streams/stages/notify.py) on the real
database, against local HTTP servers standing in for GitHub and the webhooks: what is
retried (5xx, 429 with Retry-After, GitHub's primary and secondary rate limits, a hanging
service, a refused connection, a missing secret), what is given up (401, a 403 that is no
rate limit), in which order a commit's statuses go, and that no secret reaches a row, a
log line or a metric."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from store import Database
from streams.config.queues import Extensions, load_queues
from streams.extensions import budget
from streams.extensions.notify import github_status
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


@pytest.fixture(autouse=True)
def _fresh_budgets() -> Iterator[None]:
    """Each test starts as a process whose budgets are idle and whose credentials were
    never rate-limited."""
    budget.forget_all()
    yield
    budget.forget_all()


# a content budget no test here reaches, but the ones about it (GitHub's default is 400)
UNLIMITED = 10 ** 6


def _queues(tmp_path: Path, api_url: str, *, content_per_hour: float | None = UNLIMITED
            ) -> Path:
    path = tmp_path / "queues.yaml"
    content = (f", content_requests_per_hour: {content_per_hour}"
               if content_per_hour is not None else "")
    path.write_text(
        "queues:\n  q:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: q-main}\n"
        "    build_runner: {kind: fake}\n"
        "    notify:\n"
        f"      github_status: {{repository: acme/mono, token_env: {TOKEN_ENV},"
        f" api_url: '{api_url}'{content}}}\n"
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
        # the token is paused meanwhile: the row is handed back untried, no attempt spent
        await _make_due(deps.db)
        assert (await notify.send_notifications(deps, _sink)).results \
            == [(key, "postponed")]
        paused = await _row(deps.db, key)
        assert paused["attempts"] == row["attempts"] and 5 < paused["due_in"] <= 7.5
        budget.forget_all()  # the 7 s are over
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


def test_statuses_stay_below_githubs_content_limit_by_default(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23: GitHub allows about 500 content-creating requests an hour on a token (a
    secondary limit, apart from the 5,000); Stovepipe's statuses default to 400 an hour
    (a turn every 9 s for a worker alone). Three statuses due at once: one is posted, the
    other two are handed back until the budget's next turn — no attempt spent, no
    error."""
    _env(monkeypatch, fake, fake.token)

    async def body(deps: Deps) -> None:
        keys = [await _status(deps.db, f"request/q/{n}", "pending", "pending",
                              uri=f"fake://r/q-main/c{n}") for n in (1, 2, 3)]
        report = await notify.send_notifications(deps, _sink)
        assert report.results == [(keys[0], "sent"), (keys[1], "postponed"),
                                  (keys[2], "postponed")]
        for key in keys[1:]:
            row = await _row(deps.db, key)
            assert row["outcome"] is None and row["attempts"] == 0
            assert row["last_error"] == ""
            # the next turn: 9 s after the first, less the budget's burst allowance
            assert 7 < row["due_in"] <= 3600 / 400 + 0.5, row

    _run(migrated_dsn, _queues(tmp_path, fake.github_api, content_per_hour=None), body)
    assert github_status.DEFAULT_CONTENT_REQUESTS_PER_HOUR == 400
    assert len(fake.requests(GITHUB)) == 1


def test_a_channels_statuses_are_posted_one_at_a_time(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23: GitHub asks integrations not to send concurrent requests on one token
    (a secondary limit): a round posts a channel's statuses one after another, never two
    at once, however many are due."""
    _env(monkeypatch, fake, fake.token)
    fake.set(GITHUB, latency=0.2)

    async def body(deps: Deps) -> None:
        keys = [await _status(deps.db, f"request/q/{n}", "pending", "pending",
                              uri=f"fake://r/q-main/c{n}") for n in range(1, 7)]
        report = await notify.send_notifications(deps, _sink)
        assert report.results == [(key, "sent") for key in keys]

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    assert len(fake.requests(GITHUB, answered=201)) == 6
    assert fake.most_in_flight[GITHUB] == 1


def test_a_round_hands_back_what_it_could_not_post_in_time(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Posting one at a time, a round that has run ROUND_LIMIT hands the channel's other
    rows back at once, unattempted: none is still being posted when its lease runs out
    and another sender claims it (here GitHub hangs, every post times out after 0.5 s,
    and a round may run 1.2 s)."""
    _env(monkeypatch, fake, fake.token)
    monkeypatch.setattr(notify_http, "DEFAULT_TIMEOUT", 0.5)
    monkeypatch.setattr(notify, "ROUND_LIMIT", 1.2)
    fake.set(GITHUB, hang=True)

    async def body(deps: Deps) -> None:
        keys = [await _status(deps.db, f"request/q/{n}", "pending", "pending",
                              uri=f"fake://r/q-main/c{n}") for n in range(1, 6)]
        report = await notify.send_notifications(deps, _sink)
        assert [r for _, r in report.results] == ["retried"] * 3 + ["postponed"] * 2
        for key in keys[3:]:
            row = await _row(deps.db, key)
            assert row["attempts"] == 0 and row["due_in"] <= 0.1, row

    _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
    fake.release()


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
        "event": "red", "queue": "q", "project": None, "uri": "fake://r/q-main/c2-fail",
        "sha": "c2-fail",
        "request_id": "request/q/2", "previous": "green", "at": "2026-01-01T00:00:00+00:00",
        "link": link}]
    assert fake.delivered(SLACK) == [{
        "text": f":red_circle: Stovepipe: q is RED at c2-fail (request/q/2; was green). "
                f"<{link}|details>"}]


def test_a_project_s_own_channels_are_served_when_its_queue_notifies_nothing(
        migrated_dsn: str, tmp_path: Path, fake: FakeServices,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue without `notify` whose project api has alert channels of its own: api's
    alerts go out, naming the queue and the project."""
    _env(monkeypatch, fake, fake.token)
    path = tmp_path / "queues.yaml"
    path.write_text(
        "queues:\n  mono:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: mono-main}\n"
        "    build_runner: {kind: fake}\n"
        "    projects:\n"
        "      api:\n        paths: ['api/**']\n"
        f"        alerts: {{webhook: {{url_env: {WEBHOOK_ENV}}},\n"
        f"                 slack: {{url_env: {SLACK_ENV}}}}}\n"
        "      web: {paths: ['web/**']}\n")
    event = {"kind": "alert", "event": "red", "queue": "mono#api",
             "request_id": "request/mono#api/2", "uri": "fake://r/mono-main/c2",
             "previous": "green", "at": "2026-01-01T00:00:00+00:00"}

    async def body(deps: Deps) -> None:
        async with deps.db.pool.connection() as conn:
            for channel in ("webhook", "slack"):
                await conn.execute(
                    "INSERT INTO notification (queue, key, channel, stream, event)"
                    " VALUES ('mono#api', %s, %s, 'alerts', %s::jsonb)",
                    (f"alert:{channel}:greenness:2", channel, json.dumps(event)))
        assert sorted(r for _, r in (await notify.send_notifications(deps, _sink)).results) \
            == ["sent", "sent"]

    _run(migrated_dsn, path, body)
    link = "https://stovepipe.example/#request=request/mono%23api/2"
    [sent] = fake.delivered(WEBHOOK)
    assert (sent["queue"], sent["project"], sent["request_id"], sent["link"]) == (
        "mono", "api", "request/mono#api/2", link)
    assert fake.delivered(SLACK) == [{
        "text": f":red_circle: Stovepipe: mono, project api, is RED at c2 "
                f"(request/mono#api/2; was green). <{link}|details>"}]


# --- GitHub's rate limits ----------------------------------------------------------------
# The answers below are written to GitHub's documentation, "Rate limits for the REST API"
# (https://docs.github.com/en/rest/using-the-rest-api/rate-limits-for-the-rest-api),
# section "Exceeding the rate limit": a spent primary limit is a 403 or 429 with
# `x-ratelimit-remaining: 0` and the reset (UTC epoch seconds) in `x-ratelimit-reset`; a
# secondary limit is a 403 or 429 whose message says so, with `retry-after` or without,
# and its `x-ratelimit-remaining` may be well above 0. Without `retry-after` (and with
# requests remaining) "wait for at least one minute before retrying", and longer —
# "an exponentially increasing amount of time" — while the limit goes on.

LIMITS_DOC = ("https://docs.github.com/rest/using-the-rest-api/rate-limits-for-the-rest-api"
              "#exceeding-the-rate-limit")
SECONDARY = {"message": "You have exceeded a secondary rate limit and have been temporarily "
                        "blocked from content creation. Please retry your request again "
                        "later.", "documentation_url": LIMITS_DOC}
PRIMARY = {"message": "API rate limit exceeded for user ID 4242. If you reach out to GitHub "
                      "Support for help, please include the request ID "
                      "8C1A:2B3C:4D5E6F:7A8B9C:0D1E2F3A.", "documentation_url": LIMITS_DOC}
NO_PERMISSION = {"message": "Resource not accessible by personal access token",
                 "documentation_url": "https://docs.github.com/rest/commits/statuses"
                                      "#create-a-commit-status", "status": "403"}


def _limit_headers(remaining: int, reset: float, **more: str) -> dict[str, str]:
    """The x-ratelimit-* headers GitHub sends with every answer (the primary limit)."""
    return {"x-ratelimit-limit": "5000", "x-ratelimit-remaining": str(remaining),
            "x-ratelimit-used": str(5000 - remaining), "x-ratelimit-reset": str(int(reset)),
            "x-ratelimit-resource": "core", **more}


@dataclass
class ScriptedGitHub(FakeServices):
    """The fake services, whose GitHub answers the scripted (status, headers, body)s
    first, one per request."""

    script: list[tuple[int, dict[str, str], dict[str, Any]]] = field(default_factory=list)

    def answer_next(self, status: int, headers: dict[str, str], body: dict[str, Any]) -> None:
        with self._lock:
            self.script.append((status, headers, body))

    async def _answer(self, service: str, request: web.Request,
                      normal: web.Response) -> web.Response:
        with self._lock:
            scripted = self.script.pop(0) if service == GITHUB and self.script else None
        if scripted is None:
            return await super()._answer(service, request, normal)
        status, headers, body = scripted
        return web.json_response(body, status=status, headers=headers)


def test_github_rate_limits_are_waited_out_and_a_plain_403_is_given_up(
        migrated_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit status GitHub rate-limits is posted again once the limit allows it —
    never given up, so a required check is not left `pending` — while a 403 that is no
    rate limit (no permission) is given up at once (answers: see LIMITS_DOC above)."""
    clock = [1000.0]  # the notifier's monotonic clock, moved by hand
    monkeypatch.setattr(github_status, "_clock", lambda: clock[0])
    with ScriptedGitHub(token="ghs_test_token_0123456789").running() as fake:
        _env(monkeypatch, fake, fake.token)

        async def body(deps: Deps) -> None:
            key = await _status(deps.db, "request/q/1", "pending", "pending")

            async def retried_after(status: int, headers: dict[str, str],
                                    answer: dict[str, Any]) -> float:
                fake.answer_next(status, headers, answer)
                await _make_due(deps.db)
                budget.forget_all()  # the pause of the limit before is over
                assert (await notify.send_notifications(deps, _sink)).results \
                    == [(key, "retried")]
                row = await _row(deps.db, key)
                assert row["outcome"] is None
                assert row["last_error"].startswith(f"GitHub answered HTTP {status}: ")
                return float(row["due_in"])

            now = time.time()
            # a secondary limit without retry-after, with requests left: at least a minute
            assert 58 < await retried_after(403, _limit_headers(4321, now + 3000),
                                            SECONDARY) <= 60.5
            # one with retry-after: that long
            assert 28 < await retried_after(429, _limit_headers(4320, now + 3000,
                                                                **{"retry-after": "30"}),
                                            SECONDARY) <= 30.5
            # the primary limit spent: until its reset
            assert 115 < await retried_after(403, _limit_headers(0, now + 120),
                                             PRIMARY) <= 120.5
            # a secondary limit that goes on: the waits grow with it (60, 120, 240 …)
            clock[0] += 60
            assert 58 < await retried_after(403, _limit_headers(4319, now + 3000),
                                            SECONDARY) <= 60.5
            clock[0] += 60
            assert 118 < await retried_after(403, _limit_headers(4318, now + 3000),
                                             SECONDARY) <= 120.5
            clock[0] += 120
            assert 238 < await retried_after(429, _limit_headers(4317, now + 3000),
                                             SECONDARY) <= 240.5
            clock[0] += 720  # and no longer than the sender's cap on any wait
            assert notify.RETRY_AFTER_CAP - 2 < await retried_after(
                403, _limit_headers(4316, now + 3000), SECONDARY) \
                <= notify.RETRY_AFTER_CAP + 0.5
            await _make_due(deps.db)  # GitHub takes it now
            budget.forget_all()
            assert (await notify.send_notifications(deps, _sink)).results == [(key, "sent")]
            assert (await _row(deps.db, key))["attempts"] == 8

            # accepted: the next limit is waited out for a minute again
            clock[0] += 10
            second = await _status(deps.db, "request/q/2", "pending", "pending",
                                   uri="fake://r/q-main/c2")
            fake.answer_next(403, _limit_headers(4300, now + 3000), SECONDARY)
            assert (await notify.send_notifications(deps, _sink)).results \
                == [(second, "retried")]
            assert 58 < (await _row(deps.db, second))["due_in"] <= 60.5
            budget.forget_all()

            # no permission, requests left, no retry-after: not a rate limit, given up
            third = await _status(deps.db, "request/q/3", "pending", "pending",
                                  uri="fake://r/q-main/c3")
            fake.answer_next(403, _limit_headers(4299, now + 3000), NO_PERMISSION)
            assert (await notify.send_notifications(deps, _sink)).results \
                == [(third, "given_up")]
            row = await _row(deps.db, third)
            assert row["outcome"] == "given_up"
            assert "Resource not accessible by personal access token" in row["last_error"]

        _run(migrated_dsn, _queues(tmp_path, fake.github_api), body)
        assert [r.answered for r in fake.requests(GITHUB)] == [
            403, 429, 403, 403, 403, 429, 403, 201, 403, 403]
