"""The fake SourceControl: ancestry, force-push, promotion, and a file shared by processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from streams.extensions.sourcecontrol import (
    CommitNotFound,
    NotOnFirstParent,
    SourceControl,
    SourceControlError,
    TooManyCommits,
    UnknownRef,
)
from streams.extensions.sourcecontrol.fake import FakeRepo, FakeSourceControl, fake_uri

REPO = "demo"

async def _promote(sc: Any, uri: str) -> None:
    """Promote ``uri`` from wherever the promotion ref is now (the compare-and-set's
    expected value read first, as the record stage does)."""
    await sc.promote(uri, expected=await sc.promotion_target())



@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "repo" / "repo.json"


@pytest.fixture
def repo(path: Path) -> FakeRepo:
    return FakeRepo(path)


def source(path: Path, ref: str = "main",
           promotion_ref: str | None = "verified") -> FakeSourceControl:
    return FakeSourceControl(path, REPO, ref, promotion_ref)


def uri(sha: str, ref: str = "main") -> str:
    return FakeRepo.uri(REPO, ref, sha)


def test_satisfies_the_protocol(path: Path) -> None:
    sc: SourceControl = source(path)
    assert sc is not None


def test_head_names_the_refs_newest_commit(repo: FakeRepo, path: Path) -> None:
    assert repo.push("main", "a1", "a2") == "a2"
    assert asyncio.run(source(path).head()) == "fake://demo/main/a2"
    repo.push("main", "a3")
    assert asyncio.run(source(path).head()) == uri("a3")
    assert repo.head("main") == "a3"
    assert json.loads(path.read_text())["commits"]["a3"]["parents"] == ["a2"]


def test_head_of_a_missing_file_or_ref_is_unknown_ref(repo: FakeRepo, path: Path) -> None:
    with pytest.raises(UnknownRef, match="no file"):
        asyncio.run(source(path).head())
    assert not path.parent.exists()  # reading never creates the repository
    repo.push("main", "a1")
    with pytest.raises(UnknownRef, match=r"has no ref 'release'.*main"):
        asyncio.run(source(path, ref="release").head())
    assert repo.head("release") is None
    assert FakeRepo(path.parent / "none.json").head("main") is None


def test_ancestry_over_a_linear_history(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1", "a2", "a3")
    sc = source(path)

    async def check() -> None:
        assert await sc.is_ancestor(uri("a1"), uri("a3"))
        assert await sc.is_ancestor(uri("a2"), uri("a3"))
        assert await sc.is_ancestor(uri("a3"), uri("a3"))  # a commit is its own ancestor
        assert not await sc.is_ancestor(uri("a3"), uri("a1"))

    asyncio.run(check())


def test_ancestry_over_a_merge(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "root", "m1")
    repo.commit("f1", parents=["root"])
    repo.commit("f2", parents=["f1"])
    repo.commit("merge", parents=["m1", "f2"])
    repo.force_push("main", "merge")  # a fast-forward to the merge commit
    repo.push("main", "after")
    sc = source(path)

    async def check() -> None:
        for sha in ("root", "m1", "f1", "f2", "merge"):
            assert await sc.is_ancestor(uri(sha), uri("after")), sha
        assert await sc.is_ancestor(uri("f1"), uri("merge"))
        assert not await sc.is_ancestor(uri("f1"), uri("m1"))  # side branches
        assert not await sc.is_ancestor(uri("m1"), uri("f2"))
        assert await sc.is_ancestor(uri("root"), uri("f2"))  # not on main: still a commit

    asyncio.run(check())


def test_commits_between_walk_the_first_parent_history(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "root", "m1", author="Ada <ada@example.invalid>",
              subjects={"m1": "m1: speed up the parser"})
    repo.commit("f1", parents=["root"])
    repo.commit("merge", parents=["m1", "f1"])
    repo.force_push("main", "merge")
    repo.push("main", "after")
    sc = source(path)

    async def check() -> None:
        between = await sc.commits_between(uri("root"), uri("after"), limit=10)
        assert [c.sha for c in between] == ["m1", "merge", "after"]
        assert between[0].subject == "m1: speed up the parser"
        assert between[0].author == "Ada <ada@example.invalid>"
        assert between[0].parent_uri == uri("root") and between[1].parent_uri == uri("m1")
        assert await sc.commits_between(uri("after"), uri("after"), limit=10) == []
        with pytest.raises(NotOnFirstParent):  # an ancestor through the merge's 2nd parent
            await sc.commits_between(uri("f1"), uri("after"), limit=10)
        with pytest.raises(TooManyCommits, match="more than 1 commits"):
            await sc.commits_between(uri("root"), uri("after"), limit=1)
        with pytest.raises(CommitNotFound):
            await sc.commits_between(uri("nope"), uri("after"), limit=10)
        described = await sc.describe([uri("m1"), uri("nope"), "git+/x#main@abc"])
        assert [(c.sha, c.subject) for c in described] == [("m1", "m1: speed up the parser")]

    asyncio.run(check())


def test_unknown_or_foreign_commits_are_not_found(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1")
    sc = source(path)
    for bad in (uri("nope"), "fake://other/main/a1", "git://x/a1", "a1", "fake://demo/a1"):
        with pytest.raises(CommitNotFound):
            asyncio.run(sc.is_ancestor(bad, uri("a1")))
        with pytest.raises(CommitNotFound):
            asyncio.run(sc.is_ancestor(uri("a1"), bad))
        with pytest.raises(CommitNotFound):
            asyncio.run(sc.commit_time(bad))
    # a URI minted on another ref of the same repository names the same commit
    assert asyncio.run(sc.is_ancestor(uri("a1", ref="release"), uri("a1")))


@pytest.mark.parametrize(("token", "retryable"), [("ancestryerror", False),
                                                   ("ancestryretry", True)])
def test_injected_ancestry_faults(repo: FakeRepo, path: Path, token: str,
                                  retryable: bool) -> None:
    repo.push("main", "a1", f"c7-{token}", "a3")
    sc = source(path)
    for pair in ((uri("a1"), uri(f"c7-{token}")), (uri(f"c7-{token}"), uri("a3"))):
        with pytest.raises(SourceControlError, match="injected fault") as info:
            asyncio.run(sc.is_ancestor(*pair))
        assert info.value.retryable is retryable
        assert not isinstance(info.value, CommitNotFound)
    assert asyncio.run(sc.is_ancestor(uri("a1"), uri("a3")))  # walking past it is fine
    asyncio.run(_promote(sc, uri(f"c7-{token}")))


def test_force_push_abandons_the_old_head(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1", "a2", "old")
    repo.force_push("main", "new", parents=["a1"])
    assert repo.head("main") == "new"
    sc = source(path)

    async def check() -> None:
        assert await sc.head() == uri("new")
        assert not await sc.is_ancestor(uri("old"), uri("new"))
        assert await sc.is_ancestor(uri("a1"), uri("new"))
        with pytest.raises(CommitNotFound, match="not on demo/main"):
            await _promote(sc, uri("old"))
        assert await sc.is_ancestor(uri("a2"), uri("old"))  # still a commit, off the ref

    asyncio.run(check())
    assert repo.promoted("verified") is None


def test_force_push_to_an_unrelated_root(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1")
    repo.force_push("main", "orphan")
    assert not asyncio.run(source(path).is_ancestor(uri("a1"), uri("orphan")))


def test_promotion_moves_the_promotion_ref(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1", "a2", "a3")
    sc = source(path)
    assert repo.promoted("verified") is None
    asyncio.run(_promote(sc, uri("a2")))
    assert repo.promoted("verified") == "a2"
    asyncio.run(_promote(sc, uri("a2")))  # idempotent
    assert repo.promoted("verified") == "a2"
    asyncio.run(_promote(sc, uri("a3")))
    assert repo.promoted("verified") == "a3"
    assert repo.head("main") == "a3"  # the validated ref itself never moves
    with pytest.raises(CommitNotFound):
        asyncio.run(_promote(sc, uri("ghost")))
    with pytest.raises(UnknownRef):
        asyncio.run(_promote(source(path, ref="release"), uri("a1")))


def test_without_a_promotion_ref_promote_does_nothing(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1")
    before = path.read_bytes()
    asyncio.run(_promote(source(path, promotion_ref=None), uri("a1")))
    asyncio.run(_promote(source(path, promotion_ref=None), uri("anything")))
    assert path.read_bytes() == before


def test_promote_without_a_file_is_unknown_ref(path: Path) -> None:
    with pytest.raises(UnknownRef):
        asyncio.run(_promote(source(path), uri("a1")))
    assert not path.exists()


def test_commit_time(repo: FakeRepo, path: Path) -> None:
    when = datetime(2024, 5, 1, 12, 30, tzinfo=timezone(timedelta(hours=2)))
    repo.commit("a1", time=when)
    repo.force_push("main", "a1")
    before = datetime.now(UTC)
    repo.push("main", "a2")
    sc = source(path)
    assert asyncio.run(sc.commit_time(uri("a1"))) == when
    got = asyncio.run(sc.commit_time(uri("a2")))
    assert got.tzinfo is not None and before <= got <= datetime.now(UTC)


def test_naive_or_missing_times_in_a_hand_written_file(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({
        "commits": {"a1": {"parents": [], "time": "2024-01-02T03:04:05"},
                    "a2": {"parents": ["a1"]}},
        "refs": {"main": "a2"},
    }))
    sc = source(path)
    assert asyncio.run(sc.commit_time(uri("a1"))) == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    with pytest.raises(SourceControlError, match="no valid 'time'") as info:
        asyncio.run(sc.commit_time(uri("a2")))
    assert not info.value.retryable
    asyncio.run(_promote(sc, uri("a1")))  # a file without "promoted" gains it
    assert FakeRepo(path).promoted("verified") == "a1"


def test_a_corrupt_file_is_a_non_retryable_error(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(SourceControlError, match="not a fake repository file") as info:
        asyncio.run(source(path).head())
    assert not info.value.retryable and not isinstance(info.value, UnknownRef)
    path.write_text(json.dumps({"commits": {}, "refs": {"main": "gone"}}))
    with pytest.raises(SourceControlError, match="not in 'commits'"):
        asyncio.run(source(path).head())


def test_the_repo_helper_refuses_impossible_histories(repo: FakeRepo) -> None:
    repo.push("main", "a1")
    with pytest.raises(ValueError, match="already exists"):
        repo.push("main", "a1")
    with pytest.raises(ValueError, match="is not a commit"):
        repo.commit("b1", parents=["ghost"])
    with pytest.raises(ValueError, match="exists with parents"):
        repo.force_push("main", "a1", parents=["a1"])
    for bad in ("", "a/b", "a b"):
        with pytest.raises(ValueError, match="fake sha"):
            repo.commit(bad)
    repo.commit("a1")  # same commit again: nothing to do
    assert repo.head("main") == "a1"
    assert fake_uri("r", "release/1.0", "s") == "fake://r/release/1.0/s"


def test_a_ref_with_slashes(repo: FakeRepo, path: Path) -> None:
    repo.push("release/1.0", "r1", "r2")
    sc = source(path, ref="release/1.0", promotion_ref="verified/1.0")
    head = asyncio.run(sc.head())
    assert head == "fake://demo/release/1.0/r2"
    assert asyncio.run(sc.is_ancestor(uri("r1", ref="release/1.0"), head))
    asyncio.run(_promote(sc, head))
    assert repo.promoted("verified/1.0") == "r2"


def test_another_process_pushes_and_this_one_sees_it(repo: FakeRepo, path: Path) -> None:
    repo.push("main", "a1")
    sc = source(path)
    assert asyncio.run(sc.head()) == uri("a1")
    script = textwrap.dedent(f"""
        from streams.extensions.sourcecontrol.fake import FakeRepo
        repo = FakeRepo({str(path)!r})
        repo.push("main", "a2", "a3")
        repo.force_push("main", "b1", parents=["a2"])
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parent.parent)
    assert asyncio.run(sc.head()) == uri("b1")
    assert not asyncio.run(sc.is_ancestor(uri("a3"), uri("b1")))
    with pytest.raises(CommitNotFound):
        asyncio.run(_promote(sc, uri("a3")))


def test_concurrent_writers_from_many_processes_lose_nothing(repo: FakeRepo,
                                                            path: Path) -> None:
    """Each process pushes its own commits on top of whatever `main` is: every commit
    lands, and the ref is always a single chain through all of them."""
    repo.push("main", "root")
    script = textwrap.dedent(f"""
        import sys
        from streams.extensions.sourcecontrol.fake import FakeRepo
        repo = FakeRepo({str(path)!r})
        for i in range(10):
            repo.push("main", f"p{{sys.argv[1]}}-{{i}}")
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)],
                              cwd=Path(__file__).resolve().parent.parent) for n in range(3)]
    sc = source(path)
    seen_heads = set()
    while any(p.poll() is None for p in procs):
        seen_heads.add(asyncio.run(sc.head()))  # never a torn file, never an error
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert seen_heads
    state = json.loads(path.read_text())
    assert len(state["commits"]) == 1 + 3 * 10
    chain, sha = [], state["refs"]["main"]
    while sha is not None:
        chain.append(sha)
        parents = state["commits"][sha]["parents"]
        sha = parents[0] if parents else None
    assert len(chain) == 1 + 3 * 10

