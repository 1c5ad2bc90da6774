"""The Stovepipe pipeline end to end: real worker processes on the real broker and
database, driven only through the CLI, the topics and the fake repository's file.

Most cases need only a running worker: each takes a lane of the module's shared worker,
with queues of its own (`tests.shared_worker`). The replay (it resets the consumer
group's offsets), the crashes and the scale-out start and stop workers of their own."""

from __future__ import annotations

import asyncio

import pytest

from tests.pipeline_support import (
    Pipeline,
    group_lag,
    produce_ingests,
    reset_group_to_beginning,
)
from tests.shared_worker import Lane, lane_queue
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


def _uri(ref: str, sha: str) -> str:
    return f"fake://r/{ref}/{sha}"


@lane_queue("team/main")
def test_happy_path_green_fact_bookmark_and_promotion(lane: Lane) -> None:
    queue, ref = lane.name("team/main"), lane.ref("team/main")
    lane.repo.push(ref, "a1")
    rid = lane.ingest(queue)
    assert rid == f"request/{queue}/1"
    lane.wait_quiet()
    shown = lane.request(rid)
    assert shown["request"]["state"] == "succeeded"
    assert shown["request"]["build_strategy"] == "full"
    assert shown["fact"]["degree"] == 0
    answer = lane.queue(queue)
    assert answer["last_green_uri"] == _uri(ref, "a1")
    assert answer["last_green_request_id"] == rid
    assert answer["in_flight_count"] == 0
    assert lane.repo.promoted(f"{ref}-verified-main") == "a1"
    assert lane.cli("fact", queue, _uri(ref, "a1")).returncode == 0
    # the next head builds incrementally from the last green commit
    lane.repo.push(ref, "a2")
    rid2 = lane.ingest(queue)
    lane.wait_quiet()
    second = lane.request(rid2)["request"]
    assert second["build_strategy"] == "incremental"
    assert second["base_uri"] == _uri(ref, "a1")
    assert lane.repo.promoted(f"{ref}-verified-main") == "a2"
    assert lane.invariant_violations(strict_bookmark=True) == []


@lane_queue("q")
def test_broken_head_is_red_and_moves_nothing(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "g1")
    lane.ingest(queue)
    lane.wait_quiet()
    lane.repo.push(ref, "b2-fail")
    rid = lane.ingest(queue)
    lane.wait_quiet()
    shown = lane.request(rid)
    assert shown["request"]["state"] == "failed"
    assert shown["fact"]["degree"] == 1
    answer = lane.queue(queue)
    assert answer["last_green_uri"] == _uri(ref, "g1")
    assert lane.repo.promoted(f"{ref}-verified-main") == "g1"
    assert lane.cli("fact", queue, _uri(ref, "b2-fail"), check=False).returncode == 3


@lane_queue("q", max_concurrent=1)
def test_worked_example_backlog_collapses_to_newest_head(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "A-latchA")  # A's build runs until the test releases it
    rid_a = lane.ingest(queue)
    wait_until(lambda: lane.states().get(rid_a) == "processing", timeout=60,
               what="A admitted")
    ids = {"A": rid_a}
    for name in "BCDEF":
        lane.repo.push(ref, name)
        ids[name] = lane.ingest(queue)
    # D waits for the slot while A builds; B, C and E are superseded on sight
    wait_until(lambda: all(lane.states()[ids[n]] == "superseded" for n in "BCE"),
               timeout=60, what="B, C and E superseded")
    assert lane.states()[rid_a] == "processing"
    lane.release("A")
    lane.wait_quiet(timeout=120)
    states = lane.states()
    assert states[ids["A"]] == "succeeded"
    assert states[ids["F"]] == "succeeded"
    assert [states[ids[n]] for n in "BCDE"] == ["superseded"] * 4
    assert lane.queue(queue)["in_flight_count"] == 0
    assert lane.queue(queue)["last_green_request_id"] == ids["F"]
    assert lane.query("SELECT count(*) FROM build WHERE queue = %s", queue)[0][0] == 2
    assert lane.exact_outcome_problems() == []


@lane_queue("q")
def test_history_rewrite_builds_full(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1", "c2")
    lane.ingest(queue)
    lane.wait_quiet()
    lane.repo.force_push(ref, "x1")  # c1, c2 are gone from the ref
    rid = lane.ingest(queue)
    lane.wait_quiet()
    request = lane.request(rid)["request"]
    assert request["build_strategy"] == "full"
    assert request["base_uri"] is None
    assert request["state"] == "succeeded"
    assert lane.repo.promoted(f"{ref}-verified-main") == "x1"


@lane_queue("q")
def test_a_reset_back_to_a_superseded_commit_is_validated(lane: Lane) -> None:
    """c2 is superseded by c3 without a build; a force-push resets the branch to c2. The
    branch's head must still get validated (not answered by c2's superseded Request)."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c1-latchC1")  # c1 builds until the test releases it
    rid1 = lane.ingest(queue)
    wait_until(lambda: lane.states().get(rid1) == "processing", timeout=60,
               what="c1 admitted")
    lane.repo.push(ref, "c2")
    rid2 = lane.ingest(queue)
    lane.repo.push(ref, "c3")
    lane.ingest(queue)
    wait_until(lambda: lane.states().get(rid2) == "superseded", timeout=60,
               what="c2 superseded")
    lane.repo.force_push(ref, "c2")  # back to c2; c3 is gone from the branch
    rid4 = lane.ingest(queue)
    assert rid4 not in (rid1, rid2)
    lane.release("C1")
    lane.wait_quiet(timeout=120)
    assert lane.states()[rid4] == "succeeded"
    assert lane.queue(queue)["last_green_uri"] == _uri(ref, "c2")
    assert lane.repo.promoted(f"{ref}-verified-main") == "c2"
    assert lane.ingest(queue) == rid4  # and now the head's Request is stable


@lane_queue("q")
@pytest.mark.parametrize("fault", ["ancestryerror", "triggererror", "statuserror"])
def test_fail_closed_through_the_dlq(lane: Lane, fault: str) -> None:
    """process (ancestry lookup), build (trigger) and buildsignal (status) faults that can
    never succeed end `failed` through their DLQ reconciler, and the queue goes on."""
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "ok1")
    lane.ingest(queue)
    lane.wait_quiet()
    lane.repo.push(ref, f"bad-{fault}")
    rid = lane.ingest(queue)
    lane.wait_terminal([rid])
    assert lane.states()[rid] == "failed"
    assert lane.queue(queue)["in_flight_count"] == 0
    lane.repo.push(ref, "ok2")
    rid_next = lane.ingest(queue)
    lane.wait_quiet()
    assert lane.states()[rid_next] == "succeeded"
    assert lane.queue(queue)["last_green_request_id"] == rid_next
    assert lane.invariant_violations(strict_bookmark=True) == []


@lane_queue("q")
def test_record_dlq_recovers_a_fact_whose_first_write_failed(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    # the first fact insert of this queue fails for good (non-retryable), once: sequences
    # are not rolled back with the failed statement, so only the first insert fails (the
    # schema is the module's: the trigger fires for this lane's queue only, and goes)
    tag = lane.id
    lane.execute(f"""
        CREATE SEQUENCE fact_inserts_{tag};
        CREATE FUNCTION fail_first_fact_{tag}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF nextval('fact_inserts_{tag}') = 1 THEN
                RAISE EXCEPTION 'injected failure' USING ERRCODE = 'data_exception';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER fail_first_fact_{tag} BEFORE INSERT ON validation_fact
            FOR EACH ROW WHEN (NEW.queue = '{queue}')
            EXECUTE FUNCTION fail_first_fact_{tag}();""")
    try:
        lane.repo.push(ref, "r1")
        rid = lane.ingest(queue)
        lane.wait_quiet()
        assert lane.request(rid)["fact"]["degree"] == 0
        assert lane.queue(queue)["last_green_request_id"] == rid
        # it did fail
        assert lane.query(f"SELECT last_value FROM fact_inserts_{tag}")[0][0] >= 2
    finally:
        lane.execute(f"""
            DROP TRIGGER fail_first_fact_{tag} ON validation_fact;
            DROP FUNCTION fail_first_fact_{tag}();
            DROP SEQUENCE fact_inserts_{tag};""")


@lane_queue("q", poll_deadline="3s")
def test_hung_build_fails_at_the_poll_deadline_and_frees_the_queue(lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "h1-hang")
    rid = lane.ingest(queue)
    lane.wait_terminal([rid], timeout=60)
    assert lane.states()[rid] == "failed"
    assert any(lane.cancel_dir.iterdir()), "the hung build was not cancelled"
    lane.repo.push(ref, "h2")
    rid2 = lane.ingest(queue)
    lane.wait_quiet()
    assert lane.states()[rid2] == "succeeded"


@lane_queue("q")
def test_the_same_head_ingested_100_times_concurrently_is_one_request(lane: Lane) -> None:
    from aiokafka import AIOKafkaProducer

    from store import Database
    from streams.config.queues import Extensions, load_queues
    from streams.runtime.stage import publish_payload
    from streams.stages.deps import Deps
    from streams.stages.ingest import ingest_queue

    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "same")

    async def hundred() -> set[str]:
        queues = load_queues(lane.queues_file)
        db = await Database.open(lane.dsn, max_size=20)
        producer = AIOKafkaProducer(bootstrap_servers=lane.bootstrap)
        await producer.start()
        try:
            async def publish(key: str, payload: object) -> None:
                spec = lane.topics.stage(key)
                await publish_payload(producer, spec.full_name, payload,  # type: ignore[arg-type]
                                      spec.key_field)

            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            ids = await asyncio.gather(*(ingest_queue(deps, queue, publish)
                                         for _ in range(100)))
            return set(ids)
        finally:
            await producer.stop()
            await db.close()

    first = f"request/{queue}/1"
    assert asyncio.run(hundred()) == {first}
    assert lane.ingest(queue) == first  # and once more through the CLI
    assert lane.query("SELECT count(*) FROM request WHERE queue = %s", queue)[0][0] == 1
    lane.wait_quiet()
    assert lane.states() == {first: "succeeded"}
    # duplicates absorbed
    assert lane.query("SELECT count(*) FROM build WHERE queue = %s", queue)[0][0] == 1


def _groups_and_topics(pipeline: Pipeline) -> dict[str, list[str]]:
    """Each consumer group of the workers and the topics it consumes."""
    topics = pipeline.topics
    return {
        pipeline.app_id: [t.full_name for t in (*topics.stages.values(),
                                                *topics.dead_letters.values())],
        f"{pipeline.app_id}-delay": [t.full_name for t in topics.delay_tiers],
    }


def test_replay_from_the_beginning_changes_nothing(pipeline: Pipeline) -> None:
    refs = {q: pipeline.add_queue(q) for q in ("r1", "r2")}
    pipeline.start_worker()
    for i, sha in enumerate(["c1", "c2-fail", "c3", "c4-slow1"]):
        for q, ref in refs.items():
            pipeline.repo.push(ref, f"{q}-{sha}")
        if i % 2:
            produce_ingests(pipeline.bootstrap, pipeline.topics, list(refs))
            wait_until(lambda i=i: len(pipeline.states()) >= 2 * (i + 1), timeout=60,
                       what="ingest through the topic")
        else:
            for q in refs:
                pipeline.ingest(q)
    pipeline.wait_quiet()
    before = pipeline.dump()
    pipeline.stop_workers()

    groups = _groups_and_topics(pipeline)
    for group, topics in groups.items():
        reset_group_to_beginning(pipeline.bootstrap, group, topics)
    assert group_lag(pipeline.bootstrap, pipeline.app_id, groups[pipeline.app_id]) > 0
    pipeline.start_worker()
    for group, topics in groups.items():
        wait_until(lambda g=group, t=topics: group_lag(pipeline.bootstrap, g, t) == 0,
                   timeout=120, what=f"{group} to drain the replay", interval=0.5)
    assert pipeline.dump() == before
    assert pipeline.invariant_violations(strict_bookmark=True) == []


def _behind(pipeline: Pipeline, pushed: dict[str, str]) -> list[str]:
    """The queues whose newest Request is not for the commit last pushed to them."""
    rows = pipeline.query("SELECT q.name, r.uri FROM queue q JOIN request r"
                          " ON r.queue = q.name AND r.id = q.latest_request_id"
                          " WHERE q.name = ANY(%s)", list(pushed))
    latest = {queue: uri.rsplit("/", 1)[1] for queue, uri in rows}
    return sorted(q for q, sha in pushed.items() if latest.get(q) != sha)


def _run_many_heads(pipeline: Pipeline, *, queues: int, rounds: int, kill: bool,
                    workers: int, seed: int) -> None:
    """`rounds` heads on each of `queues` queues, ingested through the topic, while
    workers are killed (SIGKILL) or stopped (SIGTERM) along the way."""
    import random

    rng = random.Random(seed)
    names = [f"crash{i}" for i in range(queues)]
    refs = {q: pipeline.add_queue(q, max_concurrent=rng.choice([1, 1, 2])) for q in names}
    procs = [pipeline.start_worker() for _ in range(workers)]
    disruptions = {rounds // 4, rounds // 2, 3 * rounds // 4} if kill else {rounds // 2}
    for r in range(rounds):
        pushed: dict[str, str] = {}
        for q, ref in refs.items():
            pushed[q] = f"{q}-h{r}{rng.choice(['', '', '', '-fail', '-slow1'])}"
            pipeline.repo.push(ref, pushed[q])
        produce_ingests(pipeline.bootstrap, pipeline.topics, names)
        if r in disruptions:
            victim = procs.pop(rng.randrange(len(procs)))
            if kill:
                pipeline.kill_worker(victim)
                procs.append(pipeline.start_worker())
            else:
                victim.terminate()
                victim.wait(timeout=60)
        try:
            # generous: two workers starting or leaving under a loaded machine rebalance
            # the group, and a rebalance waits for its slowest member. The new head is
            # what counts, not a new Request: an ingest of the round before, delivered
            # again after a rebalance, may already have minted this round's Request
            wait_until(lambda pushed=pushed: not _behind(pipeline, pushed), timeout=240,
                       what=f"round {r} ingested", interval=0.3)
        except AssertionError as exc:
            behind = _behind(pipeline, pushed)
            raise AssertionError(f"{exc}; queues not ingested: {behind}\n"
                                 f"{pipeline.logs()}") from None
    pipeline.wait_quiet(timeout=240)


def test_crash_sigkill_three_times_300_heads_30_queues(pipeline: Pipeline) -> None:
    _run_many_heads(pipeline, queues=30, rounds=10, kill=True, workers=1, seed=7)
    assert len(pipeline.states()) == 300
    assert pipeline.exact_outcome_problems() == []  # a crash delays outcomes, never changes
    assert pipeline.invariant_violations(strict_bookmark=True) == []


def test_scale_out_two_workers_one_stopped_midway(pipeline: Pipeline) -> None:
    _run_many_heads(pipeline, queues=30, rounds=10, kill=False, workers=2, seed=11)
    assert len(pipeline.states()) == 300
    assert pipeline.exact_outcome_problems() == []
    assert pipeline.invariant_violations(strict_bookmark=True) == []
