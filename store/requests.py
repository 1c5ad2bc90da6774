"""RequestStore: "validate queue Q at head URI U", and its state machine (design §4)."""

from __future__ import annotations

from store._base import Row, Store
from store.entities import BuildStrategy, Request, RequestState, parse_request_id
from store.errors import InvariantViolation

_COLUMNS = "queue, id, uri, state, build_strategy, base_uri, version, created_at, updated_at"
_VERSION = "SELECT version FROM request WHERE queue = %(queue)s AND id = %(id)s"


def _request(row: Row) -> Request:
    strategy = row["build_strategy"]
    return Request(
        **{
            **row,
            "state": RequestState(row["state"]),
            "build_strategy": BuildStrategy(strategy) if strategy is not None else None,
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
                    " base_uri = %(base_uri)s, version = version + 1, updated_at = now()"
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
        return _request(
            await self._compare_and_set(
                "UPDATE request SET state = %(state)s, version = version + 1,"
                " updated_at = now()"
                " WHERE queue = %(queue)s AND id = %(id)s AND version = %(version)s"
                f" RETURNING {_COLUMNS}",
                {**key, "state": to.value},
                version_query=_VERSION,
                key=key,
                expected_version=request.version,
            )
        )
