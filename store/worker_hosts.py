"""WorkerHostStore: each worker's own heartbeat, and since when it has heartbeaten without a
gap (migration 0008); and each worker *process*'s heartbeat, from which the workers count
each other to share the hosted APIs' budgets (migration 0013).

Evidence for declaring a host lost (design §6: a database outage is never evidence that a
host died). A host whose builds stopped heartbeating may be dead — or the database may
have been out of everyone's reach. A host may therefore declare another host's build lost
only when it has itself been heartbeating, without a gap longer than ``gap``, for at least
the build's host timeout: then the database was reachable for that whole window, and the
owner's silence over it is its own. After an outage every host starts counting afresh, so
the owners have a full host timeout to heartbeat again before anyone may judge them.
"""

from __future__ import annotations

from typing import LiteralString

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

    async def beat_process(self, process: str, host: str, within: float) -> int:
        """Record a heartbeat of worker process ``process`` (on ``host``) now, and count
        the live workers: processes heartbeaten within the last ``within`` seconds (this
        one included), plus each live host with no live process row — a worker of an
        earlier version, which heartbeats only its host. One statement; rows of processes
        silent for `FORGET_PROCESS_AFTER` are deleted by it."""
        row = await self._fetch_one(_BEAT_PROCESS, {
            "process": process, "host": host, "within": within,
            "forget": FORGET_PROCESS_AFTER}, key={"process": process})
        assert row is not None
        return int(row["alive"])


FORGET_PROCESS_AFTER = 3600.0  # seconds of silence after which a process row is deleted

# The statement's own insert is not visible to its reads (one snapshot): this process is
# counted as the 1, and its host's own row is left out (an earlier-version worker sharing
# this host and home is therefore not counted).
def _sql(text: LiteralString) -> LiteralString:
    return " ".join(text.split())


_BEAT_PROCESS = _sql("""
WITH beat AS (
    INSERT INTO worker_process AS p (id, host) VALUES (%(process)s, %(host)s)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()
    RETURNING p.id
), forgotten AS (
    DELETE FROM worker_process
     WHERE heartbeat_at < now() - make_interval(secs => %(forget)s) AND id <> %(process)s
    RETURNING id
)
SELECT 1
     + (SELECT count(*) FROM worker_process p
         WHERE p.heartbeat_at >= now() - make_interval(secs => %(within)s)
           AND p.id <> %(process)s)
     + (SELECT count(*) FROM worker_host h
         WHERE h.heartbeat_at >= now() - make_interval(secs => %(within)s)
           AND h.host <> %(host)s
           AND NOT EXISTS (SELECT 1 FROM worker_process p
                            WHERE p.host = h.host
                              AND p.heartbeat_at >= now() - make_interval(secs => %(within)s)))
       AS alive
""")
