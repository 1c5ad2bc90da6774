"""Why the bookmark is where it is (issue 18, Deliver 3, 4): the branch's story since its
last green commit, and the culprit of its current red streak, in plain words. The CLI
(`stovepipe explain`, `stovepipe queue`) and the API (`GET /api/queues/{queue}/explain`,
`GET /api/queues/{queue}`) share these reads.

The story, newest first: every Request that sorts after the bookmark's (heads, commits
validated again, backfills: request_rank), then the bookmark's own; and, while a culprit
search is current, the commits of its range after the bookmark that were never built. Each
says its state in words — superseded by which head, waiting for a slot behind which build,
building for how long, red (and the culprit), could not be validated (why) — and at most
`MAX_STORY` entries are told (`cut` says when more were left out).

The current search is the queue's newest culprit search while its red streak lasts: its
red Request sorts after the bookmark (a green commit after it ended the streak).

Words are made by pure functions (`request_words`, `unbuilt_words`, `summary`) from what
the reads found, so they are tested without a database. Times are the database's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from store import (
    Build,
    Database,
    Order,
    Queue,
    Request,
    RequestKind,
    Verdict,
    request_order,
)
from store.culprits import CommitRecord, CulpritSearch
from streams.extensions.sourcecontrol import SourceControl
from streams.stages.culprits import fresh_probe_id
from streams.web.history import BuildPages, build_log_path
from streams.web.queries import PromotionRef, pin_of, promotion_ref, queue_state
from streams.web.story_words import (
    MAX_STORY,
    BuildView,
    CommitView,
    CulpritView,
    Entry,
    Promotion,
    SearchView,
    Story,
    build_words,
    duration,
    moment,
    request_words,
    search_view,
    summary,
    unbuilt_words,
)

if TYPE_CHECKING:
    from streams.stages.deps import Deps



# --- the reads --------------------------------------------------------------------------


class Descriptions(Protocol):
    """Where the commits' descriptions come from: `streams.web.history.CommitDescriptions`
    (the table, and the repository for what it lacks), or `StoredDescriptions`."""

    async def of(self, db: Database, queue: str, uris: Sequence[str],
                 source_control: Callable[[], SourceControl]) -> dict[str, CommitRecord]: ...


class StoredDescriptions:
    """The commit_info table's descriptions only (for a queue the configuration lacks)."""

    async def of(self, db: Database, queue: str, uris: Sequence[str],
                 source_control: Callable[[], SourceControl]) -> dict[str, CommitRecord]:
        return await db.commit_infos.of(queue, uris)


async def current_search(db: Database, queue: str, row: Queue | None) -> CulpritSearch | None:
    """The queue's newest culprit search while its red streak lasts."""
    search = await db.culprit_searches.newest(queue)
    bookmark = row.last_green_request_id if row is not None else None
    if search is None or (bookmark is not None and request_order(search.red_request_id)
                          <= request_order(bookmark)):
        return None
    return search


async def red_since(deps: Deps, queue: str, descriptions: Descriptions,
                    row: Queue | None = None) -> tuple[CulpritView | None, SearchView | None]:
    """The current search in words and, once found, its culprit ("red since C") with its
    build's link: what `stovepipe queue` and `GET /api/queues/{queue}` show."""
    row = row if row is not None else await queue_state(deps.db, queue)
    search = await current_search(deps.db, queue, row)
    if search is None:
        return None, None
    builds = {}
    if search.culprit_request_id is not None:
        builds = await deps.db.builds.latest_of_requests(queue, [search.culprit_request_id])
    commits = await _describe(deps, queue, descriptions,
                              [search.culprit_uri] if search.culprit_uri else [])
    now = await _database_now(deps.db)
    link = _build_urls(deps, queue)
    return (_culprit_view(search, commits, builds, link, now),
            search_view(search, _namer(commits)))


async def explain(deps: Deps, queue: str, descriptions: Descriptions) -> Story:
    """The queue's story since its last green commit. The caller has checked the queue is
    configured."""
    db = deps.db
    row = await queue_state(db, queue)
    bookmark_id = row.last_green_request_id if row is not None else None
    newer = await db.requests.newer_than(
        queue, request_order(bookmark_id) if bookmark_id else None, MAX_STORY + 1)
    requests = newer[:MAX_STORY]
    cut = len(newer) > MAX_STORY
    if bookmark_id is not None and not cut:
        requests += (await db.requests.get_many(queue, [bookmark_id])).values()
    search = await current_search(db, queue, row)
    unbuilt = await _unbuilt(db, queue, search, row) if search is not None else []

    ids = [r.id for r in requests]
    facts = await db.facts.of_requests(queue, ids)
    holders = await db.requests.processing(queue)
    builds = await db.builds.latest_of_requests(
        queue, list(dict.fromkeys([*ids, *(h.id for h in holders),
                                   *([search.culprit_request_id]
                                     if search and search.culprit_request_id else [])])))
    latest = None
    if row is not None and row.latest_request_id is not None:
        latest = next((r for r in requests if r.id == row.latest_request_id), None) or (
            await db.requests.get_many(queue, [row.latest_request_id])).get(
                row.latest_request_id)
    uris = [r.uri for r in requests] + [uri for uri, _ in unbuilt] + [
        h.uri for h in holders] + ([search.culprit_uri] if search and search.culprit_uri
                                   else []) + ([latest.uri] if latest else [])
    commits = await _describe(deps, queue, descriptions, list(dict.fromkeys(uris)))
    name = _namer(commits)
    now = await _database_now(db)
    link = _build_urls(deps, queue)
    promotion = await _promotion(deps, queue, row)

    told: list[tuple[Order, Entry]] = []
    heads_newer: Request | None = None
    for request in sorted(requests, key=lambda r: r.order, reverse=True):
        words = request_words(
            request, builds.get(request.id), facts.get(request.id), now=now,
            newer_head=heads_newer, holders=[(h, builds.get(h.id)) for h in holders],
            search=search, name=name)
        if request.id == bookmark_id:
            words = f"{words} — the bookmark (the last green commit)"
            if promotion.uri == request.uri:
                words += f"; the promotion ref {promotion.ref} is here"
        told.append((request.order, _entry(request, words, commits, builds, link, now,
                                           bookmark=request.id == bookmark_id,
                                           search=search)))
        if request.kind is RequestKind.HEAD:
            heads_newer = request
    for (uri, order) in unbuilt:
        assert search is not None
        told.append((order, Entry(
            request_id=None, uri=uri, sha=_sha(commits, uri),
            subject=_field(commits, uri, "subject"), author=_field(commits, uri, "author"),
            kind="commit", state="unbuilt", verdict=None,
            words=unbuilt_words(search, search.commits.index(uri), name),
            build=None, bookmark=False, culprit=False)))
    entries = [entry for _, entry in sorted(told, key=lambda t: t[0], reverse=True)]
    entries = entries[:MAX_STORY]
    cut = cut or len(told) > MAX_STORY

    culprit = _culprit_view(search, commits, builds, link, now) if search else None
    view = search_view(search, name) if search else None
    by_id = {e.request_id: e for e in entries if e.request_id}
    head = by_id.get(latest.id) if latest else None
    if head is None and latest is not None:
        head = _entry(latest, request_words(latest, builds.get(latest.id), None, now=now,
                                            newer_head=None, holders=[], search=search,
                                            name=name),
                      commits, builds, link, now, bookmark=latest.id == bookmark_id,
                      search=search)
    bookmark = by_id.get(bookmark_id) if bookmark_id else None
    if bookmark is None and row is not None and row.last_green_uri and bookmark_id:
        bookmark = Entry(request_id=bookmark_id, uri=row.last_green_uri,
                         sha=_sha(commits, row.last_green_uri),
                         subject=_field(commits, row.last_green_uri, "subject"),
                         author=_field(commits, row.last_green_uri, "author"),
                         kind="", state="succeeded", verdict="green",
                         words="green — the bookmark (the last green commit)", build=None,
                         bookmark=True, culprit=False)
    return Story(queue=queue, bookmark=bookmark, promotion=promotion, head=head,
                 culprit=culprit, search=view,
                 summary=summary(queue, head=head, bookmark=bookmark, search=view,
                                 culprit=culprit, promotion=promotion,
                                 bookmark_name=name(row.last_green_uri)
                                 if row is not None and row.last_green_uri else None,
                                 ingested=row is not None and row.latest_request_id
                                 is not None, cut=cut),
                 story=entries, cut=cut)


async def _unbuilt(db: Database, queue: str, search: CulpritSearch,
                   row: Queue | None) -> list[tuple[str, Order]]:
    """The commits of the search's range after the bookmark that have no Request, each
    with the place it would sort at (after the nearest commit before it that has one)."""
    commits = list(search.commits)
    if not commits:
        return []
    requests = await db.requests.newest_for_commits(queue, commits)
    start = 1
    if row is not None and row.last_green_uri in commits:
        start = commits.index(row.last_green_uri) + 1
    unbuilt = []
    for index in range(start, len(commits)):
        if commits[index] in requests:
            continue
        try:
            at = request_order(fresh_probe_id(queue, commits, requests, index))
        except ValueError:  # the range's green end has no Request: no place to show it
            continue
        unbuilt.append((commits[index], (at[0], at[1], 0)))
    return unbuilt


async def _describe(deps: Deps, queue: str, descriptions: Descriptions,
                    uris: Sequence[str]) -> dict[str, CommitRecord]:
    if not uris:
        return {}
    return await descriptions.of(deps.db, queue, uris,
                                 lambda: deps.extensions.source_control(queue))


async def _database_now(db: Database) -> datetime:
    async with db.pool.connection() as conn:
        cursor = await conn.execute("SELECT now()")
        found = await cursor.fetchone()
    assert found is not None
    now: datetime = found[0]
    return now


async def _promotion(deps: Deps, queue: str, row: Queue | None) -> Promotion:
    pinned = pin_of(row)
    ref: PromotionRef | None = await promotion_ref(deps, queue, pinned)
    if ref is None:
        return Promotion(None, None, True, pinned)
    return Promotion(ref.name, ref.target, ref.target_known, pinned)


def _build_urls(deps: Deps, queue: str) -> Callable[[str], str | None]:
    """Where a build of the queue is looked at: the command runner's log here, a hosted
    runner's page when it says, else nowhere."""
    try:
        if getattr(deps.queue_config(queue).build_runner, "kind", None) == "command":
            return lambda build_id: build_log_path(queue, build_id)
        runner = deps.extensions.build_runner(queue)
    except Exception:  # noqa: BLE001 - a link is a nicety: the story is told without it
        return lambda build_id: None
    if isinstance(runner, BuildPages):
        return runner.build_url
    return lambda build_id: None


def _build_view(build: Build, link: Callable[[str], str | None],
                now: datetime) -> BuildView:
    running = None if build.status.is_terminal else max(
        0.0, (now - build.created_at).total_seconds())
    return BuildView(id=build.id, status=build.status.value, url=link(build.id),
                     attempt=build.attempt, started_at=build.created_at,
                     running_for_s=running)


def _entry(request: Request, words: str, commits: dict[str, CommitRecord],
           builds: dict[str, Build], link: Callable[[str], str | None], now: datetime, *,
           bookmark: bool, search: CulpritSearch | None) -> Entry:
    build = builds.get(request.id)
    return Entry(request_id=request.id, uri=request.uri, sha=_sha(commits, request.uri),
                 subject=_field(commits, request.uri, "subject"),
                 author=_field(commits, request.uri, "author"), kind=request.kind.value,
                 state=request.state.value,
                 verdict=request.verdict.value if request.verdict else None, words=words,
                 build=_build_view(build, link, now) if build else None, bookmark=bookmark,
                 culprit=search is not None and search.culprit_uri == request.uri
                 and request.verdict is Verdict.RED)


def _culprit_view(search: CulpritSearch, commits: dict[str, CommitRecord],
                  builds: dict[str, Build], link: Callable[[str], str | None],
                  now: datetime) -> CulpritView | None:
    if search.culprit_uri is None:
        return None
    uri = search.culprit_uri
    build = builds.get(search.culprit_request_id) if search.culprit_request_id else None
    return CulpritView(uri=uri, sha=_sha(commits, uri), subject=_field(commits, uri, "subject"),
                       author=_field(commits, uri, "author"),
                       committed_at=commits[uri].committed_at if uri in commits else None,
                       request_id=search.culprit_request_id,
                       build=_build_view(build, link, now) if build else None,
                       red_since=search.created_at, found_at=search.ended_at,
                       confirmed=search.culprit_confirmed,
                       unconfirmed_reason=search.unconfirmed_why)


def _sha(commits: dict[str, CommitRecord], uri: str) -> str | None:
    return commits[uri].sha if uri in commits else None


def _field(commits: dict[str, CommitRecord], uri: str, name: str) -> str | None:
    commit = commits.get(uri)
    return getattr(commit, name) if commit is not None else None


def _namer(commits: dict[str, CommitRecord]) -> Callable[[str], str]:
    def name(uri: str) -> str:
        commit = commits.get(uri)
        return CommitView(uri, commit.sha if commit else None,
                          commit.subject if commit else None, None, None).name

    return name


__all__ = [
    "MAX_STORY",
    "BuildView",
    "CommitView",
    "CulpritView",
    "Descriptions",
    "Entry",
    "Promotion",
    "SearchView",
    "StoredDescriptions",
    "Story",
    "build_words",
    "current_search",
    "duration",
    "explain",
    "moment",
    "red_since",
    "request_words",
    "search_view",
    "summary",
    "unbuilt_words",
]
