"""RequestStore: "validate queue Q at head URI U", and its state machine (design §4)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from store._base import Row, Store
from store.entities import (
    BuildStrategy,
    Order,
    Request,
    RequestKind,
    RequestState,
    UnvalidatedCause,
    Verdict,
    parse_request_id,
)
from store.errors import InvariantViolation, VersionMismatch

_COLUMNS = (
    "queue, id, uri, state, build_strategy, base_uri, version, created_at, updated_at,"
    " kind, attempt, verdict, reason, unvalidated_retries, red_reruns,"
    " loop_token, EXTRACT(EPOCH FROM now() - loop_seen_at)::float8 AS loop_age, nonce,"
    " COALESCE(EXTRACT(EPOCH FROM attempt_due_at - now())::float8, 0) AS attempt_due_in,"
    " recorded, unvalidated_cause, revalidations"
)
_VERSION = "SELECT version FROM request WHERE queue = %(queue)s AND id = %(id)s"


def _request(row: Row) -> Request:
    strategy = row["build_strategy"]
    verdict = row.get("verdict")
    return Request(
        **{
            **row,
            "state": RequestState(row["state"]),
            "build_strategy": BuildStrategy(strategy) if strategy is not None else None,
            "kind": RequestKind(row.get("kind", "head")),
            "verdict": Verdict(verdict) if verdict is not None else None,
            "unvalidated_cause": UnvalidatedCause(cause)
            if (cause := row.get("unvalidated_cause")) is not None else None,
        }
    )


class RequestStore(Store):
    entity = "request"

    async def get(self, queue: str, request_id: str) -> Request:
        """The request; NotFound if absent."""
        return _request(
            await self._get_row(
                f"SELECT {_COLUMNS} FROM request WHERE queue = %(queue)s AND id = %(id)s",
                {"queue": queue, "id": request_id},
                key={"queue": queue, "id": request_id},
            )
        )

    async def get_by_id(self, request_id: str) -> Request:
        """The request named by a `request/<queue>/<n>` id alone (the id names its queue).
        ValueError if `request_id` has another shape."""
        queue, _ = parse_request_id(request_id)
        return await self.get(queue, request_id)

    async def create(self, queue: str, request_id: str, uri: str) -> Request:
        """A new request in `accepted`; AlreadyExists if the id is taken."""
        return _request(
            await self._insert(
                f"INSERT INTO request (queue, id, uri) VALUES (%(queue)s, %(id)s, %(uri)s)"
                f" ON CONFLICT (queue, id) DO NOTHING RETURNING {_COLUMNS}",
                {"queue": queue, "id": request_id, "uri": uri},
                key={"queue": queue, "id": request_id},
            )
        )

    async def transition(
        self,
        request: Request,
        to: RequestState,
        *,
        strategy: BuildStrategy | None = None,
        base_uri: str | None = None,
    ) -> Request:
        """CAS the request from `request.state` (at `request.version`) to `to`.

        Moving to `processing` stamps the build strategy and base, which never change
        afterwards: `incremental` needs `base_uri`, `full` takes none. Raises
        InvariantViolation for an edge the state machine lacks, VersionMismatch when the
        request changed since it was read, NotFound when it is gone.
        """
        key = {"queue": request.queue, "id": request.id}
        if not request.state.can_become(to):
            raise InvariantViolation(
                self.entity, key, f"illegal transition {request.state} -> {to}"
            )
        if to is RequestState.PROCESSING:
            if strategy is None:
                raise ValueError("moving a request to processing needs a build strategy")
            if (strategy is BuildStrategy.INCREMENTAL) != (base_uri is not None):
                raise ValueError(
                    f"an incremental build needs a base URI and a full one takes none "
                    f"(got {strategy}, base_uri={base_uri!r})"
                )
            return _request(
                await self._compare_and_set(
                    "UPDATE request SET state = %(state)s, build_strategy = %(strategy)s,"
                    " base_uri = %(base_uri)s, attempt = GREATEST(attempt, 1),"
                    " attempt_due_at = now(), version = version + 1, updated_at = now()"
                    " WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s"
                    f" RETURNING {_COLUMNS}",
                    {**key, "state": to.value, "strategy": strategy.value, "base_uri": base_uri},
                    version_query=_VERSION,
                    key=key,
                    expected_version=request.version,
                )
            )
        if strategy is not None or base_uri is not None:
            raise ValueError("a build strategy is set only when moving to processing")
        # an outcome set here is a build's verdict (succeeded green, failed red); a
        # Request that could not be validated fails through `fail_unvalidated`
        return _request(
            await self._compare_and_set(
                "UPDATE request SET state = %(state)s, version = version + 1,"
                " verdict = CASE %(state)s WHEN 'succeeded' THEN 'green'"
                "                          WHEN 'failed' THEN 'red' END,"
                " updated_at = now()"
                " WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s"
                f" RETURNING {_COLUMNS}",
                {**key, "state": to.value},
                version_query=_VERSION,
                key=key,
                expected_version=request.version,
            )
        )

    async def pass_over(self, request: Request, reason: str) -> Request:
        """CAS an `accepted` Request to `superseded` saying why (a backfill whose search
        ended before it was admitted). VersionMismatch when it changed since it was
        read."""
        return await self._end_for(request, RequestState.SUPERSEDED, reason)

    async def get_many(self, queue: str, ids: Sequence[str]) -> dict[str, Request]:
        """The queue's Requests among ``ids`` that exist, by id."""
        if not ids:
            return {}
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE queue = %(queue)s AND id = ANY(%(ids)s)",
            {"queue": queue, "ids": list(ids)}, key={"queue": queue})
        return {row["id"]: _request(row) for row in rows}

    async def fail_unvalidated(self, request: Request, reason: str) -> Request:
        """CAS the request (`accepted` or `processing`, at `request.version`) to `failed`
        without a verdict — it could not be validated, for ``reason`` (a reconciler drove
        it out). InvariantViolation from a terminal state, VersionMismatch when it changed
        since it was read."""
        return await self._end_for(request, RequestState.FAILED, reason)

    async def _end_for(self, request: Request, state: RequestState, reason: str) -> Request:
        """CAS the request to ``state`` (superseded, or failed without a verdict) for
        ``reason``."""
        key = {"queue": request.queue, "id": request.id}
        if not request.state.can_become(state):
            raise InvariantViolation(self.entity, key,
                                     f"illegal transition {request.state} -> {state}")
        return _request(
            await self._compare_and_set(
                f"UPDATE request SET state = '{state.value}', verdict = NULL,"
                " reason = %(reason)s, unvalidated_cause = %(cause)s::text,"
                " version = version + 1, updated_at = now()"
                " WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s"
                f" RETURNING {_COLUMNS}",
                # a reconciler's failure: the message kept failing, which another
                # validation may not (design §4: transient)
                {**key, "reason": reason, "cause": UnvalidatedCause.TRANSIENT.value
                 if state is RequestState.FAILED else None},
                version_query=_VERSION,
                key=key,
                expected_version=request.version,
            )
        )

    async def claim_loop(self, request: Request, token: str, *,
                         quiet: float = 0.0) -> Request:
        """Make ``token`` the Request's gate loop, if the loop is still ``request``'s
        (compare-and-set on the token; VersionMismatch when another loop took it first).
        Marks the loop seen now, by the database's clock — or ``quiet`` seconds from now:
        a loop about to wait longer than its usual delays (a dependency's outage) says when
        it will be back, so the sweeper does not take it for lost meanwhile. The version
        is left alone."""
        key = {"queue": request.queue, "id": request.id}
        row = await self._fetch_one(
            "UPDATE request SET loop_token = %(new)s,"
            " loop_seen_at = now() + make_interval(secs => %(quiet)s)"
            " WHERE queue = %(queue)s AND id = %(id)s AND loop_token = %(old)s"
            f" RETURNING {_COLUMNS}",
            {**key, "new": token, "quiet": max(0.0, quiet), "old": request.loop_token},
            key=key,
        )
        if row is None:
            await self.get(request.queue, request.id)  # NotFound if it is gone
            raise VersionMismatch(self.entity, key, expected_version=request.version,
                                  actual_version=None)
        return _request(row)

    async def touch_loop(self, queue: str, request_id: str, *, quiet: float = 0.0) -> None:
        """Mark the Request's loop seen now, or ``quiet`` seconds from now (see
        `claim_loop`): the sweeper after re-publishing it, a trigger waiting out an
        outage."""
        await self._fetch_one(
            "UPDATE request SET loop_seen_at = now() + make_interval(secs => %(quiet)s)"
            " WHERE queue = %(queue)s AND id = %(id)s RETURNING id",
            {"queue": queue, "id": request_id, "quiet": max(0.0, quiet)},
            key={"queue": queue, "id": request_id},
        )

    async def list_unseen_accepted(self, older_than: float, limit: int) -> list[Request]:
        """``accepted`` Requests whose gate loop was not seen for ``older_than`` seconds,
        longest unseen first (the live-rows index: never a scan of history)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE state = 'accepted'"
            " AND loop_seen_at < now() - make_interval(secs => %(age)s)"
            " ORDER BY loop_seen_at LIMIT %(limit)s",
            {"age": older_than, "limit": limit},
            key={"state": "accepted"},
        )
        return [_request(row) for row in rows]

    async def list_processing_without_build(self, older_than: float,
                                            limit: int) -> list[Request]:
        """``processing`` Requests whose current attempt began (or fell due) more than
        ``older_than`` seconds ago and has no build row yet (its BuildRequest may never
        have been sent)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request r WHERE state = 'processing'"
            " AND loop_seen_at < now() - make_interval(secs => %(age)s)"
            " AND updated_at < now() - make_interval(secs => %(age)s)"
            " AND COALESCE(attempt_due_at, updated_at)"
            "     < now() - make_interval(secs => %(age)s)"
            " AND NOT EXISTS (SELECT 1 FROM build b WHERE b.queue = r.queue"
            "                 AND b.request_id = r.id AND b.attempt = r.attempt)"
            " ORDER BY loop_seen_at LIMIT %(limit)s",
            {"age": older_than, "limit": limit},
            key={"state": "processing"},
        )
        return [_request(row) for row in rows]

    async def list_unrecorded(self, older_than: float, limit: int) -> list[Request]:
        """Requests settled with a verdict more than ``older_than`` seconds ago whose fact
        record has not written (a `record` message lost or dead-lettered): the index holds
        only such rows, never history."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE verdict IS NOT NULL AND NOT recorded"
            " AND updated_at < now() - make_interval(secs => %(age)s)"
            " AND loop_seen_at < now() - make_interval(secs => %(age)s)"
            " ORDER BY updated_at LIMIT %(limit)s",
            {"age": older_than, "limit": limit},
            key={"recorded": False},
        )
        return [_request(row) for row in rows]

    async def newest_for_commit(self, queue: str, uri: str) -> Request | None:
        """The newest Request (by ingest order, then validation) of commit ``uri``; None
        when the commit was never ingested on ``queue``."""
        row = await self._fetch_one(
            f"SELECT {_COLUMNS} FROM request r WHERE r.queue = %(queue)s AND r.id = ("
            " SELECT m.request_id FROM request_uri m"
            " WHERE m.queue = %(queue)s AND m.uri = %(uri)s)",
            {"queue": queue, "uri": uri}, key={"queue": queue, "uri": uri})
        return _request(row) if row is not None else None

    async def newest_for_commits(self, queue: str,
                                 uris: Sequence[str]) -> dict[str, Request]:
        """The newest Request of each commit among ``uris`` the queue has validated (or
        passed over), by URI."""
        if not uris:
            return {}
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE queue = %(queue)s AND id IN ("
            " SELECT request_id FROM request_uri"
            " WHERE queue = %(queue)s AND uri = ANY(%(uris)s))",
            {"queue": queue, "uris": list(uris)}, key={"queue": queue})
        return {row["uri"]: _request(row) for row in rows}

    async def recent(self, queue: str, limit: int) -> list[Request]:
        """The queue's newest ``limit`` Requests by (ingest order, validation), newest
        first (the request_rank_idx index)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE queue = %(queue)s"
            " ORDER BY request_rank(id) DESC LIMIT %(limit)s",
            {"queue": queue, "limit": limit}, key={"queue": queue})
        return [_request(row) for row in rows]

    async def newer_than(self, queue: str, rank: Order | None, limit: int) -> list[Request]:
        """The queue's Requests that sort after ``rank`` (a `store.request_order`; None:
        all), newest first; at most ``limit`` (request_rank_idx)."""
        if rank is None:
            return await self.recent(queue, limit)
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE queue = %(queue)s"
            " AND request_rank(id) > %(rank)s::bigint[]"
            " ORDER BY request_rank(id) DESC LIMIT %(limit)s",
            {"queue": queue, "rank": list(rank), "limit": limit}, key={"queue": queue})
        return [_request(row) for row in rows]

    async def processing(self, queue: str) -> list[Request]:
        """The queue's Requests processing now (holding its slots), oldest first (the
        live-rows index)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM request WHERE state = 'processing'"
            " AND queue = %(queue)s ORDER BY request_rank(id)",
            {"queue": queue}, key={"queue": queue})
        return [_request(row) for row in rows]

    async def ingested_at(self, queue: str, request_id: str) -> tuple[datetime, float] | None:
        """When the Request was made and how many seconds ago, by the database's clock;
        None when there is no such Request."""
        row = await self._fetch_one(
            "SELECT created_at, EXTRACT(EPOCH FROM now() - created_at)::float8 AS seconds"
            " FROM request WHERE queue = %(queue)s AND id = %(id)s",
            {"queue": queue, "id": request_id}, key={"queue": queue, "id": request_id})
        return (row["created_at"], max(0.0, float(row["seconds"]))) if row else None
