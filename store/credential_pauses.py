"""CredentialPauseStore: the hosted APIs' credentials that answered a rate limit, and until
when nobody calls them (migration 0013; issue 23).

A worker that is answered a rate limit pauses the credential at once
(`streams.extensions.budget.pause`), and at its next tend writes the pause here; every
worker reads the pauses at its tend, so a credential one worker was told to leave alone
is left alone by all of them within two tends. Times are the database's: workers whose
clocks disagree agree on a pause. A row is a budget's key (provider, API and a hash of the
credential), never a secret.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import LiteralString

from store._base import Store

FORGET_AFTER = 3600.0  # seconds after its end that a pause's row is deleted


def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


# the pauses told are returned from the insert: the statement's reads do not see its writes
_EXCHANGE = _sql("""
WITH told AS (
    INSERT INTO credential_pause AS c (credential, until)
    SELECT t.credential, now() + make_interval(secs => t.seconds)
      FROM unnest(%(credentials)s::text[], %(seconds)s::float8[]) AS t(credential, seconds)
    ON CONFLICT (credential) DO UPDATE SET until = GREATEST(c.until, EXCLUDED.until)
    RETURNING c.credential, c.until
), forgotten AS (
    DELETE FROM credential_pause
     WHERE until < now() - make_interval(secs => %(forget)s)
       AND credential <> ALL(%(credentials)s::text[])
    RETURNING credential
)
SELECT credential, EXTRACT(EPOCH FROM until - now())::float8 AS seconds FROM told
 WHERE until > now()
UNION ALL
SELECT credential, EXTRACT(EPOCH FROM until - now())::float8 AS seconds
  FROM credential_pause
 WHERE until > now() AND credential <> ALL(%(credentials)s::text[])
""")


class CredentialPauseStore(Store):
    entity = "credential_pause"

    async def exchange(self, learned: Mapping[str, float]) -> dict[str, float]:
        """Record the pauses this worker ``learned`` (credential -> seconds from now; a
        longer pause already recorded stays) and return every pause still running, as
        seconds from now, in one statement."""
        rows = await self._fetch_all(_EXCHANGE, {
            "credentials": list(learned), "seconds": [learned[c] for c in learned],
            "forget": FORGET_AFTER}, key={})
        return {str(row["credential"]): float(row["seconds"]) for row in rows}
