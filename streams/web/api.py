"""The worker's HTTP surface (design §9): a JSON API, /health and the dashboard.

`mount()` adds these to the Faust worker's aiohttp web server (next to /metrics):

    POST /api/queues/{queue}/ingest      validate the queue's current head now
    POST /api/queues/{queue}/retry       validate a commit again ({"commit": C}; no body:
                                         the queue's newest head)
    POST /api/queues/{queue}/pin         hold the promotion ref at a green commit
                                         ({"commit": C, "reason": R, "by": B})
    POST /api/queues/{queue}/unpin       let it follow the bookmark again ({"by": B})
    GET  /api/queues                     every configured queue at a glance
    GET  /api/queues/{queue}             one queue: bookmark, promotion ref, slots, latest,
                                         its culprit ("red since C", or the search under
                                         way) and its health figures
    GET  /api/queues/{queue}/requests    its recent Requests, newest first (?limit=1..100)
    GET  /api/queues/{queue}/history     its last heads and built commits in history
                                         order, newest first, with subjects, authors,
                                         build links and time to signal (?limit=1..200)
    GET  /api/queues/{queue}/explain     the branch's story since its last green commit,
                                         newest first, in words (streams/web/story.py)
    GET  /api/queues/{queue}/health      time to signal, share of time red, red streak,
                                         bookmark lag (commits, time), flakes
    GET  /api/queues/{queue}/greens      green commits in history order after
                                         ?since=COMMIT (?limit=1..1000, then `next`)
    GET  /api/builds/{queue}/{build_id}/log  a command build's log tail (text/plain)
    GET  /api/requests/{request_id}      a Request, its builds (attempts), its own fact and
                                         its commit's answer
    GET  /api/queues/{queue}/green?sha=S is this commit green, and if not, its newest green
                                         ancestor and its oldest green descendant
    GET  /api/facts?queue=Q&sha=S        is this commit green? (no fact: not green); the
                                         commit by full sha, unique prefix, or uri=U
    GET  /api/dlq                        dead letters waiting for their reconcilers
    POST /webhooks/github                a GitHub push webhook (streams/web/webhooks.py)
    POST /webhooks/gitlab                a GitLab push webhook
    GET  /health                         200 when started and the database answers
    GET  /  and  /dashboard              the dashboard page (streams/web/dashboard/)

Queue names and request ids contain '/'. Both may be written as they are or URL-encoded
(`/api/queues/team%2Fmain`); a queue whose name itself ends in `/requests`, `/green`,
`/ingest`, `/retry`, `/pin` or `/unpin` can only be named encoded.
So can one whose name ends in `/history`, `/explain`, `/health` or `/greens`.

A deploy gate always gets an answer it can read `.green` from: a commit the repository
does not have is `"green": false, "known": false` with the reason (200), not an error.

The webhooks are authenticated by their provider's signature or token, never by the
bearer token (their answers are listed in streams/web/webhooks.py).

Every error is JSON `{"error": message}`, never a traceback: 400 malformed input, 401
missing or wrong bearer token (POST only, and only when a token is configured), 404
unknown queue, request, commit or endpoint, 409 a green commit asked to be validated
again (with its `fact`), or a pin refused (a red or unvalidated commit, no promotion
ref), 422 the queue's repository or ref does not exist, 502 a
dependency refused for good, 503 the worker is starting or a dependency (database, Kafka,
repository) is unavailable or too slow, 500 anything else (logged by the worker).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import faust
from aiohttp import web
from faust.web import View

from store import NotFound, StoreError
from streams.config.names import InvalidQueueName, UnknownQueue, validate_queue_name
from streams.extensions.sourcecontrol import (
    AmbiguousCommit,
    CommitNotFound,
    SourceControlError,
    UnknownRef,
)
from streams.runtime.classify import is_retryable
from streams.runtime.stage import Delivery
from streams.runtime.worker import RuntimeService
from streams.stages import gauges
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_head
from streams.stages.pins import PinRefused, pin_promotion, unpin_promotion
from streams.stages.revalidate import AlreadyGreen, NeverIngested, validate_again
from streams.web import gate, greens, history, queries, story
from streams.web.errors import ApiError
from streams.web.params import (
    commit_param,
    int_param,
    pin_fields,
    required_param,
    retry_commit,
)
from streams.web.webhooks import Webhooks

log = logging.getLogger("stovepipe.http")

READ_DEADLINE = 5.0  # seconds a read may take before it answers 503
GATE_DEADLINE = 15.0  # a green search also asks the repository about ancestry
INGEST_DEADLINE = 15.0  # an ingest also asks the repository and waits for Kafka's ack
HEALTH_DEADLINE = 2.0
GREENS_DESCRIBE_DEADLINE = 8.0  # seconds the green list waits for the commits' shas
DEFAULT_RECENT_LIMIT = 20
DLQ_CACHE_SECONDS = 5.0
DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page loads only its own script and style and calls only this server.
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                 "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                 "form-action 'none'; frame-ancestors 'none'")


def faust_settings() -> dict[str, Any]:
    """Settings for the Faust app that serves this API: JSON errors everywhere, and none
    of Faust's table and router pages (Stovepipe has no tables)."""
    return {
        "web_application_options": {"middlewares": [json_errors]},
        "web_router_enabled": False,
        "web_tables_enabled": False,
    }


def port_is_free(port: int, host: str = "") -> bool:
    """Whether a server could listen on ``port`` now (as the web server will, with
    SO_REUSEADDR, so a port in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# --- errors -----------------------------------------------------------------------------


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(queries.jsonable(body), status=status, headers=headers,
                             dumps=lambda value: json.dumps(value, sort_keys=True))


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return _json({"error": message}, status=status, headers=headers)


def error_response(exc: Exception) -> web.Response:
    """The one translation of a failure into an HTTP answer."""
    if isinstance(exc, ApiError):
        headers = exc.headers
        if headers is None and exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return _error(exc.status, exc.message, headers)
    if isinstance(exc, InvalidQueueName):
        return _error(400, str(exc))
    if isinstance(exc, UnknownQueue):
        return _error(404, str(exc))
    if isinstance(exc, NotFound):
        return _error(404, str(exc))
    if isinstance(exc, CommitNotFound):
        return _error(404, str(exc))
    if isinstance(exc, AmbiguousCommit):
        return _error(400, str(exc))
    if isinstance(exc, UnknownRef):
        return _error(422, f"{exc} (fix the queue's source_control in the queue "
                           f"configuration)")
    if isinstance(exc, TimeoutError):
        return _error(503, "a dependency (database, Kafka or the repository) did not "
                           "answer in time; try again")
    if is_retryable(exc):
        return _error(503, f"temporarily unavailable, try again: {_describe(exc)}")
    if isinstance(exc, SourceControlError):
        return _error(502, f"the repository refused: {exc}")
    if isinstance(exc, StoreError):
        return _error(500, f"the store refused: {exc}")
    log.error("http_internal_error error=%r", exc, exc_info=exc)
    return _error(500, "internal error; the worker's log has the details")


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@web.middleware
async def json_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
    """Whatever a handler raises becomes a JSON answer; so does aiohttp's own 404/405
    under /api, so an API caller always gets `{"error": ...}`."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not _is_api(request.path):
            raise
        if exc.status == 404:
            return _error(404, f"no such endpoint: {request.method} {request.path}; the "
                               f"API has {', '.join(_ENDPOINTS)}")
        allow = exc.headers.get("Allow")
        return _error(exc.status, exc.reason, {"Allow": allow} if allow else None)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - never a traceback in a response
        return error_response(exc)


def _is_api(path: str) -> bool:
    return path.startswith(("/api/", "/webhooks/")) or path in ("/api", "/health")


# --- the API ----------------------------------------------------------------------------


class Api:
    """The handlers; each returns a response or raises (see `error_response`)."""

    def __init__(self, runtime: RuntimeService[Deps], *, api_token: str | None,
                 dead_letters: queries.DeadLetterDepths) -> None:
        self.runtime = runtime
        self.api_token = api_token or None
        self.dead_letters = dead_letters
        self.webhooks = Webhooks(self._delivery)
        self._assets: dict[str, bytes] = {}

    def _delivery(self) -> Delivery[Deps]:
        delivery = self.runtime.delivery
        if delivery is None or not self.runtime.ready.is_set():
            raise ApiError(503, "the worker is starting; try again in a moment")
        return delivery

    def _require_token(self, request: web.Request) -> None:
        if self.api_token is None:
            return
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "this endpoint needs 'Authorization: Bearer <token>' (the "
                                "worker's --api-token or STOVEPIPE_API_TOKEN)")
        if not hmac.compare_digest(given.strip().encode(), self.api_token.encode()):
            raise ApiError(401, "wrong API token")

    async def ingest(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        delivery = self._delivery()
        async with asyncio.timeout(INGEST_DEADLINE):
            done = await ingest_head(delivery.deps, queue, delivery.publish)
        log.info("http_ingest queue=%s request_id=%s new=%s", queue, done.request_id,
                 done.new)
        return _json({"queue": done.queue, "request_id": done.request_id, "new": done.new},
                     status=201 if done.new else 200)

    async def retry(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        commit = await retry_commit(request)
        delivery = self._delivery()
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await validate_again(delivery.deps, queue, commit, delivery.publish)
        except AlreadyGreen as exc:
            return _json({"error": str(exc), "fact": exc.fact}, status=409)
        except NeverIngested as exc:
            raise ApiError(404, str(exc)) from None
        except ValueError as exc:  # not a sha (or, its subclass, not a queue name)
            raise ApiError(400, str(exc)) from None
        log.info("http_retry queue=%s uri=%s request_id=%s new=%s previous_id=%s", queue,
                 done.uri, done.request_id, done.new, done.previous_id)
        return _json({"queue": done.queue, "uri": done.uri, "request_id": done.request_id,
                      "new": done.new, "previous_id": done.previous_id},
                     status=201 if done.new else 200)

    async def pin(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        fields = await pin_fields(request, needs_commit=True)
        deps = self._delivery().deps
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await pin_promotion(deps, queue, fields["commit"], by=fields["by"],
                                           reason=fields["reason"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except ValueError as exc:  # not a sha (or, its subclass, not a queue name)
            raise ApiError(400, str(exc)) from None
        q = done.queue
        log.info("http_pin queue=%s uri=%s by=%s", queue, q.pinned_uri, q.pinned_by)
        return _json({"queue": q.name, "pinned_uri": q.pinned_uri,
                      "pinned_request_id": q.pinned_request_id, "pinned_by": q.pinned_by,
                      "pinned_reason": q.pinned_reason, "pinned_at": q.pinned_at,
                      "previous_target": done.previous_target,
                      "last_green_uri": q.last_green_uri})

    async def unpin(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        fields = await pin_fields(request, needs_commit=False)
        deps = self._delivery().deps
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await unpin_promotion(deps, queue, by=fields["by"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        log.info("http_unpin queue=%s was=%s by=%s", queue, done.was_pinned, fields["by"])
        return _json({"queue": done.queue.name, "was_pinned": done.was_pinned,
                      "target": done.target, "last_green_uri": done.queue.last_green_uri})

    async def github_webhook(self, request: web.Request) -> web.Response:
        return await self.webhooks.github(request)  # signed, so no bearer token

    async def gitlab_webhook(self, request: web.Request) -> web.Response:
        return await self.webhooks.gitlab(request)  # its secret token, no bearer token

    async def queues(self, request: web.Request) -> web.Response:
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            overviews = [await self._overview(deps, name, lag_deadline=0.0)
                         for name in deps.queues.names()]
        return _json({"queues": overviews})

    async def queue(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            return _json(await self._overview(deps, queue,
                                              lag_deadline=gauges.LAG_DEADLINE_API))

    async def queue_requests(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", DEFAULT_RECENT_LIMIT, 1,
                           queries.MAX_RECENT_REQUESTS)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            recent = await queries.recent_requests(deps.db, queue, limit)
        return _json({"queue": queue, "requests": [
            {"request": r.request, "fact": r.fact, "green": r.green} for r in recent]})

    async def queue_history(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", history.DEFAULT_LIMIT, 1, history.MAX_LIMIT)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            return _json(await history.queue_history(deps, queue, limit,
                                                     self._commit_descriptions))

    @cached_property
    def _commit_descriptions(self) -> history.CommitDescriptions:
        return history.CommitDescriptions()

    async def request(self, request: web.Request, request_id: str) -> web.Response:
        try:
            queries.parse_request_path(request_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            try:
                detail = await queries.request_detail(deps.db, request_id)
            except NotFound:
                raise ApiError(404, f"no request {request_id!r}") from None
        return _json({"request": detail.request, "builds": detail.builds,
                      "fact": detail.fact, "commit_fact": detail.commit_fact,
                      "newest_for_commit": detail.newest_for_commit,
                      "green": detail.green})

    async def fact(self, request: web.Request) -> web.Response:
        queue = required_param(request, "queue")
        by, commit = commit_param(request)
        validate_queue_name(queue)
        deps = self._delivery().deps
        body: dict[str, Any] = {"queue": queue, by: commit}
        if by == "uri":
            try:
                deps.queue_config(queue)
            except UnknownQueue as exc:  # still not green, and say why
                return _json({**body, "green": False, "fact": None, "known": False,
                              "reason": str(exc), "note": str(exc)})
        try:
            async with asyncio.timeout(GATE_DEADLINE):
                uri = await _resolved(deps, queue, commit) if by == "sha" else commit
                body["uri"] = uri
                fact = await queries.fact_or_none(deps.db, queue, uri)
                if fact is None:  # a fact proves the commit; without one, ask
                    await deps.extensions.source_control(queue).commit_time(uri)
        except CommitNotFound as exc:
            return _json(_unknown_commit(body, exc))
        return _json({**body, "green": fact is not None and fact.is_green, "fact": fact,
                      "known": True})

    async def green(self, request: web.Request, queue: str) -> web.Response:
        by, commit = commit_param(request)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        body: dict[str, Any] = {"queue": queue, by: commit}
        try:
            async with asyncio.timeout(GATE_DEADLINE):
                uri = await _resolved(deps, queue, commit) if by == "sha" else commit
                body["uri"] = uri
                answer = await gate.green_answer(deps, queue, uri)
        except CommitNotFound as exc:
            return _json(_unknown_commit(body, exc))
        return _json({**body, "uri": answer.uri, "committed_at": answer.committed_at,
                      "green": answer.green, "known": True, "fact": answer.fact,
                      "prior_green": answer.prior_green, "next_green": answer.next_green,
                      "searched": answer.searched, "complete": answer.complete})

    # --- the branch's story, its health, its green commits, a build's log (issue 18) ----

    async def _overview(self, deps: Deps, queue: str, *,
                        lag_deadline: float) -> dict[str, Any]:
        """A queue at a glance, with its culprit ("red since C", or the search under way)
        and its health figures (the commit lag only as counted already when
        ``lag_deadline`` is 0)."""
        overview = await queries.queue_overview(deps, queue)
        culprit, search = await story.red_since(deps, queue, self._commit_descriptions)
        health = await gauges.queue_health(deps, queue, lag_deadline=lag_deadline)
        return {**queries.jsonable(overview), "culprit": culprit, "search": search,
                "health": health}

    async def explain(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            told = await story.explain(deps, queue, self._commit_descriptions)
        return _json(told)

    async def queue_health(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            return _json(await gauges.queue_health(deps, queue,
                                                   lag_deadline=gauges.LAG_DEADLINE_API))

    async def greens(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", greens.DEFAULT_LIMIT, 1, greens.MAX_LIMIT)
        since = request.query.get("since")
        if since is not None and not since.strip():
            raise ApiError(400, "query parameter 'since' names a commit (a full sha, a "
                                "unique prefix or the URI); leave it out to list from the "
                                "first green commit")
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(GATE_DEADLINE):
            since_uri = await _resolved(deps, queue, since.strip()) if since else None
            try:
                listed = await greens.greens_after(deps, queue, since_uri, limit,
                                                   self._green_descriptions)
            except greens.NeverValidated as exc:
                raise ApiError(404, str(exc)) from None
        return _json(listed)

    @cached_property
    def _green_descriptions(self) -> history.CommitDescriptions:
        # the green list waits longer for the commits' shas: release tooling wants them
        return history.CommitDescriptions(deadline=GREENS_DESCRIBE_DEADLINE)

    async def build_log(self, request: web.Request, queue: str,
                        build_id: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            try:
                build = await deps.db.command_builds.get(build_id)
            except NotFound:
                build = None
        if build is None or build.queue != queue:
            raise ApiError(404, f"queue {queue!r} has no command build {build_id!r} (only "
                                f"the command runner's builds have a log here)")
        return web.Response(text=build.log_tail, content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "X-Content-Type-Options": "nosniff",
                                     "X-Build-Status": build.status.value})

    async def dlq(self, request: web.Request) -> web.Response:
        report = await self.dead_letters.report()
        body = {"group": report.group, "measured_at": report.measured_at,
                "topics": report.topics, "total": report.total, "error": report.error}
        return _json(body, status=503 if report.error else 200)

    async def health(self, request: web.Request) -> web.Response:
        started = self.runtime.ready.is_set() and self.runtime.delivery is not None
        body: dict[str, Any] = {"runtime": "started" if started else "starting",
                                "database": "not checked"}
        if started:
            assert self.runtime.delivery is not None
            try:
                async with asyncio.timeout(HEALTH_DEADLINE):
                    await queries.database_answers(self.runtime.delivery.deps.db)
                body["database"] = "ok"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - health reports, it never raises
                body["database"] = (f"no answer within {HEALTH_DEADLINE:g}s"
                                    if isinstance(exc, TimeoutError) else _describe(exc))
        healthy = started and body["database"] == "ok"
        body["status"] = "ok" if healthy else "unavailable"
        return _json(body, status=200 if healthy else 503)

    async def dashboard(self, request: web.Request) -> web.Response:
        return await self._asset("index.html", "text/html")

    async def dashboard_asset(self, request: web.Request, asset: str) -> web.Response:
        if asset not in DASHBOARD_ASSETS:
            raise web.HTTPNotFound()
        return await self._asset(asset, DASHBOARD_ASSETS[asset])

    async def _asset(self, name: str, content_type: str) -> web.Response:
        if name not in self._assets:
            try:
                self._assets[name] = await asyncio.to_thread((DASHBOARD_DIR / name).read_bytes)
            except OSError:
                log.error("dashboard_asset_missing path=%s", DASHBOARD_DIR / name)
                return web.Response(status=500, text=f"dashboard asset {name} is missing "
                                                     f"from this installation")
        return web.Response(body=self._assets[name], content_type=content_type,
                            charset="utf-8", headers={"Content-Security-Policy": DASHBOARD_CSP,
                                                      "Cache-Control": "no-cache"})


async def _resolved(deps: Deps, queue: str, commit: str) -> str:
    """The URI of a sha or prefix on the queue; not a sha at all is a 400."""
    try:
        return await gate.resolve_commit(deps, queue, commit)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _unknown_commit(asked: dict[str, Any], exc: CommitNotFound) -> dict[str, Any]:
    """A gate's answer about a commit the repository does not have: not green, and why
    (a 200, so a gate reading `.green` needs no special case)."""
    return {"uri": None, **asked, "green": False, "fact": None, "known": False,
            "reason": str(exc)}


# --- mounting ---------------------------------------------------------------------------

# Registration order matters where patterns overlap: the `/ingest`, `/retry`, `/requests`
# and `/green` routes are tried before the plain queue route, whose name may contain '/'
# (and so is `/history`).
_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("post", "/api/queues/{queue:.+}/ingest", "ingest"),
    ("post", "/api/queues/{queue:.+}/retry", "retry"),
    ("post", "/api/queues/{queue:.+}/pin", "pin"),
    ("post", "/api/queues/{queue:.+}/unpin", "unpin"),
    ("get", "/api/queues/{queue:.+}/requests", "queue_requests"),
    ("get", "/api/queues/{queue:.+}/history", "queue_history"),
    ("get", "/api/queues/{queue:.+}/green", "green"),
    ("get", "/api/queues/{queue:.+}/greens", "greens"),
    ("get", "/api/queues/{queue:.+}/explain", "explain"),
    ("get", "/api/queues/{queue:.+}/health", "queue_health"),
    ("get", "/api/queues/{queue:.+}", "queue"),
    ("get", "/api/queues", "queues"),
    ("get", "/api/requests/{request_id:.+}", "request"),
    ("get", "/api/builds/{queue:.+}/{build_id:[^/]+}/log", "build_log"),
    ("get", "/api/facts", "fact"),
    ("get", "/api/dlq", "dlq"),
    ("post", "/webhooks/github", "github_webhook"),
    ("post", "/webhooks/gitlab", "gitlab_webhook"),
    ("get", "/health", "health"),
    ("get", "/", "dashboard"),
    ("get", "/dashboard", "dashboard"),
    ("get", "/dashboard/{asset}", "dashboard_asset"),
)


_PATH_REGEX = re.compile(r"{(\w+):[^}]*}")
_ENDPOINTS = tuple(method.upper() + " " + _PATH_REGEX.sub(r"{\1}", path)
                   for method, path, _ in _ROUTES if path.startswith("/api"))


def mount(app: faust.App, runtime: RuntimeService[Deps], *, api_token: str | None) -> Api:
    """Add the API, /health and the dashboard to ``app``'s web server. Call before the
    app starts, on an app built with `faust_settings()`."""
    config = runtime.config
    dead_letters = queries.DeadLetterDepths(
        bootstrap=config.bootstrap, group=config.app_id, ttl=DLQ_CACHE_SECONDS,
        topics={key: route.dlq_topic for key, route in config.routes.items()
                if route.dlq_topic})
    api = Api(runtime, api_token=api_token, dead_letters=dead_letters)
    for method, path, name in _ROUTES:
        app.page(path, name=f"stovepipe.{name}.{method}.{path}")(
            _view(method, getattr(api, name)))
    return api


def _view(method: str, handler: Callable[..., Awaitable[web.StreamResponse]]) -> type[View]:
    """A Faust view answering ``method`` with ``handler(request, **path_parameters)``."""

    async def answer(view: View, request: Any, **match: str) -> web.StreamResponse:
        return await handler(request, **match)

    return type(f"stovepipe_{handler.__name__}", (View,), {method: answer})
