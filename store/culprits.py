"""Culprit searches and what commits are (migration 0010; design §5, "backfill").

`CulpritSearchStore` keeps one search per red streak of a queue: the first-parent range
from the last green commit to the red one, the bisection's bounds, the backfill Requests
it started and how it ended. Every change is a compare-and-set on `version`; an ended
search is final (the database refuses to change it).

`CommitInfoStore` keeps what a person recognises a commit by (subject, author, time),
written once per commit and read by the API, the CLI and the alerts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from store._base import Row, Store


class SearchState(StrEnum):
    BISECTING = "bisecting"
    FOUND = "found"  # the culprit is named
    FIXED = "fixed"  # the branch went green again before the culprit was found
    BUDGET_SPENT = "budget_spent"  # backfill.max_builds spent; the range is narrowed
    INCONCLUSIVE = "inconclusive"  # every commit left could not be validated
    NO_RANGE = "no_range"  # no green commit on the first-parent history to search from

    @property
    def ended(self) -> bool:
        return self is not SearchState.BISECTING


@dataclass(frozen=True, slots=True)
class CulpritSearch:
    """``commits[0]`` is the green end (None when the search has no range), the last one
    the red commit that opened it; the culprit lies in ``commits[lo + 1 .. hi]``."""

    queue: str
    red_request_id: str
    red_uri: str
    green_request_id: str | None
    green_uri: str | None
    commits: tuple[str, ...]
    lo: int
    hi: int
    skipped: tuple[int, ...]
    probes: tuple[str, ...]
    builds: int
    max_builds: int
    state: SearchState
    detail: str
    culprit_uri: str | None
    culprit_request_id: str | None
    created_at: datetime
    updated_at: datetime
    ended_at: datetime | None
    version: int

    @property
    def suspects(self) -> tuple[str, ...]:
        """The commits the culprit is among now (oldest first)."""
        return self.commits[self.lo + 1:self.hi + 1]

    @property
    def unbuilt_between(self) -> int:
        """Commits strictly between the green end and the red commit."""
        return max(len(self.commits) - 2, 0)


_COLUMNS = (
    "queue, red_request_id, red_uri, green_request_id, green_uri, commits, lo, hi, skipped,"
    " probes, builds, max_builds, state, detail, culprit_uri, culprit_request_id,"
    " created_at, updated_at, ended_at, version"
)
_VERSION = ("SELECT version FROM culprit_search"
            " WHERE queue = %(queue)s AND red_request_id = %(red_request_id)s")


def _search(row: Row) -> CulpritSearch:
    fields: dict[str, Any] = dict(row)
    fields["commits"] = tuple(row["commits"])
    fields["skipped"] = tuple(row["skipped"])
    fields["probes"] = tuple(row["probes"])
    fields["state"] = SearchState(row["state"])
    return CulpritSearch(**fields)


class CulpritSearchStore(Store):
    entity = "culprit_search"

    async def open(self, queue: str, red_request_id: str, red_uri: str, *,
                   green_request_id: str | None, green_uri: str | None,
                   commits: Sequence[str], max_builds: int,
                   state: SearchState = SearchState.BISECTING, detail: str = "",
                   culprit_uri: str | None = None,
                   culprit_request_id: str | None = None) -> tuple[CulpritSearch, bool]:
        """The search the red verdict of ``red_request_id`` opened — this one, or the one
        an earlier delivery opened (then False)."""
        params = {"queue": queue, "red_request_id": red_request_id, "red_uri": red_uri,
                  "green_request_id": green_request_id, "green_uri": green_uri,
                  "commits": list(commits), "hi": max(len(commits) - 1, 0),
                  "max_builds": max_builds, "state": state.value, "detail": detail,
                  "culprit_uri": culprit_uri, "culprit_request_id": culprit_request_id}
        key = {"queue": queue, "red_request_id": red_request_id}
        row = await self._fetch_one(
            "INSERT INTO culprit_search (queue, red_request_id, red_uri, green_request_id,"
            " green_uri, commits, lo, hi, max_builds, state, detail, culprit_uri,"
            " culprit_request_id, ended_at)"
            " VALUES (%(queue)s, %(red_request_id)s, %(red_uri)s, %(green_request_id)s,"
            " %(green_uri)s, %(commits)s, 0, %(hi)s, %(max_builds)s, %(state)s, %(detail)s,"
            " %(culprit_uri)s, %(culprit_request_id)s,"
            " CASE WHEN %(state)s = 'bisecting' THEN NULL ELSE now() END)"
            f" ON CONFLICT (queue, red_request_id) DO NOTHING RETURNING {_COLUMNS}",
            params, key=key)
        if row is not None:
            return _search(row), True
        return await self.get(queue, red_request_id), False

    async def get(self, queue: str, red_request_id: str) -> CulpritSearch:
        key = {"queue": queue, "red_request_id": red_request_id}
        return _search(await self._get_row(
            f"SELECT {_COLUMNS} FROM culprit_search"
            " WHERE queue = %(queue)s AND red_request_id = %(red_request_id)s", key, key=key))

    async def newest(self, queue: str) -> CulpritSearch | None:
        """The queue's search of its newest red streak (by the red Request's order)."""
        found = await self.of_queue(queue, 1)
        return found[0] if found else None

    async def of_queue(self, queue: str, limit: int) -> list[CulpritSearch]:
        """The queue's searches, newest red streak first."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM culprit_search WHERE queue = %(queue)s"
            " ORDER BY request_rank(red_request_id) DESC LIMIT %(limit)s",
            {"queue": queue, "limit": limit}, key={"queue": queue})
        return [_search(row) for row in rows]

    async def of_probe(self, queue: str, request_id: str) -> CulpritSearch | None:
        """The search that started the backfill Request ``request_id`` (None: none)."""
        row = await self._fetch_one(
            f"SELECT {_COLUMNS} FROM culprit_search WHERE queue = %(queue)s"
            " AND %(request_id)s = ANY(probes)"
            " ORDER BY request_rank(red_request_id) DESC LIMIT 1",
            {"queue": queue, "request_id": request_id}, key={"queue": queue})
        return _search(row) if row is not None else None

    async def bisecting_unchanged_for(self, seconds: float,
                                      limit: int) -> list[CulpritSearch]:
        """Searches still bisecting that nothing changed for ``seconds`` (oldest first):
        the sweeper advances them, in case the message that would have was lost."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM culprit_search WHERE state = 'bisecting'"
            " AND updated_at < now() - make_interval(secs => %(seconds)s)"
            " ORDER BY updated_at LIMIT %(limit)s",
            {"seconds": seconds, "limit": limit}, key={"state": "bisecting"})
        return [_search(row) for row in rows]

    async def update(self, search: CulpritSearch, *, lo: int, hi: int,
                     skipped: Iterable[int], probes: Sequence[str], builds: int,
                     state: SearchState, detail: str, culprit_uri: str | None = None,
                     culprit_request_id: str | None = None) -> CulpritSearch:
        """Compare-and-set the search's progress (VersionMismatch when another writer
        changed it since ``search`` was read)."""
        key = {"queue": search.queue, "red_request_id": search.red_request_id}
        row = await self._compare_and_set(
            "UPDATE culprit_search SET lo = %(lo)s, hi = %(hi)s, skipped = %(skipped)s,"
            " probes = %(probes)s, builds = %(builds)s, state = %(state)s,"
            " detail = %(detail)s, culprit_uri = %(culprit_uri)s,"
            " culprit_request_id = %(culprit_request_id)s,"
            " ended_at = CASE WHEN %(state)s = 'bisecting' THEN NULL"
            "                 ELSE COALESCE(ended_at, now()) END,"
            " version = version + 1, updated_at = now()"
            " WHERE queue = %(queue)s AND red_request_id = %(red_request_id)s"
            f" AND version = %(version)s RETURNING {_COLUMNS}",
            {**key, "lo": lo, "hi": hi, "skipped": sorted(set(skipped)),
             "probes": list(probes), "builds": builds, "state": state.value,
             "detail": detail, "culprit_uri": culprit_uri,
             "culprit_request_id": culprit_request_id},
            version_query=_VERSION, key=key, expected_version=search.version)
        return _search(row)


@dataclass(frozen=True, slots=True)
class CommitRecord:
    queue: str
    uri: str
    sha: str
    subject: str
    author: str
    committed_at: datetime | None
    parent_uri: str | None


class CommitInfoStore(Store):
    entity = "commit_info"

    async def remember(self, queue: str, commits: Iterable[CommitRecord]) -> None:
        """Keep each commit's description (the first one written stays)."""
        rows = [c for c in commits if c.queue == queue]
        if not rows:
            return
        await self._fetch_all(
            "INSERT INTO commit_info (queue, uri, sha, subject, author, committed_at,"
            " parent_uri)"
            " SELECT %(queue)s, * FROM unnest(%(uris)s::text[], %(shas)s::text[],"
            " %(subjects)s::text[], %(authors)s::text[], %(times)s::timestamptz[],"
            " %(parents)s::text[])"
            " ON CONFLICT (queue, uri) DO NOTHING RETURNING uri",
            {"queue": queue, "uris": [c.uri for c in rows], "shas": [c.sha for c in rows],
             "subjects": [c.subject for c in rows], "authors": [c.author for c in rows],
             "times": [c.committed_at for c in rows],
             "parents": [c.parent_uri for c in rows]},
            key={"queue": queue})

    async def of(self, queue: str, uris: Sequence[str]) -> dict[str, CommitRecord]:
        """The described commits among ``uris``, by URI."""
        if not uris:
            return {}
        rows = await self._fetch_all(
            "SELECT queue, uri, sha, subject, author, committed_at, parent_uri"
            " FROM commit_info WHERE queue = %(queue)s AND uri = ANY(%(uris)s)",
            {"queue": queue, "uris": list(uris)}, key={"queue": queue})
        return {row["uri"]: CommitRecord(**row) for row in rows}
