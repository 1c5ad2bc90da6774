"""Issue 25, item 6, on the real database: `prune` deletes history older than the
retention in small batches and keeps, however old, what a gate or a person still needs —
one history holding a case of every rule (`streams.stages.retention_rules`), pruned, then
every table compared with what must be left. Facts stay immutable to everything but the
prune's own statement; a prune never waits behind the pipeline's locks or a pin being
taken; a round deletes at most ``max_rows``; the workers' rounds run one at a time and
once per ``every``."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from store import Database
from store.pins import PIN_LOCK
from streams.config.retention import RetentionConfig
from streams.stages import retention
from streams.stages.retention import TABLES, PruneReport, prune
from streams.stages.retention_rules import Keep, Policy

pytestmark = pytest.mark.postgres

POLICY = Policy(older_than=timedelta(days=180), keep_newest=2)
OLD, RECENT = 200, 10  # days ago
STATES = {"accepted": (None, None), "processing": ("running", None),
          "succeeded": ("succeeded", "green"), "failed": ("failed", "red"),
          "cancelled": ("cancelled", None), "superseded": (None, None)}


class History:
    """Rows as the pipeline writes them, dated ``days`` ago (a minute apart by number)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def sql(self, statement: str, *params: Any) -> None:
        self.conn.execute(statement, params)  # type: ignore[arg-type]

    def request(self, queue: str, n: str, state: str, days: int, *, fact: int | None = None,
                verdict: str | None = "auto", recorded: bool = True, kind: str = "head",
                mapped: bool = True) -> str:
        request_id = f"request/{queue}/{n}"
        status, state_verdict = STATES[state]
        verdict = state_verdict if verdict == "auto" else verdict
        at = f"now() - interval '{days} days' + interval '{_minutes(n)} minutes'"
        self.sql(f"INSERT INTO request (queue, id, uri, state, build_strategy, verdict,"
                 f" recorded, kind, attempt, created_at, updated_at) VALUES (%s, %s, %s, %s,"
                 f" %s, %s, %s, %s, %s, {at}, {at})", queue, request_id, _uri(queue, n),
                 state, None if status is None else "full", verdict, recorded, kind,
                 0 if status is None else 1)
        if status is not None:
            self.sql(f"INSERT INTO build (queue, id, request_id, status, verdict, created_at,"
                     f" updated_at) VALUES (%s, %s, %s, %s, %s, {at}, {at})", queue,
                     f"b-{request_id}", request_id, status, verdict)
        if fact is not None:
            self.sql(f"INSERT INTO validation_fact (queue, uri, project, degree, request_id,"
                     f" created_at) VALUES (%s, %s, queue_project(%s), %s, %s, {at})",
                     queue, _uri(queue, n), queue, fact, request_id)
        if mapped and "#" not in queue:
            self.sql("INSERT INTO request_uri (queue, uri, request_id) VALUES (%s, %s, %s)"
                     " ON CONFLICT (queue, uri) DO UPDATE SET request_id = EXCLUDED.request_id",
                     queue, _uri(queue, n.split(".")[0]), request_id)
        return request_id


def _minutes(n: str) -> int:
    head, _, rest = n.partition("~")
    return int(head.split(".")[0]) * 10 + (1 if rest or "." in n else 0)


def _uri(queue: str, n: str) -> str:
    return f"fake://r/{queue.split('#')[0]}/{n.split('.')[0]}"


def _history(conn: psycopg.Connection[Any]) -> None:
    h = History(conn)
    r = h.request
    # the queue `mono` (a monorepo with the project `web`)
    r("mono", "1", "superseded", OLD)  # goes
    r("mono", "2", "failed", OLD, fact=1)  # goes: red of a search ended long ago
    r("mono", "3", "succeeded", OLD, fact=0)  # goes, with its project answer and plan
    r("mono", "4", "succeeded", OLD, fact=0)  # the bookmark
    r("mono", "5", "succeeded", OLD, fact=0)  # pinned
    r("mono", "5~1", "failed", OLD, fact=1, kind="backfill", mapped=False)  # a probe
    r("mono", "6", "failed", OLD, fact=1)  # the open search's red
    r("mono", "6.2", "succeeded", OLD, fact=0, kind="retry")  # its commit again, green
    r("mono", "7", "accepted", OLD)  # not terminal
    r("mono", "8", "processing", OLD)  # not terminal
    r("mono", "9", "succeeded", OLD, recorded=False)  # its fact not recorded yet
    r("mono", "10", "failed", OLD, fact=1)  # where the current red streak began
    r("mono", "11", "succeeded", OLD, fact=0)  # its project plan is not decided
    r("mono", "12", "succeeded", OLD, fact=0)  # the project's bookmark
    r("mono", "13", "failed", OLD, fact=1)  # goes
    r("mono", "14", "failed", OLD, verdict=None)  # could not validate: goes
    for n, state, degree in (("20", "succeeded", 0), ("21", "failed", 1),
                             ("22", "succeeded", 0)):
        r("mono", n, state, RECENT, fact=degree)
    # its project's scope
    for n, state, degree in (("3", "succeeded", 0), ("4", "succeeded", 0),
                             ("11", "failed", 1), ("12", "succeeded", 0),
                             ("15", "succeeded", 0), ("16", "failed", 1),
                             ("17", "failed", 1)):
        r("mono#web", n, state, OLD, fact=degree)
    r("mono#web", "14", "superseded", OLD)
    for n, state, degree in (("21", "failed", 1), ("22", "succeeded", 0)):
        r("mono#web", n, state, RECENT, fact=degree)
    # a quiet queue: nothing for 200 days
    for n in "12345":
        r("quiet", n, "failed" if n == "3" else "succeeded", OLD, fact=1 if n == "3" else 0)
    r("quiet", "6", "superseded", OLD)

    sql = h.sql
    sql("INSERT INTO queue (name, last_green_uri, last_green_request_id, latest_request_id,"
        " pinned_uri, pinned_request_id, pinned_by, pinned_reason, pinned_at) VALUES"
        " ('mono', %s, 'request/mono/4', 'request/mono/22', %s, 'request/mono/5', 'ops',"
        " 'incident', now() - interval '200 days')", _uri("mono", "4"), _uri("mono", "5"))
    sql("INSERT INTO queue (name, last_green_uri, last_green_request_id, latest_request_id)"
        " VALUES ('mono#web', %s, 'request/mono#web/22', 'request/mono#web/14'),"
        " ('quiet', NULL, NULL, 'request/quiet/6')", _uri("mono#web", "22"))
    sql("INSERT INTO project_state (queue, project, pinned_uri, pinned_request_id)"
        " VALUES ('mono', 'web', %s, 'request/mono#web/15')", _uri("mono#web", "15"))
    for parent, degree, inherited, source in (("3", 0, False, "3"), ("4", 0, False, "4"),
                                              ("12", 0, False, "12"), ("21", 1, True, "16")):
        sql("INSERT INTO project_answer (queue, request_id, project, uri, degree, inherited,"
            " source_request_id, source_uri) VALUES ('mono', %s, 'web', %s, %s, %s, %s, %s)",
            f"request/mono/{parent}", _uri("mono", parent), degree, inherited,
            f"request/mono#web/{source}", _uri("mono#web", source))
    sql("INSERT INTO request_plan (queue, request_id, affected, completed) VALUES"
        " ('mono', 'request/mono/11', '{web}', false), ('mono', 'request/mono/3', '{web}', true)")
    sql("INSERT INTO culprit_search (queue, red_request_id, red_uri, green_request_id,"
        " green_uri, commits, lo, hi, probes, max_builds, state) VALUES ('mono',"
        " 'request/mono/6', %s, 'request/mono/4', %s, %s, 0, 2, '{request/mono/5~1}', 10,"
        " 'bisecting')", _uri("mono", "6"), _uri("mono", "4"),
        [_uri("mono", "4"), _uri("mono", "5~1"), _uri("mono", "6")])
    sql("INSERT INTO culprit_search (queue, red_request_id, red_uri, green_request_id,"
        " max_builds, state, ended_at, created_at) VALUES ('mono', 'request/mono/2', %s,"
        " 'request/mono/1', 10, 'fixed', now() - interval '199 days',"
        " now() - interval '200 days')", _uri("mono", "2"))
    sql("INSERT INTO culprit_search (queue, red_request_id, red_uri, green_request_id,"
        " commits, lo, hi, max_builds, state, culprit_uri, culprit_request_id, ended_at)"
        " VALUES ('quiet', 'request/quiet/3', %s, 'request/quiet/2', %s, 0, 1, 10, 'found',"
        " %s, 'request/quiet/3', now() - interval '199 days')", _uri("quiet", "3"),
        [_uri("quiet", "2"), _uri("quiet", "3")], _uri("quiet", "3"))
    for days, greenness, n in ((200, "green", "4"), (190, "red", "6"), (185, "green", "6.2"),
                               (20, "red", "10")):
        sql("INSERT INTO greenness_change (queue, at, greenness, request_id) VALUES"
            " ('mono', now() - make_interval(days => %s), %s, %s)", days, greenness,
            f"request/mono/{n}")
    for key, created, done in (("gone", OLD, OLD), ("unsent", OLD, None),
                               ("recent", RECENT, RECENT)):
        sql("INSERT INTO notification (queue, key, channel, stream, event, created_at,"
            " done_at, outcome) VALUES ('mono', %s, 'slack', 'alerts', '{}',"
            " now() - make_interval(days => %s), now() - make_interval(days => %s), %s)",
            key, created, done, None if done is None else "sent")
    for offset, days in ((1, OLD), (2, RECENT)):
        sql("INSERT INTO parked_message (topic, partition, \"offset\", error, parked_at)"
            " VALUES ('p.process_dlq', 0, %s, 'x', now() - make_interval(days => %s))",
            offset, days)
    for delivery, days in (("old", OLD), ("new", 3)):
        sql("INSERT INTO webhook_delivery (provider, delivery_id, state, claim, received_at,"
            " ingested_at) VALUES ('github', %s, 'ingested', gen_random_uuid(),"
            " now() - make_interval(days => %s), now() - make_interval(days => %s))",
            delivery, days, days)
    sql("INSERT INTO promotion_pin (queue, uri, request_id, pinned_by, reason, pinned_at,"
        " unpinned_by, unpinned_at) VALUES ('mono', %s, 'request/mono/3', 'ops', 'old',"
        " now() - interval '200 days', 'ops', now() - interval '199 days'),"
        " ('mono', %s, 'request/mono/5', 'ops', 'incident', now() - interval '200 days',"
        " NULL, NULL)", _uri("mono", "3"), _uri("mono", "5"))
    for n, days in (("13", OLD), ("4", OLD), ("5~1", OLD), ("never", OLD), ("20", RECENT)):
        sql("INSERT INTO commit_info (queue, uri, sha, subject, author, created_at) VALUES"
            " ('mono', %s, 'abc', 's', 'a', now() - make_interval(days => %s))",
            _uri("mono", n), days)
    for request_id, status in (("request/mono/2", "failed"), ("request/mono/13", "failed"),
                               ("request/mono/14", "running")):
        sql("INSERT INTO command_build (build_id, queue, request_id, host, work_dir, status)"
            " VALUES (%s, 'mono', %s, 'h', '/w', %s)", f"b-{request_id}", request_id, status)


DELETED = {"request": 8, "validation_fact": 6, "project_answer": 1, "request_plan": 1,
           "build": 7, "command_build": 2, "request_uri": 6, "culprit_search": 1,
           "greenness_change": 2, "notification": 1, "parked_message": 1,
           "promotion_pin": 1, "webhook_delivery": 1, "commit_info": 2}
# a dry run counts the commit descriptions nothing names now; the round also deletes
# those of the commits whose Requests it deletes (here mono/13's)
DRY_RUN = {**DELETED, "commit_info": 1}
GONE = {"request/mono/1", "request/mono/2", "request/mono/3", "request/mono/13",
        "request/mono/14", "request/mono#web/3", "request/mono#web/17", "request/quiet/1"}
KEPT = {Keep.BOOKMARK: 1, Keep.PIN: 2, Keep.SEARCH: 4, Keep.NEWER_VALIDATION: 1,
        Keep.LIVE: 2, Keep.UNRECORDED: 1, Keep.STREAK: 1, Keep.PLAN: 1,
        Keep.PROJECT_BOOKMARK: 1, Keep.ANSWER_SOURCE: 3, Keep.PROJECT_REQUEST: 1,
        Keep.LATEST: 2, Keep.NEWEST: 2}
# every id a row that stays names must name a Request that stays
NAMED = """
SELECT x FROM (
    SELECT last_green_request_id FROM queue UNION ALL SELECT latest_request_id FROM queue
    UNION ALL SELECT pinned_request_id FROM queue
    UNION ALL SELECT pinned_request_id FROM project_state
    UNION ALL SELECT red_request_id FROM culprit_search
    UNION ALL SELECT green_request_id FROM culprit_search
    UNION ALL SELECT culprit_request_id FROM culprit_search
    UNION ALL SELECT unnest(probes) FROM culprit_search
    UNION ALL SELECT source_request_id FROM project_answer
    UNION ALL SELECT request_id FROM request_uri
    UNION ALL SELECT request_id FROM promotion_pin WHERE unpinned_at IS NULL
    UNION ALL SELECT (SELECT request_id FROM greenness_change g WHERE g.queue = q.name
                      ORDER BY at DESC LIMIT 1) FROM queue q
) AS named(x) WHERE x IS NOT NULL AND NOT EXISTS (SELECT 1 FROM request WHERE id = x)
"""


def _counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]  # type: ignore[index]
            for t in TABLES}


@pytest.fixture
def history(migrated_dsn: str) -> Iterator[str]:
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        _history(conn)
    yield migrated_dsn


def _pruned(dsn: str, **options: Any) -> PruneReport:
    """One `prune` round on a pool of its own."""
    async def main() -> PruneReport:
        database = await Database.open(dsn, max_size=4)
        try:
            return await prune(database, POLICY, **options)
        finally:
            await database.close()
    return asyncio.run(main())


def test_prune_keeps_what_a_gate_or_a_person_needs_and_deletes_the_rest(history: str) -> None:
    with psycopg.connect(history) as conn:
        before = _counts(conn)
        ids_before = {row[0] for row in conn.execute("SELECT id FROM request")}

    dry = _pruned(history, dry_run=True)
    assert {t: n for t, n in dry.deleted.items() if n} == DRY_RUN
    assert dry.kept == Counter(KEPT)
    with psycopg.connect(history) as conn:
        assert _counts(conn) == before  # a dry run deletes nothing

    report = _pruned(history, batch=3)
    assert {t: n for t, n in report.deleted.items() if n} == DELETED
    assert report.kept == Counter(KEPT) and report.finished and report.skipped == 0
    with psycopg.connect(history) as conn:
        after = _counts(conn)
        assert {t: before[t] - after[t] for t in TABLES if before[t] != after[t]} == DELETED
        assert ids_before - {row[0] for row in conn.execute("SELECT id FROM request")} == GONE
        assert conn.execute(NAMED).fetchall() == []
        # the running command build of a Request that went is left to its host
        assert conn.execute("SELECT build_id FROM command_build").fetchall() == [
            ("b-request/mono/14",)]
        assert conn.execute("SELECT key FROM notification ORDER BY key").fetchall() == [
            ("recent",), ("unsent",)]
        assert conn.execute("SELECT delivery_id FROM webhook_delivery").fetchall() == [("new",)]
        assert [row[0] for row in conn.execute(
            "SELECT greenness FROM greenness_change ORDER BY at")] == ["green", "red"]
        assert sorted(row[0] for row in conn.execute("SELECT uri FROM commit_info")) == sorted(
            _uri("mono", n) for n in ("4", "5~1", "20"))
        # the gates' answers of what stays are what they were
        assert conn.execute("SELECT request_id FROM validation_fact WHERE queue = 'mono'"
                            " AND uri = %s", (_uri("mono", "6"),)).fetchall() in (
            [("request/mono/6",), ("request/mono/6.2",)],
            [("request/mono/6.2",), ("request/mono/6",)])

    again = _pruned(history)
    assert again.total == 0 and again.kept == Counter(KEPT)


def test_facts_and_answers_refuse_every_change_but_the_prunes_own_delete(history: str) -> None:
    with psycopg.connect(history, autocommit=True) as conn:
        for statement in ("DELETE FROM validation_fact WHERE request_id = 'request/mono/13'",
                          "UPDATE validation_fact SET degree = 0"
                          " WHERE request_id = 'request/mono/13'",
                          "TRUNCATE validation_fact CASCADE",
                          "DELETE FROM project_answer WHERE request_id = 'request/mono/3'",
                          "TRUNCATE project_answer"):
            with pytest.raises(psycopg.errors.IntegrityError, match="immutable"):
                conn.execute(statement)
        with pytest.raises(psycopg.errors.IntegrityError, match="immutable"), \
                conn.transaction():
            conn.execute("SET LOCAL stovepipe.pruning = 'yes'")  # only 'on' counts
            conn.execute("DELETE FROM validation_fact WHERE request_id = 'request/mono/13'")
        with pytest.raises(psycopg.errors.IntegrityError, match="immutable"), \
                conn.transaction():
            conn.execute("SET LOCAL stovepipe.pruning = 'on'")  # never an update
            conn.execute("UPDATE validation_fact SET degree = 0"
                         " WHERE request_id = 'request/mono/13'")
        with conn.transaction():
            conn.execute("SET LOCAL stovepipe.pruning = 'on'")
            assert conn.execute("DELETE FROM validation_fact"
                                " WHERE request_id = 'request/mono/13'").rowcount == 1
            assert conn.execute("DELETE FROM project_answer"
                                " WHERE request_id = 'request/mono/3'").rowcount == 1
        # transaction-local: the next transaction is refused again
        with pytest.raises(psycopg.errors.IntegrityError, match="immutable"):
            conn.execute("DELETE FROM validation_fact WHERE request_id = 'request/mono/2'")


def test_a_prune_skips_what_is_locked_instead_of_waiting(history: str) -> None:
    with psycopg.connect(history) as holder:
        # the pipeline holds a Request and a fact: the batches go on without them
        holder.execute("SELECT 1 FROM request WHERE id = 'request/mono/13' FOR UPDATE")
        holder.execute("SELECT 1 FROM validation_fact WHERE request_id = 'request/quiet/1'"
                       " FOR KEY SHARE")
        report = _pruned(history, batch=3)
        assert report.skipped == 1  # quiet's batch met the lock (lock_timeout)
        with psycopg.connect(history) as conn:
            left = {row[0] for row in conn.execute("SELECT id FROM request WHERE id = ANY(%s)",
                                                   (sorted(GONE),))}
        assert left == {"request/mono/13", "request/quiet/1"}
    again = _pruned(history)
    assert again.deleted["request"] == 2 and again.skipped == 0


def test_a_prune_leaves_a_queue_whose_pin_is_being_taken(history: str) -> None:
    with psycopg.connect(history) as pinning:
        pinning.execute(PIN_LOCK, {"family": "mono"})  # a pin of mono (or a project) under way
        report = _pruned(history)
        assert report.skipped >= 1
        assert report.deleted["request"] == 1  # quiet's only
    again = _pruned(history)
    assert again.deleted["request"] == 7 and again.skipped == 0


def test_a_round_deletes_at_most_max_rows_and_the_next_goes_on(history: str) -> None:
    first = _pruned(history, batch=2, max_rows=4)
    assert not first.finished and 4 <= first.total < sum(DELETED.values())
    left = _pruned(history, dry_run=True)
    assert left.deleted["request"] == DELETED["request"] - first.deleted["request"] > 0
    rest = _pruned(history, batch=2)
    assert rest.finished and first.deleted + rest.deleted == Counter(DELETED)


def test_a_round_rests_after_each_batch_in_proportion_to_its_work(history: str) -> None:
    now = [0.0]
    rests: list[float] = []

    def clock() -> float:  # moves one second each time it is read
        now[0] += 1
        return now[0]

    async def sleep(seconds: float) -> None:
        rests.append(seconds)
        now[0] += seconds

    def pace(duty_cycle: float) -> retention.Pace:
        return retention.Pace(duty_cycle, clock=clock, sleep=sleep)

    report = _pruned(history, batch=3, pace=pace(0.25))
    # each batch read the clock once after a rest: busy 1 s, so 3 s of rest each time
    assert report.batches > 3 and rests == [3.0] * report.batches
    assert report.rested == 3.0 * report.batches < report.seconds
    assert {t: n for t, n in report.deleted.items() if n} == DELETED  # same work
    rests.clear()
    _pruned(history, dry_run=True, pace=pace(1.0))
    assert rests and set(rests) == {0.0}  # 1: never rests, yields only


def test_workers_prune_one_at_a_time_once_per_every(history: str) -> None:
    async def main() -> None:
        database = await Database.open(history, max_size=4)
        try:
            await _rounds(database, history)
        finally:
            await database.close()
    asyncio.run(main())


async def _rounds(db: Database, history: str) -> None:
    deps: Any = type("Deps", (), {"db": db, "queues": type("Q", (), {"retention": None})()})()
    await retention.apply_retention(deps, _no_publish)  # off: nothing
    assert await db.retention.last_round() is None

    deps.queues.retention = RetentionConfig(older_than=timedelta(days=180), keep_newest=2,
                                            every=timedelta(hours=1), max_rows=5)
    async with db.try_exclusive(retention.LOCK) as mine:  # another worker's round
        assert mine
        await retention.apply_retention(deps, _no_publish)
    assert await db.retention.last_round() is None

    await retention.apply_retention(deps, _no_publish)
    first = await db.retention.last_round()
    assert first is not None and first["finished_at"] is not None
    assert 5 <= sum(first["deleted"].values()) < sum(DELETED.values())
    # what it left past retention (every table is there, for its gauge)
    assert set(first["past_retention"]) == set(TABLES)
    assert first["past_retention"]["request"] == (DELETED["request"]
                                                  - first["deleted"]["request"]) > 0
    await retention.apply_retention(deps, _no_publish)  # within `every`: not due
    assert await db.retention.last_round() == first

    with psycopg.connect(history, autocommit=True) as conn:  # an hour later
        conn.execute("UPDATE retention_round SET started_at = started_at - interval '1 hour'")
    deps.queues.retention = RetentionConfig(older_than=timedelta(days=180), keep_newest=2)
    await retention.apply_retention(deps, _no_publish)
    second = await db.retention.last_round()
    assert second is not None and second["started_at"] > first["started_at"]
    assert set(second["past_retention"].values()) == {0}
    with psycopg.connect(history) as conn:
        assert conn.execute(NAMED).fetchall() == []
        assert {row[0] for row in conn.execute("SELECT id FROM request WHERE id = ANY(%s)",
                                               (sorted(GONE),))} == set()
    from streams.runtime import metrics
    assert metrics.ROWS_PAST_RETENTION.labels(table="request")._value.get() == 0


def test_a_workers_round_holds_its_lock_on_no_pooled_connection(history: str) -> None:
    """A round lasts minutes at its duty cycle: its lock is held on a connection of its
    own, so the stages keep the whole pool (here a pool of one, which a round holding a
    pooled connection would wait on for its own batches)."""
    async def main() -> dict[str, Any] | None:
        database = await Database.open(history, max_size=1, acquire_timeout=5)
        try:
            config = RetentionConfig(older_than=timedelta(days=180), keep_newest=2)
            deps: Any = type("Deps", (), {"db": database,
                                          "queues": type("Q", (), {"retention": config})()})()
            await retention.apply_retention(deps, _no_publish)
            return await database.retention.last_round()
        finally:
            await database.close()
    last = asyncio.run(main())
    assert last is not None and last["finished_at"] is not None
    assert sum(last["deleted"].values()) == sum(DELETED.values())


async def _no_publish(*args: Any) -> None:
    raise AssertionError("retention publishes nothing")


def test_prune_command_says_what_it_deletes(history: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from streams.cli.prune import prune_command

    monkeypatch.setenv("STOVEPIPE_POSTGRES_DSN", history)
    dry = CliRunner().invoke(prune_command, ["--older-than", "180d", "--dry-run",
                                             "--keep-newest", "2"])
    assert dry.exit_code == 0, dry.output
    assert "would delete" in dry.output and "(dry run: nothing deleted)" in dry.output
    assert re.search(r"^  request +8$", dry.output, re.MULTILINE), dry.output
    assert "Kept although older: 22 Requests (4 named by a culprit search, " in dry.output
    done = CliRunner().invoke(prune_command, ["--older-than", "180d", "--keep-newest", "2",
                                              "--json"])
    assert done.exit_code == 0, done.output
    assert '"request": 8' in done.output and '"total": 40' in done.output
    assert '"rested_seconds": ' in done.output
    for args, message in (
            (["5x"], "expected a duration such as"), (["2h"], "at least 1d"),
            ([""], "expected a duration"),
            (["180d", "--duty-cycle", "0"], "must be a share of time above 0 and at most 1"),
            (["180d", "--duty-cycle", "2"], "got 2.0"),
            (["180d", "--duty-cycle", "x"], "'x' is not a valid float")):
        refused = CliRunner().invoke(prune_command, ["--older-than", *args])
        assert refused.exit_code == 2 and message in refused.output, refused.output
        assert "Traceback" not in refused.output
    again = CliRunner().invoke(prune_command, ["--older-than", "180d", "--duty-cycle", "1"])
    assert again.exit_code == 0, again.output
    assert re.search(r"^0 rows in [0-9.]+ s \(0 rows/s\), \d+ batches, 0\.0 s of it resting$",
                     again.output, re.MULTILINE), again.output


def test_prune_command_waits_for_no_running_round(history: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from streams.cli.prune import prune_command

    monkeypatch.setenv("STOVEPIPE_POSTGRES_DSN", history)

    async def held() -> Any:
        database = await Database.open(history, max_size=2)
        try:
            async with database.try_exclusive(retention.LOCK):
                return await asyncio.to_thread(CliRunner().invoke, prune_command,
                                               ["--older-than", "180d", "--keep-newest", "2"])
        finally:
            await database.close()

    result = asyncio.run(held())
    assert result.exit_code == 1
    assert "a retention round is running" in result.output
