"""The entities Stovepipe keeps in PostgreSQL, as plain frozen data (design §2, §4, §7).

Every mutable entity carries `version`; stores update it only by compare-and-set, so
holding an entity means holding the version a write must still match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

REQUEST_ID_PREFIX = "request/"
# field metadata: the pipeline's own bookkeeping, left out of what users are shown
INTERNAL = {"internal": True}


class RequestState(StrEnum):
    ACCEPTED = "accepted"
    PROCESSING = "processing"
    SUPERSEDED = "superseded"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_REQUEST_STATES

    @property
    def is_outcome(self) -> bool:
        """A build outcome was stamped (succeeded, failed or cancelled)."""
        return self in _OUTCOME_REQUEST_STATES

    def can_become(self, new: RequestState) -> bool:
        """Whether `self → new` is an edge of the request state machine (design §4)."""
        return new in _REQUEST_TRANSITIONS[self]


_TERMINAL_REQUEST_STATES = frozenset(
    {
        RequestState.SUPERSEDED,
        RequestState.SUCCEEDED,
        RequestState.FAILED,
        RequestState.CANCELLED,
    }
)
_OUTCOME_REQUEST_STATES = frozenset(
    {RequestState.SUCCEEDED, RequestState.FAILED, RequestState.CANCELLED}
)
# Mirrored by the request_guard trigger in migrations/0001_initial.sql.
_REQUEST_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.ACCEPTED: frozenset(
        {RequestState.PROCESSING, RequestState.SUPERSEDED, RequestState.FAILED}
    ),
    RequestState.PROCESSING: frozenset(
        {RequestState.SUCCEEDED, RequestState.FAILED, RequestState.CANCELLED}
    ),
    RequestState.SUPERSEDED: frozenset(),
    RequestState.SUCCEEDED: frozenset(),
    RequestState.FAILED: frozenset(),
    RequestState.CANCELLED: frozenset(),
}


class BuildStatus(StrEnum):
    ACCEPTED = "accepted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (BuildStatus.SUCCEEDED, BuildStatus.FAILED, BuildStatus.CANCELLED)

    @property
    def request_outcome(self) -> RequestState:
        """The Request state a terminal build status projects to."""
        if not self.is_terminal:
            raise ValueError(f"build status {self.value!r} is not terminal")
        return RequestState(self.value)


class BuildStrategy(StrEnum):
    INCREMENTAL = "incremental"
    FULL = "full"


class UnvalidatedCause(StrEnum):
    """Why a Request that failed without a verdict could not validate its commit (design
    §4): ``transient`` — a lost host, a vanished build, a dependency unavailable past its
    deadline, a build that never started in time: an ingest of the head validates it
    again by itself, a bounded number of times; ``permanent`` — a refused trigger, a
    workflow that cannot start, a checkout that fails: only an explicit retry does."""

    TRANSIENT = "transient"
    PERMANENT = "permanent"


class RequestKind(StrEnum):
    """Why a Request exists (design §4, §5): ``head`` — a head of the branch, superseded by
    a newer head; ``retry`` — a commit validated again on request, and ``backfill`` — a
    commit validated to find a culprit: these two supersede nothing and nothing supersedes
    them. A backfill holds a slot of the queue's backfill capacity, never a head's."""

    HEAD = "head"
    RETRY = "retry"
    BACKFILL = "backfill"

    @property
    def supersedable(self) -> bool:
        """Only a head is superseded by a newer head (design §4, §5)."""
        return self is RequestKind.HEAD


class Verdict(StrEnum):
    """What a build that ran said. No verdict (None) is never green and never red."""

    GREEN = "green"
    RED = "red"


def make_request_id(queue: str, n: int, validation: int = 1, position: int = 0) -> str:
    """`request/<queue>/<n>`; `n` is the queue's counter value (its ingest order). A
    commit validated again is `request/<queue>/<n>.<k>`: ``validation`` k (from 2) of the
    commit first ingested as Request n, so it sorts where its commit was first ingested
    (design §4). A commit never ingested but validated to find a culprit is
    `request/<queue>/<n>~<p>` (``position`` p ≥ 1): p first-parent commits after the head
    of Request n, so it sorts by its place in the branch's history (design §5)."""
    if n < 1:
        raise ValueError(f"request counter values start at 1, got {n}")
    if validation < 1:
        raise ValueError(f"validations are counted from 1, got {validation}")
    if position < 0:
        raise ValueError(f"a position after a head is at least 1 (0: the head), got "
                         f"{position}")
    at = f"~{position}" if position else ""
    suffix = f".{validation}" if validation > 1 else ""
    return f"{REQUEST_ID_PREFIX}{queue}/{n}{at}{suffix}"


def parse_request_id(request_id: str) -> tuple[str, int]:
    """(queue, n) from `request/<queue>/<n>`, `…/<n>.<k>`, `…/<n>~<p>` or `…/<n>~<p>.<k>`.
    Queue names may themselves contain '/'."""
    queue, n, _, _ = _parse(request_id)
    return queue, n


def _parse(request_id: str) -> tuple[str, int, int, int]:
    queue, sep, tail = request_id.removeprefix(REQUEST_ID_PREFIX).rpartition("/")
    place, dot, k = tail.partition(".")
    n, tilde, p = place.partition("~")
    well_formed = (request_id.startswith(REQUEST_ID_PREFIX) and sep and queue
                   and _digits(n) and (not tilde or _digits(p))
                   and (not dot or (_digits(k) and int(k) >= 2)))
    if not well_formed:
        raise ValueError(f"not a request id (want request/<queue>/<n>, "
                         f"request/<queue>/<n>.<k> for a commit validated again, or "
                         f"request/<queue>/<n>~<p> for a commit between two heads): "
                         f"{request_id!r}")
    return queue, int(n), int(p) if tilde else 0, int(k) if dot else 1


def _digits(text: str) -> bool:
    return bool(text) and text.isascii() and text.isdigit() and not text.startswith("0")


def request_seq(request_id: str) -> int:
    """The ingest order of a request id: the place of its commit's first ingest (or of
    the head a backfilled commit follows), the coarse "newer than" (validations of one
    commit share it)."""
    return _parse(request_id)[1]


def request_position(request_id: str) -> int:
    """First-parent commits after the head of its ingest order: 0 for a head's Request,
    p for `…/<n>~<p>`."""
    return _parse(request_id)[2]


def request_validation(request_id: str) -> int:
    """Which validation of its commit a Request is: 1 for `…/<n>`, k for `…/<n>.<k>`."""
    return _parse(request_id)[3]


Order = tuple[int, int, int]


def request_order(request_id: str) -> Order:
    """(ingest order, position after that head, validation): the total order of a queue's
    Requests, which for the commits of one first-parent history is their order in it.
    Mirrors the SQL function request_rank (migration 0010)."""
    _, n, p, k = _parse(request_id)
    return n, p, k


def commit_request_id(request_id: str) -> str:
    """The id of the commit's first validation (`…/<n>[~<p>]`)."""
    queue, n, p, _ = _parse(request_id)
    return make_request_id(queue, n, 1, p)


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    last_green_uri: str | None
    last_green_request_id: str | None
    in_flight_count: int
    latest_request_id: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    backfill_in_flight: int = 0  # backfill Requests processing (their own capacity)
    # the promotion ref held at a green commit (`stovepipe pin`); None: it follows the
    # bookmark
    pinned_uri: str | None = None
    pinned_request_id: str | None = None
    pinned_by: str | None = None
    pinned_reason: str | None = None
    pinned_at: datetime | None = None

    @property
    def pinned(self) -> bool:
        return self.pinned_uri is not None


@dataclass(frozen=True, slots=True)
class Request:
    queue: str
    id: str
    uri: str
    state: RequestState
    build_strategy: BuildStrategy | None
    base_uri: str | None
    version: int
    created_at: datetime
    updated_at: datetime
    kind: RequestKind = RequestKind.HEAD
    attempt: int = 0  # the current (or last) attempt, from 1; 0 before admission
    verdict: Verdict | None = None  # set when a build's verdict settled it
    reason: str = ""  # why it ended as it did (always set when failed without a verdict)
    unvalidated_retries: int = 0  # attempts started again after one could not validate
    red_reruns: int = 0  # attempts started again after a red one (retry.red)
    # the gate loop's token, and seconds since the loop was last seen by the database's
    # clock (an observation of the moment it was read, so no part of equality): the
    # pipeline's own bookkeeping, not shown to users (INTERNAL)
    loop_token: str = field(default="", metadata=INTERNAL)
    loop_age: float = field(default=0.0, compare=False, metadata=INTERNAL)
    # minted with the row; every message about the Request carries it (design §10)
    nonce: str = field(default="", metadata=INTERNAL)
    # seconds until the current attempt may trigger its build (<= 0: due), by the
    # database's clock
    attempt_due_in: float = field(default=0.0, compare=False, metadata=INTERNAL)
    recorded: bool = field(default=False, compare=False, metadata=INTERNAL)
    # failed without a verdict: whether the cause looks transient (None: not such a
    # Request, or settled by a release that did not say: taken as transient)
    unvalidated_cause: UnvalidatedCause | None = None
    # ingests that validated its commit again by themselves before it (design §4)
    revalidations: int = 0

    @property
    def seq(self) -> int:
        """Ingest order: larger is newer (validations of one commit share it)."""
        return request_seq(self.id)

    @property
    def order(self) -> Order:
        """(ingest order, position, validation): the total order of the queue's
        Requests."""
        return request_order(self.id)

    @property
    def unvalidated(self) -> bool:
        """Failed without a verdict: it could not be validated (design §4)."""
        return self.state is RequestState.FAILED and self.verdict is None

    def is_about(self, nonce: str) -> bool:
        """Whether a message carrying ``nonce`` was about this Request (an empty nonce:
        a message from before nonces, taken to be)."""
        return not nonce or nonce == self.nonce


@dataclass(frozen=True, slots=True)
class RequestUri:
    """The dedup mapping `(queue, uri)` → request id."""

    queue: str
    uri: str
    request_id: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class Build:
    queue: str
    id: str
    request_id: str
    status: BuildStatus
    version: int
    created_at: datetime
    updated_at: datetime
    attempt: int = 1  # which attempt of its Request
    verdict: Verdict | None = None  # green/red once a run said; None: none (yet)
    reason: str = ""  # why it ended without a verdict, or more about how it ended
    # when it started running (the provider's start, or the first poll that saw it run);
    # None: not started yet
    started_at: datetime | None = None
    # the poll loop's token; seconds since the loop was last seen, since the build was
    # created (triggered) and since it started (None: not started), by the database's
    # clock (observations, so no part of equality)
    loop_token: str = field(default="", metadata=INTERNAL)
    loop_age: float = field(default=0.0, compare=False, metadata=INTERNAL)
    age: float = field(default=0.0, compare=False, metadata=INTERNAL)
    run_age: float | None = field(default=None, compare=False, metadata=INTERNAL)


@dataclass(frozen=True, slots=True)
class CommandBuild:
    """A build of the command build runner, as every host sees it (the row its owning
    ``host`` keeps up to date; see migrations/0004_command_builds.sql)."""

    build_id: str
    queue: str
    request_id: str
    trigger_key: str | None
    host: str
    work_dir: str
    status: BuildStatus
    reason: str  # queued, running, exit_code, cancelled, timeout, vanished, host_lost
    detail: str
    pid: int | None
    pgid: int | None
    proc_start_time: int | None
    exit_code: int | None
    log_tail: str
    created_at: datetime
    started_at: datetime | None
    heartbeat_at: datetime
    cancel_requested_at: datetime | None
    finished_at: datetime | None
    # the head commit it builds; None for a build started before the column existed
    head_sha: str | None = None
    # seconds since the heartbeat, by the database's clock (an observation: no part of
    # equality)
    heartbeat_age: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class ValidationFact:
    """Immutable: degree 0 is green, 1 fully broken. `project` is '' for the whole repo."""

    queue: str
    uri: str
    project: str
    degree: float
    request_id: str
    created_at: datetime
    attempts: int = 1  # builds of its Request it took
    flaky: bool = False  # green on a re-run of a red build (retry.red)

    @property
    def is_green(self) -> bool:
        return self.degree == 0


def check_degree(degree: float) -> float:
    if math.isnan(degree) or not 0 <= degree <= 1:
        raise ValueError(f"a validation degree lies in [0, 1], got {degree!r}")
    return float(degree)


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """A dead-letter message no reconciler could handle, kept for an operator."""

    id: int
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    error: str
    parked_at: datetime


class DeliveryState(StrEnum):
    INGESTING = "ingesting"  # claimed: its claimant is ingesting it now
    INGESTED = "ingested"


@dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """A push webhook delivery, by its provider's delivery id: claimed while it is being
    ingested, then the ids of the Requests its ingest found or minted."""

    provider: str
    delivery_id: str
    state: DeliveryState
    request_ids: tuple[str, ...]
    received_at: datetime
    ingested_at: datetime | None
