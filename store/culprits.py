"""Culprit searches and what commits are (migration 0010; design §5, "backfill").

`CulpritSearchStore` keeps one search per red streak of a queue: the first-parent range
from the last green commit to the red one, the bisection's bounds, the backfill Requests
it started, how it ended and whether the culprit it named is confirmed as the head's
(migration 0012). Every change is a compare-and-set on `version`; an ended search is
final (the database refuses to change it).

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
class ProbeRecord:
    """One backfill Request a search started, as the search counts it: its state and
    verdict, the builds of it that ran (gave a verdict: green or red, a hang included;
    a build that could not validate did not run), and how long ago it last changed (by
    the database's clock: for a probe that ended, since it ended)."""

    request_id: str
    uri: str
    state: str
    verdict: str | None
    ran: int
    changed_ago: float
    # it could not validate its commit for a cause building again would not change (a
    # refused trigger, a checkout that fails): probing it again is pointless
    permanent: bool = False

    @property
    def in_flight(self) -> bool:
        return self.state in ("accepted", "processing")

    @property
    def unvalidated(self) -> bool:
        """It ended without a verdict (could not validate, or was cancelled)."""
        return not self.in_flight and self.verdict is None


@dataclass(frozen=True, slots=True)
class CulpritSearch:
    """``commits[0]`` is the green end (None when the search has no range), the last one
    the red commit that opened it; ``commits[lo]`` is the newest commit known green and
    ``commits[hi]`` the oldest known red above it, so a break lies in ``lo + 1 .. hi``."""

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
    # migration 0012 (None in rows of the release before)
    confirmed: bool | None = None
    unconfirmed_reason: str | None = None
    candidate_uri: str | None = None
    wake_at: datetime | None = None

    @property
    def culprit_confirmed(self) -> bool:
        """The culprit named is the break the red head is red for: every commit from it
        to the head is known red. A culprit named by the release before 0012 was not
        confirmed, unless it is the red commit itself (its first parent is green)."""
        if self.culprit_uri is None:
            return False
        if self.confirmed is not None:
            return self.confirmed
        return self.culprit_uri == self.red_uri

    @property
    def unconfirmed_why(self) -> str | None:
        """Why the culprit named is not confirmed as the head's (None: it is, or none
        was named)."""
        if self.culprit_uri is None or self.culprit_confirmed:
            return None
        return self.unconfirmed_reason or (
            "named by an earlier release, which did not check the commits between it and "
            "the head")

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
    " created_at, updated_at, ended_at, version, confirmed, unconfirmed_reason,"
    " candidate_uri, wake_at"
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
                   culprit_uri: str | None = None, culprit_request_id: str | None = None,
                   confirmed: bool | None = None) -> tuple[CulpritSearch, bool]:
        """The search the red verdict of ``red_request_id`` opened — this one, or the one
        an earlier delivery opened (then False)."""
        params = {"queue": queue, "red_request_id": red_request_id, "red_uri": red_uri,
                  "green_request_id": green_request_id, "green_uri": green_uri,
                  "commits": list(commits), "hi": max(len(commits) - 1, 0),
                  "max_builds": max_builds, "state": state.value, "detail": detail,
                  "culprit_uri": culprit_uri, "culprit_request_id": culprit_request_id,
                  "confirmed": confirmed}
        key = {"queue": queue, "red_request_id": red_request_id}
        row = await self._fetch_one(
            "INSERT INTO culprit_search (queue, red_request_id, red_uri, green_request_id,"
            " green_uri, commits, lo, hi, max_builds, state, detail, culprit_uri,"
            " culprit_request_id, confirmed, ended_at)"
            " VALUES (%(queue)s, %(red_request_id)s, %(red_uri)s, %(green_request_id)s,"
            " %(green_uri)s, %(commits)s, 0, %(hi)s, %(max_builds)s, %(state)s, %(detail)s,"
            " %(culprit_uri)s, %(culprit_request_id)s, %(confirmed)s,"
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

    async def due_to_advance(self, unchanged_for: float,
                             limit: int) -> list[CulpritSearch]:
        """Searches still bisecting that nothing changed for ``unchanged_for`` seconds
        (the message that would have advanced them was lost), or whose commit waiting to
        be probed again is due (``wake_at``): the sweeper advances them, oldest first."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM culprit_search WHERE state = 'bisecting'"
            " AND (updated_at < now() - make_interval(secs => %(seconds)s)"
            "      OR wake_at <= now())"
            " ORDER BY updated_at LIMIT %(limit)s",
            {"seconds": unchanged_for, "limit": limit}, key={"state": "bisecting"})
        return [_search(row) for row in rows]

    async def probe_records(self, queue: str,
                            request_ids: Sequence[str]) -> dict[str, ProbeRecord]:
        """The search's probes among ``request_ids``, by id, with the builds of each that
        ran (one read of the Requests and their builds)."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            "SELECT r.id AS request_id, r.uri, r.state, r.verdict,"
            " (SELECT count(*) FROM build b WHERE b.queue = r.queue"
            "   AND b.request_id = r.id AND b.verdict IS NOT NULL)::int AS ran,"
            " EXTRACT(EPOCH FROM now() - r.updated_at)::float8 AS changed_ago,"
            " COALESCE(r.unvalidated_cause = 'permanent', false) AS permanent"
            " FROM request r WHERE r.queue = %(queue)s AND r.id = ANY(%(ids)s)",
            {"queue": queue, "ids": list(request_ids)}, key={"queue": queue})
        return {row["request_id"]: ProbeRecord(**row) for row in rows}

    async def count_builds(self, search: CulpritSearch, builds: int) -> CulpritSearch:
        """Compare-and-set the count of builds that ran (of an ended search too: a probe
        running when it ended adds its builds; nothing else of it changes)."""
        key = {"queue": search.queue, "red_request_id": search.red_request_id}
        row = await self._compare_and_set(
            "UPDATE culprit_search SET builds = %(builds)s, version = version + 1,"
            " updated_at = now()"
            " WHERE queue = %(queue)s AND red_request_id = %(red_request_id)s"
            f" AND version = %(version)s RETURNING {_COLUMNS}",
            {**key, "builds": builds}, version_query=_VERSION, key=key,
            expected_version=search.version)
        return _search(row)

    async def update(self, search: CulpritSearch, *, lo: int, hi: int,
                     skipped: Iterable[int], probes: Sequence[str], builds: int,
                     state: SearchState, detail: str, culprit_uri: str | None = None,
                     culprit_request_id: str | None = None, confirmed: bool | None = None,
                     unconfirmed_reason: str | None = None,
                     candidate_uri: str | None = None,
                     wake_in: float | None = None) -> CulpritSearch:
        """Compare-and-set the search's progress (VersionMismatch when another writer
        changed it since ``search`` was read). ``wake_in``: seconds until the sweeper
        should advance it again (a commit is due to be probed again); None: no time."""
        key = {"queue": search.queue, "red_request_id": search.red_request_id}
        row = await self._compare_and_set(
            "UPDATE culprit_search SET lo = %(lo)s, hi = %(hi)s, skipped = %(skipped)s,"
            " probes = %(probes)s, builds = %(builds)s, state = %(state)s,"
            " detail = %(detail)s, culprit_uri = %(culprit_uri)s,"
            " culprit_request_id = %(culprit_request_id)s, confirmed = %(confirmed)s,"
            " unconfirmed_reason = %(unconfirmed_reason)s, candidate_uri = %(candidate_uri)s,"
            " wake_at = now() + make_interval(secs => %(wake_in)s::float8),"
            " ended_at = CASE WHEN %(state)s = 'bisecting' THEN NULL"
            "                 ELSE COALESCE(ended_at, now()) END,"
            " version = version + 1, updated_at = now()"
            " WHERE queue = %(queue)s AND red_request_id = %(red_request_id)s"
            f" AND version = %(version)s RETURNING {_COLUMNS}",
            {**key, "lo": lo, "hi": hi, "skipped": sorted(set(skipped)),
             "probes": list(probes), "builds": builds, "state": state.value,
             "detail": detail, "culprit_uri": culprit_uri,
             "culprit_request_id": culprit_request_id, "confirmed": confirmed,
             "unconfirmed_reason": unconfirmed_reason, "candidate_uri": candidate_uri,
             "wake_in": wake_in},
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
