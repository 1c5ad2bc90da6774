"""Commit statuses and transition alerts: the outbox's sender, and the staleness judge
(issue 11).

The pipeline's stages never call GitHub or a webhook: the statement that makes a state
change also writes what it notifies into the `notification` table (`store.steps`). This
task, run by every worker about once a second, (1) judges the staleness of the queues
with ``notify.stale_after`` (one statement: going stale writes its alert), then (2)
claims a batch of due rows (``FOR UPDATE SKIP LOCKED`` and a lease, so workers share the
work and a crashed sender's rows come back after the lease), posts each to its channel
and records the result. A channel's rows are posted one at a time (GitHub asks for no
concurrent requests on one token; channels go on side by side), for at most
`ROUND_LIMIT` per round: rows left then are handed back, due at once. A failure the
notifier classifies as retryable (5xx, 408, 429, a rate limit, a timeout, a refused
connection) is tried again after a capped backoff, or after the service's Retry-After,
forever; any other is given up with its reason on the row. A row whose turn in its
channel's rate budget is not due yet, or whose credential is paused after a rate limit,
is postponed to its turn: not an attempt, not an error. A queue without ``notify`` costs
nothing here; without any, the task reads nothing.

Delivery is once per cause, except in two windows: a sender that dies (or outlives its
lease, `LEASE`, much longer than a request's timeout) after the service accepted a post
and before the row is marked sent posts it again when the row comes back; and a post that
timed out may have reached the service all the same, and is retried. A commit status
posted twice is the same status; an alert is delivered twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

from store import NotFound, split_scope
from store.culprits import SearchState
from store.notifications import Notification, StaleRule
from streams.config.queues import UnknownQueue
from streams.config.settings import load_settings
from streams.extensions.notify import Notice, NotifyError, NotifyPostponed
from streams.extensions.sourcecontrol import commit_sha
from streams.runtime import metrics
from streams.runtime.logs import bounded
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps
from streams.stages.kit import seconds

log = logging.getLogger("stovepipe.notify")

INTERVAL = 1.0  # seconds between two rounds of a worker
BATCH = 50  # rows claimed per round
LEASE = 60.0  # seconds a claimed row is left to its sender
RETRY_BASE, RETRY_CAP = 1.0, 60.0  # backoff after attempt n: base * 2**(n-1), capped
RETRY_AFTER_CAP = 600.0  # the longest a service's Retry-After is honoured
CULPRIT_WAIT = 15.0  # seconds a red alert waits for its culprit search to be opened
# seconds a round posts a channel's rows one after another; then the rest is handed back
# (half the lease: a row is never still posting when its lease runs out and another
# sender claims it)
ROUND_LIMIT = LEASE / 2

Result = Literal["sent", "retried", "given_up", "postponed"]


@dataclass
class NotifyReport:
    went_stale: int = 0
    freshened: int = 0
    results: list[tuple[str, Result]] = field(default_factory=list)  # (key, result)


def backoff(attempts: int, retry_after: float | None = None) -> float:
    if retry_after is not None:
        return min(max(retry_after, RETRY_BASE), RETRY_AFTER_CAP)
    return min(RETRY_BASE * 2 ** max(attempts - 1, 0), RETRY_CAP)


async def send_notifications(deps: Deps, publish: Publisher) -> NotifyReport:
    report = NotifyReport()
    configs = [deps.queues.get(name) for name in deps.queues.names()]
    # a project with alert channels of its own notifies even when its queue does not
    if not any(c.notify is not None for c in (*configs, *deps.queues.scopes.values())):
        return report
    rules = [StaleRule(c.name, seconds(c.notify.stale_after), c.alert_channels)
             for c in configs if c.notify is not None and c.notify.stale_after]
    report.went_stale, report.freshened = await deps.db.notifications.judge_staleness(rules)
    if report.went_stale:
        log.warning("queues_went_stale count=%d", report.went_stale)

    due = await deps.db.notifications.claim_due(BATCH, LEASE)
    public_url = load_settings().public_url
    channels: dict[str, list[Notification]] = {}
    for row in due:
        channels.setdefault(row.channel, []).append(row)
    delivered = await asyncio.gather(*(_deliver_in_turn(deps, rows, public_url)
                                       for rows in channels.values()))
    outcome_of = {row.key: outcome for rows in delivered for row, outcome in rows}
    outcomes = [outcome_of[row.key] for row in due]
    report.results = [(row.key, result) for row, (result, _) in zip(due, outcomes,
                                                                    strict=True)]
    retried = [(row, error) for row, (result, error) in zip(due, outcomes, strict=True)
               if result == "retried"]
    if retried:  # one line per round, however many rows a down service holds back
        log.warning("notifications_retrying count=%d first=%s error=%s", len(retried),
                    bounded(retried[0][0].key), bounded(retried[0][1]))
    return report


async def _deliver_in_turn(deps: Deps, rows: list[Notification], public_url: str | None
                           ) -> list[tuple[Notification, tuple[Result, str]]]:
    """One channel's ``rows``, one at a time, for at most `ROUND_LIMIT`; the rows
    postponed (their budget's turn not due) and those left over are handed back in one
    statement, without counting an attempt."""
    began = time.monotonic()
    outcomes: list[tuple[Notification, tuple[Result, str]]] = []
    postponed: list[tuple[Notification, float]] = []
    for row in rows:
        if time.monotonic() - began >= ROUND_LIMIT:
            postponed.append((row, 0.0))
            outcomes.append((row, ("postponed", "")))
            continue
        try:
            outcomes.append((row, await _deliver(deps, row, public_url)))
        except NotifyPostponed as exc:
            postponed.append((row, exc.delay))
            outcomes.append((row, ("postponed", str(exc))))
    if postponed:
        await deps.db.notifications.postpone(postponed)
    return outcomes


async def _deliver(deps: Deps, row: Notification,
                   public_url: str | None) -> tuple[Result, str]:
    """What became of ``row``, and the error when it was not sent; NotifyPostponed
    when its turn is not due."""
    try:
        notifier = deps.extensions.notifier(row.queue, row.channel)
        culprit = await culprit_details(deps, row, public_url)
        if culprit is None:
            # a red alert whose culprit search is being opened: a second, to say more
            await deps.db.notifications.retry_later(row, 1.0, "waiting for the culprit "
                                                              "search to open")
            return "retried", "waiting for the culprit search to open"
        projects = await red_projects(deps, row)
        await notifier.send(notice_of(row, public_url, {**culprit, **projects}))
    except NotifyPostponed:
        raise
    except UnknownQueue:
        return await _give_up(deps, row, f"queue {row.queue!r} is no longer configured")
    except NotifyError as exc:
        if not exc.retryable:
            return await _give_up(deps, row, str(exc))
        # the service or the network is down: the notice is right, try it again later
        await deps.db.notifications.retry_later(row, backoff(row.attempts, exc.retry_after),
                                                str(exc))
        metrics.NOTIFICATIONS.labels(channel=row.channel, outcome="retried").inc()
        return "retried", str(exc)
    except Exception as exc:  # noqa: BLE001 - unclassified: given up, never a loop
        return await _give_up(deps, row, f"{type(exc).__name__}: {exc}")
    await deps.db.notifications.mark_sent(row)
    metrics.NOTIFICATIONS.labels(channel=row.channel, outcome="sent").inc()
    log.info("notification_sent key=%s attempts=%d", bounded(row.key), row.attempts)
    return "sent", ""


async def _give_up(deps: Deps, row: Notification, reason: str) -> tuple[Result, str]:
    await deps.db.notifications.give_up(row, reason)
    metrics.NOTIFICATIONS.labels(channel=row.channel, outcome="given_up").inc()
    log.error("notification_given_up key=%s attempts=%d error=%s", bounded(row.key),
              row.attempts, bounded(reason))
    return "given_up", reason


def request_link(public_url: str | None, request_id: str | None) -> str | None:
    """Where a person reads about the Request: its view on the dashboard."""
    if public_url is None:
        return None
    if request_id is None:
        return f"{public_url}/"
    return f"{public_url}/#request={quote(request_id, safe='/')}"


async def culprit_details(deps: Deps, row: Notification,
                          public_url: str | None) -> dict[str, Any] | None:
    """What a red alert or a culprit alert says about the culprit: ``culprit`` (sha,
    subject, author, time, the Request and its link, whether it is confirmed as the
    break the head is red for and why not) when the search named it,
    ``bisecting`` (commits left, builds spent) while it looks, nothing otherwise. None
    asks to wait: a red alert of a queue that finds culprits, sent before its search was
    opened (the record that wrote it opens the search next), is held for a few
    seconds."""
    event = row.event
    if event.get("kind") != "alert" or event.get("event") not in ("red", "culprit"):
        return {}
    red_id = event.get("red_request_id") or event.get("request_id")
    if not red_id:
        return {}
    try:
        search = await deps.db.culprit_searches.get(row.queue, str(red_id))
    except NotFound:
        try:
            config = deps.queue_config(row.queue)
            # a queue with projects finds no culprit of its own: each project does
            finds = config.backfill.enabled and not config.projects
        except UnknownQueue:
            finds = False
        young = (datetime.now(UTC) - row.created_at).total_seconds() < CULPRIT_WAIT
        return None if finds and young and event.get("event") == "red" else {}
    if search.state is SearchState.BISECTING:
        return {"bisecting": {"commits": len(search.suspects),
                              "builds": search.builds}}
    if search.culprit_uri is None:
        return {"search": {"state": search.state.value, "detail": search.detail}}
    described = await deps.db.commit_infos.of(row.queue, [search.culprit_uri])
    info = described.get(search.culprit_uri)
    ended = search.ended_at or search.updated_at
    return {"culprit": {
        "uri": search.culprit_uri, "sha": commit_sha(search.culprit_uri),
        "subject": info.subject if info else None, "author": info.author if info else None,
        "committed_at": info.committed_at.isoformat() if info and info.committed_at else None,
        "request_id": search.culprit_request_id,
        "link": request_link(public_url, search.culprit_request_id),
        "builds": search.builds, "found_at": ended.isoformat(),
        "found_after_s": round((ended - search.created_at).total_seconds(), 1),
        "confirmed": search.culprit_confirmed,
        "unconfirmed_reason": search.unconfirmed_why}}


async def red_projects(deps: Deps, row: Notification) -> dict[str, Any]:
    """What a red alert of a queue with projects adds: ``red_projects``, its blocking
    projects red at the red head (built or inherited; each project's own alert names its
    culprit)."""
    event = row.event
    if event.get("kind") != "alert" or event.get("event") != "red" \
            or not event.get("request_id"):
        return {}
    try:
        blocking = deps.queue_config(row.queue).blocking_projects
    except UnknownQueue:
        return {}
    if not blocking:
        return {}
    answers = await deps.db.projects.answers(row.queue, str(event["request_id"]))
    return {"red_projects": sorted(p for p, a in answers.items()
                                   if p in blocking and not a.is_green)}


def notice_of(row: Notification, public_url: str | None,
              culprit: dict[str, Any] | None = None) -> Notice:
    event: dict[str, Any] = row.event
    kind = event.get("kind")
    if kind not in ("status", "alert"):
        raise NotifyError(f"unknown notification kind {kind!r}")
    uri = event.get("uri")
    request_id = event.get("request_id")
    details = {k: event[k] for k in ("description", "latest_request_id", "behind_since")
               if event.get(k) is not None}
    if event.get("flaky"):  # green on a re-run of a red build: say so, with the attempts
        details.update(flaky=True, attempts=event.get("attempts"))
    if event.get("red_since"):
        details["red_since"] = event["red_since"]
    if event.get("inherited_from"):  # an unaffected project's status: where its answer is from
        source = str(event["inherited_from"])
        details.update(inherited_from=commit_sha(source) or source, inherited_from_uri=source)
    details.update(culprit or {})
    queue, project = split_scope(row.queue)
    return Notice(kind=kind, event=str(event["state" if kind == "status" else "event"]),
                  queue=queue, project=project, request_id=request_id, uri=uri,
                  sha=commit_sha(uri) if uri else None, at=str(event.get("at", "")),
                  link=request_link(public_url, request_id),
                  previous=event.get("previous"), details=details)
