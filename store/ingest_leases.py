"""IngestLeaseStore: one ingest of a queue at a time resolves its head and mints its
Request, holding no database connection while git runs (migration 0008).

A lease is taken (`try_acquire`), renewed while the head is resolved (`renew`), and given
back by the very statement that mints the Request (`StepStore.find_or_mint`) or, when the
ingest failed, by `release`. A holder that died loses it when it runs out. Every lease
taken is a *resolve*, numbered (`started`); a release after a mint records the number
(`finished`) and the Request it found, so an ingest that arrived while another resolve was
under way can take the answer of the first resolve that began after it arrived instead of
resolving again (a burst of webhooks for one queue costs a few resolves, not one each).
"""

from __future__ import annotations

from dataclasses import dataclass

from store._base import Store


@dataclass(frozen=True)
class IngestProgress:
    started: int  # resolves begun so far
    finished: int  # the number of the last resolve that minted, 0 for none
    finished_request_id: str | None  # what it found


class IngestLeaseStore(Store):
    entity = "ingest_lease"

    async def try_acquire(self, queue: str, holder: str, lease: float) -> int | None:
        """Take the queue's lease for ``lease`` seconds if nobody holds it (or its holder
        let it run out); the number of the resolve it starts, None when held."""
        row = await self._fetch_one(
            "INSERT INTO ingest_lease AS l (queue, holder, lease_until, started)"
            " VALUES (%(queue)s, %(holder)s, now() + make_interval(secs => %(lease)s), 1)"
            " ON CONFLICT (queue) DO UPDATE SET holder = EXCLUDED.holder,"
            "   lease_until = EXCLUDED.lease_until, started = l.started + 1"
            " WHERE l.holder IS NULL OR l.lease_until < now()"
            " RETURNING started",
            {"queue": queue, "holder": holder, "lease": lease}, key={"queue": queue})
        return int(row["started"]) if row is not None else None

    async def progress(self, queue: str) -> IngestProgress:
        row = await self._fetch_one(
            "SELECT started, finished, finished_request_id FROM ingest_lease"
            " WHERE queue = %(queue)s", {"queue": queue}, key={"queue": queue})
        if row is None:
            return IngestProgress(0, 0, None)
        return IngestProgress(int(row["started"]), int(row["finished"]),
                              row["finished_request_id"])

    async def renew(self, queue: str, holder: str, lease: float) -> bool:
        """Extend the lease while it is still ``holder``'s; whether it was."""
        row = await self._fetch_one(
            "UPDATE ingest_lease SET lease_until = now() + make_interval(secs => %(lease)s)"
            " WHERE queue = %(queue)s AND holder = %(holder)s RETURNING queue",
            {"queue": queue, "holder": holder, "lease": lease}, key={"queue": queue})
        return row is not None

    async def release(self, queue: str, holder: str) -> None:
        """Give the lease back without a result (the ingest failed)."""
        await self._fetch_one(
            "UPDATE ingest_lease SET holder = NULL, lease_until = now()"
            " WHERE queue = %(queue)s AND holder = %(holder)s RETURNING queue",
            {"queue": queue, "holder": holder}, key={"queue": queue})
