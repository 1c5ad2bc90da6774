"""A queue's history as the dashboard reads it (streams/web/history.py) on a real
PostgreSQL: heads, superseded heads, validations again and backfills in history order,
newest first; commits described from commit_info, and the ones it lacks described by the
repository and remembered — in the background, so a slow or failing repository never
fails or stalls the read; build links; the current red streak's culprit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from store import (
    BuildStatus,
    BuildStrategy,
    Database,
    Request,
    RequestState,
    Verdict,
)
from store.culprits import SearchState
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol import CommitInfo, SourceControlError
from streams.extensions.sourcecontrol.fake import FakeRepo
from streams.stages.deps import Deps
from streams.web.history import (
    CommitDescriptions,
    DescribesCommits,
    Outcome,
    build_log_path,
    outcome_of,
    queue_history,
)
from tests.waiting import wait_until_async

pytestmark = pytest.mark.postgres

Q = "mono/main"
HOSTED = "mono/hosted"  # a Buildkite queue
AUTHOR = "Ada Lovelace <ada@example.invalid>"
SUBJECTS = {f"c{n}": f"c{n}: change {n}" for n in range(6)}


def _deps_run(dsn: str, root: Path, body: Callable[[Deps], Awaitable[None]]) -> None:
    (root / "queues.yaml").write_text(
        "queues:\n"
        f"  {Q}:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: main}\n"
        "    build_runner: {kind: fake}\n"
        f"  {HOSTED}:\n"
        "    source_control: {kind: fake, path: repo.json, repo: r, ref: main}\n"
        "    build_runner: {kind: buildkite, organization: acme, pipeline: mono,"
        " token_env: BK_TOKEN}\n")
    FakeRepo(root / "repo.json").push("main", *SUBJECTS, author=AUTHOR, subjects=SUBJECTS)

    async def main() -> None:
        queues = load_queues(root / "queues.yaml")
        async with await Database.open(dsn, min_size=1, max_size=8) as db:
            extensions = Extensions(queues, db)
            try:
                await body(Deps(db=db, queues=queues, extensions=extensions))
            finally:
                await extensions.aclose()

    asyncio.run(main())


def uri(name: str) -> str:
    return FakeRepo.uri("r", "main", name)


async def _ingest(db: Database, name: str, queue: str = Q) -> str:
    async with db.queue_transaction(queue) as tx:
        minted = await tx.steps.find_or_mint(queue, uri(name))
        assert minted is not None
        return minted.request_id


async def _admit(db: Database, request_id: str, queue: str = Q) -> Request:
    request, row = await db.steps.request_with_queue(queue, request_id)
    assert row is not None
    admitted = await db.steps.admit(request, strategy=BuildStrategy.FULL, base_uri=None,
                                    max_concurrent=100, backfill_max_concurrent=10,
                                    last_green_request_id=row.last_green_request_id)
    assert admitted is not None
    return admitted


async def _built(db: Database, request_id: str, name: str, *, green: bool,
                 queue: str = Q, build_id: str | None = None) -> None:
    """Admit, build and record ``request_id`` of commit ``name``: green or red."""
    request = await _admit(db, request_id, queue)
    build = await db.builds.create(queue, build_id or f"b-{request_id}", request.id)
    await db.steps.settle(build, BuildStatus.SUCCEEDED if green else BuildStatus.FAILED)
    await db.steps.record_fact(queue, uri(name), request_id=request_id,
                               degree=0.0 if green else 1.0)


async def _red_streak_with_backfills(deps: Deps) -> None:
    """c0 green (head 1); c1..c3 pushed at once, c3 red (head 2); the search backfills c1
    (green) and c2 (red: the culprit); c3 validated again (2.2, waiting); c4 a head that
    c5 superseded while it waited; c5 building."""
    db = deps.db
    assert await _ingest(db, "c0") == f"request/{Q}/1"
    await _built(db, f"request/{Q}/1", "c0", green=True)
    assert await _ingest(db, "c3") == f"request/{Q}/2"
    await _built(db, f"request/{Q}/2", "c3", green=False)
    for name, position, green in (("c1", 1, True), ("c2", 2, False)):
        backfill = await db.steps.mint_backfill(Q, uri(name), f"request/{Q}/1~{position}")
        assert backfill.minted_id == f"request/{Q}/1~{position}"
        await _built(db, backfill.minted_id, name, green=green)
    again = await db.steps.validate_again(Q, uri("c3"))
    assert again.minted_id == f"request/{Q}/2.2"
    await _ingest(db, "c4")  # request 3, superseded by 4 before it was admitted
    assert await _ingest(db, "c5") == f"request/{Q}/4"
    superseded = await db.requests.get(Q, f"request/{Q}/3")
    await db.requests.pass_over(superseded, f"superseded by request/{Q}/4")
    await db.builds.create(Q, f"b-request/{Q}/4", (await _admit(db, f"request/{Q}/4")).id)
    search, _ = await db.culprit_searches.open(
        Q, f"request/{Q}/2", uri("c3"), green_request_id=f"request/{Q}/1",
        green_uri=uri("c0"), commits=[uri(n) for n in ("c0", "c1", "c2", "c3")],
        max_builds=4)
    await db.culprit_searches.update(
        search, lo=1, hi=2, skipped=(), probes=[f"request/{Q}/1~1", f"request/{Q}/1~2"],
        builds=2, state=SearchState.FOUND, detail="c2 broke it",
        culprit_uri=uri("c2"), culprit_request_id=f"request/{Q}/1~2")


def test_heads_backfills_and_validations_again_in_history_order(migrated_dsn: str,
                                                                 tmp_path: Path) -> None:
    async def body(deps: Deps) -> None:
        await _red_streak_with_backfills(deps)
        found = await queue_history(deps, Q, 30, CommitDescriptions())
        got = [(e.request_id.removeprefix(f"request/{Q}/"), e.kind, e.outcome,
                e.subject) for e in found.entries]
        assert got == [
            ("4", "head", Outcome.RUNNING, SUBJECTS["c5"]),
            ("3", "head", Outcome.SUPERSEDED, SUBJECTS["c4"]),
            ("2.2", "retry", Outcome.WAITING, SUBJECTS["c3"]),
            ("2", "head", Outcome.RED, SUBJECTS["c3"]),
            ("1~2", "backfill", Outcome.RED, SUBJECTS["c2"]),
            ("1~1", "backfill", Outcome.GREEN, SUBJECTS["c1"]),
            ("1", "head", Outcome.GREEN, SUBJECTS["c0"]),
        ]
        assert found.order == "newest first" and found.described
        assert found.greenness == "red"  # the newest verdict: head 2
        by_id = {e.request_id.removeprefix(f"request/{Q}/"): e for e in found.entries}
        assert [k for k, e in by_id.items() if e.culprit] == ["1~2"]
        assert [k for k, e in by_id.items() if e.bookmark] == ["1~1"]  # moved forward
        assert by_id["3"].reason == f"superseded by request/{Q}/4"
        assert by_id["3"].build is None and by_id["3"].time_to_signal_s is None
        red = by_id["2"]
        assert red.author == AUTHOR and red.sha == "c3" and red.verdict == "red"
        assert red.fact_at is not None and red.time_to_signal_s is not None
        assert red.time_to_signal_s == pytest.approx(
            (red.fact_at - red.ingested_at).total_seconds())
        assert red.build is not None and (red.build.id, red.build.status) == (
            f"b-request/{Q}/2", "failed")
        assert red.build.url is None  # the fake runner has no pages
        assert by_id["4"].build is not None and by_id["4"].build.status == "accepted"

        search = found.culprit_search
        assert search is not None and search.state == "found"
        assert (search.sha, search.subject, search.author) == ("c2", SUBJECTS["c2"], AUTHOR)
        assert search.build is not None and search.build.id == f"b-request/{Q}/1~2"
        assert (search.builds, search.suspects) == (2, 1)

        # a window of the newest three
        newest = await queue_history(deps, Q, 3, CommitDescriptions())
        assert [e.request_id for e in newest.entries] == [
            f"request/{Q}/4", f"request/{Q}/3", f"request/{Q}/2.2"]
        with pytest.raises(ValueError, match="limit"):
            await queue_history(deps, Q, 201, CommitDescriptions())

    _deps_run(migrated_dsn, tmp_path, body)


def test_a_green_commit_after_the_streak_ends_its_culprit(migrated_dsn: str,
                                                         tmp_path: Path) -> None:
    async def body(deps: Deps) -> None:
        await _red_streak_with_backfills(deps)
        db = deps.db
        await db.steps.settle(await db.builds.get(Q, f"b-request/{Q}/4"), BuildStatus.SUCCEEDED)
        await db.steps.record_fact(Q, uri("c5"), request_id=f"request/{Q}/4", degree=0.0)
        found = await queue_history(deps, Q, 30, CommitDescriptions())
        assert found.greenness == "green" and found.culprit_search is None
        assert not any(e.culprit for e in found.entries)
        assert [e.request_id for e in found.entries if e.bookmark] == [f"request/{Q}/4"]

    _deps_run(migrated_dsn, tmp_path, body)


class SlowRepository:
    """A repository that takes ``delay`` seconds to describe commits (or fails)."""

    def __init__(self, inner: DescribesCommits, delay: float, *, fail: bool = False) -> None:
        self.inner = inner
        self.delay = delay
        self.fail = fail
        self.asked: list[list[str]] = []

    async def describe(self, uris: Sequence[str]) -> list[CommitInfo]:
        self.asked.append(list(uris))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise SourceControlError("the repository is away", retryable=True)
        return await self.inner.describe(uris)


def test_subjects_are_filled_in_the_background_when_the_repository_is_slow(
        migrated_dsn: str, tmp_path: Path) -> None:
    async def body(deps: Deps) -> None:
        db = deps.db
        await _ingest(db, "c0")
        await _ingest(db, "c1")
        assert await db.commit_infos.of(Q, [uri("c0"), uri("c1")]) == {}
        slow = SlowRepository(deps.extensions.source_control(Q), 1.0)
        descriptions = CommitDescriptions(deadline=0.2)
        started = time.monotonic()
        found = await descriptions.of(db, Q, [uri("c1"), uri("c0")], lambda: slow)
        assert time.monotonic() - started < 0.9, "the read waited for the repository"
        assert found == {}
        # a second read while the first description runs asks nothing more
        assert await descriptions.of(db, Q, [uri("c1"), uri("c0")], lambda: slow) == {}
        assert slow.asked == [[uri("c1"), uri("c0")]]
        # the description ends in the background, remembered

        async def described() -> bool:
            return len(await db.commit_infos.of(Q, [uri("c0"), uri("c1")])) == 2

        await wait_until_async(described, within=30, what="the background description")
        known = await db.commit_infos.of(Q, [uri("c0"), uri("c1")])
        assert {u: (c.subject, c.author) for u, c in known.items()} == {
            uri("c0"): (SUBJECTS["c0"], AUTHOR), uri("c1"): (SUBJECTS["c1"], AUTHOR)}
        history = await queue_history(deps, Q, 30, descriptions)
        assert [e.subject for e in history.entries] == [SUBJECTS["c1"], SUBJECTS["c0"]]
        assert history.described and len(slow.asked) == 1

    _deps_run(migrated_dsn, tmp_path, body)


def test_a_failing_repository_leaves_commits_undescribed_and_is_asked_again_later(
        migrated_dsn: str, tmp_path: Path) -> None:
    async def body(deps: Deps) -> None:
        db = deps.db
        await _ingest(db, "c0")
        down = SlowRepository(deps.extensions.source_control(Q), 0.0, fail=True)
        descriptions = CommitDescriptions(deadline=1.0, failed_retry=0.3)
        assert await descriptions.of(db, Q, [uri("c0")], lambda: down) == {}
        assert await descriptions.of(db, Q, [uri("c0")], lambda: down) == {}
        assert len(down.asked) == 1, "asked again at once"
        await asyncio.sleep(0.35)
        down.fail = False
        found = await descriptions.of(db, Q, [uri("c0")], lambda: down)
        assert found[uri("c0")].subject == SUBJECTS["c0"] and len(down.asked) == 2
        # a commit the repository does not have is not asked about again soon
        gone = FakeRepo.uri("r", "main", "nowhere")
        assert await descriptions.of(db, Q, [gone], lambda: down) == {}
        assert await descriptions.of(db, Q, [gone], lambda: down) == {}
        assert down.asked[2:] == [[gone]]
        # and the history read answers all the same, naming the commit by its URI
        history = await queue_history(deps, Q, 30, descriptions)
        assert [(e.sha, e.subject) for e in history.entries] == [("c0", SUBJECTS["c0"])]

    _deps_run(migrated_dsn, tmp_path, body)


def test_builds_link_to_the_command_log_or_the_providers_page(migrated_dsn: str,
                                                             tmp_path: Path) -> None:
    assert build_log_path("mono/main", "cmd-0123") == "/api/builds/mono/main/cmd-0123/log"
    assert build_log_path("a b/c", "x/y") == "/api/builds/a%20b/c/x%2Fy/log"

    async def body(deps: Deps) -> None:
        db = deps.db
        request_id = await _ingest(db, "c0", HOSTED)
        await _built(db, request_id, "c0", green=True, queue=HOSTED,
                     build_id="bk-acme/mono/7")
        [entry] = (await queue_history(deps, HOSTED, 30, CommitDescriptions())).entries
        assert entry.build is not None
        assert (entry.build.url, entry.build.url_kind) == (
            "https://buildkite.com/acme/mono/builds/7", "provider")
        assert entry.outcome is Outcome.GREEN and entry.bookmark

    _deps_run(migrated_dsn, tmp_path, body)


@pytest.mark.parametrize(("state", "verdict", "outcome"), [
    (RequestState.SUCCEEDED, Verdict.GREEN, Outcome.GREEN),
    (RequestState.FAILED, Verdict.RED, Outcome.RED),
    (RequestState.FAILED, None, Outcome.UNVALIDATED),  # could not validate: never red
    (RequestState.SUPERSEDED, None, Outcome.SUPERSEDED),
    (RequestState.PROCESSING, None, Outcome.RUNNING),
    (RequestState.ACCEPTED, None, Outcome.WAITING),
    (RequestState.CANCELLED, None, Outcome.CANCELLED),
])
def test_every_request_state_has_one_outcome(state: RequestState, verdict: Verdict | None,
                                             outcome: Outcome) -> None:
    now = datetime.now(UTC)
    request = Request(queue=Q, id=f"request/{Q}/1", uri=uri("c0"), state=state,
                      build_strategy=None, base_uri=None, version=1, created_at=now,
                      updated_at=now, verdict=verdict)
    assert outcome_of(request) is outcome
