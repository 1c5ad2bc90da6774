"""GitHub's commit-status endpoint, a JSON webhook and a Slack incoming webhook, served by
one aiohttp application on 127.0.0.1 (an ephemeral port) in a thread of its own, for the
tests of commit statuses and alerts. Every request is recorded with what it was answered;
a service can be told to answer an error status (with a Retry-After) or to hang until the
test lets it go.

- ``POST /github/repos/{owner}/{repo}/statuses/{sha}`` — GitHub REST "Create a commit
  status": wants ``Authorization: Bearer <token>`` (401 "Bad credentials" otherwise), a
  ``state`` of pending/success/failure/error and string ``context``/``description``
  (422 "Validation Failed" otherwise); answers 201 with the status object.
- ``POST /hooks/webhook`` — any JSON object; 200.
- ``POST /hooks/slack/{secret}`` — Slack's incoming webhook: ``{"text": ...}``; 200 ``ok``,
  400 ``invalid_payload`` without a text.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

GITHUB, WEBHOOK, SLACK = "github", "webhook", "slack"
STATES = ("pending", "success", "failure", "error")


@dataclass
class Received:
    service: str
    path: str
    headers: dict[str, str]
    body: Any
    answered: int


@dataclass
class Behaviour:
    """How a service answers: ``status`` None is its normal answer; ``hang`` holds every
    request until `FakeServices.release` is called."""

    status: int | None = None
    retry_after: str | None = None
    hang: bool = False
    latency: float = 0.0  # seconds every answer takes


@dataclass
class FakeServices:
    token: str
    slack_secret: str = "T000/B000/XXXXSECRET"
    received: list[Received] = field(default_factory=list)
    behaviour: dict[str, Behaviour] = field(default_factory=dict)
    port: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)  # requests being answered
    most_in_flight: dict[str, int] = field(default_factory=dict)  # the most at once

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._released = asyncio.Event()
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None

    # -- what the tests use ---------------------------------------------------------
    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def github_api(self) -> str:
        return f"{self.base}/github"

    @property
    def webhook_url(self) -> str:
        return f"{self.base}/hooks/webhook"

    @property
    def slack_url(self) -> str:
        return f"{self.base}/hooks/slack/{self.slack_secret}"

    def set(self, service: str, **behaviour: Any) -> None:
        with self._lock:
            self.behaviour[service] = Behaviour(**behaviour)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._released.set)

    def requests(self, service: str, answered: int | None = None) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.service == service
                    and (answered is None or r.answered == answered)]

    def delivered(self, service: str) -> list[Any]:
        """The bodies the service accepted, in order."""
        return [r.body for r in self.requests(service) if 200 <= r.answered < 300]

    # -- the server -----------------------------------------------------------------
    async def _answer(self, service: str, request: web.Request,
                      normal: web.Response) -> web.Response:
        with self._lock:
            behaviour = self.behaviour.get(service, Behaviour())
            self.in_flight[service] = now = self.in_flight.get(service, 0) + 1
            self.most_in_flight[service] = max(self.most_in_flight.get(service, 0), now)
        try:
            return await self._answer_as(service, behaviour, normal)
        finally:
            with self._lock:
                self.in_flight[service] -= 1

    async def _answer_as(self, service: str, behaviour: Behaviour,
                         normal: web.Response) -> web.Response:
        if behaviour.latency:
            await asyncio.sleep(behaviour.latency)
        if behaviour.hang:
            await self._released.wait()
        if behaviour.status is not None:
            headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after else {}
            normal = web.json_response({"message": "scripted failure"},
                                       status=behaviour.status, headers=headers)
        return normal

    async def _record(self, service: str, request: web.Request, body: Any,
                      answer: web.Response) -> web.Response:
        with self._lock:
            self.received.append(Received(service, request.path, dict(request.headers),
                                          body, answer.status))
        return answer

    async def github_status(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            answer = web.json_response({"message": "Bad credentials"}, status=401)
        elif not isinstance(body, dict) or body.get("state") not in STATES \
                or not isinstance(body.get("context"), str) \
                or not isinstance(body.get("description", ""), str):
            answer = web.json_response({"message": "Validation Failed"}, status=422)
        else:
            answer = await self._answer(GITHUB, request, web.json_response(
                {"id": len(self.received) + 1, "state": body["state"],
                 "context": body["context"], "description": body.get("description"),
                 "target_url": body.get("target_url")}, status=201))
        return await self._record(GITHUB, request, body, answer)

    async def webhook(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        answer = await self._answer(WEBHOOK, request, web.json_response({"ok": True}))
        return await self._record(WEBHOOK, request, body, answer)

    async def slack(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if request.match_info["secret"] != self.slack_secret:
            answer = web.Response(text="no_service", status=404)
        elif not isinstance(body, dict) or not isinstance(body.get("text"), str):
            answer = web.Response(text="invalid_payload", status=400)
        else:
            answer = await self._answer(SLACK, request, web.Response(text="ok"))
        return await self._record(SLACK, request, body, answer)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/github/repos/{owner}/{repo}/statuses/{sha}", self.github_status)
        app.router.add_post("/hooks/webhook", self.webhook)
        app.router.add_post("/hooks/slack/{secret:.+}", self.slack)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._started.set()
        self._loop.run_forever()

    @contextmanager
    def running(self) -> Iterator[FakeServices]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        assert self._started.wait(10), "the fake services did not start"
        try:
            yield self
        finally:
            self.release()
            runner = self._runner
            if runner is not None:
                asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(10)
            self._loop.close()


async def _json_body(request: web.Request) -> Any:
    text = await request.text()
    try:
        return json.loads(text)
    except ValueError:
        return text


@contextmanager
def fake_services(token: str = "ghs_test_token_0123456789") -> Iterator[FakeServices]:
    with FakeServices(token=token).running() as services:
        yield services
