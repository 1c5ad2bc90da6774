"""WorkerHostStore: each worker's own heartbeat, and since when it has heartbeaten without a
gap (migration 0008).

Evidence for declaring a host lost (design §6: a database outage is never evidence that a
host died). A host whose builds stopped heartbeating may be dead — or the database may
have been out of everyone's reach. A host may therefore declare another host's build lost
only when it has itself been heartbeating, without a gap longer than ``gap``, for at least
the build's host timeout: then the database was reachable for that whole window, and the
owner's silence over it is its own. After an outage every host starts counting afresh, so
the owners have a full host timeout to heartbeat again before anyone may judge them.
"""

from __future__ import annotations

from store._base import Store

# Seconds between two heartbeats of a host beyond which it starts being up afresh. Each
# worker heartbeats every tend (2 s, streams.stages.pipeline.TEND_INTERVAL), so 6 s is
# three tends missed. Relation that keeps an outage from failing builds: after an outage
# shorter than this gap, an owner's builds are at most gap + one tend silent, so every
# host_timeout must exceed gap + 2 tends (the command runner requires at least
# MIN_HOST_TIMEOUT); after a longer outage every host starts counting afresh.
HEARTBEAT_GAP = 6.0
MIN_HOST_TIMEOUT = 10.0


class WorkerHostStore(Store):
    entity = "worker_host"

    async def heartbeat(self, host: str, gap: float) -> float:
        """Record a heartbeat of ``host`` now (by the database's clock); when its previous
        one is more than ``gap`` seconds old, it starts being up afresh. Returns for how
        many seconds it has been up without a gap."""
        row = await self._fetch_one(
            "INSERT INTO worker_host AS w (host) VALUES (%(host)s)"
            " ON CONFLICT (host) DO UPDATE SET heartbeat_at = now(),"
            "   up_since = CASE WHEN w.heartbeat_at < now() - make_interval(secs => %(gap)s)"
            "                   THEN now() ELSE w.up_since END"
            " RETURNING EXTRACT(EPOCH FROM now() - up_since)::float8 AS up_for",
            {"host": host, "gap": gap}, key={"host": host})
        assert row is not None
        return float(row["up_for"])

    async def count_alive(self, within: float) -> int:
        """Hosts whose worker heartbeat within the last ``within`` seconds: the workers a
        shared budget is divided among (`streams.extensions.budget`)."""
        row = await self._fetch_one(
            "SELECT count(*) AS alive FROM worker_host"
            " WHERE heartbeat_at >= now() - make_interval(secs => %(within)s)",
            {"within": within}, key={})
        return int(row["alive"]) if row is not None else 0
