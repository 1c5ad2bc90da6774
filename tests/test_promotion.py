"""The promotion ref only moves forward (design §4, invariant 5): record moves it by
compare-and-set, so concurrent record deliveries — of successive green Requests, each
delivered more than once — never move it back, even for a moment. On the real store, with
the fake repository recording every move of the ref, and with a real git repository."""

from __future__ import annotations

import asyncio
import logging
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from contract import Record
from store import BuildStrategy, Database, RequestState
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol import PromotionMoved
from streams.extensions.sourcecontrol.fake import FakeRepo
from streams.extensions.sourcecontrol.git import GitSourceControl
from streams.runtime.stage import Context, Incoming
from streams.stages.deps import Deps
from streams.stages.ingest import ingest_queue
from streams.stages.record import handle_record

pytestmark = pytest.mark.postgres

HEADS = 20


async def _sink(key: str, payload: Any) -> None:
    """Publishes go nowhere: record is driven by hand here."""


class Jittery:
    """A source control whose promotion calls each take 0-60 ms."""

    def __init__(self, inner: Any, rng: random.Random) -> None:
        self.inner, self.rng = inner, rng

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def promotion_target(self) -> str | None:
        await asyncio.sleep(self.rng.uniform(0, 0.06))
        return await self.inner.promotion_target()  # type: ignore[no-any-return]

    async def promote(self, uri: str, *, expected: str | None) -> None:
        await asyncio.sleep(self.rng.uniform(0, 0.06))
        await self.inner.promote(uri, expected=expected)


def _ctx(deps: Deps, n: int) -> Context[Deps]:
    return Context(stage="record",
                   message=Incoming(topic="record", partition=0, offset=n, key=None,
                                    value=None, headers=[]),
                   publish=_sink, deps=deps,
                   log=logging.LoggerAdapter(logging.getLogger("test"), {}))


async def _settle_green(deps: Deps, queue: str, request_id: str) -> None:
    """What process and buildsignal do for a green build, without Kafka."""
    request = await deps.db.requests.get(queue, request_id)
    async with deps.db.transaction() as tx:
        await tx.queues.take_slot(await tx.queues.get(queue))
        request = await tx.requests.transition(request, RequestState.PROCESSING,
                                               strategy=BuildStrategy.FULL)
    async with deps.db.transaction() as tx:
        await tx.queues.release_slot(await tx.queues.get(queue))
        await tx.requests.transition(request, RequestState.SUCCEEDED)


def test_concurrent_record_deliveries_never_move_the_ref_back(migrated_dsn: str,
                                                              tmp_path: Path) -> None:
    repo = FakeRepo(tmp_path / "repo.json")
    (tmp_path / "queues.yaml").write_text(
        "queues:\n  q:\n    source_control: {kind: fake, path: repo.json, repo: r, ref: main,"
        " promotion_ref: verified}\n"
        "    build_runner: {kind: fake}\n")
    rng = random.Random(9)

    async def run() -> list[str]:
        queues = load_queues(tmp_path / "queues.yaml")
        db = await Database.open(migrated_dsn, max_size=20)
        try:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            # every call to the repository takes a random while, as a remote's would: the
            # interleavings that move a blindly pushed ref back happen here
            real = deps.extensions.source_control("q")
            deps.extensions._source_controls["q"] = Jittery(real, rng)  # type: ignore[assignment]
            ids = []
            for i in range(1, HEADS + 1):
                repo.push("main", f"c{i}")
                ids.append(await ingest_queue(deps, "q", _sink))
                await _settle_green(deps, "q", ids[-1])
            # every Request's record delivered three times, all at once, shuffled
            deliveries = [*ids, *ids, *ids]
            rng.shuffle(deliveries)
            await asyncio.gather(*(handle_record(Record(id=rid, queue_name="q"),
                                                 _ctx(deps, n))
                                   for n, rid in enumerate(deliveries)))
            return ids
        finally:
            await db.close()

    ids = asyncio.run(run())
    async def bookmark() -> str | None:
        async with await Database.open(migrated_dsn, max_size=1) as db:
            return (await db.queues.get("q")).last_green_request_id

    assert asyncio.run(bookmark()) == ids[-1]
    moves = [int(sha.removeprefix("c")) for sha in repo.promotions("verified")]
    assert moves == sorted(moves), f"the promotion ref moved back: {moves}"
    assert moves[-1] == HEADS and repo.promoted("verified") == f"c{HEADS}"
    assert len(moves) == len(set(moves))


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-C", str(cwd), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.parametrize("remote", [False, True])
def test_git_promotion_is_a_compare_and_set(tmp_path: Path, remote: bool) -> None:
    """update-ref with the old value (a local repository), push --force-with-lease (a
    remote one): a promotion expecting a stale target is refused and moves nothing."""
    origin = tmp_path / "origin.git"
    work = tmp_path / "work"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], check=True)
    subprocess.run(["git", "clone", "-q", str(origin), str(work)], check=True,
                   capture_output=True)
    shas = []
    for i in range(3):
        _git(work, "commit", "-q", "--allow-empty", "-m", f"c{i}")
        shas.append(_git(work, "rev-parse", "HEAD"))
    _git(work, "push", "-q", "origin", "HEAD:main")
    repository = origin.as_uri() if remote else str(origin)
    sc = GitSourceControl(repository, "main", "verified", cache_dir=tmp_path / "cache")

    def uri(sha: str) -> str:
        return f"git+{repository}#main@{sha}"

    async def run() -> None:
        assert await sc.promotion_target() is None
        await sc.promote(uri(shas[1]), expected=None)
        assert await sc.promotion_target() == uri(shas[1])
        with pytest.raises(PromotionMoved):  # another promotion moved it meanwhile
            await sc.promote(uri(shas[2]), expected=None)
        with pytest.raises(PromotionMoved):
            await sc.promote(uri(shas[0]), expected=uri(shas[2]))
        assert await sc.promotion_target() == uri(shas[1])
        await sc.promote(uri(shas[2]), expected=uri(shas[1]))
        assert await sc.promotion_target() == uri(shas[2])

    asyncio.run(run())
    assert _git(origin.parent, "--git-dir", str(origin), "rev-parse", "verified") == shas[2]
