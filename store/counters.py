"""CounterStore: the per-queue counter whose values order requests (ingest order)."""

from __future__ import annotations

from store._base import Store


class CounterStore(Store):
    entity = "queue_counter"

    async def next(self, queue: str) -> int:
        """The queue's next value: 1, 2, 3, … One atomic statement, so concurrent callers
        get distinct values and each caller's successive values increase. A value drawn in
        a transaction that rolls back may be reused, like any uncommitted write."""
        row = await self._fetch_one(
            "INSERT INTO queue_counter (queue, value) VALUES (%(queue)s, 1)"
            " ON CONFLICT (queue) DO UPDATE SET value = queue_counter.value + 1"
            " RETURNING value",
            {"queue": queue},
            key={"queue": queue},
        )
        assert row is not None  # INSERT … ON CONFLICT DO UPDATE always returns the row
        return int(row["value"])

    async def current(self, queue: str) -> int:
        """The last value drawn for the queue, 0 if none."""
        row = await self._fetch_one(
            "SELECT value FROM queue_counter WHERE queue = %(queue)s",
            {"queue": queue},
            key={"queue": queue},
        )
        return int(row["value"]) if row is not None else 0
