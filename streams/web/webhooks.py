"""Push webhooks: ``POST /webhooks/github`` and ``POST /webhooks/gitlab`` (design §9).

A verified push to a branch ingests every queue validating that branch of that repository
(`QueuesConfig.watching`), exactly as ``POST /api/queues/{queue}/ingest`` does: the head
is resolved from the repository itself, so deliveries arriving late or out of order
cannot move a queue backwards. A delivery is ingested once by its provider's delivery id:
the same delivery again (a retry, a redelivery, two at once) ingests nothing more.

The answers, each JSON:

- 503 the worker is starting, or the provider's secret is not configured (queues.yaml
  ``webhooks``) or its environment variable is unset: nothing is accepted unverified;
- 413 a body over `MAX_BODY` bytes (25 MB, GitHub's cap on a payload); 401 a missing or
  wrong signature (GitHub) or token (GitLab); 400 an unreadable delivery — in each case
  nothing is ingested;
- 503 with ``Retry-After`` when `WebhookLimits.bodies` bodies of the provider are being
  read already, 408 (and the connection closed) for a body not sent within
  `WebhookLimits.read_timeout` of its headers: nothing is read, or kept, for them;
- 200 a ping (GitHub), or a delivery already ingested (``already_ingested: true`` with
  the Requests it found or minted);
- 202 a verified delivery that asks nothing: another event, a tag, a deleted branch, or
  a branch no queue watches (``ignored`` says which);
- 201 ingested with at least one new Request, 200 ingested finding each head's existing
  Request (``ingested``: queue, request_id, new);
- what ``POST /api/queues/{queue}/ingest`` answers when an ingest fails (503 the broker,
  the database or the repository is unavailable, 422 the ref does not exist, ...): the
  delivery is then not marked ingested, so the provider's retry ingests it.

The delivery id: GitHub's ``X-GitHub-Delivery``; GitLab's ``Idempotency-Key``, else its
``X-Gitlab-Event-UUID`` together with what the hook is about (`pushes.gitlab_delivery_id`:
GitLab shares one UUID among every hook a request fires), else a digest of the body.

What an unauthenticated sender can make a worker hold is bounded (design §6, "Bounded").
No buffer is sized by what the request says: a body is read in chunks into one buffer
that grows with what has arrived (no second copy of it kept), so a sender that declares
25 MB and sends little costs little. GitLab's token is a header, compared before any of
the body is read. GitHub's signature covers the whole body, so a GitHub body is read
before it is authenticated: at most `WebhookLimits.bodies` at once per provider (beyond
that a delivery is turned away at once, not queued, since each waiting connection would
hold aiohttp's read buffer), each within `WebhookLimits.read_timeout` — at most
``bodies`` x 25 MB for senders without the secret, however many or slow they are.
Checking the signature of a large body and parsing it run in a worker thread: hashing
releases the GIL, and the JSON parser, which holds it in stretches, lets the loop run
between them (a 25 MB push held the loop for at most about 80 ms at once, against some
140 ms inline).

Neither the secret nor the signature or token sent appears in an answer or a log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import Counter

from store import DeliveryState, WebhookDelivery, parse_request_id
from store.webhook_deliveries import KEEP_DELIVERIES
from streams.config.queues import QueuesConfig
from streams.config.settings import DEFAULT_WEBHOOK_BODIES, DEFAULT_WEBHOOK_READ_TIMEOUT
from streams.config.webhooks import PROVIDERS, Provider
from streams.runtime.logs import bounded
from streams.runtime.stage import Delivery
from streams.stages.deps import Deps
from streams.stages.ingest import Ingested, ingest_head
from streams.web.errors import ApiError
from streams.web.pushes import (
    BadPayload,
    Body,
    Event,
    Ignored,
    Ping,
    Push,
    delivery_id,
    github_event,
    github_signature_matches,
    gitlab_delivery_id,
    gitlab_event,
    gitlab_token_matches,
)

log = logging.getLogger("stovepipe.webhooks")
T = TypeVar("T")

MAX_BODY = 25 * 1024 * 1024  # GitHub caps payloads at 25 MB (a push: 2,048 commits at most)
READ_CHUNK = 256 * 1024  # bytes read from the socket at a time
OFF_LOOP_ABOVE = 256 * 1024  # bodies larger than this are verified and parsed in a thread
INGEST_DEADLINE = 15.0  # seconds to ingest every queue a push moves (then 503)
CLAIM_WAIT = 15.0  # how long a delivery waits while another with its id is ingesting
CLAIM_POLL = 0.1
STALE_CLAIM = 60.0  # a claim older than this outlived its claimant's deadline: it died

_NAMES: dict[Provider, str] = {"github": "GitHub", "gitlab": "GitLab"}

DELIVERIES = Counter(
    "stovepipe_webhook_deliveries_total",
    "Push webhook deliveries, by provider and what became of them.",
    ["provider", "outcome"],
)


@dataclass(frozen=True)
class WebhookLimits:
    """How much webhook bodies may cost one worker before they are authenticated:
    ``bodies`` read at once per provider, each within ``read_timeout`` seconds of its
    headers (worker ``--webhook-bodies``, ``--webhook-read-timeout``)."""

    bodies: int = DEFAULT_WEBHOOK_BODIES
    read_timeout: float = DEFAULT_WEBHOOK_READ_TIMEOUT


DEFAULT_LIMITS = WebhookLimits()


class Webhooks:
    """The two endpoints. ``pipeline`` returns the worker's delivery (its deps and its
    publisher) or raises a 503 ApiError while the worker is starting."""

    def __init__(self, pipeline: Callable[[], Delivery[Deps]],
                 limits: WebhookLimits = DEFAULT_LIMITS) -> None:
        self.pipeline = pipeline
        self.limits = limits
        self._reading: dict[Provider, int] = dict.fromkeys(PROVIDERS, 0)

    async def github(self, request: web.Request) -> web.Response:
        pipeline = self.pipeline()
        secret = self._secret(pipeline.deps, "github")
        body = await self._read_body(request, "github")
        signature = request.headers.get("X-Hub-Signature-256")
        delivery = request.headers.get("X-GitHub-Delivery")
        if not signature:
            self._reject("github", delivery, "no signature")
            raise _unauthorized("missing the X-Hub-Signature-256 header: give the webhook "
                                "a secret in GitHub (the value of the environment variable "
                                "queues.yaml names)")
        if not await _work(body, lambda: github_signature_matches(secret, body, signature)):
            self._reject("github", delivery, "wrong signature")
            raise _unauthorized("X-Hub-Signature-256 does not match the body signed with the "
                                "configured secret")
        event = await _work(body, lambda: _read(lambda: github_event(
            request.headers.get("X-GitHub-Event", ""), request.headers.get("Content-Type", ""),
            body), "github"))
        return await self._act(pipeline, "github", _read(
            lambda: delivery_id(delivery, body), "github"), event)

    async def gitlab(self, request: web.Request) -> web.Response:
        pipeline = self.pipeline()
        secret = self._secret(pipeline.deps, "gitlab")
        token = request.headers.get("X-Gitlab-Token")
        key = request.headers.get("Idempotency-Key")
        event_uuid = request.headers.get("X-Gitlab-Event-UUID")
        delivery = key or event_uuid  # for the log of a rejected delivery
        if not token:
            self._reject("gitlab", delivery, "no token")
            raise _unauthorized("missing the X-Gitlab-Token header: give the webhook a "
                                "secret token in GitLab (the value of the environment "
                                "variable queues.yaml names)")
        if not gitlab_token_matches(secret, token):
            self._reject("gitlab", delivery, "wrong token")
            raise _unauthorized("X-Gitlab-Token is not the configured secret token")
        body = await self._read_body(request, "gitlab")  # only once the token matches
        event = await _work(body, lambda: _read(lambda: gitlab_event(
            request.headers.get("X-Gitlab-Event", ""), body), "gitlab"))
        return await self._act(pipeline, "gitlab", await _work(body, lambda: _read(
            lambda: gitlab_delivery_id(key, event_uuid, body, event), "gitlab")), event)

    # -- the steps shared by both providers ------------------------------------------------

    def _secret(self, deps: Deps, provider: Provider) -> str:
        config = deps.queues.webhooks
        name = config.secret_env(provider)
        secret = config.secret(provider)
        if secret is None:
            DELIVERIES.labels(provider=provider, outcome="unconfigured").inc()
            what = "secret" if provider == "github" else "secret token"
            field = "secret_env" if provider == "github" else "token_env"
            raise ApiError(503, f"the {provider} webhook is not set up on this worker: "
                                + (f"its {what} variable {name} is unset or empty"
                                   if name else
                                   f"queues.yaml has no webhooks.{provider}.{field}")
                                + "; nothing is accepted unverified")
        return secret

    async def _read_body(self, request: web.Request, provider: Provider) -> Body:
        """The raw body (`_read_raw_body`) if it fits: 413 past `MAX_BODY` (by its declared
        length before anything is read); 503 with Retry-After while `WebhookLimits.bodies`
        of this provider are being read; 408, closing the connection, when it has not
        all arrived within `WebhookLimits.read_timeout` of the headers."""
        if request.content_length is not None and request.content_length > MAX_BODY:
            DELIVERIES.labels(provider=provider, outcome="invalid").inc()
            raise _too_large()
        limits = self.limits
        if self._reading[provider] >= limits.bodies:
            DELIVERIES.labels(provider=provider, outcome="busy").inc()
            log.warning("webhook_busy provider=%s reading=%d", provider,
                        self._reading[provider])
            raise ApiError(503, f"{limits.bodies} {_NAMES[provider]} webhook bodies are "
                                f"being read already; send it again shortly",
                           headers={"Retry-After": f"{math.ceil(limits.read_timeout)}"})
        # no await between the check and the count: a slot is never given twice
        self._reading[provider] += 1
        try:
            async with asyncio.timeout(limits.read_timeout):
                return await _read_raw_body(request, provider)
        except TimeoutError:
            DELIVERIES.labels(provider=provider, outcome="timed_out").inc()
            log.warning("webhook_timed_out provider=%s timeout=%g", provider,
                        limits.read_timeout)
            raise ApiError(408, f"the body was not sent within {limits.read_timeout:g} s "
                                f"of the headers", close=True) from None
        finally:
            self._reading[provider] -= 1

    def _reject(self, provider: Provider, delivery: str | None, reason: str) -> None:
        DELIVERIES.labels(provider=provider, outcome="rejected").inc()
        log.warning("webhook_rejected provider=%s delivery=%s reason=%s", provider,
                    bounded(delivery or "-", 80), reason)

    async def _act(self, pipeline: Delivery[Deps], provider: Provider, delivery: str,
                   event: Event) -> web.Response:
        answer: dict[str, Any] = {"provider": provider, "delivery": delivery}
        if isinstance(event, Ping):
            DELIVERIES.labels(provider=provider, outcome="ping").inc()
            log.info("webhook_ping provider=%s delivery=%s", provider, bounded(delivery))
            return _answer(200, {**answer, "ping": "pong: the signature matches; pushes to "
                                                   "watched branches will be ingested"})
        if isinstance(event, Ignored):
            return self._ignored(provider, answer, event.reason)
        queues = watching(pipeline.deps.queues, event)
        answer.update(repository=event.repository, branch=event.branch)
        if not queues:
            return self._ignored(provider, answer,
                                 f"no queue watches branch {bounded(event.branch, 120)!r} of "
                                 f"{bounded(event.repository, 120)}")
        claim = str(uuid.uuid4())
        done = await _claim(pipeline.deps, provider, delivery, claim)
        if done is not None:
            DELIVERIES.labels(provider=provider, outcome="duplicate").inc()
            log.info("webhook_duplicate provider=%s delivery=%s request_ids=%s", provider,
                     bounded(delivery), ",".join(done.request_ids))
            return _answer(200, {**answer, "already_ingested": True, "ingested": [
                {"queue": parse_request_id(r)[0], "request_id": r} for r in done.request_ids]})
        ingested = await _ingest(pipeline, provider, delivery, claim, event, queues)
        DELIVERIES.labels(provider=provider, outcome="ingested").inc()
        log.info("webhook_ingested provider=%s delivery=%s repository=%s branch=%s "
                 "after=%s request_ids=%s", provider, bounded(delivery),
                 bounded(event.repository), bounded(event.branch), bounded(event.after),
                 ",".join(i.request_id for i in ingested))
        return _answer(201 if any(i.new for i in ingested) else 200, {
            **answer, "already_ingested": False, "ingested": [
                {"queue": i.queue, "request_id": i.request_id, "new": i.new}
                for i in ingested]})

    def _ignored(self, provider: Provider, answer: dict[str, Any],
                 reason: str) -> web.Response:
        DELIVERIES.labels(provider=provider, outcome="ignored").inc()
        log.info("webhook_ignored provider=%s delivery=%s reason=%s", provider,
                 bounded(answer["delivery"]), reason)
        return _answer(202, {**answer, "ignored": reason})


def watching(queues: QueuesConfig, push: Push) -> tuple[str, ...]:
    """The queues ``push`` moves, in file order: those validating its branch of the
    repository it names (`Push.names`: by ``webhook_repository``, else by the path in the
    queue's git URL — under the instance's path prefix too, for a GitLab served under
    one)."""
    return tuple(name for name, queue in queues.queues.items()
                 if queue.source_control.ref == push.branch
                 and (hosted := queue.hosted_repository()) is not None
                 and push.names(hosted))


async def _claim(deps: Deps, provider: Provider, delivery: str,
                 claim: str) -> WebhookDelivery | None:
    """None once ``claim`` holds the delivery; the delivery when it is already ingested.
    While another claimant is ingesting it, waits for that one to finish (ingested) or
    fail (released: claim it then), up to `CLAIM_WAIT`."""
    store = deps.db.webhook_deliveries
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        if await store.claim(provider, delivery, claim, stale_after=STALE_CLAIM,
                             keep=KEEP_DELIVERIES):
            return None
        found = await store.get(provider, delivery)
        if found is not None and found.state is DeliveryState.INGESTED:
            return found
        # ingesting elsewhere, or released between the two statements: look again
        if time.monotonic() > deadline:
            raise ApiError(503, "another delivery with this id is being ingested right now; "
                                "try again shortly")
        await asyncio.sleep(CLAIM_POLL)


async def _ingest(pipeline: Delivery[Deps], provider: Provider, delivery: str, claim: str,
                  push: Push, queues: tuple[str, ...]) -> list[Ingested]:
    """Ingest ``queues`` and mark the delivery ingested; on any failure release the claim
    (so the provider's retry ingests it) and raise."""
    store = pipeline.deps.db.webhook_deliveries
    try:
        async with asyncio.timeout(INGEST_DEADLINE):
            ingested = [await ingest_head(pipeline.deps, queue, pipeline.publish)
                        for queue in queues]
            # every Request is accepted and published: from here a retry must not
            # ingest again, and if this mark is lost the claim goes stale and a retry
            # re-ingests, which finds the same Requests unless the branch moved since
            if not await store.complete(provider, delivery, claim,
                                        [i.request_id for i in ingested]):
                log.warning("webhook_claim_lost provider=%s delivery=%s", provider,
                            bounded(delivery))  # taken over as stale: cannot happen in time
    except BaseException as exc:
        DELIVERIES.labels(provider=provider, outcome="failed").inc()
        log.warning("webhook_ingest_failed provider=%s delivery=%s queues=%s error=%s",
                    provider, bounded(delivery), ",".join(queues),
                    bounded(f"{type(exc).__name__}: {exc}", 300))
        await asyncio.shield(_release(pipeline.deps, provider, delivery, claim))
        raise
    return ingested


async def _release(deps: Deps, provider: Provider, delivery: str, claim: str) -> None:
    try:
        await deps.db.webhook_deliveries.release(provider, delivery, claim)
    except Exception as exc:  # noqa: BLE001 - the claim then goes stale and is taken over
        log.warning("webhook_release_failed provider=%s delivery=%s error=%s", provider,
                    bounded(delivery), bounded(exc, 300))


async def _read_raw_body(request: web.Request, provider: Provider) -> Body:
    """The raw body (the signature covers its exact bytes), read chunk by chunk into one
    buffer that grows with what has arrived — never sized by what the request declares,
    and no second copy of it kept; 413 past `MAX_BODY`."""
    body = bytearray()
    async for chunk in request.content.iter_chunked(READ_CHUNK):
        if len(body) + len(chunk) > MAX_BODY:
            DELIVERIES.labels(provider=provider, outcome="invalid").inc()
            raise _too_large()
        body += chunk
    return body


async def _work(body: Body, work: Callable[[], T]) -> T:
    """``work()`` (over ``body``): in a worker thread when the body is large, so hashing
    or parsing megabytes does not hold the event loop; inline otherwise."""
    if len(body) > OFF_LOOP_ABOVE:
        return await asyncio.to_thread(work)
    return work()


def _read(read: Callable[[], T], provider: Provider) -> T:
    try:
        return read()
    except BadPayload as exc:
        DELIVERIES.labels(provider=provider, outcome="invalid").inc()
        raise ApiError(400, str(exc)) from None


def _too_large() -> ApiError:
    return ApiError(413, f"the body is larger than {MAX_BODY} bytes (25 MB, GitHub's limit "
                         f"for a webhook payload)")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, headers={})  # no bearer challenge: the body is signed


def _answer(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status,
                             dumps=lambda value: json.dumps(value, sort_keys=True))
