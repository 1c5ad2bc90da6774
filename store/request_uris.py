"""RequestUriStore: the ingest dedup mapping `(queue, uri)` → request id."""

from __future__ import annotations

from store._base import Row, Store
from store.entities import RequestUri

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
