"""ParkedStore: dead-letter messages that can never be reconciled, kept for an operator.

Headers are stored as readable JSON: `[{"key": k, "value": "<utf-8 text>"}, …]`, with
`"base64"` instead of `"value"` for a value that is not UTF-8 and neither for a null one.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from psycopg.types.json import Jsonb

from store._base import Row, Store
from store.entities import ParkedMessage

_COLUMNS = 'id, topic, "partition", "offset", key, value, headers, error, parked_at'
Headers = Sequence[tuple[str, bytes | None]]


def _headers_to_json(headers: Headers) -> list[dict[str, str]]:
    encoded = []
    for name, value in headers:
        item = {"key": name}
        if value is not None:
            try:
                item["value"] = value.decode("utf-8")
            except UnicodeDecodeError:
                item["base64"] = base64.b64encode(value).decode("ascii")
        encoded.append(item)
    return encoded


def _headers_from_json(items: list[dict[str, Any]]) -> tuple[tuple[str, bytes | None], ...]:
    decoded: list[tuple[str, bytes | None]] = []
    for item in items:
        value: bytes | None = None
        if "value" in item:
            value = str(item["value"]).encode("utf-8")
        elif "base64" in item:
            value = base64.b64decode(item["base64"])
        decoded.append((str(item["key"]), value))
    return tuple(decoded)


def _parked(row: Row) -> ParkedMessage:
    return ParkedMessage(
        id=row["id"],
        topic=row["topic"],
        partition=row["partition"],
        offset=row["offset"],
        key=bytes(row["key"]) if row["key"] is not None else None,
        value=bytes(row["value"]) if row["value"] is not None else None,
        headers=_headers_from_json(row["headers"]),
        error=row["error"],
        parked_at=row["parked_at"],
    )


class ParkedStore(Store):
    entity = "parked_message"

    async def park(
        self,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: Headers = (),
        error: str = "",
    ) -> ParkedMessage:
        """Keep the message at (topic, partition, offset). Idempotent: parking the same
        coordinates again returns the row parked first and changes nothing."""
        coordinates = {"topic": topic, "partition": partition, "offset": offset}
        row = await self._fetch_one(
            'INSERT INTO parked_message (topic, "partition", "offset", key, value, headers, error)'
            " VALUES (%(topic)s, %(partition)s, %(offset)s, %(key)s, %(value)s, %(headers)s,"
            " %(error)s)"
            ' ON CONFLICT (topic, "partition", "offset") DO NOTHING'
            f" RETURNING {_COLUMNS}",
            {
                **coordinates,
                "key": key,
                "value": value,
                "headers": Jsonb(_headers_to_json(headers)),
                "error": error,
            },
            key=coordinates,
        )
        if row is None:
            row = await self._get_row(
                f"SELECT {_COLUMNS} FROM parked_message WHERE topic = %(topic)s"
                ' AND "partition" = %(partition)s AND "offset" = %(offset)s',
                coordinates,
                key=coordinates,
            )
        return _parked(row)

    async def get(self, parked_id: int) -> ParkedMessage:
        """The parked message; NotFound if absent (or deleted)."""
        return _parked(
            await self._get_row(
                f"SELECT {_COLUMNS} FROM parked_message WHERE id = %(id)s",
                {"id": parked_id},
                key={"id": parked_id},
            )
        )

    async def list_messages(
        self, *, topic: str | None = None, after_id: int = 0, limit: int = 100
    ) -> list[ParkedMessage]:
        """Parked messages in the order they were parked, `limit` at a time: pass the last
        id seen as `after_id` for the next page. `topic` filters by source DLQ topic."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM parked_message"
            " WHERE id > %(after_id)s AND (%(topic)s::text IS NULL OR topic = %(topic)s)"
            " ORDER BY id LIMIT %(limit)s",
            {"topic": topic, "after_id": after_id, "limit": limit},
            key={"topic": topic},
        )
        return [_parked(row) for row in rows]

    async def count(self, *, topic: str | None = None) -> int:
        """How many messages are parked (for `topic`, or in all)."""
        row = await self._fetch_one(
            "SELECT count(*) AS n FROM parked_message"
            " WHERE %(topic)s::text IS NULL OR topic = %(topic)s",
            {"topic": topic},
            key={"topic": topic},
        )
        assert row is not None
        return int(row["n"])

    async def delete(self, parked_id: int) -> bool:
        """Forget a parked message once an operator has dealt with it; False if absent."""
        row = await self._fetch_one(
            "DELETE FROM parked_message WHERE id = %(id)s RETURNING id",
            {"id": parked_id},
            key={"id": parked_id},
        )
        return row is not None
