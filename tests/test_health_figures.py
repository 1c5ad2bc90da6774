"""Health figures per queue (issue 18, Deliver 5; streams/stages/gauges.py): their
arithmetic as plain functions, and their reads on a real PostgreSQL with facts, Requests
and greenness changes at controlled times, and the bookmark's lag in commits counted by a
real git repository."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from store import Database
from streams.config.queues import Extensions, load_queues
from streams.stages import gauges
from streams.stages.deps import Deps
from streams.stages.gauges import percentile, red_share
from tests.culprit_support import QUEUE, Branch, git

DAY = 86400.0

# --- the arithmetic ---------------------------------------------------------------------


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.9) == 7.0
    assert percentile([60.0, 120.0, 300.0], 0.5) == 120.0
    assert percentile([300.0, 60.0, 120.0], 0.9) == pytest.approx(264.0)  # 120 + .8 * 180
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0], 0.0) == 1.0 and percentile([1.0, 2.0], 1.0) == 2.0
    with pytest.raises(ValueError, match="quantile"):
        percentile([1.0], 1.5)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.floats(0, 1))
def test_percentile_lies_between_the_values_and_agrees_with_statistics(
        values: list[float], q: float) -> None:
    found = percentile(values, q)
    assert found is not None and min(values) <= found <= max(values)
    if len(values) >= 2:  # statistics' "inclusive" method is the same interpolation
        cuts = statistics.quantiles(values, n=10, method="inclusive")
        assert percentile(values, 0.9) == pytest.approx(cuts[8], rel=1e-9, abs=1e-6)
        assert percentile(values, 0.5) == pytest.approx(statistics.median(values),
                                                        rel=1e-9, abs=1e-6)


def test_red_share_of_a_window() -> None:
    week = 7 * DAY
    # green at the start, red for day 1..2, green, red again from day 6
    changes = [(1 * DAY, "red"), (2 * DAY, "green"), (6 * DAY, "red")]
    assert red_share(week, "green", changes) == (2 * DAY, week)
    # not known before the first change: only the time since counts
    assert red_share(week, None, [(3 * DAY, "red"), (5 * DAY, "green")]) == (2 * DAY,
                                                                             4 * DAY)
    assert red_share(week, None, []) == (0.0, 0.0)
    assert red_share(week, "red", []) == (week, week)
    # the same colour twice changes nothing
    assert red_share(week, "red", [(DAY, "red")]) == (week, week)


changes_strategy = st.lists(
    st.tuples(st.floats(0, 7 * DAY), st.sampled_from(["green", "red"])), max_size=20
).map(lambda cs: sorted(cs))


@given(st.sampled_from([None, "green", "red"]), changes_strategy)
def test_red_and_green_share_the_known_time(before: str | None,
                                            changes: list[tuple[float, str]]) -> None:
    week = 7 * DAY
    red, known = red_share(week, before, changes)
    flip = {"green": "red", "red": "green"}
    green, known_again = red_share(week, flip[before] if before else None,
                                   [(at, flip[c]) for at, c in changes])
    assert 0 <= red <= known <= week + 1e-6
    assert known_again == pytest.approx(known)
    assert red + green == pytest.approx(known)
    if before is not None:
        assert known == pytest.approx(week)


# --- on the database and a real repository ----------------------------------------------


def _run(dsn: str, root: Path, branch: Branch,
         body: Callable[[Deps], Awaitable[None]]) -> None:
    (root / "queues.yaml").write_text(
        "queues:\n"
        f"  {QUEUE}:\n"
        f"    source_control: {{kind: git, repository: {branch.work}, ref: main}}\n"
        "    build_runner: {kind: fake}\n")

    async def main() -> None:
        queues = load_queues(root / "queues.yaml")
        async with await Database.open(dsn, min_size=1, max_size=4) as db:
            extensions = Extensions(queues, db)
            try:
                await body(Deps(db=db, queues=queues, extensions=extensions))
            finally:
                await extensions.aclose()

    gauges._lag_counts.clear()
    gauges._flake_bases.clear()
    asyncio.run(main())


def _seed(dsn: str, branch: Branch) -> None:
    """Requests and facts with controlled times: heads c0 (ingested 10 h ago, fact 60 s
    later), c3 (5 h ago, red after 120 s) and c3 validated again (red after 300 s), c7
    building; a flaky backfill (green after 1000 s: not a head, so no time to signal); a
    head of 30 h ago (outside the window) and a flake of 2 days ago; greenness green 8 days
    ago, red 6 days ago, green 5 days ago and red since 1 day ago."""
    rows = [  # id, commit, kind, state, verdict, ingested (s ago), fact after (s), flaky
        ("request/mono/main/1", "c0", "head", "succeeded", "green", 10 * 3600, 60, False),
        ("request/mono/main/1~1", "c1", "backfill", "succeeded", "green", 4 * 3600, 1000,
         True),
        ("request/mono/main/2", "c3", "head", "failed", "red", 5 * 3600, 120, False),
        ("request/mono/main/2.2", "c3", "retry", "failed", "red", 3 * 3600, 300, False),
        ("request/mono/main/3", "c7", "head", "accepted", None, 3600, None, False),
    ]
    old = [("request/mono/main/1~2", "x1", 30 * 3600, 5000, False),
           ("request/mono/main/1~3", "x2", 2 * 86400, 10, True)]
    with psycopg.connect(dsn) as conn:  # one transaction: one now() for every time
        for rid, name, kind, state, verdict, ago, after, flaky in rows:
            conn.execute(
                "INSERT INTO request (queue, id, uri, kind, state, verdict, created_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, now() - make_interval(secs => %s))",
                (QUEUE, rid, branch.uri(name), kind, state, verdict, ago))
            if after is not None:
                conn.execute(
                    "INSERT INTO validation_fact (queue, uri, degree, request_id,"
                    " created_at, flaky) VALUES (%s, %s, %s, %s,"
                    " now() - make_interval(secs => %s), %s)",
                    (QUEUE, branch.uri(name), 0 if verdict == "green" else 1, rid,
                     ago - after, flaky))
        # facts of their time: a head's outside the window, a flake of 2 days ago
        for rid, name, ago, after, flaky in old:
            conn.execute("INSERT INTO request (queue, id, uri, state, verdict, created_at)"
                         " VALUES (%s, %s, %s, 'succeeded', 'green',"
                         " now() - make_interval(secs => %s))",
                         (QUEUE, rid, f"x://{name}", ago))
            conn.execute("INSERT INTO validation_fact (queue, uri, degree, request_id,"
                         " created_at, flaky) VALUES (%s, %s, 0, %s,"
                         " now() - make_interval(secs => %s), %s)",
                         (QUEUE, f"x://{name}", rid, ago - after, flaky))
        for days, greenness in ((8, "green"), (6, "red"), (5, "green"), (1, "red")):
            conn.execute("INSERT INTO greenness_change (queue, at, greenness, request_id)"
                         " VALUES (%s, now() - make_interval(days => %s), %s, 'x')",
                         (QUEUE, days, greenness))
        conn.execute("INSERT INTO queue (name, last_green_uri, last_green_request_id,"
                     " latest_request_id) VALUES (%s, %s, 'request/mono/main/1',"
                     " 'request/mono/main/3')", (QUEUE, branch.uri("c0")))


def _branch(tmp_path: Path) -> Branch:
    branch = Branch(tmp_path)
    for n in range(8):
        branch.commit(f"c{n}", "green")
    return branch


def test_health_figures_with_known_values(migrated_dsn: str, tmp_path: Path) -> None:
    branch = _branch(tmp_path)
    _seed(migrated_dsn, branch)

    async def body(deps: Deps) -> None:
        health = await gauges.queue_health(deps, QUEUE)
        signal = health.time_to_signal
        # the heads and the commit validated again in the last 24 h: 60, 120 and 300 s
        assert (signal.facts, signal.p50_s, signal.p90_s) == (3, 120.0, 264.0)
        assert signal.window_s == DAY
        red = health.red
        # red for day 6..5 ago and since a day ago: 2 of the 7 days
        assert red.window_s == 7 * DAY
        assert red.share == pytest.approx(2 / 7, abs=1e-6)
        assert red.known_s == pytest.approx(7 * DAY, abs=1.0)
        assert red.streak_s == pytest.approx(DAY, abs=60)
        lag = health.bookmark_lag
        # c1..c7 after the bookmarked c0, on the branch's first-parent history
        assert (lag.commits, lag.commits_more_than, lag.commits_note) == (7, False, None)
        # behind since the first head after the bookmark (request 2, 5 h ago)
        assert lag.seconds == pytest.approx(5 * 3600, abs=60)
        # the flaky backfill of 4 h ago in the window; with the one of 2 days ago, 2
        assert (health.flakes.in_window, health.flakes.total) == (1, 2)

        # counted once per (bookmark, head) pair: the repository is not asked again
        git(branch.work, "update-ref", "-d", "refs/heads/main")
        again = await gauges.queue_health(deps, QUEUE)
        assert again.bookmark_lag.commits == 7

        gauges.set_health_gauges(health)
        sample = REGISTRY.get_sample_value
        assert sample("stovepipe_time_to_signal_seconds",
                      {"queue": QUEUE, "quantile": "0.5"}) == 120.0
        assert sample("stovepipe_red_time_ratio", {"queue": QUEUE}) == pytest.approx(2 / 7,
                                                                                    abs=1e-6)
        assert sample("stovepipe_bookmark_lag_commits", {"queue": QUEUE}) == 7
        assert sample("stovepipe_flakes", {"queue": QUEUE, "window": "total"}) == 2
        assert sample("stovepipe_red_streak_seconds", {"queue": QUEUE}) > 0

    _run(migrated_dsn, tmp_path, branch, body)


def test_commit_lag_beyond_the_limit_and_off_the_history(migrated_dsn: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    branch = _branch(tmp_path)
    _seed(migrated_dsn, branch)
    monkeypatch.setattr(gauges, "LAG_COMMITS_LIMIT", 5)

    async def body(deps: Deps) -> None:
        lag = (await gauges.queue_health(deps, QUEUE)).bookmark_lag
        assert (lag.commits, lag.commits_more_than) == (5, True)  # "more than 5"
        # a list of every queue never waits for a repository: a count not made yet is
        # said to be so
        gauges._lag_counts.clear()
        lag = (await gauges.queue_health(deps, QUEUE, lag_deadline=0)).bookmark_lag
        assert lag.commits is None and "not counted yet" in (lag.commits_note or "")

    _run(migrated_dsn, tmp_path, branch, body)

    # the bookmarked commit off the head's history (the branch was rewritten)
    git(branch.work, "checkout", "-q", "-b", "side", branch.shas["c0"])
    side = branch.commit("s1", "green")
    git(branch.work, "checkout", "-q", "main")
    with psycopg.connect(migrated_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO request (queue, id, uri, state, verdict) VALUES"
                     " (%s, 'request/mono/main/3.2', %s, 'succeeded', 'green')",
                     (QUEUE, branch.uri("s1")))
        conn.execute("INSERT INTO validation_fact (queue, uri, degree, request_id) VALUES"
                     " (%s, %s, 0, 'request/mono/main/3.2')", (QUEUE, branch.uri("s1")))
        conn.execute("INSERT INTO request (queue, id, uri) VALUES"
                     " (%s, 'request/mono/main/4', %s)", (QUEUE, branch.uri("c7")))
        conn.execute("UPDATE queue SET last_green_uri = %s,"
                     " last_green_request_id = 'request/mono/main/3.2',"
                     " latest_request_id = 'request/mono/main/4'", (branch.uri("s1"),))
    assert side

    async def rewritten(deps: Deps) -> None:
        lag = (await gauges.queue_health(deps, QUEUE)).bookmark_lag
        assert lag.commits is None
        assert lag.commits_note == ("the bookmarked commit is not in the head's history "
                                    "(the branch was rewritten)")

    _run(migrated_dsn, tmp_path, branch, rewritten)


def test_a_queue_with_nothing_yet(migrated_dsn: str, tmp_path: Path) -> None:
    branch = _branch(tmp_path)

    async def body(deps: Deps) -> None:
        health = await gauges.queue_health(deps, QUEUE)
        assert (health.time_to_signal.facts, health.time_to_signal.p50_s) == (0, None)
        assert (health.red.share, health.red.streak_s) == (None, None)
        assert health.bookmark_lag.commits is None
        assert health.bookmark_lag.commits_note == "nothing was ingested yet"
        assert (health.flakes.in_window, health.flakes.total) == (0, 0)

    _run(migrated_dsn, tmp_path, branch, body)
