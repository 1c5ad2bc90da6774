"""A queue's history as the dashboard draws it (issue 18, Deliver 6): its last heads and
built commits — heads, superseded ones included, validations again and backfills — in
history order, newest first, each with what a person recognises it by (subject, author),
how it ended, a link to its build and its time to signal (ingest → fact).

Order is the Requests' total order, request_rank (design §4, migration 0010): a backfilled
commit `…/<n>~<p>` sorts after the head `…/<n>` it follows and before the next head; a
commit validated again `…/<n>.<k>` next to its first validation. One indexed read finds
the Requests, one read each their facts, their latest builds and their commits'
descriptions.

Descriptions come from the commit_info table. Commits it does not describe yet (heads
are described only when something asks) are described by the queue's repository and
remembered there — in the background: the read waits at most `DESCRIBE_DEADLINE` for the
repository and then answers without them, so a slow repository never fails or stalls
the page; the next read finds them remembered. One description runs per queue at a time;
a commit the repository does not describe is not asked about again for
`UNDESCRIBED_RETRY` seconds, nor any of a description the repository failed to answer for
`FAILED_RETRY`.

Build links: a command runner's build links to its log (`GET
/api/builds/{queue}/{build_id}/log`); a hosted runner's to the provider's page when the
runner says where it is (`build_url(build_id)`: Buildkite, GitHub Actions); other
runners' builds have none.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import quote

from store import Build, Database, Request, RequestState, ValidationFact, Verdict, request_order
from store.culprits import CommitRecord, CulpritSearch
from streams.extensions.sourcecontrol import CommitInfo, SourceControlError
from streams.web.queries import queue_state

if TYPE_CHECKING:
    from streams.stages.deps import Deps

log = logging.getLogger("stovepipe.http.history")

DEFAULT_LIMIT = 30
MAX_LIMIT = 200
# seconds a read waits for the repository to describe commits before it answers without
# them; well inside the API's READ_DEADLINE (5 s) with the database reads around it
DESCRIBE_DEADLINE = 1.5
# seconds before a commit the repository did not describe is asked about again; after
# the repository failed to answer at all
UNDESCRIBED_RETRY = 300.0
FAILED_RETRY = 30.0


class Outcome(StrEnum):
    """What a history cell says, by colour and by word."""

    GREEN = "green"  # a green fact
    RED = "red"  # a red verdict
    UNVALIDATED = "unvalidated"  # failed without a verdict: could not validate, not red
    SUPERSEDED = "superseded"  # a newer head came first: never built
    RUNNING = "running"  # admitted: its build is running (or being started)
    WAITING = "waiting"  # accepted, waiting for a slot
    CANCELLED = "cancelled"  # stopped by a person or the pipeline, no verdict


def outcome_of(request: Request) -> Outcome:
    match request.state:
        case RequestState.SUCCEEDED:
            return Outcome.GREEN
        case RequestState.FAILED:
            return Outcome.RED if request.verdict is Verdict.RED else Outcome.UNVALIDATED
        case RequestState.SUPERSEDED:
            return Outcome.SUPERSEDED
        case RequestState.PROCESSING:
            return Outcome.RUNNING
        case RequestState.ACCEPTED:
            return Outcome.WAITING
        case RequestState.CANCELLED:
            return Outcome.CANCELLED
    raise AssertionError(f"unknown request state {request.state!r}")


class DescribesCommits(Protocol):
    """What the history needs of a queue's SourceControl."""

    async def describe(self, uris: Sequence[str]) -> list[CommitInfo]: ...


@runtime_checkable
class BuildPages(Protocol):
    """A build runner that knows where people look at its builds (a hosted CI)."""

    def build_url(self, build_id: str) -> str | None: ...


@dataclass(frozen=True)
class BuildLink:
    id: str
    status: str
    attempt: int
    verdict: str | None
    url: str | None  # None: nowhere to look at it
    url_kind: str | None  # "log" (the command runner's log here) or "provider"


@dataclass(frozen=True)
class HistoryEntry:
    request_id: str
    kind: str  # head, retry or backfill
    state: str
    verdict: str | None
    outcome: Outcome
    reason: str
    uri: str
    sha: str  # the full sha when described, else the URI's last part
    subject: str | None  # None: not described (yet)
    author: str | None
    committed_at: datetime | None
    ingested_at: datetime  # when the Request was made
    fact_at: datetime | None  # when its fact was recorded; None: no fact
    time_to_signal_s: float | None  # ingested_at → fact_at
    flaky: bool  # green on a re-run of a red build
    attempts: int
    build: BuildLink | None  # its latest build
    culprit: bool  # the commit the current red streak's search named
    bookmark: bool  # the queue's last green commit


@dataclass(frozen=True)
class CulpritView:
    """The current red streak's culprit search: None once the branch is green again."""

    state: str  # bisecting, found, fixed, budget_spent, inconclusive, no_range
    red_request_id: str
    red_uri: str
    detail: str
    builds: int  # backfill builds that ran (gave a verdict)
    suspects: int  # commits the culprit is still among
    culprit_uri: str | None
    culprit_request_id: str | None
    sha: str | None
    subject: str | None
    author: str | None
    committed_at: datetime | None
    build: BuildLink | None
    # found: whether the culprit is the break the red head is red for (every commit from
    # it to the head known red), and why not
    confirmed: bool | None = None
    unconfirmed_reason: str | None = None


@dataclass(frozen=True)
class QueueHistory:
    queue: str
    order: str  # always "newest first"
    entries: list[HistoryEntry]
    greenness: str | None  # the newest verdict among the entries: green, red, None
    culprit_search: CulpritView | None
    described: bool  # every commit shown has its subject and author


# --- the read ---------------------------------------------------------------------------


async def queue_history(deps: Deps, queue: str, limit: int,
                        descriptions: CommitDescriptions) -> QueueHistory:
    """The queue's last ``limit`` Requests in history order, newest first. The caller has
    checked the queue is configured; ValueError for a limit out of range."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    db = deps.db
    requests = await db.requests.recent(queue, limit)
    ids = [r.id for r in requests]
    facts = await db.facts.of_requests(queue, ids)
    builds = await db.builds.latest_of_requests(queue, ids)
    row = await queue_state(db, queue)
    bookmark = row.last_green_request_id if row is not None else None
    search = await _current_search(db, queue, bookmark)

    uris = list(dict.fromkeys([r.uri for r in requests]
                              + ([search.culprit_uri] if search and search.culprit_uri else [])))
    described = await descriptions.of(db, queue, uris,
                                      lambda: deps.extensions.source_control(queue))
    link = build_linker(deps, queue)

    entries = [_entry(r, facts.get(r.id), builds.get(r.id), described.get(r.uri), link,
                      culprit=search is not None and r.id == search.culprit_request_id,
                      bookmark=r.id == bookmark)
               for r in requests]
    greenness = next((e.verdict for e in entries if e.verdict is not None), None)
    view = None
    if search is not None:
        culprit_build = None
        if search.culprit_request_id is not None:
            culprit_build = builds.get(search.culprit_request_id) or (
                await db.builds.latest_of_requests(queue, [search.culprit_request_id])
            ).get(search.culprit_request_id)
        commit = described.get(search.culprit_uri) if search.culprit_uri else None
        view = CulpritView(
            state=search.state.value, red_request_id=search.red_request_id,
            red_uri=search.red_uri, detail=search.detail, builds=search.builds,
            suspects=len(search.suspects), culprit_uri=search.culprit_uri,
            culprit_request_id=search.culprit_request_id,
            sha=(commit.sha if commit else _sha_of(search.culprit_uri))
            if search.culprit_uri else None,
            subject=commit.subject if commit else None,
            author=commit.author if commit else None,
            committed_at=commit.committed_at if commit else None,
            build=link(culprit_build) if culprit_build else None,
            confirmed=search.culprit_confirmed if search.culprit_uri else None,
            unconfirmed_reason=search.unconfirmed_why)
    return QueueHistory(queue=queue, order="newest first", entries=entries,
                        greenness=greenness, culprit_search=view,
                        described=all(e.subject is not None for e in entries))


async def _current_search(db: Database, queue: str,
                          bookmark: str | None) -> CulpritSearch | None:
    """The newest culprit search while its red streak lasts: its red commit is newer than
    the bookmark (a green commit after it ended the streak)."""
    search = await db.culprit_searches.newest(queue)
    if search is None:
        return None
    if bookmark is not None and request_order(search.red_request_id) <= request_order(
            bookmark):
        return None
    return search


def _entry(request: Request, fact: ValidationFact | None, build: Build | None,
           commit: CommitRecord | None, link: Callable[[Build], BuildLink],
           *, culprit: bool, bookmark: bool) -> HistoryEntry:
    signal = (fact.created_at - request.created_at).total_seconds() if fact else None
    return HistoryEntry(
        request_id=request.id, kind=request.kind.value, state=request.state.value,
        verdict=request.verdict.value if request.verdict else None,
        outcome=outcome_of(request), reason=request.reason, uri=request.uri,
        sha=commit.sha if commit else _sha_of(request.uri),
        subject=commit.subject if commit else None,
        author=commit.author if commit else None,
        committed_at=commit.committed_at if commit else None,
        ingested_at=request.created_at, fact_at=fact.created_at if fact else None,
        time_to_signal_s=max(signal, 0.0) if signal is not None else None,
        flaky=bool(fact and fact.flaky), attempts=request.attempt,
        build=link(build) if build else None, culprit=culprit, bookmark=bookmark)


_URI_TAIL = re.compile(r"[^@/#]+$")


def _sha_of(uri: str) -> str:
    """A commit's name when nothing describes it: the URI's last part (a sha for the git
    and fake source controls; URIs are otherwise opaque, so this is only for people)."""
    found = _URI_TAIL.search(uri)
    return found.group(0) if found else uri


# --- build links ------------------------------------------------------------------------


def build_log_path(queue: str, build_id: str) -> str:
    """Where the API serves a command runner build's log."""
    return f"/api/builds/{quote(queue, safe='/')}/{quote(build_id, safe='')}/log"


def build_linker(deps: Deps, queue: str) -> Callable[[Build], BuildLink]:
    """How this queue's builds are linked (decided once per read)."""
    url_of: Callable[[str], str | None] = lambda build_id: None  # noqa: E731
    kind: str | None = None
    if getattr(deps.queue_config(queue).build_runner, "kind", None) == "command":
        url_of, kind = (lambda build_id: build_log_path(queue, build_id)), "log"
    else:
        try:
            runner = deps.extensions.build_runner(queue)
        except Exception as exc:  # noqa: BLE001 - a link is a nicety: the page still answers
            log.warning("history_no_build_runner queue=%s error=%r", queue, exc)
            runner = None
        if isinstance(runner, BuildPages):
            url_of, kind = runner.build_url, "provider"

    def link(build: Build) -> BuildLink:
        url = url_of(build.id)
        return BuildLink(id=build.id, status=build.status.value, attempt=build.attempt,
                         verdict=build.verdict.value if build.verdict else None, url=url,
                         url_kind=kind if url else None)

    return link


# --- commit descriptions ----------------------------------------------------------------


class CommitDescriptions:
    """Commits' subjects and authors: the commit_info table's, and the repository's for
    the ones it lacks, remembered there (see the module docstring). One per worker; all
    its calls run on the worker's event loop."""

    def __init__(self, *, deadline: float = DESCRIBE_DEADLINE,
                 undescribed_retry: float = UNDESCRIBED_RETRY,
                 failed_retry: float = FAILED_RETRY) -> None:
        self.deadline = deadline
        self.undescribed_retry = undescribed_retry
        self.failed_retry = failed_retry
        self._running: dict[str, asyncio.Task[None]] = {}  # queue -> its description
        self._ask_again_at: dict[tuple[str, str], float] = {}  # (queue, uri) -> monotonic

    async def of(self, db: Database, queue: str, uris: Sequence[str],
                 source_control: Callable[[], DescribesCommits]) -> dict[str, CommitRecord]:
        """The descriptions of ``uris`` known within the deadline, by URI."""
        known = await db.commit_infos.of(queue, uris)
        now = time.monotonic()
        missing = [u for u in uris if u not in known
                   and self._ask_again_at.get((queue, u), now) <= now]
        if not missing:
            return known
        task = self._running.get(queue)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(
                self._describe(db, queue, missing, source_control),
                name=f"describe-commits-{queue}")
            self._running[queue] = task
        # the description goes on after the deadline (it is never cancelled half-way):
        # the next read finds what it remembered
        done, _ = await asyncio.wait({task}, timeout=self.deadline)
        if task not in done:
            log.info("history_describe_slow queue=%s commits=%d deadline=%s", queue,
                     len(missing), self.deadline)
            return known
        return await db.commit_infos.of(queue, uris)

    async def _describe(self, db: Database, queue: str, uris: Sequence[str],
                        source_control: Callable[[], DescribesCommits]) -> None:
        retry = self.undescribed_retry
        found: set[str] = set()
        try:
            infos = await source_control().describe(uris)
            await db.commit_infos.remember(queue, [_record(queue, i) for i in infos])
            found = {i.uri for i in infos}
        except SourceControlError as exc:
            log.warning("history_describe_failed queue=%s commits=%d error=%r", queue,
                        len(uris), exc)
            retry = self.failed_retry
        except Exception as exc:  # a background task: logged here, or lost
            log.error("history_describe_failed queue=%s commits=%d error=%r", queue,
                      len(uris), exc, exc_info=exc)
            retry = self.failed_retry
        now = time.monotonic()
        for key in [k for k, at in self._ask_again_at.items() if at <= now]:
            del self._ask_again_at[key]  # bounded by the commits still being missed
        for uri in uris:
            if uri not in found:
                self._ask_again_at[(queue, uri)] = now + retry


def _record(queue: str, commit: CommitInfo) -> CommitRecord:
    return CommitRecord(queue=queue, uri=commit.uri, sha=commit.sha, subject=commit.subject,
                        author=commit.author, committed_at=commit.committed_at,
                        parent_uri=commit.parent_uri)
