"""The pipeline's state changes of design §5, each one statement that checks its own
conditions as it writes, plus the joined reads the stages start from.

Each change used to be a read, a decision in Python and a compare-and-set on the version
read, often in a transaction of several statements. Here the conditions the decision
relied on are part of the write, so a change that still holds commits in one round trip,
and one that no longer holds writes nothing and says so (the caller re-reads and decides
again, exactly as after a lost compare-and-set). Under READ COMMITTED an UPDATE that waits
for a concurrent writer re-checks its WHERE clause against the row that writer committed,
which is what makes a condition in the WHERE clause as strong as a compare-and-set. The
statements themselves are in `store.statements`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import LiteralString

from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from store._base import Row, Store, translate_integrity_errors
from store.builds import _build
from store.entities import (
    REQUEST_ID_PREFIX,
    Build,
    BuildStatus,
    BuildStrategy,
    Queue,
    Request,
    RequestState,
    UnvalidatedCause,
    ValidationFact,
    Verdict,
    check_degree,
)
from store.errors import NotFound
from store.requests import _request
from store.statements import (
    ADMIT,
    BUILD_COLUMNS,
    COMMIT_LOCK_NAMESPACE,
    END_ATTEMPT,
    FACT_COLUMNS,
    FIND_OR_MINT,
    LOCK_COMMIT,
    MINT_BACKFILL,
    QUEUE_COLUMNS,
    RECORD_FACT,
    REQUEST_COLUMNS,
    REQUEST_KEYS,
    VALIDATE_AGAIN,
)


def _prefixed(row: Row, prefix: str) -> Row | None:
    """The columns of ``row`` named ``prefix``+name, by name; None for a missed join."""
    picked = {k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)}
    return None if all(v is None for v in picked.values()) else picked


def _request_of(row: Row) -> Request:
    return _request({k: row[k] for k in REQUEST_KEYS})


@dataclass(frozen=True)
class Revalidation:
    """How often an ingest validates again, by itself, a head whose newest Request could
    not validate it for a transient cause (design §4): at most ``most`` times per
    commit, the n-th (from 0) once ``spacing`` * 2**n seconds (at most ``spacing_cap``)
    have passed since the Request before it ended."""

    most: int = 2
    spacing: float = 30.0
    spacing_cap: float = 3600.0


@dataclass(frozen=True)
class Minted:
    """What ingest's find-or-mint did for one head."""

    request_id: str
    state: RequestState  # the Request's state when the statement ran
    minted: bool  # a new Request was created for the head by this call
    nonce: str = ""


@dataclass(frozen=True)
class Again:
    """What asking to validate a commit again found or did (`StepStore.validate_again`)."""

    newest_id: str | None  # the commit's newest Request before the call; None: never ingested
    newest_state: RequestState | None
    minted_id: str | None  # the new Request validating it again; None: none was minted


@dataclass(frozen=True)
class Backfilled:
    """What asking for a backfill of a commit found or did (`StepStore.mint_backfill`)."""

    newest_id: str | None  # the commit's newest Request before the call; None: none
    newest_state: RequestState | None
    newest_verdict: Verdict | None
    minted_id: str | None  # the new backfill Request; None: none was minted
    nonce: str = ""


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ends (decided by buildsignal or build from the Request it read):
    ``settle`` the Request with ``outcome`` (its slot released), or start attempt n+1
    after ``backoff`` seconds, counted as an ``unvalidated`` retry or a ``red`` re-run."""

    settle: bool
    outcome: RequestState | None = None
    verdict: Verdict | None = None
    reason: str = ""
    again_after: str = ""  # "unvalidated" | "red" when not settling
    backoff: float = 0.0
    cause: UnvalidatedCause | None = None  # settled without a verdict: why (design §4)


@dataclass(frozen=True)
class Ended:
    """What ending an attempt did: the build's stored (write-once) status, verdict and
    reason (None without a build), and the Request as the statement left it when this
    call ended the attempt (None: another delivery, a reconciler or a different stored
    build status got there first — read again and decide again)."""

    build_status: BuildStatus | None
    build_verdict: Verdict | None
    build_reason: str
    request: Request | None
    settled: bool  # the Request was settled (else: its next attempt began), if request


@dataclass(frozen=True)
class Settled:
    """What settling a build did: the build's stored (write-once) status, and the Request
    if this call stamped its outcome (None: another build or a reconciler did first, or
    the stored status is not terminal yet)."""

    build_status: BuildStatus
    request: Request | None


@dataclass(frozen=True)
class Recorded:
    """What recording a fact did: the stored fact (the Request's own, or the commit's
    green fact that refused it) and whether this fact's Request holds the bookmark now."""

    fact: ValidationFact | None  # None: a concurrent writer's fact is not visible yet
    holds_bookmark: bool
    pinned_uri: str | None = None  # the promotion ref is pinned there (read after the fact)


def verdict_of(status: BuildStatus) -> Verdict | None:
    """The verdict a build that ran and ended with ``status`` gives."""
    return {BuildStatus.SUCCEEDED: Verdict.GREEN,
            BuildStatus.FAILED: Verdict.RED}.get(status)


class StepStore(Store):
    entity = "request"

    # --- joined reads ----------------------------------------------------------------

    async def request_with_queue(self, queue: str, request_id: str) -> tuple[Request,
                                                                            Queue | None]:
        """The Request and its queue's row (None if the queue has no row yet), in one
        read. NotFound if the Request is absent."""
        row = await self._get_row(
            f"SELECT {REQUEST_COLUMNS}, {QUEUE_COLUMNS} FROM request r"
            " LEFT JOIN queue q ON q.name = r.queue"
            " WHERE r.queue = %(queue)s AND r.id = %(id)s",
            {"queue": queue, "id": request_id},
            key={"queue": queue, "id": request_id},
        )
        fields = _prefixed(row, "q_")
        return _request_of(row), Queue(**fields) if fields is not None else None

    async def request_with_attempt_build(self, queue: str,
                                         request_id: str) -> tuple[Request, str | None]:
        """The Request and the id of the build of its current attempt (None if that
        attempt has none yet), in one read. NotFound if the Request is absent."""
        row = await self._get_row(
            f"SELECT {REQUEST_COLUMNS}, (SELECT b.id FROM build b"
            "  WHERE b.queue = r.queue AND b.request_id = r.id AND b.attempt = r.attempt"
            "  ORDER BY b.created_at, b.id LIMIT 1) AS attempt_build_id"
            " FROM request r WHERE r.queue = %(queue)s AND r.id = %(id)s",
            {"queue": queue, "id": request_id},
            key={"queue": queue, "id": request_id},
        )
        return _request_of(row), row["attempt_build_id"]

    async def build_with_request(self, queue: str, build_id: str) -> tuple[Build, Request]:
        """The build and its Request, in one read. NotFound if the build is absent."""
        key = {"queue": queue, "id": build_id}
        row = await self._fetch_one(
            f"SELECT {REQUEST_COLUMNS}, {BUILD_COLUMNS} FROM build b"
            " JOIN request r ON r.queue = b.queue AND r.id = b.request_id"
            " WHERE b.queue = %(queue)s AND b.id = %(id)s", key, key=key)
        if row is None:
            raise NotFound("build", key)
        build = _prefixed(row, "b_")
        assert build is not None
        return _build(build), _request_of(row)

    # --- state changes ---------------------------------------------------------------

    async def find_or_mint(self, queue: str, uri: str, *,
                           lease_holder: str | None = None,
                           revalidation: Revalidation = Revalidation()) -> Minted | None:
        """ingest: the Request of head ``uri``, minting one when the head has none (or
        only a superseded one, or a mapping whose Request was never written: a head the
        branch came back to must be validated after all), and the queue's latest pointer
        moved forward to it. When the head's newest Request could not validate it for a
        cause that looks transient, a new validation of it is minted — at most
        ``revalidation.most`` times per commit, each once its spacing has passed since
        the Request before ended (`Revalidation`); it sorts where the commit was first
        ingested (`…/<n>.<k>`), unless a newer head was ingested since: then it is the
        newest head (a fresh number). After a red verdict or a permanent cause it is
        not. One statement, holding the commit's lock: counter, Request, mapping and
        latest commit together.

        Ingests of a queue are serialized: by the queue's ingest lease, which the
        statement checks and gives back (``lease_holder``; None when the caller holds the
        queue's lock instead, `Transaction.lock_queue`). None when the lease is no longer
        the caller's (nothing was written), or when the id to mint was taken meanwhile
        (the lease is given back: resolve and try again)."""
        row = await self._fetch_one_holding_commit(queue, uri, FIND_OR_MINT, {
            "queue": queue, "uri": uri, "prefix": f"{REQUEST_ID_PREFIX}{queue}/",
            "holder": lease_holder, "max_revalidations": revalidation.most,
            "spacing": revalidation.spacing, "spacing_cap": revalidation.spacing_cap})
        if row is None:
            return None
        return Minted(row["id"], RequestState(row["state"]), row["minted"], row["nonce"])

    async def validate_again(self, queue: str, uri: str) -> Again:
        """An explicit retry: a new Request (`…/<n>.<k>`, kind `retry`) validating commit
        ``uri`` again, when its newest Request ended `failed` (either way), `cancelled` or
        `superseded`; it sorts where the commit was first ingested, so it supersedes no
        newer head, and the queue's latest moves to it only if it is newer by that order.
        Nothing is minted when the commit was never ingested, is green, or is being
        validated now (`Again.newest_state` says which). Holds the commit's lock, so two
        retries at once mint one Request and the second is told it is under way."""
        row = await self._fetch_one_holding_commit(queue, uri, VALIDATE_AGAIN, {
            "queue": queue, "uri": uri, "prefix": f"{REQUEST_ID_PREFIX}{queue}/"})
        if row is None:
            return Again(None, None, None)
        return Again(row["newest_id"], RequestState(row["newest_state"]), row["minted_id"])

    async def mint_backfill(self, queue: str, uri: str, fresh_id: str) -> Backfilled:
        """A culprit search's probe: a new Request (kind `backfill`) validating commit
        ``uri`` — ``fresh_id`` (`…/<n>~<p>`) for a commit the queue never validated, the
        commit's next validation (`….<k>`) when its newest Request was superseded,
        cancelled or could not validate it. Nothing is minted when the commit is green,
        red or being validated now (`Backfilled.newest_*` say which); the queue's latest
        never moves to a backfill. Holds the commit's lock: one live Request per commit."""
        row = await self._fetch_one_holding_commit(queue, uri, MINT_BACKFILL, {
            "queue": queue, "uri": uri, "fresh_id": fresh_id})
        assert row is not None
        return Backfilled(
            row["newest_id"],
            RequestState(row["newest_state"]) if row["newest_state"] else None,
            Verdict(row["newest_verdict"]) if row["newest_verdict"] else None,
            row["minted_id"], row["nonce"] or "")

    async def _fetch_one_holding_commit(self, queue: str, uri: str, statement: LiteralString,
                                        params: Mapping[str, object]) -> Row | None:
        """Run ``statement`` after taking the commit's lock in a statement of its own in
        the same transaction (`statements.LOCK_COMMIT`), so ``statement``'s snapshot
        starts once the lock's previous holder committed. On a pooled connection the
        transaction is this call's: BEGIN, the lock, the statement and COMMIT travel in
        one round trip (a pipeline); inside an open transaction the lock is held to its
        end."""
        key = {"queue": queue, "uri": uri}
        lock = {"namespace": COMMIT_LOCK_NAMESPACE, **key}
        async with (
            translate_integrity_errors(self.entity, key),
            self._source.connection() as conn,
        ):
            own = conn.info.transaction_status is TransactionStatus.IDLE
            cur = conn.cursor(row_factory=dict_row)
            try:
                async with conn.pipeline():
                    if own:
                        await conn.execute("BEGIN")
                    await conn.execute(LOCK_COMMIT, lock)
                    await cur.execute(statement, params)
                    if own:
                        await conn.execute("COMMIT")
                return await cur.fetchone()
            except BaseException:
                if own and conn.info.transaction_status is not TransactionStatus.IDLE:
                    # a connection too broken to roll back is discarded by the pool
                    with contextlib.suppress(Exception):
                        await conn.execute("ROLLBACK")
                raise
            finally:
                await cur.close()

    async def admit(self, request: Request, *, strategy: BuildStrategy,
                    base_uri: str | None, max_concurrent: int,
                    last_green_request_id: str | None,
                    backfill_max_concurrent: int = 0,
                    status_channels: Sequence[str] = ()) -> Request | None:
        """process: take a slot of the Request's queue and move the Request to
        `processing` with its build strategy and its first attempt, in one statement —
        only if the Request is still the one read (same version, `accepted`), the queue
        has a free slot for its heads (a `backfill` takes a slot of the backfill capacity,
        ``backfill_max_concurrent``, and only while a head's slot is free too), no newer
        Request is the queue's latest (for a head: a `retry` or a `backfill` supersedes
        nothing and nothing supersedes it), and the bookmark the strategy was decided from
        (``last_green_request_id``) has not moved. None when any of that no longer holds:
        nothing was written; read again and decide again. With ``status_channels`` the
        Request's `pending` commit status joins the outbox in the same statement."""
        if (strategy is BuildStrategy.INCREMENTAL) != (base_uri is not None):
            raise ValueError(f"an incremental build needs a base URI and a full one takes "
                             f"none (got {strategy}, base_uri={base_uri!r})")
        row = await self._fetch_one(ADMIT, {
            "queue": request.queue, "id": request.id, "version": request.version,
            "kind": request.kind.value, "max": max_concurrent,
            "backfill_max": backfill_max_concurrent, "last_green": last_green_request_id,
            "strategy": strategy.value, "base_uri": base_uri,
            "status_channels": list(status_channels)},
            key={"queue": request.queue, "id": request.id})
        return _request(row) if row is not None else None

    async def end_attempt(self, request: Request, end: AttemptEnd, *,
                          build: Build | None = None,
                          build_status: BuildStatus | None = None,
                          build_verdict: Verdict | None = None, build_reason: str = "",
                          status_channels: Sequence[str] = ()) -> Ended:
        """buildsignal (or build, when a trigger never succeeded): end the Request's
        current attempt as ``end`` says, in one statement. With ``build``, its terminal
        ``build_status`` (and verdict and reason) is stored first — write-once: one stored
        first stays — and the Request changes only if the stored build says what ``end``
        was decided from. The Request changes only if it is still the one read (same
        version, `processing`, the same attempt): settled with its outcome and its slot
        released, or moved to its next attempt (keeping its slot), due after the backoff.
        A Request settled without a verdict (cancelled, or failed because it could not be
        validated) gets its final commit status (`error`) here: it will have no fact."""
        if build is not None and (build_status is None or not build_status.is_terminal):
            raise ValueError(f"ending an attempt with a build needs its terminal status, got "
                             f"{build_status}")
        if end.settle and end.outcome is None:
            raise ValueError("settling a Request needs its outcome")
        row = await self._fetch_one(END_ATTEMPT, {
            "queue": request.queue, "request_id": request.id, "version": request.version,
            "attempt": request.attempt,
            "build_id": build.id if build is not None else None,
            "status": build_status.value if build_status is not None else None,
            "b_verdict": build_verdict.value if build_verdict is not None else None,
            "b_reason": build_reason, "settle": end.settle,
            "outcome": end.outcome.value if end.outcome is not None else None,
            "r_verdict": end.verdict.value if end.verdict is not None else None,
            "r_reason": end.reason, "cause": end.cause.value if end.cause else None,
            "unvalidated": int(end.again_after == "unvalidated"),
            "red": int(end.again_after == "red"), "backoff": max(0.0, end.backoff),
            "status_channels": list(status_channels)},
            key={"queue": request.queue, "id": request.id})
        assert row is not None
        stored = row["build_status"]
        verdict = row["build_verdict"]
        changed = _request_of(row) if row["id"] is not None else None
        return Ended(BuildStatus(stored) if stored is not None else None,
                     Verdict(verdict) if verdict is not None else None,
                     row["build_reason"] or "", changed, row["ended"] == "settled")

    async def settle(self, build: Build, status: BuildStatus,
                     status_channels: Sequence[str] = ()) -> Settled:
        """Store a terminal ``status`` on the build (write-once) and settle its Request, if
        still `processing`, with the outcome the stored status projects to (a build that
        ran: succeeded is a green verdict, failed a red one; cancelled has none) — no
        re-attempt. For callers that settle directly (the store's own tests and tools);
        the pipeline decides through `end_attempt`."""
        if not status.is_terminal:
            raise ValueError(f"settling needs a terminal status, got {status}")
        stored: BuildStatus = status
        for _ in range(2):  # a second time from the status another delivery stored first
            request = await self._request(build.queue, build.request_id)
            verdict = verdict_of(status)
            ended = await self.end_attempt(
                request, AttemptEnd(settle=True, outcome=status.request_outcome,
                                    verdict=verdict,
                                    reason="its build was cancelled"
                                    if status is BuildStatus.CANCELLED else ""),
                build=build, build_status=status, build_verdict=verdict,
                status_channels=status_channels)
            assert ended.build_status is not None
            stored = ended.build_status
            if ended.request is not None or stored is status:
                break
            status = stored
        return Settled(stored, ended.request)

    async def _request(self, queue: str, request_id: str) -> Request:
        row = await self._get_row(f"SELECT {REQUEST_COLUMNS} FROM request r"
                                  " WHERE r.queue = %(queue)s AND r.id = %(id)s",
                                  {"queue": queue, "id": request_id},
                                  key={"queue": queue, "id": request_id})
        return _request_of(row)

    async def record_fact(self, queue: str, uri: str, *, request_id: str,
                          degree: float, attempts: int = 1, flaky: bool = False,
                          move_bookmark: bool = True, checked_bookmark: str | None = None,
                          check_bookmark: bool = False,
                          status_channels: Sequence[str] = (),
                          alert_channels: Sequence[str] = ()) -> Recorded:
        """record: write the Request's fact (first fact wins: an existing one stays; a
        commit has at most one green fact) and, when the stored fact is this Request's
        and green, move the bookmark to it unless it already names a newer Request — one
        statement, which also marks the Request recorded (the sweeper looks for settled
        verdicts that are not). ``holds_bookmark`` is whether this Request holds the
        bookmark afterwards (moved now or by an earlier delivery).

        A newly written fact also decides the queue's greenness, if its Request is the
        newest (by ingest order, then validation) with a fact — a late fact of an older
        commit changes nothing — and puts in the outbox, in the same statement, the
        Request's final commit status (``status_channels``) and, when the greenness
        changed, an alert (``alert_channels``): red on any change to red, including a
        queue's first fact; green on a change from red. A redelivery writes no fact, so
        it adds nothing.

        The bookmark moves only with ``move_bookmark``, and with ``check_bookmark`` only
        if it is still ``checked_bookmark`` (a backfilled commit moves it only when it
        descends from the bookmark, which the caller asked the repository about)."""
        row = await self._fetch_one(RECORD_FACT, {
            "queue": queue, "uri": uri, "project": "", "degree": check_degree(degree),
            "request_id": request_id, "attempts": attempts, "flaky": flaky,
            "may_move": move_bookmark, "checked": check_bookmark,
            "checked_bookmark": checked_bookmark,
            "status_channels": list(status_channels),
            "alert_channels": list(alert_channels)},
            key={"queue": queue, "uri": uri, "project": ""},
            request_key={"queue": queue, "id": request_id})
        if row is None:
            return Recorded(None, False)
        fact = ValidationFact(**{k: row[k] for k in FACT_COLUMNS.split(", ")})
        holder = row["moved_to"] or row["holder_before"]
        return Recorded(fact, holder == request_id, row["pinned_uri"])


