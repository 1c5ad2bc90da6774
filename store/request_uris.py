"""RequestUriStore: the ingest dedup mapping `(queue, uri)` → request id."""

from __future__ import annotations

from store._base import Row, Store
from store.entities import RequestUri
from store.errors import VersionMismatch

_COLUMNS = "queue, uri, request_id, created_at"


def _request_uri(row: Row) -> RequestUri:
    return RequestUri(**row)


class RequestUriStore(Store):
    entity = "request_uri"

    async def get(self, queue: str, uri: str) -> RequestUri:
        """The mapping; NotFound if this head was never ingested."""
        return _request_uri(
            await self._get_row(
                f"SELECT {_COLUMNS} FROM request_uri WHERE queue = %(queue)s AND uri = %(uri)s",
                {"queue": queue, "uri": uri},
                key={"queue": queue, "uri": uri},
            )
        )

    async def create(self, queue: str, uri: str, request_id: str) -> RequestUri:
        """Map (queue, uri) to `request_id`; AlreadyExists if the head is already mapped."""
        return _request_uri(
            await self._insert(
                "INSERT INTO request_uri (queue, uri, request_id)"
                " VALUES (%(queue)s, %(uri)s, %(request_id)s)"
                f" ON CONFLICT (queue, uri) DO NOTHING RETURNING {_COLUMNS}",
                {"queue": queue, "uri": uri, "request_id": request_id},
                key={"queue": queue, "uri": uri},
            )
        )

    async def get_or_create(self, queue: str, uri: str, request_id: str) -> RequestUri:
        """The mapping, claiming it for `request_id` if free. When another ingest won the
        race the returned mapping names the winner's id, which the caller adopts."""
        row = await self._fetch_one(
            "INSERT INTO request_uri (queue, uri, request_id)"
            " VALUES (%(queue)s, %(uri)s, %(request_id)s)"
            f" ON CONFLICT (queue, uri) DO NOTHING RETURNING {_COLUMNS}",
            {"queue": queue, "uri": uri, "request_id": request_id},
            key={"queue": queue, "uri": uri},
        )
        return _request_uri(row) if row is not None else await self.get(queue, uri)

    async def reassign(self, mapping: RequestUri, request_id: str) -> RequestUri:
        """Point the head at a new Request, if it still names `mapping.request_id`
        (compare-and-set on the id: VersionMismatch when another ingest moved it first).

        Used when the head's Request was superseded without a build and the branch came
        back to that commit (a force-push reset): the head must be validated again.
        """
        key = {"queue": mapping.queue, "uri": mapping.uri}
        row = await self._fetch_one(
            "UPDATE request_uri SET request_id = %(new)s"
            " WHERE queue = %(queue)s AND uri = %(uri)s AND request_id = %(old)s"
            f" RETURNING {_COLUMNS}",
            {**key, "new": request_id, "old": mapping.request_id},
            key=key,
        )
        if row is None:
            await self.get(mapping.queue, mapping.uri)  # NotFound if it is gone
            raise VersionMismatch(self.entity, key, expected_version=-1, actual_version=None)
        return _request_uri(row)
