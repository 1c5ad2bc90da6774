"""WebhookDeliveryStore: push webhook deliveries, so each is ingested once (design §9).

A delivery is claimed before it is ingested and marked ingested after; a failed ingest
releases the claim, so the provider's retry of the same delivery may try again. Every
state change is one statement that names the claimant's token: a claimant can only finish
or release its own claim.
"""

from __future__ import annotations

from collections.abc import Sequence

from store._base import Row, Store
from store.entities import DeliveryState, WebhookDelivery

_COLUMNS = "provider, delivery_id, state, request_ids, received_at, ingested_at"
EXPIRY_BATCH = 100  # expired rows deleted by one claim at most
# seconds a delivery id is remembered (GitHub lets a delivery be redelivered for 3 days);
# retention never deletes one younger either
KEEP_DELIVERIES = 7 * 24 * 3600.0


def _delivery(row: Row) -> WebhookDelivery:
    return WebhookDelivery(
        provider=row["provider"],
        delivery_id=row["delivery_id"],
        state=DeliveryState(row["state"]),
        request_ids=tuple(row["request_ids"]),
        received_at=row["received_at"],
        ingested_at=row["ingested_at"],
    )


class WebhookDeliveryStore(Store):
    entity = "webhook_delivery"

    async def claim(self, provider: str, delivery_id: str, claim: str, *,
                    stale_after: float, keep: float) -> bool:
        """Claim the delivery for ingesting under the token ``claim`` (a UUID). True when
        this call holds it now: it was unknown, or its claimant has been ingesting it for
        longer than ``stale_after`` seconds (so died). False when it is ingested, or
        another claimant is ingesting it (`get` tells which).

        The same statement deletes up to `EXPIRY_BATCH` deliveries received more than
        ``keep`` seconds ago, oldest first through the ``received_at`` index, so the table
        holds about ``keep`` seconds of deliveries at a cost only when one arrives."""
        key = {"provider": provider, "delivery_id": delivery_id}
        row = await self._fetch_one(
            "WITH expired AS ("
            "  DELETE FROM webhook_delivery WHERE (provider, delivery_id) IN ("
            "    SELECT provider, delivery_id FROM webhook_delivery"
            "     WHERE received_at < now() - make_interval(secs => %(keep)s)"
            "       AND (provider, delivery_id) <> (%(provider)s, %(delivery_id)s)"
            "     ORDER BY received_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED))"
            " INSERT INTO webhook_delivery AS d (provider, delivery_id, claim)"
            " VALUES (%(provider)s, %(delivery_id)s, %(claim)s)"
            " ON CONFLICT (provider, delivery_id) DO UPDATE"
            "   SET claim = EXCLUDED.claim, claimed_at = now()"
            "   WHERE d.state = 'ingesting'"
            "     AND d.claimed_at < now() - make_interval(secs => %(stale)s)"
            " RETURNING d.claim",
            {**key, "claim": claim, "stale": float(stale_after), "keep": float(keep),
             "batch": EXPIRY_BATCH},
            key=key,
        )
        return row is not None

    async def complete(self, provider: str, delivery_id: str, claim: str,
                       request_ids: Sequence[str]) -> bool:
        """Mark the delivery ingested, with the Requests its ingest found or minted.
        False when ``claim`` no longer holds it (taken over as stale): nothing changed."""
        key = {"provider": provider, "delivery_id": delivery_id}
        row = await self._fetch_one(
            "UPDATE webhook_delivery"
            " SET state = 'ingested', ingested_at = now(), request_ids = %(request_ids)s"
            " WHERE provider = %(provider)s AND delivery_id = %(delivery_id)s"
            "   AND claim = %(claim)s AND state = 'ingesting'"
            " RETURNING provider",
            {**key, "claim": claim, "request_ids": list(request_ids)},
            key=key,
        )
        return row is not None

    async def release(self, provider: str, delivery_id: str, claim: str) -> bool:
        """Give up the claim after a failed ingest, so a later delivery of the same id
        ingests it. False when ``claim`` did not hold it: nothing changed."""
        key = {"provider": provider, "delivery_id": delivery_id}
        row = await self._fetch_one(
            "DELETE FROM webhook_delivery"
            " WHERE provider = %(provider)s AND delivery_id = %(delivery_id)s"
            "   AND claim = %(claim)s AND state = 'ingesting'"
            " RETURNING provider",
            {**key, "claim": claim},
            key=key,
        )
        return row is not None

    async def get(self, provider: str, delivery_id: str) -> WebhookDelivery | None:
        """The delivery, None when unknown (never claimed, released, or expired)."""
        key = {"provider": provider, "delivery_id": delivery_id}
        row = await self._fetch_one(
            f"SELECT {_COLUMNS} FROM webhook_delivery"
            " WHERE provider = %(provider)s AND delivery_id = %(delivery_id)s",
            key,
            key=key,
        )
        return _delivery(row) if row is not None else None
