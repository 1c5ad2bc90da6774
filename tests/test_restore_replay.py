"""Recovering from a restored database (issue 16 item 9; design §10): back the database
up, let the pipeline go on, restore the backup, replay every stage topic from the
backup's time and ingest again, as docs/operating.md tells an operator.

The restore sends the queue's counter back, so the next head gets the id a lost Request
had (`request/<queue>/3`), while Kafka still holds, and the replay brings back, every
message about the lost Requests 3 and 4 and their builds. The new Request must be
validated on its own: the old messages are recognised by their nonce and ignored
(`stale_message`), those about Requests and builds the backup never knew end parked by
their reconciler, and nothing fails, cancels or records anything for the new Request —
whether an old message reaches it through its stage (the first test) or through a
reconciler, as a dead letter an operator redrives (the second).

Real broker, real database, real worker processes; the CLI for everything an operator
types (`ingest`, `replay`, `parked`), `pg_dump` and `pg_restore` for the backup.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from streams.runtime.config import retry_of
from tests.pipeline_support import Pipeline, group_lag, topic_sizes
from tests.waiting import wait_until
from tests.web_support import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

PG_BIN = Path("/usr/lib/postgresql/15/bin")
QUEUE = "restored"
STAGE_TOPICS = ("ingest", "process", "build", "buildsignal", "record")
# what a reconciler says when it parks a message naming what the database does not have:
# `Irreconcilable` (process_dlq, build_dlq, buildsignal_dlq) or the store's `NotFound`
# (record_dlq re-runs record, which loads the Request)
UNKNOWN = re.compile(r"unknown request 'request/|unknown build 'fake-"
                     r"|NotFound: (request|build) not found")


def _pg_tool(name: str) -> str:
    path = PG_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (PostgreSQL server binaries)")
    return found


def _split_dsn(dsn: str) -> tuple[str, str]:
    """The server's DSN without the search_path option, and the test's schema."""
    params = conninfo_to_dict(dsn)
    options = str(params.pop("options", ""))
    match = re.search(r"search_path=(\S+)", options)
    assert match, f"no search_path in {options!r}"
    return make_conninfo("", **params), match.group(1)


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(args[:2])} exited {result.returncode}: " \
                                   f"{result.stderr}"


def _at_rest(pipeline: Pipeline) -> bool:
    """Nothing in flight: the workers' groups have consumed every stage, `_dlq` and delay
    topic (a message held or retried waits in a delay tier, so the tiers count), and no
    message was produced while we looked."""
    topics = pipeline.topics
    app = [t.full_name for t in (*topics.stages.values(), *topics.dead_letters.values())]
    tiers = [t.full_name for t in topics.delay_tiers]
    before = topic_sizes(pipeline.bootstrap, app + tiers)
    lag = group_lag(pipeline.bootstrap, f"{pipeline.app_id}-delay", tiers) + \
        group_lag(pipeline.bootstrap, pipeline.app_id, app)
    return lag == 0 and topic_sizes(pipeline.bootstrap, app + tiers) == before


def _stale_counts(port: int) -> dict[str, float]:
    """`stovepipe_stale_messages_total` by stage, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {stage: float(value) for stage, value in re.findall(
        r'^stovepipe_stale_messages_total\{stage="([^"]+)"\} (\S+)$', text, re.M)}


def _rid(n: int) -> str:
    return f"request/{QUEUE}/{n}"


@dataclass(frozen=True)
class Restored:
    """What the test knows of the pipeline's life before the restore."""

    ref: str
    promotion_ref: str
    lost_nonces: dict[str, str]  # the lost Requests 3 and 4
    lost_builds: set[str]  # their builds
    dead_before: int  # messages on the `_dlq` topics before the replay
    replayed: int  # messages the replay brought back


def _validate_back_up_restore_and_replay(pipeline: Pipeline, tmp_path: Path, *,
                                         g4: str) -> Restored:
    """Steps 1 to 5: G1 and G2 validated, a backup, R3 (red) and ``g4`` (green) validated,
    the workers stopped, the backup restored, every stage topic replayed from the backup's
    time. Leaves no worker running."""
    pg_dump, pg_restore = _pg_tool("pg_dump"), _pg_tool("pg_restore")
    server_dsn, schema = _split_dsn(pipeline.dsn)
    ref = pipeline.add_queue(QUEUE, poll_deadline="5m")
    promotion_ref = f"{ref}-verified-main"

    # 1. two green heads validated
    pipeline.start_worker()
    for n, sha in ((1, "g1"), (2, "g2")):
        pipeline.repo.push(ref, sha)
        assert pipeline.ingest(QUEUE) == _rid(n)
        pipeline.wait_quiet()
    assert pipeline.states() == {_rid(1): "succeeded", _rid(2): "succeeded"}

    # 2. the backup, and its time
    backup = tmp_path / "backup.dump"
    backup_time = datetime.now(UTC)
    _run(pg_dump, f"--dbname={server_dsn}", f"--schema={schema}", "--format=custom",
         f"--file={backup}")

    # 3. a red head and a green one after the backup: Requests 3 and 4
    pipeline.repo.push(ref, "r3-fail")
    assert pipeline.ingest(QUEUE) == _rid(3)
    pipeline.wait_quiet()
    pipeline.repo.push(ref, g4)
    assert pipeline.ingest(QUEUE) == _rid(4)
    pipeline.wait_quiet()
    assert pipeline.states() == {_rid(1): "succeeded", _rid(2): "succeeded",
                                 _rid(3): "failed", _rid(4): "succeeded"}
    assert dict(pipeline.query("SELECT request_id, degree FROM validation_fact "
                               "WHERE request_id IN (%s, %s)", _rid(3), _rid(4))) == \
        {_rid(3): 1.0, _rid(4): 0.0}
    assert pipeline.queue(QUEUE)["last_green_request_id"] == _rid(4)
    assert pipeline.repo.promoted(promotion_ref) == g4
    lost_nonces = dict(pipeline.query("SELECT id, nonce FROM request WHERE id IN (%s, %s)",
                                      _rid(3), _rid(4)))
    lost_builds = {b for (b,) in pipeline.query(
        "SELECT id FROM build WHERE request_id IN (%s, %s)", _rid(3), _rid(4))}
    assert len(lost_builds) >= 2, lost_builds
    dead_before = pipeline.dead_letters()

    # 4. stop the workers; restore the backup as an operator would
    pipeline.stop_workers()
    pipeline.execute(f'DROP SCHEMA "{schema}" CASCADE')
    _run(pg_restore, f"--dbname={server_dsn}", "--exit-on-error", "--single-transaction",
         str(backup))
    assert pipeline.states() == {_rid(1): "succeeded", _rid(2): "succeeded"}
    assert pipeline.queue(QUEUE)["last_green_request_id"] == _rid(2)
    assert pipeline.repo.promoted(promotion_ref) == g4  # the repository was not restored

    # 5. replay every stage topic from the backup's time
    replayed = 0
    for topic in STAGE_TOPICS:
        out = pipeline.cli("replay", topic, "--to-time", backup_time.isoformat(),
                           "--yes").stdout
        counted = re.search(r"(\d+) to consume from the new offsets", out)
        replayed += int(counted.group(1)) if counted else 0
    assert replayed > 0, "the replay brought nothing back"
    return Restored(ref, promotion_ref, lost_nonces, lost_builds, dead_before, replayed)


def _parked(pipeline: Pipeline) -> list[tuple[int, str, str, str]]:
    """Every parked row: id, topic, error, payload."""
    return [(pid, topic, error, value) for pid, topic, error, value in pipeline.query(
        "SELECT id, topic, error, convert_from(value, 'UTF8') FROM parked_message "
        "ORDER BY id")]


def _names(value: str, ids: set[str]) -> bool:
    """Whether a protojson payload names one of ``ids`` (its `id` field)."""
    return json.loads(value).get("id") in ids


def _assert_g4_validated_by_the_new_request(pipeline: Pipeline, lost: Restored,
                                            g4: str) -> None:
    """The end state: the new Request 3 validated ``g4`` on its own — a build of its own,
    green, its own fact — and holds the bookmark and the promotion ref; the lost red
    fact of r3-fail stays lost (nothing recorded anything about it again)."""
    ref = lost.ref
    assert pipeline.states() == {_rid(1): "succeeded", _rid(2): "succeeded",
                                 _rid(3): "succeeded"}, \
        pipeline.query("SELECT id, state, verdict, reason FROM request ORDER BY id")
    pipeline.wait_quiet(timeout=60)  # its fact, the bookmark and the promotion ref
    assert pipeline.query("SELECT count(*) FROM request WHERE state = 'failed'") == [(0,)]
    shown = pipeline.request(_rid(3))
    assert shown["request"]["uri"] == pipeline.repo.uri("r", ref, g4)
    assert shown["request"]["build_strategy"] == "incremental"
    assert shown["request"]["base_uri"] == pipeline.repo.uri("r", ref, "g2")
    assert (shown["fact"]["request_id"], shown["fact"]["degree"]) == (_rid(3), 0)
    builds = dict(pipeline.query("SELECT id, status FROM build WHERE request_id = %s",
                                 _rid(3)))
    assert builds and not set(builds) & lost.lost_builds, (builds, lost.lost_builds)
    assert "succeeded" in builds.values(), builds
    assert not set(builds) & pipeline.cancelled_builds(), "a build of the new 3 cancelled"
    assert pipeline.query("SELECT request_id, uri, degree FROM validation_fact "
                          "ORDER BY request_id") == [
        (_rid(1), pipeline.repo.uri("r", ref, "g1"), 0.0),
        (_rid(2), pipeline.repo.uri("r", ref, "g2"), 0.0),
        (_rid(3), pipeline.repo.uri("r", ref, g4), 0.0)]
    queue = pipeline.queue(QUEUE)
    assert (queue["last_green_request_id"], queue["last_green_uri"],
            queue["in_flight_count"]) == (_rid(3), pipeline.repo.uri("r", ref, g4), 0)
    assert pipeline.repo.promoted(lost.promotion_ref) == g4
    assert pipeline.exact_outcome_problems(dead_letters_allowed=True) == []
    assert pipeline.invariant_violations(strict_bookmark=True) == []


def _assert_parked_only_what_the_backup_never_knew(pipeline: Pipeline,
                                                   lost: Restored) -> None:
    """Every parked message names Request 4 or a build of the lost Requests, none names
    Request 3 (the new one answers to that id), and each says it names something
    unknown."""
    unknown = {_rid(4), *lost.lost_builds}
    for _, topic, error, value in _parked(pipeline):
        assert UNKNOWN.search(error), (topic, error)
        assert _names(value, unknown), (topic, error, value)


def test_replayed_messages_about_the_lost_request_never_touch_the_new_one(
        pipeline: Pipeline, tmp_path: Path) -> None:
    lost = _validate_back_up_restore_and_replay(pipeline, tmp_path, g4="g4")

    # 6. the head (g4) ingested again: the restored counter hands out 3 once more.
    # Ingested before the worker consumes the replay, so every replayed message about the
    # lost Request 3 meets the new Request 3 (the harmful case) instead of racing it.
    assert pipeline.ingest(QUEUE) == _rid(3)
    new_nonce = pipeline.query("SELECT nonce FROM request WHERE id = %s", _rid(3))[0][0]
    assert new_nonce != lost.lost_nonces[_rid(3)]
    port = free_port()
    worker = pipeline.start_worker(web_port=port)

    # 7. everything settles: every Request terminal, nothing left in flight or retrying
    pipeline.wait_terminal(timeout=120)
    wait_until(lambda: _at_rest(pipeline), timeout=120, interval=0.5,
               what="every stage, _dlq and delay topic consumed, nothing in flight")
    assert worker.poll() is None, pipeline.logs()
    _assert_g4_validated_by_the_new_request(pipeline, lost, "g4")

    # the replayed messages about the lost Request 3 were seen, and ignored, by every
    # stage that received one (process, build, record), counted and logged
    stale = _stale_counts(port)
    assert {s for s, n in stale.items() if n > 0} >= {"process", "build", "record"}, stale
    assert pipeline.full_logs().count("stale_message") == sum(stale.values()), stale

    # what the backup never knew (Request 4, the builds of the lost 3 and 4) was
    # dead-lettered by the replay and parked by its reconciler; nothing else was
    parked = _parked(pipeline)
    assert parked, "the replayed messages about Request 4 and the lost builds were parked"
    _assert_parked_only_what_the_backup_never_knew(pipeline, lost)
    # each parked message went round its `_dlq` topic park_after times; nothing else did
    park_after = {t.full_name: retry_of(t.retry, t.park_after).park_after
                  for t in pipeline.topics.dead_letters.values()}
    assert pipeline.dead_letters() - lost.dead_before == \
        sum(park_after[topic] for _, topic, _, _ in parked)
    # an operator sees them with `stovepipe parked` (and clears them with `parked delete`)
    listed = json.loads(pipeline.cli("parked", "--json").stdout)["messages"]
    assert {m["id"] for m in listed} == {pid for pid, *_ in parked}, listed
    by_topic = Counter(topic.removeprefix(pipeline.prefix) for _, topic, _, _ in parked)
    print(f"\nreplayed {lost.replayed} message(s); stale {stale}; parked {len(parked)}: "
          f"{dict(by_topic)}")


def test_redriven_dead_letters_about_the_lost_request_never_fail_the_new_one(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """The reconcilers' side: the replay drains before anything is ingested, so what it
    brings back about the lost Request 3 is dead-lettered and parked as unknown too. An
    operator then ingests the head, and while the new Request 3 builds, redrives every
    parked message: the reconcilers must not fail the new Request 3 nor cancel its
    build for a dead letter about the lost one."""
    g4 = "g4-latchG4"  # its build runs until the test releases the latch
    pipeline.release("G4")  # released before G4 is built: the lost Request 4 goes green
    lost = _validate_back_up_restore_and_replay(pipeline, tmp_path, g4=g4)

    # the replay drains with no Request 3 in the database: all of it is parked
    port = free_port()
    worker = pipeline.start_worker(web_port=port)
    wait_until(lambda: _at_rest(pipeline), timeout=120, interval=0.5,
               what="the replay consumed, nothing in flight")
    first = _parked(pipeline)
    about_3 = [row for row in first if _names(row[3], {_rid(3)})]
    assert {topic.removeprefix(pipeline.prefix) for _, topic, _, _ in about_3} == \
        {"process_dlq", "build_dlq", "record_dlq"}, first
    for _, topic, error, _ in first:
        assert UNKNOWN.search(error), (topic, error)
    assert pipeline.states() == {_rid(1): "succeeded", _rid(2): "succeeded"}

    # the head ingested; its build held running
    (pipeline.cancel_dir / "latches" / "G4").unlink()
    assert pipeline.ingest(QUEUE) == _rid(3)
    wait_until(lambda: pipeline.query("SELECT status FROM build WHERE request_id = %s",
                                      _rid(3)) == [("running",)],
               timeout=60, what="the new Request 3's build running")

    # every parked message redriven to its `_dlq` topic
    for parked_id, *_ in first:
        pipeline.cli("parked", "redrive", str(parked_id), "--yes")

    dead_letter_topics = [t.full_name for t in pipeline.topics.dead_letters.values()]

    def redriven_handled() -> bool:
        """The ones about Request 4 and the lost builds parked again (under new ids), and
        the reconcilers have consumed every `_dlq` topic: the ones about Request 3 were
        handled at their first delivery."""
        reparked = _parked(pipeline)
        return len(reparked) == len(first) - len(about_3) \
            and not {pid for pid, *_ in reparked} & {pid for pid, *_ in first} \
            and group_lag(pipeline.bootstrap, pipeline.app_id, dead_letter_topics) == 0
    wait_until(redriven_handled, timeout=120, interval=0.5,
               what="the redriven dead letters handled")
    # the reconcilers ignored the ones about the lost Request 3: the new one still builds
    assert pipeline.states()[_rid(3)] == "processing", \
        pipeline.query("SELECT id, state, verdict, reason FROM request ORDER BY id")
    stale = _stale_counts(port)
    assert {s for s, n in stale.items() if n > 0} == \
        {"process_dlq", "build_dlq", "record_dlq"}, stale
    new_builds = {b for (b,) in pipeline.query("SELECT id FROM build WHERE request_id = %s",
                                               _rid(3))}
    assert not new_builds & pipeline.cancelled_builds(), "the new 3's build was cancelled"
    _assert_parked_only_what_the_backup_never_knew(pipeline, lost)

    # its build ends: g4 validated by the new Request 3 after all
    pipeline.release("G4")
    pipeline.wait_quiet(timeout=120)
    assert worker.poll() is None, pipeline.logs()
    _assert_g4_validated_by_the_new_request(pipeline, lost, g4)
    stale = _stale_counts(port)
    assert pipeline.full_logs().count("stale_message") == sum(stale.values()), stale
    print(f"\nreplayed {lost.replayed} message(s); parked {len(first)} after the replay, "
          f"{len(about_3)} of them about Request 3; stale after the redrive {stale}")
