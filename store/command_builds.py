"""CommandBuildStore: the command build runner's builds, shared by every host.

Each write is one statement. The owning host records what it observes with a
compare-and-set on "still live and still mine" (`record`); other hosts only ask for a
cancel (`request_cancel`) or fail a build whose owner went silent (`fail_if_silent`). A
terminal status is write-once (also enforced by a trigger), so whoever moves a build to
a terminal status first decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from store._base import Row, Store
from store.entities import BuildStatus, CommandBuild

_LIVE = "('accepted', 'running')"
_COLUMNS = (
    "build_id, queue, request_id, trigger_key, host, work_dir, status, reason, detail,"
    " pid, pgid, proc_start_time, exit_code, log_tail, created_at, started_at,"
    " heartbeat_at, cancel_requested_at, finished_at, head_sha,"
    " EXTRACT(EPOCH FROM now() - heartbeat_at)::float8 AS heartbeat_age"
)


@dataclass(frozen=True)
class Observation:
    """What the owning host saw of a build, to be recorded in its row."""

    status: BuildStatus
    reason: str
    detail: str = ""
    pid: int | None = None
    pgid: int | None = None
    proc_start_time: int | None = None
    exit_code: int | None = None
    log_tail: str = ""


def _command_build(row: Row) -> CommandBuild:
    return CommandBuild(**{**row, "status": BuildStatus(row["status"])})


class CommandBuildStore(Store):
    entity = "command_build"

    async def get(self, build_id: str) -> CommandBuild:
        """The build; NotFound if absent."""
        return _command_build(await self._get_row(
            f"SELECT {_COLUMNS} FROM command_build WHERE build_id = %(id)s",
            {"id": build_id}, key={"build_id": build_id}))

    async def find_by_trigger_key(self, trigger_key: str) -> CommandBuild | None:
        row = await self._fetch_one(
            f"SELECT {_COLUMNS} FROM command_build WHERE trigger_key = %(key)s",
            {"key": trigger_key}, key={"trigger_key": trigger_key})
        return _command_build(row) if row is not None else None

    async def create_or_get(self, build_id: str, *, queue: str, request_id: str,
                            trigger_key: str | None, host: str, work_dir: str,
                            head_sha: str | None = None,
                            observed: Observation | None = None,
                            ) -> tuple[CommandBuild, bool]:
        """A new `accepted` build of ``head_sha`` (or, with ``observed``, one adopted in
        that state), and True; or the build already started for ``trigger_key`` (by any
        host), and False — whatever commit it builds: the caller compares."""
        seen = observed or Observation(BuildStatus.ACCEPTED, "queued")
        key = {"build_id": build_id}
        row = await self._fetch_one(
            "INSERT INTO command_build (build_id, queue, request_id, trigger_key, host,"
            " work_dir, head_sha, status, reason, detail, pid, pgid, proc_start_time,"
            " exit_code, log_tail, started_at, finished_at)"
            " VALUES (%(id)s, %(queue)s, %(request_id)s, %(key)s, %(host)s, %(work_dir)s,"
            " %(head_sha)s, %(status)s, %(reason)s, %(detail)s, %(pid)s, %(pgid)s,"
            " %(start_time)s, %(exit_code)s, %(log_tail)s,"
            " CASE WHEN %(pid)s::integer IS NULL THEN NULL ELSE now() END,"
            " CASE WHEN %(terminal)s THEN now() END)"
            f" ON CONFLICT DO NOTHING RETURNING {_COLUMNS}",
            {"id": build_id, "queue": queue, "request_id": request_id, "key": trigger_key,
             "host": host, "work_dir": work_dir, "head_sha": head_sha,
             **_observation(seen)},
            key=key)
        if row is not None:
            return _command_build(row), True
        # a conflict on the trigger key: the other insert has committed (ours waited for
        # it), and this new statement sees it
        known = await self.find_by_trigger_key(trigger_key) if trigger_key else None
        if known is None:
            return await self.get(build_id), False
        return known, False

    async def list_live(self, host: str, work_dir: str) -> list[CommandBuild]:
        """The builds of ``host`` under ``work_dir`` not yet terminal (the live-rows
        index)."""
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM command_build WHERE host = %(host)s"
            f" AND work_dir = %(work_dir)s AND status IN {_LIVE} ORDER BY created_at",
            {"host": host, "work_dir": work_dir}, key={"host": host, "work_dir": work_dir})
        return [_command_build(row) for row in rows]

    async def get_many(self, build_ids: list[str]) -> dict[str, CommandBuild]:
        rows = await self._fetch_all(
            f"SELECT {_COLUMNS} FROM command_build WHERE build_id = ANY(%(ids)s)",
            {"ids": build_ids}, key={"build_id": "any"})
        return {row["build_id"]: _command_build(row) for row in rows}

    async def heartbeat(self, host: str, work_dir: str) -> int:
        """Renew the heartbeat of every live build of ``host`` under ``work_dir``, by the
        database's clock; returns how many."""
        rows = await self._fetch_all(
            "UPDATE command_build SET heartbeat_at = now() WHERE host = %(host)s"
            f" AND work_dir = %(work_dir)s AND status IN {_LIVE} RETURNING build_id",
            {"host": host, "work_dir": work_dir}, key={"host": host, "work_dir": work_dir})
        return len(rows)

    async def record(self, build_id: str, host: str,
                     observed: Observation) -> CommandBuild | None:
        """Store what the owner observed (and renew the heartbeat), if the build is still
        live and still ``host``'s (compare-and-set); None when it is not: then another
        host decided its status first, and that stays."""
        row = await self._fetch_one(
            "UPDATE command_build SET status = %(status)s, reason = %(reason)s,"
            " detail = %(detail)s, pid = %(pid)s, pgid = %(pgid)s,"
            " proc_start_time = %(start_time)s, exit_code = %(exit_code)s,"
            " log_tail = %(log_tail)s, heartbeat_at = now(),"
            " started_at = COALESCE(started_at,"
            "   CASE WHEN %(pid)s::integer IS NULL THEN NULL ELSE now() END),"
            " finished_at = CASE WHEN %(terminal)s THEN now() END"
            " WHERE build_id = %(id)s AND host = %(host)s"
            f" AND status IN {_LIVE} RETURNING {_COLUMNS}",
            {"id": build_id, "host": host, **_observation(observed)},
            key={"build_id": build_id})
        return _command_build(row) if row is not None else None

    async def request_cancel(self, build_id: str) -> CommandBuild:
        """Ask the owner to stop the build (idempotent: the first request's time stays);
        a terminal build is returned as it is. NotFound if absent."""
        row = await self._fetch_one(
            "UPDATE command_build SET"
            " cancel_requested_at = COALESCE(cancel_requested_at, now())"
            f" WHERE build_id = %(id)s AND status IN {_LIVE} RETURNING {_COLUMNS}",
            {"id": build_id}, key={"build_id": build_id})
        return _command_build(row) if row is not None else await self.get(build_id)

    async def fail_if_silent(self, build_id: str, older_than: float, *, declarer: str,
                             gap: float) -> CommandBuild | None:
        """Fail a live build whose heartbeat is older than ``older_than`` seconds by the
        database's clock (compare-and-set on both) — only on evidence: the ``declarer``
        host itself has been heartbeating (`WorkerHostStore.heartbeat`) without a gap
        longer than ``gap`` for at least ``older_than`` seconds, so the database was
        reachable all that time and the owner's silence is its own, not an outage's.
        None when it is not (any more), or when the evidence is missing."""
        row = await self._fetch_one(
            "UPDATE command_build SET status = 'failed', reason = 'host_lost',"
            " detail = format('host %%s stopped heartbeating (last seen %%s, %%s s before"
            " it was declared lost)', host,"
            "   to_char(heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
            "   floor(EXTRACT(EPOCH FROM now() - heartbeat_at))::bigint),"
            " finished_at = now()"
            f" WHERE build_id = %(id)s AND status IN {_LIVE}"
            " AND heartbeat_at < now() - make_interval(secs => %(age)s)"
            " AND EXISTS (SELECT 1 FROM worker_host w WHERE w.host = %(declarer)s"
            "   AND w.up_since <= now() - make_interval(secs => %(age)s)"
            "   AND w.heartbeat_at >= now() - make_interval(secs => %(gap)s))"
            f" RETURNING {_COLUMNS}",
            {"id": build_id, "age": older_than, "declarer": declarer, "gap": gap},
            key={"build_id": build_id})
        return _command_build(row) if row is not None else None


def _observation(observed: Observation) -> dict[str, object]:
    return {"status": observed.status.value, "reason": observed.reason,
            "detail": observed.detail, "pid": observed.pid, "pgid": observed.pgid,
            "start_time": observed.proc_start_time, "exit_code": observed.exit_code,
            "log_tail": observed.log_tail, "terminal": observed.status.is_terminal}

