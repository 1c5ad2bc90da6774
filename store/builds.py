"""BuildStore: runs of a queue's build runner, keyed by the runner-minted build id."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from store._base import Row, Store
from store.entities import Build, BuildStatus, RequestState, Verdict
from store.errors import AlreadyExists, AmbiguousKey, InvariantViolation, NotFound, VersionMismatch

_COLUMNS = (
    "queue, id, request_id, status, version, created_at, updated_at, attempt, verdict,"
    " reason, loop_token, EXTRACT(EPOCH FROM now() - loop_seen_at)::float8 AS loop_age,"
    " EXTRACT(EPOCH FROM now() - created_at)::float8 AS age, started_at,"
    " EXTRACT(EPOCH FROM now() - started_at)::float8 AS run_age"
)
_VERSION = "SELECT version FROM build WHERE queue = %(queue)s AND id = %(id)s"
_INSERT = (
    "INSERT INTO build (queue, id, request_id, loop_token, attempt)"
    " VALUES (%(queue)s, %(id)s, %(request_id)s, %(loop_token)s, %(attempt)s)"
    f" ON CONFLICT (queue, id) DO NOTHING RETURNING {_COLUMNS}"
)


def _build(row: Row) -> Build:
    verdict = row.get("verdict")
    return Build(**{**row, "status": BuildStatus(row["status"]),
                    "verdict": Verdict(verdict) if verdict is not None else None})


class BuildStore(Store):
    entity = "build"

    async def get(self, queue: str, build_id: str) -> Build:
        """The build; NotFound if absent."""
        return _build(
            await self._get_row(
                f"SELECT {_COLUMNS} FROM build WHERE queue = %(queue)s AND id = %(id)s",
                {"queue": queue, "id": build_id},
                key={"queue": queue, "id": build_id},
            )
        )

    async def get_by_id(self, build_id: str) -> Build:
        """The build with this id in whichever queue holds it (an index lookup), for
        callers that have no queue name. Build ids are minted per queue's runner, so two
        queues could mint the same one: then AmbiguousKey (pass the queue to `get`)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM build WHERE id = %(id)s LIMIT 2",
            {"id": build_id},
            key={"id": build_id},
        )
        if not rows:
            raise NotFound(self.entity, {"id": build_id})
        if len(rows) > 1:
            raise AmbiguousKey(self.entity, {"id": build_id}, len(rows))
        return _build(rows[0])

    async def create(self, queue: str, build_id: str, request_id: str, *,
                     loop_token: str = "", attempt: int = 1) -> Build:
        """A new build in `accepted` for the request (its ``attempt``); AlreadyExists if
        the id is taken, NotFound if the request does not exist."""
        return _build(
            await self._insert(
                _INSERT,
                {"queue": queue, "id": build_id, "request_id": request_id,
                 "loop_token": loop_token, "attempt": attempt},
                key={"queue": queue, "id": build_id},
                request_key={"queue": queue, "id": request_id},
            )
        )

    async def get_or_create(self, queue: str, build_id: str, request_id: str, *,
                            loop_token: str = "", attempt: int = 1) -> Build:
        """Like `create`, but an existing build of the same request is returned as is (a
        redelivered build message). AlreadyExists if the id belongs to another request."""
        key = {"queue": queue, "id": build_id}
        row = await self._fetch_one(
            _INSERT,
            {**key, "request_id": request_id, "loop_token": loop_token, "attempt": attempt},
            key=key,
            request_key={"queue": queue, "id": request_id},
        )
        build = _build(row) if row is not None else await self.get(queue, build_id)
        if build.request_id != request_id:
            raise AlreadyExists(self.entity, key)
        return build

    async def list_for_request(self, queue: str, request_id: str) -> list[Build]:
        """Every build started for the request, oldest first (by attempt)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM build WHERE queue = %(queue)s"
            " AND request_id = %(request_id)s ORDER BY attempt, created_at, id",
            {"queue": queue, "request_id": request_id},
            key={"queue": queue, "request_id": request_id},
        )
        return [_build(row) for row in rows]

    async def mark_started(self, build: Build, provider_started_at: datetime | None) -> Build:
        """Record when the build started running, once: the provider's own start time
        when it gives one — never before the trigger nor after now, by the database's
        clock (a provider's clock may be off) — else now (the first poll that saw it
        run). A start recorded first stays; the version is left alone (an observation,
        not a state change)."""
        key = {"queue": build.queue, "id": build.id}
        row = await self._fetch_one(
            "UPDATE build SET started_at = LEAST(now(), GREATEST(created_at,"
            " COALESCE(%(at)s::timestamptz, now())))"
            " WHERE queue = %(queue)s AND id = %(id)s AND started_at IS NULL"
            f" RETURNING {_COLUMNS}",
            {**key, "at": provider_started_at}, key=key)
        return _build(row) if row is not None else await self.get(build.queue, build.id)

    async def set_status(self, build: Build, status: BuildStatus) -> Build:
        """CAS the build's status. A terminal status is write-once: changing it raises
        InvariantViolation (the caller ignores a later poll that disagrees)."""
        key = {"queue": build.queue, "id": build.id}
        if build.status.is_terminal and status != build.status:
            raise InvariantViolation(
                self.entity,
                key,
                f"terminal status {build.status} is write-once (got {status})",
            )
        return _build(
            await self._compare_and_set(
                "UPDATE build SET status = %(status)s, version = version + 1, updated_at = now(),"
                " verdict = CASE WHEN %(status)s = 'succeeded' THEN 'green' ELSE verdict END"
                " WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s"
                f" RETURNING {_COLUMNS}",
                {**key, "status": status.value},
                version_query=_VERSION,
                key=key,
                expected_version=build.version,
            )
        )

    async def claim_loop(self, build: Build, token: str, *,
                         quiet: float = 0.0) -> Build:
        """Make ``token`` the build's poll loop, if the loop is still ``build``'s
        (compare-and-set on the token; VersionMismatch when another loop took it first).
        Marks the loop seen now, by the database's clock — or ``quiet`` seconds from now:
        a loop about to wait longer than its usual delays (a dependency's outage) says when
        it will be back, so the sweeper does not take it for lost meanwhile. The version
        is left alone."""
        key = {"queue": build.queue, "id": build.id}
        row = await self._fetch_one(
            "UPDATE build SET loop_token = %(new)s,"
            " loop_seen_at = now() + make_interval(secs => %(quiet)s)"
            " WHERE queue = %(queue)s AND id = %(id)s AND loop_token = %(old)s"
            f" RETURNING {_COLUMNS}",
            {**key, "new": token, "quiet": max(0.0, quiet), "old": build.loop_token},
            key=key,
        )
        if row is None:
            await self.get(build.queue, build.id)  # NotFound if it is gone
            raise VersionMismatch(self.entity, key, expected_version=build.version,
                                  actual_version=None)
        return _build(row)

    async def touch_loop(self, queue: str, build_id: str, *, quiet: float = 0.0) -> None:
        """Mark the build's poll loop seen now, or ``quiet`` seconds from now (see
        `claim_loop`): the sweeper after re-publishing it, a poll waiting for its turn in
        a rate budget."""
        await self._fetch_one(
            "UPDATE build SET loop_seen_at = now() + make_interval(secs => %(quiet)s)"
            " WHERE queue = %(queue)s AND id = %(id)s RETURNING id",
            {"queue": queue, "id": build_id, "quiet": max(0.0, quiet)},
            key={"queue": queue, "id": build_id},
        )

    async def list_unseen_live(self, older_than: float,
                               limit: int) -> list[tuple[Build, RequestState]]:
        """Builds not yet terminal whose poll loop was not seen for ``older_than``
        seconds, with their Request's state, longest unseen first (the live-rows index:
        never a scan of history)."""
        rows = await self._fetch_all(
            "SELECT b.queue, b.id, b.request_id, b.status, b.version, b.created_at,"
            " b.updated_at, b.attempt, b.verdict, b.reason, b.loop_token,"
            " EXTRACT(EPOCH FROM now() - b.loop_seen_at)::float8 AS loop_age,"
            " EXTRACT(EPOCH FROM now() - b.created_at)::float8 AS age, b.started_at,"
            " EXTRACT(EPOCH FROM now() - b.started_at)::float8 AS run_age,"
            " r.state AS request_state"
            " FROM build b JOIN request r ON r.queue = b.queue AND r.id = b.request_id"
            " WHERE b.status IN ('accepted', 'running')"
            " AND b.loop_seen_at < now() - make_interval(secs => %(age)s)"
            " ORDER BY b.loop_seen_at LIMIT %(limit)s",
            {"age": older_than, "limit": limit},
            key={"status": "live"},
        )
        return [(_build({k: v for k, v in row.items() if k != "request_state"}),
                 RequestState(row["request_state"])) for row in rows]

    async def latest_of_requests(self, queue: str,
                                 request_ids: Sequence[str]) -> dict[str, Build]:
        """Each Request's latest build (its highest attempt), by request id; a Request
        without a build is absent (one read of build_attempt_idx)."""
        if not request_ids:
            return {}
        rows = await self._fetch_all(
            f"SELECT DISTINCT ON (request_id) {_COLUMNS} FROM build"
            " WHERE queue = %(queue)s AND request_id = ANY(%(ids)s)"
            " ORDER BY request_id, attempt DESC, created_at DESC, id",
            {"queue": queue, "ids": list(request_ids)}, key={"queue": queue})
        return {row["request_id"]: _build(row) for row in rows}
