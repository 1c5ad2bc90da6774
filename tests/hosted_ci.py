"""Local stand-ins for the hosted CI APIs the build runners call: real aiohttp servers on
127.0.0.1 (an ephemeral port) implementing the documented endpoints, states and errors.

- `FakeBuildkite`: Buildkite REST v2 builds — create, list (filtered by ``meta_data[…]``,
  ``commit``, ``branch``, ``state``, ``created_from``), get (with its jobs unless
  ``exclude_jobs=true``), cancel (``422`` unless scheduled, running or failing).
- `FakeGitHub`: GitHub Actions — workflow dispatch (``return_run_details``, declared inputs,
  ``run-name`` rendered into ``display_title``), list a workflow's runs (``event``,
  ``branch``, ``created=>=…``, pages), get a run, cancel (``409`` once completed), list
  the jobs of a run's attempt, list a check run's annotations — and commit statuses
  (``POST …/statuses/{sha}``, ``201``), so a runner and a notifier can share one token
  on one API.

Both check the bearer token (``401`` otherwise), record every request, and can be told to
answer the next matching requests with any status and headers (429 with ``Retry-After``,
5xx, 401, 404, …) or to hang until the server stops (a timeout for the client). Tests move
builds between states with `set_state` / `set_run`, give them jobs (`bk_job`, `gh_job`)
and annotations (`gh_annotation`) shaped as the providers publish them, or `plan` a build
by the clock: queued for an agent (a runner) for N s, then running M s, then ended — a
congested CI.

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


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


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
BK_QUEUED = ("creating", "scheduled")
BK_OVER = ("passed", "failed", "canceled", "skipped", "not_run", "waiting_failed")
# a pipeline's build settings as the build answers carry them ("skip_queued_branch_builds"
# … in the published examples)
BK_PIPELINE_SETTINGS = {"skip_queued_branch_builds": False,
                        "skip_queued_branch_builds_filter": None,
                        "cancel_running_branch_builds": False,
                        "cancel_running_branch_builds_filter": None}


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def bk_job(name: str, state: str, *, exit_status: int | None = None,
           signal_reason: str | None = None, soft_failed: bool = False,
           job_type: str = "script", agent: bool = True) -> dict[str, Any]:
    """A job as Buildkite's REST API shows it (its "Job data model"): ``state`` as the
    REST API flattens it (``passed``/``failed`` for a finished job), ``exit_status``,
    ``signal_reason`` (``agent_stop``, ``cancel``, …), ``soft_failed``; ``agent`` False
    for a job no agent took (``scheduled``, ``expired``)."""
    now = _iso(time.time())
    started = agent and state not in ("pending", "waiting", "blocked", "scheduled",
                                      "expired", "limited")
    over = state in ("passed", "failed", "canceled", "timed_out", "expired", "skipped",
                     "broken", "unblocked")
    job_id = str(uuid.uuid4())
    return {
        "id": job_id, "type": job_type, "name": name, "step_key": name.lower(),
        "state": state, "web_url": f"https://buildkite.com/acme/monorepo/builds/1#{job_id}",
        "command": "make ci" if job_type == "script" else None,
        "soft_failed": soft_failed, "exit_status": exit_status,
        "signal": "SIGTERM" if signal_reason else None, "signal_reason": signal_reason,
        "agent": {"id": str(uuid.uuid4()), "name": "agent-1"} if started else None,
        "created_at": now, "scheduled_at": now, "runnable_at": now,
        "started_at": now if started else None, "finished_at": now if over else None,
        "retried": False, "retried_in_job_id": None, "retries_count": None,
        "parallel_group_index": None, "parallel_group_total": None, "matrix": None,
    }


@dataclass
class BkPlan:
    """A build that waits ``queued`` seconds for an agent from its creation, then runs
    ``runs`` seconds and ends ``ends`` — read off the clock at every answer, as a congested
    Buildkite cluster would answer."""

    created: float
    queued: float
    runs: float
    ends: str = "passed"


class FakeBuildkite(FakeApi):
    """One organization's pipelines (``pipeline``, plus ``more_pipelines``; others are
    404). Build numbers are unique across them (Buildkite's are per pipeline; unique is a
    case of that). With ``limit_per_minute`` it enforces Buildkite's REST limit ("REST API
    rate limits", https://buildkite.com/docs/apis/rest-api/limits): that many requests per
    organization per minute window, ``RateLimit-Remaining``/``-Limit``/``-Reset`` on every
    answer and 429 once spent. ``latency`` delays every answer.

    Builds answer with the fields of the REST "Build data model" the runner reads:
    ``state``, ``blocked``, ``cancel_reason``, ``created_at``, ``scheduled_at``,
    ``started_at`` (set when it leaves ``scheduled``: the first job started),
    ``finished_at``, ``pipeline`` (with its settings, `pipeline_settings`) and ``jobs``
    (left out with ``exclude_jobs=true``). A build's jobs are the ones a test set
    (`set_jobs`, made with `bk_job`), else one ``ci`` job that follows the build's state.
    `plan` makes a build wait for an agent, run and end by the clock (a congested
    cluster)."""

    def __init__(self, token: str, organization: str = "acme",
                 pipeline: str = "monorepo", *, more_pipelines: tuple[str, ...] = (),
                 limit_per_minute: int | None = None, latency: float = 0.0) -> None:
        super().__init__(token)
        self.organization, self.pipeline = organization, pipeline
        self.pipelines = {pipeline, *more_pipelines}
        self.builds: dict[int, dict[str, Any]] = {}
        self.plans: dict[int, BkPlan] = {}
        self.new_builds_plan: tuple[float, float, str] | None = None
        self.pipeline_settings: dict[str, Any] = dict(BK_PIPELINE_SETTINGS)
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

    # -- what tests call -----------------------------------------------------------------
    def add_build(self, commit: str, *, branch: str = "main", pipeline: str | None = None,
                  state: str = "scheduled") -> int:
        """A build created straight on the server (not through the API); its number."""
        with self.lock:
            number = len(self.builds) + 1
            self.builds[number] = self._new_build(number, pipeline or self.pipeline,
                                                  commit, branch, "", {}, {})
        if state != "scheduled":
            self.set_state(number, state)
        return number

    def set_state(self, number: int, state: str, *, blocked: bool = False,
                  cancel_reason: str | None = None) -> None:
        """Move a build to ``state`` now (it started now if it had not; it finished now
        if ``state`` is over); a `plan` it had is dropped."""
        now = time.time()
        with self.lock:
            self.plans.pop(number, None)
            build = self.builds[number]
            build.update(state=state, blocked=blocked)
            if state not in BK_QUEUED and state not in ("skipped", "not_run") \
                    and build.get("started_at") is None:
                build["started_at"] = _iso(now)
            if state in BK_OVER and not blocked:
                build["finished_at"] = _iso(now)
            if cancel_reason is not None:
                build["cancel_reason"] = cancel_reason

    def set_jobs(self, number: int, jobs: list[dict[str, Any]]) -> None:
        with self.lock:
            self.builds[number]["jobs"] = [dict(j) for j in jobs]

    def plan(self, number: int, *, queued: float, runs: float, ends: str = "passed") -> None:
        """Build ``number`` waits for an agent ``queued`` seconds from its creation, then
        runs ``runs`` seconds, then ends ``ends`` (by the clock, at every answer)."""
        with self.lock:
            created = datetime.fromisoformat(self.builds[number]["created_at"]).timestamp()
            self.plans[number] = BkPlan(created, queued, runs, ends)

    def plan_new_builds(self, *, queued: float, runs: float, ends: str = "passed") -> None:
        """Every build created from now on follows `plan` (a congested cluster)."""
        with self.lock:
            self.new_builds_plan = (queued, runs, ends)

    def builds_of(self, commit: str) -> list[dict[str, Any]]:
        with self.lock:
            return [self._view(n) for n, b in self.builds.items() if b["commit"] == commit]

    def unauthorized(self) -> web.Response:
        return web.json_response({"message": "Authentication required. Please supply a "
                                             "valid API Access Token"}, status=401)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        base = "/v2/organizations/{org}/pipelines/{pipeline}/builds"
        router.add_post(base, self._create)
        router.add_get(base, self._list)
        router.add_get(base + "/{number:\\d+}", self._get)
        router.add_put(base + "/{number:\\d+}/cancel", self._cancel)

    # -- the server ----------------------------------------------------------------------
    def _new_build(self, number: int, pipeline: str, commit: str, branch: str, message: str,
                   env: dict[str, Any], meta_data: dict[str, Any]) -> dict[str, Any]:
        now = _iso(time.time())
        return {
            "id": str(uuid.uuid4()), "number": number, "state": "scheduled",
            "blocked": False, "cancel_reason": None, "pipeline": pipeline,
            "commit": commit, "branch": branch, "message": message, "env": env,
            "meta_data": {k: str(v) for k, v in meta_data.items()}, "source": "api",
            "created_at": now, "scheduled_at": now, "started_at": None,
            "failing_at": None, "finished_at": None, "jobs": None,
            "url": f"{self.url}/v2/organizations/{self.organization}/pipelines/{pipeline}"
                   f"/builds/{number}",
            "web_url": f"https://buildkite.com/{self.organization}/{pipeline}/builds/{number}",
        }

    def _view(self, number: int, *, jobs: bool = True) -> dict[str, Any]:
        """Build ``number`` as the API answers it now (under the lock)."""
        build = self.builds[number]
        plan = self.plans.get(number)
        if plan is not None:
            now = time.time()
            start, end = plan.created + plan.queued, plan.created + plan.queued + plan.runs
            if now < start:
                build.update(state="scheduled", started_at=None, finished_at=None)
            else:
                build["started_at"] = _iso(start)
                if now < end:
                    build.update(state="running", finished_at=None)
                else:
                    build.update(state=plan.ends, finished_at=_iso(end))
        answer = {**build, "pipeline": {
            "id": f"pipeline-{build['pipeline']}", "slug": build["pipeline"],
            "name": build["pipeline"], "url": f"{self.url}/v2/organizations/"
                                              f"{self.organization}/pipelines/{build['pipeline']}",
            **self.pipeline_settings}}
        if jobs:
            answer["jobs"] = [dict(j) for j in build["jobs"]] if build["jobs"] is not None \
                else [self._job_following(build)]
        else:
            answer.pop("jobs")
        return answer

    @staticmethod
    def _job_following(build: dict[str, Any]) -> dict[str, Any]:
        """The one job of a build no test gave jobs: it follows the build's state."""
        state = build["state"]
        if state in BK_QUEUED:
            return bk_job("ci", "scheduled", agent=False)
        if state in ("passed", "failed"):
            return bk_job("ci", state, exit_status=0 if state == "passed" else 1)
        if state in ("canceled", "canceling"):
            return bk_job("ci", state, exit_status=-1 if build["started_at"] is None
                          else 143, signal_reason="cancel",
                          agent=build["started_at"] is not None)
        if state in ("skipped", "not_run"):
            return bk_job("ci", "skipped", agent=False)
        return bk_job("ci", "running")

    def _known(self, request: web.Request) -> bool:
        return (request.match_info["org"] == self.organization
                and request.match_info["pipeline"] in self.pipelines)

    def _number(self, request: web.Request) -> int | None:
        if not self._known(request):
            return None
        number = int(request.match_info["number"])
        build = self.builds.get(number)
        if build is None or build["pipeline"] != request.match_info["pipeline"]:
            return None
        return number

    async def _create(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"message": "Not Found"}, status=404)
        body = request[BODY] if isinstance(request[BODY], dict) else {}
        missing = [f for f in ("commit", "branch")
                   if not isinstance(body.get(f), str) or not body[f]]
        if missing:
            return web.json_response({"message": "Validation Failed", "errors": [
                {"field": f, "code": "missing"} for f in missing]}, status=422)
        with self.lock:
            number = len(self.builds) + 1
            self.builds[number] = self._new_build(
                number, request.match_info["pipeline"], body["commit"], body["branch"],
                body.get("message", ""), body.get("env") or {}, body.get("meta_data") or {})
            if self.new_builds_plan is not None:
                queued, runs, ends = self.new_builds_plan
                self.plans[number] = BkPlan(time.time(), queued, runs, ends)
            return web.json_response(self._view(number), status=201)

    async def _list(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"message": "Not Found"}, status=404)
        query = request.query
        wanted_meta = {key[len("meta_data["):-1]: value for key, value in query.items()
                       if key.startswith("meta_data[") and key.endswith("]")}
        states = query.getall("state[]", []) or query.getall("state", [])
        since = query.get("created_from", "")
        pipeline = request.match_info["pipeline"]
        jobs = query.get("exclude_jobs") != "true"
        with self.lock:
            views = [self._view(n, jobs=jobs) for n in sorted(self.builds, reverse=True)
                     if self.builds[n]["pipeline"] == pipeline]
        found = [b for b in views
                 if (not since or _epoch(b["created_at"]) >= _epoch(since))
                 and (self.ignores_meta_data_filter
                      or all(b["meta_data"].get(k) == v for k, v in wanted_meta.items()))
                 and ("commit" not in query or b["commit"] == query["commit"])
                 and ("branch" not in query or b["branch"] == query["branch"])
                 and (not states or b["state"] in states)]
        return web.json_response(_page(found, query))

    async def _get(self, request: web.Request) -> web.Response:
        with self.lock:
            number = self._number(request)
            if number is None:
                return web.json_response({"message": "Not Found"}, status=404)
            answer = self._view(number, jobs=request.query.get("exclude_jobs") != "true")
        return web.json_response(answer)

    async def _cancel(self, request: web.Request) -> web.Response:
        with self.lock:
            number = self._number(request)
            if number is None:
                return web.json_response({"message": "Not Found"}, status=404)
            state = self._view(number)["state"]
            if state not in BK_CANCELLABLE:
                return web.json_response({"message": f"Build can't be canceled because it's "
                                                     f"{state}"}, status=422)
            self.plans.pop(number, None)
            self.builds[number].update(state="canceled", finished_at=_iso(time.time()))
            return web.json_response(self._view(number))


# --- GitHub Actions ----------------------------------------------------------------------


GH_RUNNER_LOST = ("The self-hosted runner: runner-7 lost communication with the server. "
                  "Verify the machine is running and has a healthy network connection. "
                  "Anything in your workflow that terminates the runner process, starves it "
                  "for CPU/Memory, or blocks its network access can cause this error.")
GH_SHUTDOWN = ("The runner has received a shutdown signal. This can happen when the runner "
               "service is stopped, or a manually started runner is canceled.")
GH_CONCURRENCY_CANCEL = ("Canceling since a higher priority waiting request for "
                         "'stovepipe-main' exists")
GH_STEP_FAILED = "Process completed with exit code 1."


def gh_job(job_id: int, name: str, status: str, conclusion: str | None = None, *,
           ran: bool = True) -> dict[str, Any]:
    """A job of a workflow run as GitHub's REST API shows it ("List jobs for a workflow
    run attempt"): ``ran`` False for a job no runner took (no runner, no steps)."""
    now = _now_iso()
    steps = [{"name": "Set up job", "status": "completed" if conclusion else "in_progress",
              "conclusion": "success" if conclusion else None, "number": 1,
              "started_at": now, "completed_at": now if conclusion else None},
             {"name": "Run make ci", "status": "completed" if conclusion else "in_progress",
              "conclusion": conclusion, "number": 2, "started_at": now,
              "completed_at": now if conclusion else None}] if ran else []
    return {
        "id": job_id, "run_attempt": 1, "node_id": f"CR_{job_id}",
        "head_sha": "a" * 40, "status": status, "conclusion": conclusion,
        "created_at": now, "started_at": now, "completed_at": now if conclusion else None,
        "name": name, "steps": steps,
        "url": f"https://api.github.com/repos/acme/monorepo/actions/jobs/{job_id}",
        "html_url": f"https://github.com/acme/monorepo/actions/runs/1/job/{job_id}",
        "check_run_url": f"https://api.github.com/repos/acme/monorepo/check-runs/{job_id}",
        "labels": ["self-hosted"], "runner_id": 7 if ran else None,
        "runner_name": "runner-7" if ran else None,
        "runner_group_id": 1 if ran else None,
        "runner_group_name": "Default" if ran else None, "workflow_name": "Stovepipe",
        "head_branch": "main",
    }


def gh_annotation(message: str) -> dict[str, Any]:
    """A check run's annotation as GitHub's REST API shows it ("List check run
    annotations"); the ones GitHub writes about a run's runner have path ``.github``."""
    return {"path": ".github", "blob_href": "https://github.com/acme/monorepo/blob/x/.github",
            "start_line": 1, "end_line": 1, "start_column": None, "end_column": None,
            "annotation_level": "failure", "title": "", "message": message,
            "raw_details": ""}


class FakeGitHub(FakeApi):
    """One repository's one workflow (others are 404). ``run_name`` is the workflow's
    ``run-name`` (``${{ inputs.X }}`` is replaced); ``returns_run_details`` False plays a
    GitHub that answers a dispatch 204 only; ``refuses_run_details`` (400 or 422) plays an
    Enterprise Server that does not know ``return_run_details`` and refuses a dispatch
    carrying it, starting nothing, as it refuses any unknown body parameter; while
    ``hide_new_runs`` is set, runs are started but not yet listed.

    Runs answer with the fields of the REST workflow-run object the runner reads
    (``status``, ``conclusion``, ``run_attempt``, ``run_started_at`` — set when the run is
    created, as GitHub does). A run's jobs (``…/attempts/{n}/jobs``) are the ones a test
    set (`set_jobs`, made with `gh_job`), else one ``ci`` job that follows the run (taken
    by a runner once the run was ``in_progress``); check runs' annotations
    (``/check-runs/{id}/annotations``) are the ones `annotate` set, and with
    ``checks_forbidden`` they answer 403 as for a token without "Checks: read". `plan`
    makes a run wait for a runner, run and end by the clock."""

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
        self.jobs: dict[int, list[dict[str, Any]]] = {}
        self.annotations: dict[int, list[dict[str, Any]]] = {}
        self.plans: dict[int, tuple[float, float, float, str]] = {}
        self.checks_forbidden = False
        self.next_id = 1_000_000_001

    def set_run(self, run_id: int, status: str, conclusion: str | None = None) -> None:
        with self.lock:
            self.plans.pop(run_id, None)
            run = self.runs[run_id]
            run.update(status=status, conclusion=conclusion, updated_at=_now_iso())
            run["_ran"] = run.get("_ran", False) or status == "in_progress"

    def set_jobs(self, run_id: int, jobs: list[dict[str, Any]]) -> None:
        with self.lock:
            self.jobs[run_id] = [dict(j) for j in jobs]

    def annotate(self, job_id: int, *messages: str) -> None:
        with self.lock:
            self.annotations[job_id] = [gh_annotation(m) for m in messages]

    def plan(self, run_id: int, *, queued: float, runs: float,
             conclusion: str = "success") -> None:
        """Run ``run_id`` waits ``queued`` seconds for a runner from now, then runs
        ``runs`` seconds, then completes with ``conclusion`` (by the clock)."""
        with self.lock:
            self.plans[run_id] = (time.time(), queued, runs, conclusion)

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
        router.add_get("/repos/{owner}/{repo}/actions/runs/{run_id:\\d+}/attempts/"
                       "{attempt:\\d+}/jobs", self._jobs)
        router.add_get("/repos/{owner}/{repo}/check-runs/{check_run_id:\\d+}/annotations",
                       self._annotations)
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
            now = _now_iso()
            self.runs[run_id] = {
                "id": run_id, "name": "Stovepipe", "display_title": title,
                "event": "workflow_dispatch", "status": "queued", "conclusion": None,
                "head_branch": ref, "run_attempt": 1, "created_at": now,
                "updated_at": now, "run_started_at": now,
                "path": f".github/workflows/{self.workflow}", "inputs": dict(inputs),
                "html_url": f"https://github.com/{self.repository}/actions/runs/{run_id}",
                "jobs_url": f"{self.url}/repos/{self.repository}/actions/runs/{run_id}/jobs",
                "_ran": False,
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
            found = [self._view(r["id"])
                     for r in sorted(self.runs.values(), key=lambda r: -r["id"])
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
            return web.json_response(self._view(run["id"]))

    async def _cancel(self, request: web.Request) -> web.Response:
        with self.lock:
            run = self.runs.get(int(request.match_info["run_id"]))
            if run is None or not self._repo_known(request):
                return self._not_found()
            if self._view(run["id"])["status"] == "completed":
                return web.json_response({"message": "Cannot cancel a workflow run that is "
                                                     "completed."}, status=409)
            self.plans.pop(run["id"], None)
            run.update(status="completed", conclusion="cancelled", updated_at=_now_iso())
            return web.json_response({}, status=202)

    async def _jobs(self, request: web.Request) -> web.Response:
        with self.lock:
            run = self.runs.get(int(request.match_info["run_id"]))
            if run is None or not self._repo_known(request) \
                    or int(request.match_info["attempt"]) != run["run_attempt"]:
                return self._not_found()
            view = self._view(run["id"])
            jobs = [dict(j) for j in self.jobs[run["id"]]] if run["id"] in self.jobs \
                else [_job_following(view, run["_ran"], run["id"])]
        return web.json_response({"total_count": len(jobs),
                                  "jobs": _page(jobs, request.query)})

    async def _annotations(self, request: web.Request) -> web.Response:
        if not self._repo_known(request):
            return self._not_found()
        if self.checks_forbidden:
            return web.json_response({
                "message": "Resource not accessible by personal access token",
                "documentation_url": "https://docs.github.com/rest/checks/runs"
                                     "#list-check-run-annotations", "status": "403"},
                status=403)
        with self.lock:
            found = [dict(a) for a in self.annotations.get(
                int(request.match_info["check_run_id"]), [])]
        return web.json_response(_page(found, request.query))

    def _view(self, run_id: int) -> dict[str, Any]:
        """A run as the API answers it now (under the lock; the inputs and what the fake
        keeps for itself are not part of a run object)."""
        run = self.runs[run_id]
        plan = self.plans.get(run_id)
        if plan is not None:
            began, queued, runs, conclusion = plan
            now = time.time()
            if now < began + queued:
                run.update(status="queued", conclusion=None)
            elif now < began + queued + runs:
                run.update(status="in_progress", conclusion=None, _ran=True)
            else:
                run.update(status="completed", conclusion=conclusion, _ran=True)
        return {k: v for k, v in run.items() if k != "inputs" and not k.startswith("_")}


def _job_following(run: dict[str, Any], ran: bool, run_id: int) -> dict[str, Any]:
    """The one job of a run no test gave jobs: it follows the run (a runner took it once
    the run was in progress)."""
    if run["status"] == "completed":
        return gh_job(run_id + 1, "ci", "completed", run["conclusion"], ran=ran)
    return gh_job(run_id + 1, "ci", "in_progress" if ran else "queued", ran=ran)


def shipped_example_queues(tmp_path: Path) -> QueuesConfig:
    """Every commented example queue of the shipped queues.yaml, uncommented and loaded."""
    lines = (REPO_ROOT / "queues.yaml").read_text().splitlines()
    start = lines.index("  # monorepo/main:")
    example = [line.replace("# ", "", 1) for line in lines[start:] if line.startswith("  # ")]
    path = tmp_path / "queues.yaml"
    path.write_text("queues:\n" + "\n".join(example) + "\n")
    return load_queues(path)
