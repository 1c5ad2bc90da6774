"""Local stand-ins for the hosted CI APIs the build runners call: real aiohttp servers on
127.0.0.1 (an ephemeral port) implementing the documented endpoints, states and errors.

- `FakeBuildkite`: Buildkite REST v2 builds — create, list (filtered by ``meta_data[…]``,
  ``commit``, ``branch``, ``state``), get, cancel (``422`` unless scheduled, running or
  failing).
- `FakeGitHub`: GitHub Actions — workflow dispatch (``return_run_details``, declared inputs,
  ``run-name`` rendered into ``display_title``), list a workflow's runs (``event``,
  ``branch``, ``created=>=…``, pages), get a run, cancel (``409`` once completed) — and
  commit statuses (``POST …/statuses/{sha}``, ``201``), so a runner and a notifier can
  share one token on one API.

Both check the bearer token (``401`` otherwise), record every request, and can be told to
answer the next matching requests with any status and headers (429 with ``Retry-After``,
5xx, 401, 404, …) or to hang until the server stops (a timeout for the client). Tests move
builds between states with `set_state` / `set_run`.

A server runs on the test's event loop (``async with fake.serving()``) or on a thread of
its own (``with fake.in_thread()``) for worker processes to call. State is guarded by a
lock, so a test thread may change it while the server thread answers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from streams.config.queues import QueuesConfig, load_queues
from streams.config.settings import REPO_ROOT

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY = web.RequestKey("body", object)  # the request's JSON body, parsed once


@dataclass
class Fault:
    status: int = 500
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    hang: bool = False
    method: str | None = None
    path: str | None = None  # a substring of the path
    times: int = 1

    def matches(self, request: web.Request) -> bool:
        return ((self.method is None or request.method == self.method)
                and (self.path is None or self.path in request.path))


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    authorization: str
    at: float = 0.0  # epoch seconds when it arrived


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeApi:
    """What both fakes share: the token check, faults, the request log, serving."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.faults: list[Fault] = []
        self.seen: list[Seen] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._release: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- what tests call -----------------------------------------------------------------
    def fail_next(self, status: int, *, headers: dict[str, str] | None = None,
                  body: Any = None, method: str | None = None, path: str | None = None,
                  times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(status, dict(headers or {}), body, False, method, path,
                                     times))

    def hang_next(self, *, method: str | None = None, path: str | None = None,
                  times: int = 1) -> None:
        with self.lock:
            self.faults.append(Fault(hang=True, method=method, path=path, times=times))

    def go_down(self, status: int = 503, *, headers: dict[str, str] | None = None,
                hang: bool = False) -> None:
        """An outage: every request from now on is answered ``status`` (or hangs until
        `come_back`), until `come_back`."""
        with self.lock:
            self.faults = [Fault(status, dict(headers or {}), None, hang, None, None,
                                 times=10 ** 9)]
        if not hang and self._release is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._release.set)  # hanging ones answer
            self._loop.call_soon_threadsafe(self._rearm)

    def come_back(self) -> None:
        with self.lock:
            self.faults = []
        if self._release is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._release.set)
            self._loop.call_soon_threadsafe(self._rearm)

    def _rearm(self) -> None:
        self._release = asyncio.Event()

    def requests(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if (method is None or s.method == method)
                    and (path is None or path in s.path)]

    # -- serving -------------------------------------------------------------------------
    def add_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    latency = 0.0

    def limited(self) -> tuple[bool, dict[str, str]]:
        """Whether a provider's rate limit refuses this request, and the headers saying
        so (none by default)."""
        return False, {}

    def unauthorized(self) -> web.Response:
        raise NotImplementedError

    async def start(self) -> str:
        app = web.Application(middlewares=[self._middleware])
        self.add_routes(app.router)
        self._loop = asyncio.get_running_loop()
        self._release = asyncio.Event()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._release is not None:
            self._release.set()  # hanging requests answer now
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[FakeApi]:
        await self.start()
        try:
            yield self
        finally:
            await self.stop()

    @contextmanager
    def in_thread(self) -> Iterator[FakeApi]:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout=30)
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        with self.lock:
            self.seen.append(Seen(request.method, request.path, dict(request.query), body,
                                  request.headers.get("Authorization", ""), time.time()))
            fault = next((f for f in self.faults if f.matches(request)), None)
            if fault is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self.faults.remove(fault)
        if fault is not None:
            if fault.hang:
                assert self._release is not None
                release = self._release
                await release.wait()
                return web.json_response({"message": "released"}, status=504)
            if fault.body is None:
                return web.json_response({"message": f"injected {fault.status}"},
                                         status=fault.status, headers=fault.headers)
            if isinstance(fault.body, str):
                return web.Response(text=fault.body, status=fault.status,
                                    headers=fault.headers)
            return web.json_response(fault.body, status=fault.status, headers=fault.headers)
        if self.latency:
            await asyncio.sleep(self.latency)
        refused, limit_headers = self.limited()
        if refused:
            return web.json_response({"message": "You have exceeded your API rate limit"},
                                     status=429, headers=limit_headers)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return self.unauthorized()
        request[BODY] = body
        answer = await handler(request)
        answer.headers.update(limit_headers)
        return answer


def _page(items: list[dict[str, Any]], query: Any) -> list[dict[str, Any]]:
    per_page = min(int(query.get("per_page", "30")), 100)
    page = int(query.get("page", "1"))
    return items[(page - 1) * per_page: page * per_page]


# --- Buildkite ---------------------------------------------------------------------------

BK_CANCELLABLE = ("scheduled", "running", "failing")


class FakeBuildkite(FakeApi):
    """One organization's pipelines (``pipeline``, plus ``more_pipelines``; others are
    404). Build numbers are unique across them (Buildkite's are per pipeline; unique is a
    case of that). With ``limit_per_minute`` it enforces Buildkite's REST limit ("REST API
    rate limits", https://buildkite.com/docs/apis/rest-api/limits): that many requests per
    organization per minute window, ``RateLimit-Remaining``/``-Limit``/``-Reset`` on every
    answer and 429 once spent. ``latency`` delays every answer."""

    def __init__(self, token: str, organization: str = "acme",
                 pipeline: str = "monorepo", *, more_pipelines: tuple[str, ...] = (),
                 limit_per_minute: int | None = None, latency: float = 0.0) -> None:
        super().__init__(token)
        self.organization, self.pipeline = organization, pipeline
        self.pipelines = {pipeline, *more_pipelines}
        self.builds: dict[int, dict[str, Any]] = {}
        self.ignores_meta_data_filter = False  # plays a server that drops the filter
        self.limit_per_minute = limit_per_minute
        self.latency = latency
        self.refused = 0  # 429s answered for the limit
        self._window: tuple[float, int] = (0.0, 0)  # (window start, requests in it)

    def limited(self) -> tuple[bool, dict[str, str]]:
        """Count one request against the organization's minute; whether it is refused,
        and the rate-limit headers to answer with."""
        if self.limit_per_minute is None:
            return False, {}
        now = time.time()
        with self.lock:
            start, used = self._window
            if now - start >= 60:
                start, used = now, 0
            used += 1
            self._window = (start, used)
            refused = used > self.limit_per_minute
            self.refused += refused
            headers = {"RateLimit-Limit": str(self.limit_per_minute),
                       "RateLimit-Remaining": str(max(0, self.limit_per_minute - used)),
                       "RateLimit-Reset": str(max(0, int(start + 60 - now)))}
        return refused, headers

    def set_state(self, number: int, state: str, *, blocked: bool = False) -> None:
        with self.lock:
            self.builds[number].update(state=state, blocked=blocked)

    def builds_of(self, commit: str) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(b) for b in self.builds.values() if b["commit"] == commit]

    def unauthorized(self) -> web.Response:
        return web.json_response({"message": "Authentication required. Please supply a "
                                             "valid API Access Token"}, status=401)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        base = "/v2/organizations/{org}/pipelines/{pipeline}/builds"
        router.add_post(base, self._create)
        router.add_get(base, self._list)
        router.add_get(base + "/{number:\\d+}", self._get)
        router.add_put(base + "/{number:\\d+}/cancel", self._cancel)

    def _known(self, request: web.Request) -> bool:
        return (request.match_info["org"] == self.organization
                and request.match_info["pipeline"] in self.pipelines)

    def _build(self, request: web.Request) -> dict[str, Any] | None:
        if not self._known(request):
            return None
        build = self.builds.get(int(request.match_info["number"]))
        if build is None or build["pipeline"] != request.match_info["pipeline"]:
            return None
        return build

    async def _create(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"message": "Not Found"}, status=404)
        body = request[BODY] if isinstance(request[BODY], dict) else {}
        missing = [f for f in ("commit", "branch")
                   if not isinstance(body.get(f), str) or not body[f]]
        if missing:
            return web.json_response({"message": "Validation Failed", "errors": [
                {"field": f, "code": "missing"} for f in missing]}, status=422)
        pipeline = request.match_info["pipeline"]
        with self.lock:
            number = len(self.builds) + 1
            build = {
                "id": str(uuid.uuid4()), "number": number, "state": "scheduled",
                "pipeline": pipeline,
                "blocked": False, "commit": body["commit"], "branch": body["branch"],
                "message": body.get("message", ""), "env": body.get("env") or {},
                "meta_data": {k: str(v) for k, v in (body.get("meta_data") or {}).items()},
                "source": "api", "created_at": _now_iso(), "jobs": [],
                "web_url": f"https://buildkite.com/{self.organization}/{pipeline}"
                           f"/builds/{number}",
            }
            self.builds[number] = build
            return web.json_response(build, status=201)

    async def _list(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"message": "Not Found"}, status=404)
        query = request.query
        wanted_meta = {key[len("meta_data["):-1]: value for key, value in query.items()
                       if key.startswith("meta_data[") and key.endswith("]")}
        states = query.getall("state[]", []) or query.getall("state", [])
        since = query.get("created_from", "")
        pipeline = request.match_info["pipeline"]
        with self.lock:
            found = [dict(b) for b in sorted(self.builds.values(), key=lambda b: -b["number"])
                     if b["pipeline"] == pipeline and (not since or b["created_at"] >= since)
                     and (self.ignores_meta_data_filter
                         or all(b["meta_data"].get(k) == v for k, v in wanted_meta.items()))
                     and ("commit" not in query or b["commit"] == query["commit"])
                     and ("branch" not in query or b["branch"] == query["branch"])
                     and (not states or b["state"] in states)]
        return web.json_response(_page(found, query))

    async def _get(self, request: web.Request) -> web.Response:
        with self.lock:
            build = self._build(request)
            if build is None:
                return web.json_response({"message": "Not Found"}, status=404)
            answer = dict(build)
        if request.query.get("exclude_jobs") == "true":
            answer.pop("jobs")
        return web.json_response(answer)

    async def _cancel(self, request: web.Request) -> web.Response:
        with self.lock:
            build = self._build(request)
            if build is None:
                return web.json_response({"message": "Not Found"}, status=404)
            if build["state"] not in BK_CANCELLABLE:
                return web.json_response({"message": f"Build can't be canceled because it's "
                                                     f"{build['state']}"}, status=422)
            build["state"] = "canceled"
            return web.json_response(dict(build))


# --- GitHub Actions ----------------------------------------------------------------------


class FakeGitHub(FakeApi):
    """One repository's one workflow (others are 404). ``run_name`` is the workflow's
    ``run-name`` (``${{ inputs.X }}`` is replaced); ``returns_run_details`` False plays a
    GitHub that answers a dispatch 204 only; ``refuses_run_details`` (400 or 422) plays an
    Enterprise Server that does not know ``return_run_details`` and refuses a dispatch
    carrying it, starting nothing, as it refuses any unknown body parameter; while
    ``hide_new_runs`` is set, runs are started but not yet listed."""

    def __init__(self, token: str, repository: str = "acme/monorepo",
                 workflow: str = "stovepipe.yml",
                 inputs: tuple[str, ...] = ("head", "base", "stovepipe_id"),
                 run_name: str = "Stovepipe ${{ inputs.stovepipe_id }}",
                 returns_run_details: bool = True,
                 refuses_run_details: int | None = None) -> None:
        super().__init__(token)
        self.repository, self.workflow = repository, workflow
        self.declared_inputs = inputs
        self.run_name = run_name
        self.returns_run_details = returns_run_details
        self.refuses_run_details = refuses_run_details
        self.hide_new_runs = False
        self.hidden: set[int] = set()
        self.unknown_refs: set[str] = set()
        self.runs: dict[int, dict[str, Any]] = {}
        self.next_id = 1_000_000_001

    def set_run(self, run_id: int, status: str, conclusion: str | None = None) -> None:
        with self.lock:
            self.runs[run_id].update(status=status, conclusion=conclusion)

    def reveal_runs(self) -> None:
        with self.lock:
            self.hide_new_runs = False
            self.hidden.clear()

    def unauthorized(self) -> web.Response:
        return web.json_response({"message": "Bad credentials",
                                  "documentation_url": "https://docs.github.com/rest",
                                  "status": "401"}, status=401)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        workflow = "/repos/{owner}/{repo}/actions/workflows/{workflow}"
        router.add_post(workflow + "/dispatches", self._dispatch)
        router.add_get(workflow + "/runs", self._list)
        router.add_get("/repos/{owner}/{repo}/actions/runs/{run_id:\\d+}", self._get)
        router.add_post("/repos/{owner}/{repo}/actions/runs/{run_id:\\d+}/cancel",
                        self._cancel)
        router.add_post("/repos/{owner}/{repo}/statuses/{sha}", self._status)

    async def _status(self, request: web.Request) -> web.Response:
        if not self._repo_known(request):
            return self._not_found()
        body = request[BODY] if isinstance(request[BODY], dict) else {}
        return web.json_response({"state": body.get("state"),
                                  "context": body.get("context")}, status=201)

    @staticmethod
    def _not_found() -> web.Response:
        return web.json_response({"message": "Not Found", "documentation_url":
                                  "https://docs.github.com/rest", "status": "404"},
                                 status=404)

    def _repo_known(self, request: web.Request) -> bool:
        info = request.match_info
        return f"{info['owner']}/{info['repo']}" == self.repository

    def _workflow_known(self, request: web.Request) -> bool:
        return self._repo_known(request) and request.match_info["workflow"] == self.workflow

    async def _dispatch(self, request: web.Request) -> web.Response:
        if not self._workflow_known(request):
            return self._not_found()
        body = request[BODY] if isinstance(request[BODY], dict) else {}
        if self.refuses_run_details is not None and "return_run_details" in body:
            # the answer GitHub's REST API gives a body with a key the endpoint does not
            # take ("Invalid request" listing the key; 422, or 400 on some versions)
            return web.json_response({
                "message": 'Invalid request.\n\n"return_run_details" is not a permitted '
                           'key.',
                "documentation_url": "https://docs.github.com/enterprise-server@3.14/rest/"
                                     "actions/workflows#create-a-workflow-dispatch-event",
                "status": str(self.refuses_run_details)}, status=self.refuses_run_details)
        ref = body.get("ref")
        if not isinstance(ref, str) or not ref:
            return web.json_response({"message": "Invalid request.\n\n\"ref\" wasn't "
                                                 "supplied."}, status=422)
        if ref in self.unknown_refs:
            return web.json_response({"message": f"No ref found for: {ref}"}, status=422)
        inputs = body.get("inputs") or {}
        unexpected = sorted(set(inputs) - set(self.declared_inputs))
        if unexpected:
            return web.json_response({"message": f"Unexpected inputs provided: "
                                                 f"{json.dumps(unexpected)}"}, status=422)
        title = self.run_name
        for name in self.declared_inputs:
            title = title.replace("${{ inputs." + name + " }}", str(inputs.get(name, "")))
        with self.lock:
            run_id, self.next_id = self.next_id, self.next_id + 1
            self.runs[run_id] = {
                "id": run_id, "name": "Stovepipe", "display_title": title,
                "event": "workflow_dispatch", "status": "queued", "conclusion": None,
                "head_branch": ref, "run_attempt": 1, "created_at": _now_iso(),
                "path": f".github/workflows/{self.workflow}", "inputs": dict(inputs),
                "html_url": f"https://github.com/{self.repository}/actions/runs/{run_id}",
            }
            if self.hide_new_runs:
                self.hidden.add(run_id)
        if body.get("return_run_details") is True and self.returns_run_details:
            return web.json_response({
                "workflow_run_id": run_id,
                "run_url": f"{self.url}/repos/{self.repository}/actions/runs/{run_id}",
                "html_url": f"https://github.com/{self.repository}/actions/runs/{run_id}"})
        return web.Response(status=204)

    async def _list(self, request: web.Request) -> web.Response:
        if not self._workflow_known(request):
            return self._not_found()
        query = request.query
        created = query.get("created", "")
        since = created[2:] if created.startswith(">=") else ""
        with self.lock:
            found = [_public(r) for r in sorted(self.runs.values(), key=lambda r: -r["id"])
                     if r["id"] not in self.hidden
                     and ("event" not in query or r["event"] == query["event"])
                     and ("branch" not in query or r["head_branch"] == query["branch"])
                     and (not since or r["created_at"] >= since)]
        return web.json_response({"total_count": len(found),
                                  "workflow_runs": _page(found, query)})

    async def _get(self, request: web.Request) -> web.Response:
        with self.lock:
            run = self.runs.get(int(request.match_info["run_id"]))
            if run is None or not self._repo_known(request):
                return self._not_found()
            return web.json_response(_public(run))

    async def _cancel(self, request: web.Request) -> web.Response:
        with self.lock:
            run = self.runs.get(int(request.match_info["run_id"]))
            if run is None or not self._repo_known(request):
                return self._not_found()
            if run["status"] == "completed":
                return web.json_response({"message": "Cannot cancel a workflow run that is "
                                                     "completed."}, status=409)
            run.update(status="completed", conclusion="cancelled")
            return web.json_response({}, status=202)


def _public(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the API shows it (the inputs are not part of a run object)."""
    return {k: v for k, v in run.items() if k != "inputs"}


def shipped_example_queues(tmp_path: Path) -> QueuesConfig:
    """Every commented example queue of the shipped queues.yaml, uncommented and loaded."""
    lines = (REPO_ROOT / "queues.yaml").read_text().splitlines()
    start = lines.index("  # monorepo/main:")
    example = [line.replace("# ", "", 1) for line in lines[start:] if line.startswith("  # ")]
    path = tmp_path / "queues.yaml"
    path.write_text("queues:\n" + "\n".join(example) + "\n")
    return load_queues(path)
