"""The worker's HTTP surface (design §9): a JSON API, /health and the dashboard.

`mount()` adds these to the Faust worker's aiohttp web server (next to /metrics):

    POST /api/queues/{queue}/ingest      validate the queue's current head now
    POST /api/queues/{queue}/retry       validate a commit again ({"commit": C}; no body:
                                         the queue's newest head)
    POST /api/queues/{queue}/pin         hold the promotion ref at a green commit
                                         ({"commit": C, "reason": R, "by": B}; with
                                         "project": P, the project's own ref)
    POST /api/queues/{queue}/unpin       let it follow the bookmark again ({"by": B},
                                         and "project": P for a project's)
    GET  /api/queues                     every configured queue at a glance
    GET  /api/queues/{queue}             one queue: bookmark, promotion ref, slots, latest,
                                         its culprit ("red since C", or the search under
                                         way) and its health figures
    GET  /api/queues/{queue}/requests    its recent Requests, newest first (?limit=1..100)
    GET  /api/queues/{queue}/history     its last heads and built commits in history
                                         order, newest first, with subjects, authors,
                                         build links and time to signal (?limit=1..200)
    GET  /api/queues/{queue}/grid        a queue with projects: its last heads by its
                                         projects, each cell the project's answer there,
                                         and each project's bookmark and culprit
                                         (?limit=1..100; streams/web/grid.py)
    GET  /api/queues/{queue}/explain     the branch's story since its last green commit,
                                         newest first, in words (streams/web/story.py)
                                         (?project=P: the story of project P)
    GET  /api/queues/{queue}/health      time to signal, share of time red, red streak,
                                         bookmark lag (commits, time), flakes
    GET  /api/queues/{queue}/greens      green commits in history order after
                                         ?since=COMMIT (?limit=1..1000, then `next`)
    GET  /api/builds/{queue}/{build_id}/log  a command build's log tail (text/plain)
    GET  /api/requests/{request_id}      a Request, its builds (attempts), its own fact and
                                         its commit's answer
    GET  /api/queues/{queue}/green?sha=S is this commit green, and if not, its newest green
                                         ancestor and its oldest green descendant
                                         (&project=P: for project P)
    GET  /api/facts?queue=Q&sha=S        is this commit green? (no fact: not green); the
                                         commit by full sha, unique prefix, or uri=U
                                         (&project=P: for project P, and whether it is
                                         unaffected, inheriting from which commit)
    GET  /api/queues/{queue}/last-green  the newest commit green for every project of
                                         ?projects=a,b with each one's fact (none: the
                                         queue's bookmark); &format=text: the bare sha
    GET  /api/queues/{queue}/projects    each project at the head: green, red, pending,
                                         unvalidated or unaffected, its bookmark, red
                                         streak and culprit
    GET  /api/queues/{queue}/projects/{p}  one project likewise; ?format=text: the bare
                                         sha of its last green commit
    GET  /api/dlq                        dead letters waiting for their reconcilers
    POST /webhooks/github                a GitHub push webhook (streams/web/webhooks.py)
    POST /webhooks/gitlab                a GitLab push webhook
    GET  /health                         200 when started and the database answers
    GET  /livez                          200 unless a delivery made no progress past the
                                         bound (never because Kafka or PostgreSQL is down)
    GET  /readyz                         200 when the API and gate can answer now
    GET  /startupz                       200 once migrations and topics were verified and
                                         the runtime started
    GET  /  and  /dashboard              the dashboard page (streams/web/dashboard/)

Queue names and request ids contain '/'. Both may be written as they are or URL-encoded
(`/api/queues/team%2Fmain`); a queue whose name itself ends in `/requests`, `/green`,
`/ingest`, `/retry`, `/pin` or `/unpin` can only be named encoded.
So can one whose name ends in `/history`, `/grid`, `/explain`, `/health`, `/greens`,
`/last-green` or `/projects`, or in `/projects/<a name>`.

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
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust
from aiohttp import web
from faust.web import View

from streams import __version__
from streams.runtime import liveness
from streams.runtime.stage import Delivery
from streams.runtime.worker import RuntimeService
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_head
from streams.stages.pins import PinNotApplied, PinRefused, pin_promotion, unpin_promotion
from streams.stages.project_pins import pin_project, unpin_project
from streams.stages.revalidate import AlreadyGreen, NeverIngested, validate_again
from streams.web import queries
from streams.web.errors import ApiError
from streams.web.params import (
    pin_fields,
    retry_commit,
)
from streams.web.project_answers import check_projects
from streams.web.reads import Reads
from streams.web.responses import describe, error_answer, error_response, json_answer
from streams.web.webhooks import DEFAULT_LIMITS, WebhookLimits, Webhooks

log = logging.getLogger("stovepipe.http")

INGEST_DEADLINE = 15.0  # an ingest also asks the repository and waits for Kafka's ack
HEALTH_DEADLINE = 2.0
DLQ_CACHE_SECONDS = 5.0
DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
# The page loads only its own script and style and calls only this server.
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                 "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                 "form-action 'none'; frame-ancestors 'none'")


# What one request may make the server hold before a handler runs. aiohttp's parser
# refuses a request line over MAX_LINE bytes, a header over MAX_FIELD (name and value
# together) and more than MAX_HEADERS headers, so a request's head is at most about
# MAX_LINE + MAX_HEADERS x MAX_FIELD (520 KiB): GitHub and GitLab send some 15 headers, a
# browser or a proxy chain a few dozen. Of a body nobody reads yet aiohttp buffers at most
# about 512 KiB (then it stops reading the socket); the handlers read bodies themselves,
# with limits of their own (`streams.web.params`, `streams.web.webhooks`), and none uses
# aiohttp's whole-body readers (``request.read()``, ``.json()``, ``.post()``), which
# CLIENT_MAX_SIZE caps for any that would.
MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 64
CLIENT_MAX_SIZE = 64 * 1024


def faust_settings() -> dict[str, Any]:
    """Settings for the Faust app that serves this API: JSON errors everywhere, the
    request-size bounds above, and none of Faust's table and router pages (Stovepipe has
    no tables)."""
    return {
        "web_application_options": {
            "middlewares": [json_errors],
            "client_max_size": CLIENT_MAX_SIZE,
            "handler_args": {"max_line_size": MAX_LINE, "max_field_size": MAX_FIELD,
                             "max_headers": MAX_HEADERS},
        },
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
            return error_answer(404, f"no such endpoint: {request.method} {request.path}; the "
                               f"API has {', '.join(_ENDPOINTS)}")
        allow = exc.headers.get("Allow")
        return error_answer(exc.status, exc.reason, {"Allow": allow} if allow else None)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - never a traceback in a response
        if isinstance(exc, ApiError) and exc.close:
            return await answer_and_close(request, error_response(exc))
        return error_response(exc)


async def answer_and_close(request: web.Request, answer: web.Response) -> web.Response:
    """Send ``answer`` and close the connection at once. aiohttp would otherwise go on
    reading (and discarding) what is left of the body for up to its lingering time, 10 s,
    so a slow sender would keep its connection that long after being answered."""
    answer.force_close()  # says "Connection: close"
    await answer.prepare(request)
    await answer.write_eof()
    request.protocol.force_close()  # the transport sends what was written, then closes
    return answer


def _is_api(path: str) -> bool:
    return path.startswith(("/api/", "/webhooks/")) or path in (
        "/api", "/health", "/livez", "/readyz", "/startupz")


# --- the API ----------------------------------------------------------------------------


class Api(Reads):
    """The handlers: the writes, the webhooks, /health and the dashboard here, the reads
    in `Reads`; each returns a response or raises (see `error_response`)."""

    def __init__(self, runtime: RuntimeService[Deps], *, api_token: str | None,
                 dead_letters: queries.DeadLetterDepths,
                 webhook_limits: WebhookLimits = DEFAULT_LIMITS) -> None:
        self.runtime = runtime
        self.api_token = api_token or None
        self.dead_letters = dead_letters
        self.webhooks = Webhooks(self._delivery, webhook_limits)
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
        return json_answer({"queue": done.queue, "request_id": done.request_id, "new": done.new},
                     status=201 if done.new else 200)

    async def retry(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        commit = await retry_commit(request)
        delivery = self._delivery()
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await validate_again(delivery.deps, queue, commit, delivery.publish)
        except AlreadyGreen as exc:
            return json_answer({"error": str(exc), "fact": exc.fact}, status=409)
        except NeverIngested as exc:
            raise ApiError(404, str(exc)) from None
        except ValueError as exc:  # not a sha (or, its subclass, not a queue name)
            raise ApiError(400, str(exc)) from None
        log.info("http_retry queue=%s uri=%s request_id=%s new=%s previous_id=%s", queue,
                 done.uri, done.request_id, done.new, done.previous_id)
        return json_answer({"queue": done.queue, "uri": done.uri, "request_id": done.request_id,
                      "new": done.new, "previous_id": done.previous_id},
                     status=201 if done.new else 200)

    async def pin(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        fields = await pin_fields(request, needs_commit=True)
        deps = self._delivery().deps
        if "project" in fields:
            return await self._pin_project(deps, queue, fields)
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await pin_promotion(deps, queue, fields["commit"], by=fields["by"],
                                           reason=fields["reason"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except PinNotApplied as exc:
            # the repository refused the move (502) or did not answer (503): nothing changed
            raise ApiError(503 if exc.retryable else 502, str(exc)) from None
        except ValueError as exc:  # not a sha (or, its subclass, not a queue name)
            raise ApiError(400, str(exc)) from None
        q = done.queue
        log.info("http_pin queue=%s uri=%s by=%s", queue, q.pinned_uri, q.pinned_by)
        return json_answer({"queue": q.name, "pinned_uri": q.pinned_uri,
                      "pinned_request_id": q.pinned_request_id, "pinned_by": q.pinned_by,
                      "pinned_reason": q.pinned_reason, "pinned_at": q.pinned_at,
                      "previous_target": done.previous_target,
                      "last_green_uri": q.last_green_uri})

    async def unpin(self, request: web.Request, queue: str) -> web.Response:
        self._require_token(request)
        fields = await pin_fields(request, needs_commit=False)
        deps = self._delivery().deps
        if "project" in fields:
            return await self._unpin_project(deps, queue, fields)
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await unpin_promotion(deps, queue, by=fields["by"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        log.info("http_unpin queue=%s was=%s by=%s", queue, done.was_pinned, fields["by"])
        return json_answer({"queue": done.queue.name, "was_pinned": done.was_pinned,
                      "target": done.target, "last_green_uri": done.queue.last_green_uri})

    async def _pin_project(self, deps: Deps, queue: str,
                           fields: dict[str, str]) -> web.Response:
        check_projects(deps.queue_config(queue), [fields["project"]])
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await pin_project(deps, queue, fields["project"], fields["commit"],
                                         by=fields["by"], reason=fields["reason"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except PinNotApplied as exc:
            raise ApiError(503 if exc.retryable else 502, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        log.info("http_pin queue=%s project=%s uri=%s by=%s", queue, done.project,
                 done.pinned_uri, fields["by"])
        return json_answer({"queue": done.queue, "project": done.project,
                            "pinned_uri": done.pinned_uri,
                            "pinned_request_id": done.pinned_request_id,
                            "inherited_from": done.inherited_from,
                            "previous_target": done.previous_target,
                            "last_green_uri": done.last_green_uri})

    async def _unpin_project(self, deps: Deps, queue: str,
                             fields: dict[str, str]) -> web.Response:
        check_projects(deps.queue_config(queue), [fields["project"]])
        try:
            async with asyncio.timeout(INGEST_DEADLINE):
                done = await unpin_project(deps, queue, fields["project"], by=fields["by"])
        except PinRefused as exc:
            raise ApiError(409, str(exc)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        log.info("http_unpin queue=%s project=%s was=%s by=%s", queue, done.project,
                 done.was_pinned, fields["by"])
        return json_answer({"queue": done.queue, "project": done.project,
                            "was_pinned": done.was_pinned, "target": done.target,
                            "last_green_uri": done.last_green_uri})

    async def github_webhook(self, request: web.Request) -> web.Response:
        return await self.webhooks.github(request)  # signed, so no bearer token

    async def gitlab_webhook(self, request: web.Request) -> web.Response:
        return await self.webhooks.gitlab(request)  # its secret token, no bearer token

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
                                    if isinstance(exc, TimeoutError) else describe(exc))
        healthy = started and body["database"] == "ok"
        body["status"] = "ok" if healthy else "unavailable"
        body["version"] = __version__
        return json_answer(body, status=200 if healthy else 503)

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: whether this process can make progress (`streams.runtime.liveness`)
        — never whether the broker or the database answers. 503 names the deliveries
        stuck past the bound."""
        delivery = self.runtime.delivery
        stuck = delivery.progress.stuck(liveness.stuck_after()) if delivery else []
        body: dict[str, Any] = {
            "status": "stuck" if stuck else "ok",
            "underway": delivery.progress.underway if delivery else 0,
            "version": __version__,
            "stuck": [{"stage": s.stage, "message": s.what, "for_s": round(s.for_s, 1)}
                      for s in stuck[:20]]}
        return json_answer(body, status=503 if stuck else 200)

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: whether the API and the gate can answer now — the runtime started
        and the database answered within `HEALTH_DEADLINE`."""
        return await self.health(request)

    async def startupz(self, request: web.Request) -> web.Response:
        """Startup: the migrations and topics were verified (the worker checks both
        before it joins its group, and stops when they are not) and the runtime
        started."""
        started = self.runtime.ready.is_set() and self.runtime.delivery is not None
        return json_answer({"status": "ok" if started else "starting",
                            "migrations": "verified", "topics": "verified"},
                           status=200 if started else 503)

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


# --- mounting ---------------------------------------------------------------------------

# Registration order matters where patterns overlap: the `/ingest`, `/retry`, `/requests`
# and `/green` routes are tried before the plain queue route, whose name may contain '/'
# (and so is `/history`); `/projects/{project}` first of all, so that a project may be
# named like one of those suffixes.
_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("get", "/api/queues/{queue:.+}/projects/{project:[^/]+}", "project"),
    ("get", "/api/queues/{queue:.+}/projects", "projects"),
    ("get", "/api/queues/{queue:.+}/last-green", "last_green"),
    ("post", "/api/queues/{queue:.+}/ingest", "ingest"),
    ("post", "/api/queues/{queue:.+}/retry", "retry"),
    ("post", "/api/queues/{queue:.+}/pin", "pin"),
    ("post", "/api/queues/{queue:.+}/unpin", "unpin"),
    ("get", "/api/queues/{queue:.+}/requests", "queue_requests"),
    ("get", "/api/queues/{queue:.+}/history", "queue_history"),
    ("get", "/api/queues/{queue:.+}/grid", "queue_grid"),
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
    ("get", "/livez", "livez"),
    ("get", "/readyz", "readyz"),
    ("get", "/startupz", "startupz"),
    ("get", "/", "dashboard"),
    ("get", "/dashboard", "dashboard"),
    ("get", "/dashboard/{asset}", "dashboard_asset"),
)


_PATH_REGEX = re.compile(r"{(\w+):[^}]*}")
_ENDPOINTS = tuple(method.upper() + " " + _PATH_REGEX.sub(r"{\1}", path)
                   for method, path, _ in _ROUTES if path.startswith("/api"))


def mount(app: faust.App, runtime: RuntimeService[Deps], *, api_token: str | None,
          webhook_limits: WebhookLimits = DEFAULT_LIMITS) -> Api:
    """Add the API, /health and the dashboard to ``app``'s web server. Call before the
    app starts, on an app built with `faust_settings()`."""
    config = runtime.config
    dead_letters = queries.DeadLetterDepths(
        bootstrap=config.bootstrap, group=config.app_id, ttl=DLQ_CACHE_SECONDS,
        topics={key: route.dlq_topic for key, route in config.routes.items()
                if route.dlq_topic})
    api = Api(runtime, api_token=api_token, dead_letters=dead_letters,
              webhook_limits=webhook_limits)
    for method, path, name in _ROUTES:
        app.page(path, name=f"stovepipe.{name}.{method}.{path}")(
            _view(method, getattr(api, name)))
    return api


def _view(method: str, handler: Callable[..., Awaitable[web.StreamResponse]]) -> type[View]:
    """A Faust view answering ``method`` with ``handler(request, **path_parameters)``."""

    async def answer(view: View, request: Any, **match: str) -> web.StreamResponse:
        return await handler(request, **match)

    return type(f"stovepipe_{handler.__name__}", (View,), {method: answer})
