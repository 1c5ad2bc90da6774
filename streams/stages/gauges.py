"""The queues' health figures (issue 11; issue 18, Deliver 5), as Prometheus gauges
refreshed by every worker on a timer and, through `queue_health`, in the API.

Per queue:

- **time to signal** — ingest to fact (a Request's creation to its fact's) of the heads and
  commits validated again whose facts were recorded in the last `SIGNAL_WINDOW` seconds:
  p50 and p90 (`percentile`, interpolated as PostgreSQL's percentile_cont);
- **share of time red** over the last `RED_WINDOW` seconds, from the greenness changes the
  record stage writes (`red_share`: of the time the greenness was known), and the current
  red streak's duration;
- **how far the bookmark lags the head**: in git commits — the first-parent commits from
  the bookmarked commit to the newest head, counted by the repository up to
  `LAG_COMMITS_LIMIT` ("more than" beyond), once per (bookmark, head) pair — and in time,
  since the first head ingested after the bookmark's Request;
- **flakes**: facts green on a re-run of a red build, in the window and in total.

Every read is a range of an index (validation_fact_recent, greenness_change's primary
key) or a key lookup, except the total of flakes' settled part, counted once a day per
process (`_flakes`).

`stovepipe_bookmark_age_seconds` and `stovepipe_commits_since_green` (heads, not commits)
come from one query over every configured queue, every round; so do, per queue with
projects and labelled {queue, project}, each project's greenness, red streak, heads since
its last green answer and that answer's age (`store.project_views`: a few index probes
per project); the rest is refreshed at most every `HEALTH_INTERVAL` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from prometheus_client import Gauge

from store import NotFound, make_request_id, request_seq
from store.project_views import ProjectStanding
from streams.extensions.sourcecontrol import (
    CommitNotFound,
    NotOnFirstParent,
    SourceControlError,
    TooManyCommits,
)
from streams.runtime import metrics
from streams.runtime.classify import is_outage
from streams.runtime.stage import Publisher
from streams.stages.deps import Deps

log = logging.getLogger("stovepipe.gauges")

SIGNAL_WINDOW = 24 * 3600.0  # seconds of facts the time to signal and recent flakes cover
SIGNAL_SAMPLES = 10_000  # facts at most in one window's percentiles (the newest)
RED_WINDOW = 7 * 24 * 3600.0  # seconds the share of time red covers
LAG_COMMITS_LIMIT = 1000  # first-parent commits counted at most between bookmark and head
# seconds the repository may take to count them: in the API, well inside its 5 s read
# deadline; in the gauges' own round, longer (the count is then kept for the pair)
LAG_DEADLINE_API = 2.0
LAG_DEADLINE_GAUGES = 10.0
# (0: only a count already made; a list of every queue must not wait for each repository)
HEALTH_INTERVAL = 30.0  # seconds between two refreshes of the health gauges in a worker
FLAKE_BASE_MARGIN = 3600.0  # seconds: far longer than a transaction lives
FLAKE_BASE_MAX_AGE = 24 * 3600.0  # seconds before the settled part is counted again


# --- the figures' arithmetic ------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, interpolated linearly between the two
    nearest ranks (PostgreSQL's percentile_cont); None for no values."""
    if not 0 <= q <= 1:
        raise ValueError(f"a quantile lies in [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def red_share(window_s: float, before: str | None,
              changes: Sequence[tuple[float, str]]) -> tuple[float, float]:
    """(seconds red, seconds known) of a window of ``window_s`` seconds in which the
    greenness was ``before`` at its start (None: not known yet) and changed at the
    ``changes`` (seconds after the start, oldest first). Time before the greenness was
    first known counts as neither."""
    red = known = 0.0
    current, since = before, 0.0
    for offset, greenness in changes:
        at = min(max(offset, since), window_s)
        if current is not None:
            known += at - since
            red += (at - since) if current == "red" else 0.0
        current, since = greenness, at
    if current is not None:
        known += window_s - since
        red += (window_s - since) if current == "red" else 0.0
    return red, known


# --- the figures of one queue -----------------------------------------------------------


@dataclass(frozen=True)
class TimeToSignal:
    window_s: float
    facts: int  # facts of heads and commits validated again in the window
    p50_s: float | None  # None: no fact in the window
    p90_s: float | None


@dataclass(frozen=True)
class Redness:
    window_s: float
    share: float | None  # of the time the greenness was known; None: never known
    red_s: float
    known_s: float
    streak_s: float | None  # the current red streak's length; None: not red
    red_since: datetime | None


@dataclass(frozen=True)
class BookmarkLag:
    commits: int | None  # first-parent commits from the bookmark to the head; None: unknown
    commits_more_than: bool  # True: more than `commits` (the count stopped there)
    commits_note: str | None  # why the count is unknown, when it is
    seconds: float | None  # since the first head after the bookmark; 0: at the head
    behind_since: datetime | None


@dataclass(frozen=True)
class Flakes:
    window_s: float
    in_window: int
    total: int


@dataclass(frozen=True)
class QueueHealth:
    queue: str
    time_to_signal: TimeToSignal
    red: Redness
    bookmark_lag: BookmarkLag
    flakes: Flakes


async def queue_health(deps: Deps, queue: str, *,
                       lag_deadline: float = LAG_DEADLINE_API) -> QueueHealth:
    """The health figures of ``queue`` (a queue with no state yet has empty ones)."""
    db = deps.db
    signals = await db.facts.signal_times(queue, SIGNAL_WINDOW, SIGNAL_SAMPLES)
    window = await db.notifications.greenness_window(queue, RED_WINDOW)
    red_s, known_s = red_share(RED_WINDOW, window.before, window.changes)
    streak = await db.notifications.red_streak(queue)
    return QueueHealth(
        queue=queue,
        time_to_signal=TimeToSignal(SIGNAL_WINDOW, len(signals), percentile(signals, 0.5),
                                    percentile(signals, 0.9)),
        red=Redness(RED_WINDOW, red_s / known_s if known_s > 0 else None, red_s, known_s,
                    streak[1] if streak else None, streak[0] if streak else None),
        bookmark_lag=await _bookmark_lag(deps, queue, lag_deadline),
        flakes=await _flakes(deps, queue))


async def _bookmark_lag(deps: Deps, queue: str, deadline: float) -> BookmarkLag:
    try:
        row = await deps.db.queues.get(queue)
    except NotFound:
        return BookmarkLag(None, False, "nothing was ingested yet", None, None)
    bookmark, latest = row.last_green_request_id, row.latest_request_id
    if latest is None:
        return BookmarkLag(None, False, "nothing was ingested yet", None, None)
    if bookmark is not None and request_seq(bookmark) >= request_seq(latest):
        return BookmarkLag(0, False, None, 0.0, None)
    first_after = make_request_id(queue, request_seq(bookmark) + 1 if bookmark else 1)
    behind = await deps.db.requests.ingested_at(queue, first_after)
    head = await deps.db.requests.get(queue, latest)
    counted: tuple[int | None, bool, str | None] = (None, False, "the queue has no green "
                                                                 "commit yet")
    if row.last_green_uri is not None:
        counted = await _commits_behind(deps, queue, row.last_green_uri, head.uri, deadline)
    return BookmarkLag(*counted, behind[1] if behind else None,
                       behind[0] if behind else None)


# one count per queue, for the (bookmark, head) pair it was counted for
_lag_counts: dict[str, tuple[tuple[str, str], tuple[int | None, bool, str | None]]] = {}


async def _commits_behind(deps: Deps, queue: str, bookmark_uri: str, head_uri: str,
                          deadline: float) -> tuple[int | None, bool, str | None]:
    """(commits, more than that, why unknown) from the bookmark to the head: asked of the
    repository once per pair (commits never change under a pair of URIs)."""
    pair = (bookmark_uri, head_uri)
    cached = _lag_counts.get(queue)
    if cached is not None and cached[0] == pair:
        return cached[1]
    if deadline <= 0:
        return None, False, "not counted yet (the workers count it on their timer)"
    source_control = deps.extensions.source_control(queue)
    try:
        async with asyncio.timeout(deadline):
            try:
                between = await source_control.commits_between(
                    bookmark_uri, head_uri, limit=LAG_COMMITS_LIMIT)
                counted: tuple[int | None, bool, str | None] = (len(between), False, None)
            except TooManyCommits:
                # more than the limit since the bookmark — if it is in the head's history
                # at all: past the limit the walk cannot tell, ancestry can
                counted = ((LAG_COMMITS_LIMIT, True, None)
                           if await source_control.is_ancestor(bookmark_uri, head_uri)
                           else (None, False, REWRITTEN))
            except NotOnFirstParent:
                counted = (None, False, MERGED_IN if await source_control.is_ancestor(
                    bookmark_uri, head_uri) else REWRITTEN)
            except CommitNotFound as exc:
                counted = (None, False, f"the repository does not have it: {exc}")
    except TimeoutError:
        return None, False, f"the repository did not count them within {deadline:g} s"
    except SourceControlError as exc:
        return None, False, f"the repository did not answer: {exc}"
    _lag_counts[queue] = (pair, counted)
    return counted


REWRITTEN = "the bookmarked commit is not in the head's history (the branch was rewritten)"
MERGED_IN = ("the bookmarked commit came into the head's history through a merge, not on its "
             "first-parent history: its commits are not counted")

# per queue: (a time, the flaky facts recorded before it), see `FactStore.flaky_before`
_flake_bases: dict[str, tuple[datetime, int]] = {}


async def _flakes(deps: Deps, queue: str) -> Flakes:
    """Flaky facts in the window and in total: the total's settled part (before a cutoff
    an hour or more ago) is counted once a day, the rest on the recent-facts index."""
    base = _flake_bases.get(queue)
    if base is not None:
        recent, since, now = await deps.db.facts.flaky_counts(queue, SIGNAL_WINDOW, base[0])
        if (now - base[0]).total_seconds() <= FLAKE_BASE_MAX_AGE:
            return Flakes(SIGNAL_WINDOW, recent, base[1] + since)
    base = _flake_bases[queue] = await deps.db.facts.flaky_before(queue, FLAKE_BASE_MARGIN)
    recent, since, _ = await deps.db.facts.flaky_counts(queue, SIGNAL_WINDOW, base[0])
    return Flakes(SIGNAL_WINDOW, recent, base[1] + since)


# --- the gauges -------------------------------------------------------------------------

_health_refreshed_at: float | None = None


async def refresh_gauges(deps: Deps, publish: Publisher) -> None:
    names = deps.queues.names()
    for lag in await deps.db.notifications.lags(names):
        if lag.bookmark_age is None:  # never green: no age to show
            with contextlib.suppress(KeyError):
                metrics.BOOKMARK_AGE.remove(lag.queue)
        else:
            metrics.BOOKMARK_AGE.labels(queue=lag.queue).set(lag.bookmark_age)
        metrics.COMMITS_SINCE_GREEN.labels(queue=lag.queue).set(lag.heads_since_green)
    for name in names:
        projects = deps.queues.get(name).projects
        if projects:
            set_project_gauges(name, await deps.db.project_views.standings(name,
                                                                          list(projects)))
    global _health_refreshed_at
    now = time.monotonic()
    if _health_refreshed_at is not None and now - _health_refreshed_at < HEALTH_INTERVAL:
        return
    _health_refreshed_at = now
    for name in names:
        try:
            health = await queue_health(deps, name, lag_deadline=LAG_DEADLINE_GAUGES)
        except Exception as exc:
            if is_outage(exc):
                raise  # the round waits for the database like any other
            # one queue's figures never keep the others' from being refreshed
            log.error("health_gauges_failed queue=%s error=%r", name, exc)
            continue
        set_health_gauges(health)


def set_health_gauges(health: QueueHealth) -> None:
    queue = health.queue
    signal = health.time_to_signal
    for quantile, value in (("0.5", signal.p50_s), ("0.9", signal.p90_s)):
        _set_or_clear(metrics.TIME_TO_SIGNAL, value, queue=queue, quantile=quantile)
    _set_or_clear(metrics.RED_SHARE, health.red.share, queue=queue)
    metrics.RED_STREAK.labels(queue=queue).set(health.red.streak_s or 0.0)
    lag = health.bookmark_lag
    _set_or_clear(metrics.BOOKMARK_LAG_COMMITS,
                  float(lag.commits) if lag.commits is not None else None, queue=queue)
    _set_or_clear(metrics.BOOKMARK_LAG_SECONDS, lag.seconds, queue=queue)
    metrics.FLAKES.labels(queue=queue, window="24h").set(health.flakes.in_window)
    metrics.FLAKES.labels(queue=queue, window="total").set(health.flakes.total)


def set_project_gauges(queue: str, standings: Mapping[str, ProjectStanding]) -> None:
    """Each project's greenness, red streak and bookmark, labelled {queue, project}."""
    for project, standing in standings.items():
        labels = {"queue": queue, "project": project}
        green = None if standing.greenness is None else float(standing.greenness == "green")
        _set_or_clear(metrics.PROJECT_GREEN, green, **labels)
        streak = None if standing.greenness is None else (standing.red_streak_s or 0.0)
        _set_or_clear(metrics.PROJECT_RED_STREAK, streak, **labels)
        metrics.PROJECT_HEADS_SINCE_GREEN.labels(**labels).set(standing.heads_since_green)
        _set_or_clear(metrics.PROJECT_BOOKMARK_AGE, standing.last_green_age_s, **labels)


def _set_or_clear(gauge: Gauge, value: float | None, **labels: str) -> None:
    """Set the sample, or remove it while there is no value (rather than show a 0)."""
    if value is None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels.values())
    else:
        gauge.labels(**labels).set(value)
