"""QueueStore: the per-queue row — latest request, in-flight slots, last-green bookmark."""

from __future__ import annotations

from typing import LiteralString

from store._base import Row, Store
from store.entities import Queue, RequestKind, request_order
from store.errors import InvariantViolation

_COLUMNS = (
    "name, last_green_uri, last_green_request_id, in_flight_count, latest_request_id,"
    " version, created_at, updated_at, backfill_in_flight, pinned_uri, pinned_request_id,"
    " pinned_by, pinned_reason, pinned_at"
)
_VERSION = "SELECT version FROM queue WHERE name = %(name)s"


def _queue(row: Row) -> Queue:
    return Queue(**row)


class QueueStore(Store):
    entity = "queue"

    async def get(self, name: str) -> Queue:
        """The queue; NotFound if it was never created."""
        return _queue(
            await self._get_row(
                f"SELECT {_COLUMNS} FROM queue WHERE name = %(name)s",
                {"name": name},
                key={"name": name},
            )
        )

    async def create(self, name: str) -> Queue:
        """A new queue with no bookmark and no slot taken; AlreadyExists if present."""
        return _queue(
            await self._insert(
                f"INSERT INTO queue (name) VALUES (%(name)s)"
                f" ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}",
                {"name": name},
                key={"name": name},
            )
        )

    async def get_or_create(self, name: str) -> Queue:
        """The queue, created first if missing. Safe to race: the loser reads the winner's.

        Two statements on purpose: under READ COMMITTED a concurrent insert that makes ours
        do nothing is visible only to a statement started after it committed.
        """
        row = await self._fetch_one(
            f"INSERT INTO queue (name) VALUES (%(name)s)"
            f" ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}",
            {"name": name},
            key={"name": name},
        )
        return _queue(row) if row is not None else await self.get(name)

    async def set_latest_request(self, queue: Queue, request_id: str) -> Queue:
        """CAS `latest_request_id` forward to `request_id`, which must be newer (by ingest
        order) than the stored one; InvariantViolation otherwise."""
        current = queue.latest_request_id
        if current is not None and request_order(request_id) <= request_order(current):
            raise InvariantViolation(
                self.entity,
                {"name": queue.name},
                f"latest_request_id only moves forward: {request_id} is not newer than {current}",
            )
        return await self._update(
            queue, "latest_request_id = %(request_id)s", {"request_id": request_id}
        )

    async def take_slot(self, queue: Queue) -> Queue:
        """CAS `in_flight_count` up by one. The caller checks `max_concurrent` on `queue`
        first; the compare-and-set makes that check hold at write time."""
        return await self._update(queue, "in_flight_count = in_flight_count + 1", {})

    async def release_slot(self, queue: Queue, kind: RequestKind = RequestKind.HEAD) -> Queue:
        """CAS the slot a Request of ``kind`` held down by one (a backfill's is of the
        backfill capacity); InvariantViolation if no such slot is taken."""
        if kind is RequestKind.BACKFILL:
            if queue.backfill_in_flight <= 0:
                raise InvariantViolation(self.entity, {"name": queue.name},
                                         "no backfill slot to release (backfill_in_flight "
                                         "is 0)")
            return await self._update(queue, "backfill_in_flight = backfill_in_flight - 1", {})
        if queue.in_flight_count <= 0:
            raise InvariantViolation(
                self.entity, {"name": queue.name}, "no slot to release (in_flight_count is 0)"
            )
        return await self._update(queue, "in_flight_count = in_flight_count - 1", {})

    async def advance_bookmark(self, queue: Queue, *, uri: str, request_id: str) -> Queue:
        """CAS the last-green bookmark to (`uri`, `request_id`).

        Only forward: `request_id` must be newer than the stored bookmark's (equal means an
        earlier delivery already moved it; the caller decides that before calling). The
        database refuses a bookmark that does not name a green whole-repo fact of that
        request (InvariantViolation).
        """
        current = queue.last_green_request_id
        if current is not None and request_order(request_id) <= request_order(current):
            raise InvariantViolation(
                self.entity,
                {"name": queue.name},
                f"the last-green bookmark only moves forward: {request_id} is not newer "
                f"than {current}",
            )
        return await self._update(
            queue,
            "last_green_uri = %(uri)s, last_green_request_id = %(request_id)s",
            {"uri": uri, "request_id": request_id},
        )

    async def _update(
        self, queue: Queue, assignments: LiteralString, params: dict[str, object]
    ) -> Queue:
        return _queue(
            await self._compare_and_set(
                f"UPDATE queue SET {assignments}, version = version + 1, updated_at = now()"
                f" WHERE name = %(name)s AND version = %(version)s RETURNING {_COLUMNS}",
                {**params, "name": queue.name},
                version_query=_VERSION,
                key={"name": queue.name},
                expected_version=queue.version,
            )
        )
