"""A branch never silently stops being validated (design §6, liveness), on the real broker
and database with real worker processes: a message that was never sent, a poll loop that
was lost, a build no Request waits for, a forged message, a reconciler that fails a
building Request, and two ingesters racing a moving branch.

The cases that set a state up before any worker runs (a message never sent, a build
message lost, the racing ingesters) start a worker of their own once it is set up; the
others take a lane of the module's shared worker (`tests.shared_worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from confluent_kafka import Producer

from contract import BuildSignal, ProcessRequest, marshal
from store import Database, RequestState
from streams.config.queues import Extensions, QueuesConfig, load_queues
from streams.extensions.buildrunner.fake import FakeBuildRunner
from streams.runtime.config import topic_routes
from streams.runtime.kafka import KafkaPublisher, producer_conf
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_queue
from tests.pipeline_support import Pipeline
from tests.shared_worker import Lane, lane_queue
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _in_process(pipeline: Pipeline,
                action: Callable[[Deps], Awaitable[Any]]) -> Any:
    """Run ``action`` with the pipeline's stores and extensions, outside any worker."""
    async def run() -> Any:
        queues = load_queues(pipeline.queues_file)
        db = await Database.open(pipeline.dsn, max_size=4)
        try:
            return await action(Deps(db=db, queues=queues, extensions=Extensions(queues, db)))
        finally:
            await db.close()

    return asyncio.run(run())


async def _broker_away(key: str, payload: Any) -> None:
    raise ConnectionError("the broker is away")  # as during an outage: the publish fails


def _produce(pipeline: Pipeline, topic_key: str, key: str, payload: Any) -> None:
    producer = Producer(producer_conf(pipeline.bootstrap))
    producer.produce(pipeline.topics.entry(topic_key).full_name, key=key.encode(),
                     value=marshal(payload))
    assert producer.flush(30) == 0


def test_a_request_whose_message_was_never_sent_is_validated(pipeline: Pipeline) -> None:
    ref = pipeline.add_queue("q")
    pipeline.repo.push(ref, "a1")

    async def ingest_while_the_broker_is_away(deps: Deps) -> str:
        with pytest.raises(ConnectionError):
            await ingest_queue(deps, "q", _broker_away)
        return (await deps.db.queues.get("q")).latest_request_id or ""

    rid = _in_process(pipeline, ingest_while_the_broker_is_away)
    assert pipeline.states() == {rid: "accepted"}  # committed, never published
    pipeline.start_worker()
    started = time.monotonic()
    pipeline.wait_quiet(timeout=60)
    print(f"terminal {time.monotonic() - started:.1f}s after the worker started")
    assert pipeline.states() == {rid: "succeeded"}
    assert pipeline.exact_outcome_problems() == []
    assert "sweeper_republished what=process" in pipeline.logs()


def test_a_newer_head_does_not_strand_the_unpublished_older_one(pipeline: Pipeline) -> None:
    """Invariant 6: the stranded Request ends (superseded) once a newer head is validated."""
    ref = pipeline.add_queue("q")
    pipeline.repo.push(ref, "a1")
    stranded = _in_process(pipeline, lambda deps: _ingest_failing(deps, "q"))
    pipeline.start_worker()
    pipeline.repo.push(ref, "a2")
    newer = pipeline.ingest("q")
    pipeline.wait_quiet(timeout=60)
    assert pipeline.states() == {stranded: "superseded", newer: "succeeded"}


async def _ingest_failing(deps: Deps, queue: str) -> str:
    with pytest.raises(ConnectionError):
        await ingest_queue(deps, queue, _broker_away)
    return (await deps.db.queues.get(queue)).latest_request_id or ""


@lane_queue("q")
def test_a_lost_poll_loop_is_revived(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "a1-latchA1")
    rid = lane.ingest(queue)
    wait_until(lambda: lane.query("SELECT count(*) FROM build WHERE status = 'running'"
                                  " AND queue = %s", queue)[0][0] == 1,
               timeout=60, what="the build to run")
    # take the loop away from the live chain: its next turn is a duplicate and ends
    lane.execute("UPDATE build SET loop_token = 'gone' WHERE queue = %s", queue)
    wait_until(lambda: "poll_loop_duplicate_ended" in lane.logs() or "sweeper_republished"
               " what=buildsignal" in lane.logs(), timeout=30, what="the loop to end")
    lane.release("A1")
    lane.wait_quiet(timeout=60)
    assert lane.states() == {rid: "succeeded"}
    assert "sweeper_republished what=buildsignal" in lane.logs()
    assert lane.exact_outcome_problems() == []


def test_an_admitted_request_whose_build_message_was_lost_is_built(pipeline: Pipeline) -> None:
    ref = pipeline.add_queue("q")
    pipeline.repo.push(ref, "a1")
    rid = _in_process(pipeline, lambda deps: _ingest_failing(deps, "q"))

    async def admit_without_publishing(deps: Deps) -> None:
        from store import BuildStrategy

        request = await deps.db.requests.get("q", rid)
        queue = await deps.db.queues.get("q")
        async with deps.db.transaction() as tx:  # what process does, minus its publish
            await tx.queues.take_slot(queue)
            await tx.requests.transition(request, RequestState.PROCESSING,
                                         strategy=BuildStrategy.FULL)

    _in_process(pipeline, admit_without_publishing)
    pipeline.start_worker()
    pipeline.wait_quiet(timeout=60)
    assert pipeline.states() == {rid: "succeeded"}
    assert "sweeper_republished what=build" in pipeline.logs()


@lane_queue("q")
def test_a_build_nobody_waits_for_is_cancelled_at_its_runner(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "a1")
    rid = lane.ingest(queue)
    lane.wait_quiet()
    # a second build of the settled Request, still running (as a redelivered trigger
    # could start one): its poll loop sees the Request settled and stops it
    runner = FakeBuildRunner(lane.cancel_dir)
    head = lane.query("SELECT uri FROM request WHERE queue = %s", queue)[0][0]
    extra = asyncio.run(runner.trigger(None, head.replace("/a1", "/a1-latchNever"), {}))
    lane.execute("INSERT INTO build (queue, id, request_id) VALUES (%s, %s, %s)",
                 queue, extra, rid)
    _produce(lane, "buildsignal", extra, BuildSignal(id=extra, queue_name=queue))
    wait_until(lambda: extra in lane.cancelled_builds(), timeout=60,
               what="the orphan build cancelled")
    wait_until(lambda: lane.query("SELECT status FROM build WHERE id = %s", extra)
               == [("cancelled",)], timeout=30, what="its row cancelled")
    assert lane.states() == {rid: "succeeded"}


@lane_queue("q")
@lane_queue("other")
def test_a_forged_message_fails_nothing(lane: Lane) -> None:
    """A real Request's id with another queue's name is malformed: dead-lettered, then
    parked by process_dlq, which acts only on what the queue *and* id both name."""
    queue, other, ref = lane.name("q"), lane.name("other"), lane.ref("q")
    lane.repo.push(ref, "a1-latchF")
    rid = lane.ingest(queue)
    wait_until(lambda: lane.states().get(rid) == "processing", timeout=60,
               what="the Request to build")
    _produce(lane, "process", other, ProcessRequest(id=rid, queue_name=other))
    wait_until(lambda: len(lane.parked()) == 1, timeout=60,
               what="the forged message parked")
    [(_, error)] = lane.parked()
    assert "queue mismatch" in error
    assert lane.states() == {rid: "processing"}  # untouched, its build goes on
    assert not lane.cancelled_builds()
    lane.release("F")
    lane.wait_quiet()
    assert lane.states() == {rid: "succeeded"}


@lane_queue("q")
def test_a_reconciler_that_fails_a_building_request_cancels_its_build(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "a1-latchR")
    rid = lane.ingest(queue)
    wait_until(lambda: lane.query("SELECT count(*) FROM build WHERE queue = %s",
                                  queue)[0][0] == 1, timeout=60, what="the build to start")
    [(build_id,)] = lane.query("SELECT id FROM build WHERE queue = %s", queue)
    _produce(lane, "process_dlq", queue, ProcessRequest(id=rid, queue_name=queue))
    wait_until(lambda: lane.states() == {rid: "failed"}, timeout=60,
               what="the Request failed by process_dlq")
    wait_until(lambda: build_id in lane.cancelled_builds(), timeout=60,
               what="its build cancelled at the runner")
    assert lane.queue(queue)["in_flight_count"] == 0  # the slot is free
    lane.repo.push(ref, "a2")
    after = lane.ingest(queue)
    lane.wait_quiet()
    assert lane.states()[after] == "succeeded"
    assert lane.invariant_violations(strict_bookmark=True) == []


def test_two_ingesters_racing_a_moving_branch_leave_its_final_head_validated(
        pipeline: Pipeline) -> None:
    """The poller and an HTTP call, say, ingesting while the branch moves 50 times. With a
    head that takes a while to answer (as a remote does), and longer for one than for the
    other, an unordered ingest mints the older head after the newer one, which is then
    superseded and never validated."""
    ref = pipeline.add_queue("q", source_latency={"head": "60ms"})
    pipeline.repo.push(ref, "m0")
    moves = 50
    stop = threading.Event()

    pace = threading.Event()  # never set: its wait paces the moves

    def move() -> None:
        for i in range(1, moves + 1):
            pipeline.repo.push(ref, f"m{i}")
            pace.wait(0.01)  # the branch moves while the ingesters run, not in one go
        stop.set()

    async def ingester(deps: Deps, publish: Any) -> None:
        while not stop.is_set():
            await ingest_queue(deps, "q", publish)
        await ingest_queue(deps, "q", publish)  # and once after the last move

    async def race(deps: Deps) -> None:
        mover = threading.Thread(target=move)
        mover.start()
        try:
            # two ingesters with connections of their own, as two processes would have
            other = await Database.open(pipeline.dsn, max_size=2)
            async with KafkaPublisher(pipeline.bootstrap,
                                      topic_routes(pipeline.topics)) as publish:
                try:
                    # the twin's repository answers faster: it overtakes the first ingester
                    queue = deps.queues.get("q")
                    quick = dataclasses.replace(queue.source_control,
                                                latency={"head": timedelta(milliseconds=5)})
                    queues = QueuesConfig(deps.queues.path,
                                          {"q": dataclasses.replace(queue,
                                                                    source_control=quick)})
                    twin = Deps(db=other, queues=queues, extensions=Extensions(queues, other))
                    await asyncio.gather(ingester(deps, publish), ingester(twin, publish))
                finally:
                    await other.close()
        finally:
            mover.join()

    _in_process(pipeline, race)
    # minted in the order the branch moved: a Request is never for an older head than one
    # minted before it (an ingest that resolved its head earlier never mints it later)
    minted = sorted(pipeline.query("SELECT id, uri FROM request"),
                    key=lambda row: int(row[0].rsplit("/", 1)[1]))
    moves_seen = [int(uri.rsplit("/m", 1)[1]) for _, uri in minted]
    assert moves_seen == sorted(moves_seen), f"minted out of order: {moves_seen}"
    final = pipeline.repo.head(ref)
    latest = pipeline.queue_latest("q")
    [(latest_uri,)] = pipeline.query("SELECT uri FROM request WHERE id = %s", latest)
    assert latest_uri.endswith(f"/{final}"), f"the latest Request {latest} is {latest_uri}"
    pipeline.start_worker()  # every Request was published: the worker settles them all
    pipeline.wait_quiet(timeout=120)
    assert pipeline.states()[latest] == "succeeded"
    assert pipeline.queue("q")["last_green_uri"].endswith(f"/{final}")


def test_an_ingest_that_resolved_its_head_first_mints_it_first(pipeline: Pipeline) -> None:
    """The interleaving behind the race, made to happen: ingest A resolves head h1 and is
    slow to go on; the branch moves to h2 and ingest B starts. B must not mint h2 before A
    mints h1 (then h1 would be the queue's latest and supersede h2): it waits for A."""
    ref = pipeline.add_queue("q")
    pipeline.repo.push(ref, "h1")

    async def interleave(deps: Deps) -> tuple[str, str]:
        read, go_on = asyncio.Event(), asyncio.Event()
        slow = deps.extensions.source_control("q")

        async def pause_after_reading(call: str = "") -> None:  # A's head() answers late
            if call != "head":
                return
            read.set()
            await go_on.wait()

        slow._wait = pause_after_reading  # type: ignore[method-assign]
        other = await Database.open(pipeline.dsn, max_size=2)
        try:
            twin = Deps(db=other, queues=deps.queues,
                        extensions=Extensions(deps.queues, other))
            a = asyncio.create_task(ingest_queue(deps, "q", _sink))
            await read.wait()
            pipeline.repo.push(ref, "h2")
            b = asyncio.create_task(ingest_queue(twin, "q", _sink))
            # B either finishes at once (nothing orders it after A) or waits for A
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(b), timeout=1.0)
            go_on.set()
            return await a, await b
        finally:
            await other.close()

    first, second = _in_process(pipeline, interleave)
    uris = dict(pipeline.query("SELECT id, uri FROM request"))
    assert uris[first].endswith("/h1") and uris[second].endswith("/h2")
    assert pipeline.queue_latest("q") == second  # the newer head is the queue's latest
    assert int(second.rsplit("/", 1)[1]) > int(first.rsplit("/", 1)[1])


async def _sink(key: str, payload: Any) -> None:
    """A publish that goes nowhere: this test is about minting only."""
