"""A Hypothesis model of process → build → buildsignal → record (and the reconcilers) under
redelivery and reordering, against the real PostgreSQL store (design §4 invariants).

The real handlers run one message at a time. Kafka is replaced by a multiset of pending
messages: Hypothesis picks which one to deliver next (reordering) and whether to keep a
copy for a later redelivery (at-least-once duplicates), and interleaves pushes + ingests,
build progress, one-shot injected faults (source control, runner, broker acks) and polls
past the poll deadline. Outcomes are mapped as the runtime maps them
(`streams.runtime.policy.decide`): hold and retry re-queue the message, dead letters go
to `<key>_dlq`, whose reconciler retries forever. After every step and at the final
quiet point (everything drained, every build finished) the invariants are checked.

Examples share one migrated schema and are isolated by queue names unique per example.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from contract import BuildSignal, marshal, payload_type, unmarshal
from store import BuildStatus, Database, NotFound, RequestState, request_order, request_seq
from streams.config.queues import RetrySpec
from streams.runtime import Hold, NonRetryable, Retryable, Wait
from streams.runtime import headers as h
from streams.runtime.classify import outcome_of_exception
from streams.runtime.policy import Commit, DeadLetter, ParkMessage, Redeliver, Retry, decide
from streams.runtime.stage import Context, Incoming
from streams.stages.build import handle_build
from streams.stages.buildsignal import handle_buildsignal
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_queue
from streams.stages.process import handle_process
from streams.stages.reconcile import (
    handle_build_dlq,
    handle_buildsignal_dlq,
    handle_process_dlq,
    handle_record_dlq,
)
from streams.stages.record import handle_record
from tests.model_support import (
    Bus,
    CrashWindows,
    FaultyDatabase,
    InjectedRunnerError,
    InjectedSourceControlError,
    Knobs,
    MemoryExtensions,
    MemoryQueues,
    MemoryRepo,
    MemoryRunner,
    ModelViolation,
    Pending,
    is_injected,
)

pytestmark = pytest.mark.postgres

log = logging.getLogger("stovepipe.model")

HANDLERS: dict[str, Any] = {
    "process": handle_process,
    "build": handle_build,
    "buildsignal": handle_buildsignal,
    "record": handle_record,
    "process_dlq": handle_process_dlq,
    "build_dlq": handle_build_dlq,
    "buildsignal_dlq": handle_buildsignal_dlq,
    "record_dlq": handle_record_dlq,
}
RETRY = Retry(max_attempts=5, backoff=(1.0, 5.0, 30.0, 120.0))  # topics.yaml defaults
RETRY_FOREVER = Retry(max_attempts=None, backoff=(1.0, 5.0, 30.0, 120.0))

MAX_STEPS = 60
MAX_HEADS = 6
DRAIN_LIMIT = 1500
DRAIN_CHOSEN = 60  # drain steps whose order Hypothesis picks; FIFO afterwards
DRAIN_DUPLICATES = 20
STEP_KINDS = ["flow"] * 4 + ["deliver"] * 4 + ["push"] * 3 + ["build"] * 3 + ["fault", "deadline"]
FAULT_TARGETS = ["db", "is_ancestor", "promote", "trigger", "status", "publish", "db"]
BUILD_ENDS = [BuildStatus.SUCCEEDED, BuildStatus.SUCCEEDED, BuildStatus.FAILED]
OUTCOME_OF_REQUEST = {RequestState.SUCCEEDED: 0.0, RequestState.FAILED: 1.0}


@dataclass
class QueueModel:
    name: str
    knobs: Knobs
    repo: MemoryRepo
    runner: MemoryRunner
    heads: int = 0
    bookmark_seq: int = 0
    promoted_seq: int = 0
    ids_by_uri: dict[str, str] = field(default_factory=dict)


class Model:
    def __init__(self, db: Database, data: st.DataObject) -> None:
        self.db = db
        self.data = data
        token = uuid.uuid4().hex[:10]
        self.queues: dict[str, QueueModel] = {}
        for i in range(data.draw(st.integers(1, 2), label="queues")):
            name = f"m{token}/q{i}"
            retry = RetrySpec(unvalidated=data.draw(st.integers(0, 2), label="unvalidated"),
                              red=data.draw(st.integers(0, 1), label="red"),
                              backoff=timedelta(milliseconds=1))
            knobs = Knobs(max_concurrent=data.draw(st.integers(1, 2), label="max_concurrent"),
                          retry=retry)
            repo = MemoryRepo(name, forget_orphans=data.draw(st.booleans(), label="forget"))
            repo.on_promote = self._check_promotion
            self.queues[name] = QueueModel(name, knobs, repo,
                                           MemoryRunner(name, f"{token}-{i}"))
        self.names = list(self.queues)
        self.bus = Bus()
        self.crashes = CrashWindows()
        self.deps = Deps(
            db=FaultyDatabase(db, self.crashes),  # type: ignore[arg-type]
            queues=MemoryQueues({q.name: q.knobs for q in self.queues.values()}),  # type: ignore[arg-type]
            extensions=MemoryExtensions(  # type: ignore[arg-type]
                {q.name: q.repo for q in self.queues.values()},
                {q.name: q.runner for q in self.queues.values()}),
        )
        self.facts: dict[tuple[str, str, str], tuple[Any, ...]] = {}  # (queue, request, project)
        self.request_seen: dict[str, tuple[RequestState, Any, Any]] = {}
        self.build_terminal: dict[str, BuildStatus] = {}
        self.queue_rows: dict[str, tuple[Any, ...]] = {}
        self.outcomes: Counter[str] = Counter()
        self.parked: list[str] = []
        self.trace: list[str] = []

    # -- the run ---------------------------------------------------------------------------
    async def run(self) -> None:
        steps = self.data.draw(st.integers(1, MAX_STEPS), label="steps")
        for _ in range(steps):
            kind = self.data.draw(st.sampled_from(STEP_KINDS), label="step")
            await getattr(self, f"step_{kind}")()
            await self.check()
        await self.drain()
        await self.check(final=True)
        assert not self.parked, f"parked with no cause: {self.parked}\n{self._trace_tail()}"
        for name in self.outcomes:
            event(f"outcome {name}")

    async def step_deliver(self) -> None:
        if not self.bus.pending:
            await self.step_push()
            return
        index = self.data.draw(st.integers(0, len(self.bus.pending) - 1), label="message")
        duplicate = self.data.draw(st.integers(0, 3), label="duplicate") == 0
        await self.deliver(index, duplicate=duplicate)

    async def step_flow(self) -> None:
        """Deliver the oldest pending message (what Kafka would do next)."""
        if not self.bus.pending:
            await self.step_push()
            return
        await self.deliver(0, duplicate=False)

    async def step_push(self) -> None:
        queue = self.queues[self.data.draw(st.sampled_from(self.names), label="queue")]
        kind = self.data.draw(st.sampled_from(["commit", "force", "reset", "same"]),
                              label="push")
        if kind in ("commit", "force"):
            if queue.heads >= MAX_HEADS:
                return
            queue.heads += 1
        back = self.data.draw(st.integers(1, 3), label="back") if kind != "commit" else 0
        match kind:
            case "commit":
                queue.repo.push()
            case "force":
                queue.repo.force_push(back)
            case "reset":
                queue.repo.reset(back)
        await self.ingest(queue)

    async def ingest(self, queue: QueueModel) -> None:
        """Like a poller: an ingest that failed (an injected broker fault) is retried."""
        head = await queue.repo.head()
        for _ in range(3):
            try:
                request_id = await ingest_queue(self.deps, queue.name, self.bus.publish)
                break
            except Exception as exc:
                if not is_injected(exc):
                    raise
        else:
            raise AssertionError("ingest kept failing")
        self.trace.append(f"ingest {queue.name} {head} -> {request_id}")
        known = queue.ids_by_uri.setdefault(head, request_id)
        if known != request_id:
            # only a head whose Request was superseded (never built) gets a new Request,
            # and only a newer one: the branch came back to it and it must be validated;
            # and a head whose Request could not validate it (failed without a verdict)
            # is validated again, where it was first ingested — or, when a newer head was
            # ingested since (the branch came back to it), as the newest head (design §4)
            old = await self.deps.db.requests.get_by_id(known)
            newest = max(request_seq(rid) for rid in queue.ids_by_uri.values())
            if old.state is RequestState.SUPERSEDED:
                assert request_seq(request_id) > request_seq(known)
            else:
                assert old.unvalidated, (
                    f"head {head} was {known} ({old.state}), now {request_id}")
                if newest > request_seq(known):
                    assert request_seq(request_id) > newest
                else:
                    assert request_seq(request_id) == request_seq(known)
                assert request_order(request_id) > request_order(known)
            queue.ids_by_uri[head] = request_id

    async def step_build(self) -> None:
        running = [b for q in self.queues.values() for b in q.runner.builds.values()
                   if not b.status.is_terminal]
        if not running:
            await self.step_deliver()
            return
        build = running[self.data.draw(st.integers(0, len(running) - 1), label="build")]
        choices = [*BUILD_ENDS, BuildStatus.CANCELLED]
        if build.status is BuildStatus.ACCEPTED:
            choices.insert(0, BuildStatus.RUNNING)
        to = self.data.draw(st.sampled_from(choices), label="build_to")
        self.queues[build.queue].runner.advance(build.id, to)
        self.trace.append(f"build {build.id} -> {to}")

    async def step_fault(self) -> None:
        target = self.data.draw(st.sampled_from(FAULT_TARGETS), label="fault")
        retryable = self.data.draw(st.booleans(), label="retryable")
        queue = self.queues[self.data.draw(st.sampled_from(self.names), label="queue")]
        message = f"injected {target} fault"
        match target:
            case "db":
                countdown = self.data.draw(st.integers(0, 4), label="countdown")
                mode = self.data.draw(st.sampled_from(["before", "after"]), label="mode")
                self.crashes.armed = (countdown, mode)
                message = f"{message} countdown={countdown} {mode}"
            case "is_ancestor" | "promote":
                queue.repo.faults[target] = InjectedSourceControlError(message,
                                                                       retryable=retryable)
            case "trigger" | "status":
                queue.runner.faults[target] = InjectedRunnerError(message, retryable=retryable)
            case "publish":
                self.bus.fail_next_publish = True
        self.trace.append(f"{message} retryable={retryable} {queue.name}")

    async def step_deadline(self) -> None:
        """Deliver a buildsignal message as if its build had run past the poll deadline."""
        signals = [i for i, m in enumerate(self.bus.pending) if m.key == "buildsignal"]
        if not signals:
            await self.step_deliver()
            return
        index = signals[self.data.draw(st.integers(0, len(signals) - 1), label="signal")]
        queue = self.queues[unmarshal(self.bus.pending[index].value, BuildSignal).queue_name]
        saved = queue.knobs.poll_deadline
        queue.knobs.poll_deadline = timedelta(seconds=-60)
        try:
            await self.deliver(index, duplicate=False, note=" past deadline")
        finally:
            queue.knobs.poll_deadline = saved

    async def drain(self) -> None:
        """Deliver everything pending, finishing every build, until the bus is empty."""
        for i in range(DRAIN_LIMIT):
            for queue in self.queues.values():
                for build in list(queue.runner.builds.values()):
                    if not build.status.is_terminal:
                        to = (self.data.draw(st.sampled_from(BUILD_ENDS), label="finish")
                              if i < DRAIN_CHOSEN else BuildStatus.SUCCEEDED)
                        queue.runner.advance(build.id, to)
                        self.trace.append(f"build {build.id} -> {to}")
            if not self.bus.pending:
                return
            if i < DRAIN_CHOSEN:
                index = self.data.draw(st.integers(0, len(self.bus.pending) - 1),
                                       label="drain")
                duplicate = (i < DRAIN_DUPLICATES
                             and self.data.draw(st.integers(0, 4), label="dup") == 0)
            else:
                index, duplicate = 0, False
            await self.deliver(index, duplicate=duplicate)
            await self.check()
        raise AssertionError("liveness: the bus never drained; pending: "
                             + ", ".join(self._describe(m) for m in self.bus.pending[:10])
                             + "\n" + self._trace_tail())

    # -- one delivery, as the runtime performs it ------------------------------------------
    async def deliver(self, index: int, *, duplicate: bool, note: str = "") -> None:
        msg = self.bus.pending.pop(index)
        if duplicate:
            self.bus.pending.append(Pending(msg.key, msg.value, msg.attempt, msg.serial))
        reconciler = msg.key.endswith("_dlq")
        payload = unmarshal(msg.value, payload_type(msg.key.removesuffix("_dlq")))
        ctx = Context(
            stage=msg.key,
            # a retry carries where its delivery began, as the runtime's do
            message=Incoming(topic=msg.key, partition=0, offset=msg.serial, key=None,
                             value=msg.value,
                             headers=[(h.ATTEMPT, str(msg.attempt).encode()),
                                      (h.ORIGIN, msg.origin.encode())]),
            publish=self.bus.publish,
            deps=self.deps,
            log=logging.LoggerAdapter(log, {"stage": msg.key}),
        )
        try:
            outcome = await HANDLERS[msg.key](payload, ctx)
        except ModelViolation:
            raise
        except Exception as exc:
            outcome = outcome_of_exception(exc)
        action = decide(outcome, attempt=msg.attempt,
                        retry=RETRY_FOREVER if reconciler else RETRY, reconciler=reconciler)
        if isinstance(outcome, Hold):
            self._check_hold(msg, payload, outcome)
        name = type(outcome).__name__
        self.outcomes[f"{msg.key} {name}"] += 1
        self.trace.append(f"deliver{note} {self._describe(msg)}"
                          f"{' (dup kept)' if duplicate else ''} -> {outcome}")
        if isinstance(outcome, Retryable | NonRetryable) and not is_injected(outcome.error):
            # a retryable error may follow from an earlier fault (a lagging read); a
            # non-retryable one in a model with no concurrency is a handler bug
            if isinstance(outcome, NonRetryable):
                raise ModelViolation(f"{msg.key} failed with no injected fault: {outcome!r}"
                                     f"\n{self._trace_tail()}") from outcome.error
            self.outcomes[f"{msg.key} {type(outcome.error).__name__}"] += 1
        match action:
            case Commit():
                pass
            case Redeliver(attempt=attempt) if isinstance(outcome, Hold | Wait):
                # a hold (or a wait) is a new turn, carrying the payload the handler gave it
                value = marshal(outcome.payload) if outcome.payload is not None else msg.value
                self.bus.add(msg.key, value, attempt)
            case Redeliver(attempt=attempt):
                self.bus.add(msg.key, msg.value, attempt, origin=msg.origin)
            case DeadLetter():
                assert not reconciler
                self.bus.add(f"{msg.key}_dlq", msg.value, 0)
            case ParkMessage():
                assert reconciler
                self.parked.append(self._describe(msg))

    def _check_hold(self, msg: Pending, payload: Any, hold: Hold) -> None:
        knobs = self.queues[payload.queue_name].knobs
        if msg.key == "build":  # a re-attempt's backoff
            assert 0 < hold.delay <= knobs.retry.backoff.total_seconds() * 4, \
                f"build held for {hold.delay}s"
            return
        allowed = {"process": [knobs.gate_delay],
                   "buildsignal": [knobs.poll_delay_queued, knobs.poll_delay_running]}
        assert hold.delay in [d.total_seconds() for d in allowed.get(msg.key, [])], \
            f"{msg.key} held for {hold.delay}s"

    def _describe(self, msg: Pending) -> str:
        return f"{msg.key}#{msg.serial}[a{msg.attempt}] {msg.value.decode()}"

    def _trace_tail(self, n: int = 60) -> str:
        return "trace:\n  " + "\n  ".join(self.trace[-n:])

    # -- invariants ------------------------------------------------------------------------
    async def _check_promotion(self, queue_name: str, uri: str) -> None:
        """Called by the fake at the instant the promotion ref would move."""
        queue = self.queues[queue_name]
        try:
            fact = await self.db.facts.get(queue_name, uri)
        except NotFound:
            raise ModelViolation(f"5: promoting {uri}, which has no fact") from None
        row = await self.db.queues.get(queue_name)
        seq = request_seq(fact.request_id)
        bookmark = request_seq(row.last_green_request_id) if row.last_green_request_id else 0
        if not fact.is_green:
            raise ModelViolation(f"5: promoting {uri}, whose fact has degree {fact.degree}")
        if seq > bookmark:
            raise ModelViolation(f"5: promoting {uri} ({fact.request_id}) ahead of the "
                                 f"bookmark {row.last_green_request_id}")
        if seq < queue.promoted_seq:
            raise ModelViolation(f"5: the promotion ref moves back to {uri} "
                                 f"({fact.request_id}) from seq {queue.promoted_seq}\n"
                                 + self._trace_tail())
        queue.promoted_seq = seq

    def _check_strategy(self, rid: str, uri: str, strategy: str, base: str | None) -> None:
        """§5 process step 4, against the bookmark before this step (only record moves it)."""
        queue = self.queues[rid.removeprefix("request/").rpartition("/")[0]]
        before = self.queue_rows.get(queue.name)
        last_green = before[1] if before is not None else None
        descends = queue.repo.ancestry(last_green, uri) if last_green is not None else None
        expected = ("incremental", last_green) if descends else ("full", None)
        assert (strategy, base) == expected, \
            f"{rid} admitted {strategy} from {base}; last green {last_green}, expected {expected}"

    async def _rows(self, sql: str) -> list[tuple[Any, ...]]:
        async with self.db.pool.connection() as conn:
            cur = await conn.execute(sql, (self.names,))  # type: ignore[arg-type]
            return await cur.fetchall()

    async def check(self, *, final: bool = False) -> None:
        try:
            await self._check(final)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self._trace_tail()}") from None

    async def _check(self, final: bool) -> None:
        queues = {r[0]: r for r in await self._rows(
            "SELECT name, last_green_uri, last_green_request_id, in_flight_count,"
            " latest_request_id FROM queue WHERE name = ANY(%s)")}
        requests = {r[1]: r for r in await self._rows(
            "SELECT queue, id, uri, state, build_strategy, base_uri, verdict, attempt"
            " FROM request WHERE queue = ANY(%s)")}
        facts = {(r[0], r[4], r[2]): r for r in await self._rows(
            "SELECT queue, uri, project, degree, request_id, created_at FROM validation_fact"
            " WHERE queue = ANY(%s)")}
        green_of = {(r[0], r[1]): r for r in facts.values() if r[3] == 0}
        builds = {r[1]: r for r in await self._rows(
            "SELECT queue, id, request_id, status FROM build WHERE queue = ANY(%s)")}

        # requests: legal transitions only; strategy and base immutable once set; only the
        # latest Request is admitted, only older ones are superseded (design §5 process)
        for rid, (_q, _, _uri, state, strategy, base, _verdict, _attempt) in requests.items():
            state = RequestState(state)
            latest = queues[_q][4]
            before = self.request_seen.get(rid)
            old_state = before[0] if before is not None else RequestState.ACCEPTED
            if state is not old_state:
                assert old_state.can_become(state), f"4: {rid} went {old_state} -> {state}"
                if state is RequestState.PROCESSING:
                    assert rid == latest, f"{rid} admitted while {latest} is the latest"
                    self._check_strategy(rid, _uri, strategy, base)
                if state is RequestState.SUPERSEDED:
                    assert request_order(rid) < request_order(latest), \
                        f"{rid} superseded, but the latest is {latest}"
            if before is not None and before[1] is not None:
                assert (strategy, base) == before[1:], f"{rid}: strategy/base changed"
            if base is not None:
                base_fact = green_of.get((_q, base))
                assert base_fact is not None and base_fact[3] == 0, \
                    f"{rid}: incremental from {base}, which is not green"
            self.request_seen[rid] = (state, strategy, base)

        self.queue_rows = queues

        # 3. facts: never updated nor deleted, one per (queue, request, project), and a
        # commit has at most one green fact
        for key, row in facts.items():
            first = self.facts.setdefault(key, row)
            assert first == row, f"3: fact {key} changed from {first} to {row}"
        missing = set(self.facts) - set(facts)
        assert not missing, f"3: facts deleted: {missing}"

        # builds: a stored terminal status is write-once and was reported by the runner
        # (or is the poll-deadline failure)
        for bid, (q, _, _rid, status) in builds.items():
            status = BuildStatus(status)
            fake = self.queues[q].runner.builds[bid]
            request = requests[_rid]
            assert RequestState(request[3]) not in (RequestState.ACCEPTED,
                                                    RequestState.SUPERSEDED), \
                f"build {bid} of {_rid}, which is {request[3]}"
            assert (fake.head_uri, fake.base_uri) == (request[2], request[5]), \
                f"build {bid} triggered with {fake.base_uri} -> {fake.head_uri}: {request}"
            if status.is_terminal:
                first = self.build_terminal.setdefault(bid, status)
                assert first is status, f"build {bid}: terminal {first} became {status}"
                # (cancelled: stopped because its Request ended without it; failed: the
                # poll deadline stopped it)
                assert status in fake.reported or (
                    status in (BuildStatus.FAILED, BuildStatus.CANCELLED)
                    and fake.cancel_calls), \
                    f"build {bid} stored {status}, the runner reported {fake.reported}"

        greens = Counter((r[0], r[1]) for r in facts.values() if r[3] == 0)
        assert all(n == 1 for n in greens.values()), f"3: a commit with two green facts {greens}"

        # 7. never green without a green build; facts agree with their Request, and only
        # a verdict has one (a Request that could not be validated has none)
        for (_q, rid, _), (_, uri, _, degree, _, _) in facts.items():
            request = requests[rid]
            assert request[2] == uri, f"fact {uri} names {rid}, which validates {request[2]}"
            state = RequestState(request[3])
            assert OUTCOME_OF_REQUEST.get(state) == degree, \
                f"7: fact {uri} degree {degree}, but {rid} is {state}"
            assert request[6] is not None, f"7: fact {uri} of {rid}, which has no verdict"
        for rid, request in requests.items():
            if RequestState(request[3]) is RequestState.SUCCEEDED:
                runner = self.queues[request[0]].runner
                green = [b for b, row in builds.items() if row[2] == rid
                         and BuildStatus.SUCCEEDED in runner.builds[b].reported]
                assert green, f"7: {rid} succeeded without a build reported succeeded"

        for name, queue in self.queues.items():
            row = queues.get(name)
            mine = [r for r in requests.values() if r[0] == name]
            processing = sum(RequestState(r[3]) is RequestState.PROCESSING for r in mine)
            if row is None:
                assert not processing
                continue
            _, lg_uri, lg_id, in_flight, latest = row
            # 1, 2. slots: every handler writes slot and state in one transaction, so the
            # count matches after every delivery, not only at rest
            assert 0 <= in_flight <= queue.knobs.max_concurrent, \
                f"1: {name} in_flight_count {in_flight}, max {queue.knobs.max_concurrent}"
            assert in_flight == processing, \
                f"1: {name} in_flight_count {in_flight} but {processing} processing"
            # 4. the bookmark only moves forward and names a green fact of its request
            seq = request_seq(lg_id) if lg_id is not None else 0
            assert seq >= queue.bookmark_seq, \
                f"4: {name} bookmark went back from seq {queue.bookmark_seq} to {lg_id}"
            queue.bookmark_seq = seq
            if lg_id is not None:
                fact = facts.get((name, lg_id, ""))
                assert fact is not None and fact[3] == 0 and fact[4] == lg_id, \
                    f"4: {name} bookmark {lg_uri} {lg_id} names no green fact of it: {fact}"
            # 5. the promotion ref: a green commit no newer than the bookmark
            promoted = queue.repo.promoted
            if promoted is not None:
                fact = green_of.get((name, promoted))
                assert fact is not None and fact[3] == 0, f"5: {name} promoted {promoted}"
                assert request_seq(fact[4]) <= seq, \
                    f"5: {name} promoted {promoted} ({fact[4]}) ahead of bookmark {lg_id}"
            if latest is not None:
                assert RequestState(requests[latest][3]) is not RequestState.SUPERSEDED, \
                    f"{name}: the latest request {latest} was superseded"

            if final:
                # 6. liveness: every Request terminal
                open_ = [(r[1], r[3]) for r in mine if not RequestState(r[3]).is_terminal]
                assert not open_, f"6: {name} has non-terminal requests {open_}"
                greens = [f for f in facts.values() if f[0] == name and f[3] == 0]
                for r in mine:
                    if r[6] is not None:
                        assert (name, r[1], "") in facts, f"{r[1]} has a verdict, no fact"
                newest = max(greens, key=lambda f: request_order(f[4]), default=None)
                assert (newest[4] if newest else None) == lg_id, \
                    f"4: {name} bookmark {lg_id}, newest green fact {newest}"
                if lg_uri is not None and queue.repo.on_ref(lg_uri):
                    assert promoted == lg_uri, \
                        f"5: {name} promotion ref {promoted}, bookmark {lg_uri}"


def _run_examples(dsn: str) -> None:
    with asyncio.Runner() as runner:
        db = runner.run(Database.open(dsn, min_size=1, max_size=2))
        try:
            @settings(max_examples=100, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
            @given(st.data())
            def example(data: st.DataObject) -> None:
                runner.run(Model(db, data).run())

            example()
        finally:
            runner.run(db.close())


def test_pipeline_model(migrated_dsn: str) -> None:
    """Redelivery, reordering, faults: the §4 invariants hold after every delivery and at
    the final quiet point, with the real handlers on the real store."""
    _run_examples(migrated_dsn)


def test_truncate_of_facts_is_refused(migrated_dsn: str) -> None:
    """Why examples are isolated by queue name rather than by TRUNCATE."""
    with psycopg.connect(migrated_dsn, autocommit=True) as conn, \
            pytest.raises(psycopg.errors.IntegrityConstraintViolation):
        conn.execute("TRUNCATE validation_fact CASCADE")
