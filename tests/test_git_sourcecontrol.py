"""The git SourceControl on real repositories: a local one used in place, and a "remote"
(a bare repository reached by a file:// URL, changed by pushes from a working clone)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pytest

from streams.extensions.sourcecontrol import (
    CommitNotFound,
    NotOnFirstParent,
    SourceControl,
    SourceControlError,
    TooManyCommits,
    UnknownRef,
)
from streams.extensions.sourcecontrol.git import GitSourceControl
from streams.extensions.sourcecontrol.gitrepo import GIT_LOCATION_VARIABLES
from streams.extensions.sourcecontrol.gituri import (
    cache_name,
    check_branch_name,
    git_uri,
    is_remote_url,
    parse_uri,
    repository_identity,
)

T = TypeVar("T")

async def _promote(sc: Any, uri: str) -> None:
    """Promote ``uri`` from wherever the promotion ref is now (the compare-and-set's
    expected value read first, as the record stage does)."""
    await sc.promote(uri, expected=await sc.promotion_target())



def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def git(cwd: Path, *args: str, date: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    if date is not None:
        env["GIT_COMMITTER_DATE"] = env["GIT_AUTHOR_DATE"] = date
    return subprocess.run(
        ["git", "-c", "user.name=Stovepipe Test", "-c", "user.email=test@stovepipe.invalid",
         "-c", "init.defaultBranch=main", "-c", "advice.detachedHead=false", *args],
        cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


class Origin:
    """The repository Stovepipe reads, and a developer's working copy that changes it:
    the same directory when local; a bare repository plus a clone that pushes when remote."""

    def __init__(self, tmp: Path, *, remote: bool) -> None:
        self.remote = remote
        if remote:
            self.store = tmp / "origin.git"
            git(tmp, "init", "-q", "--bare", str(self.store))
            self.work = tmp / "work"
            git(tmp, "clone", "-q", str(self.store), str(self.work))
            self.repository = self.store.as_uri()  # file:///…
        else:
            self.store = self.work = tmp / "repo"
            git(tmp, "init", "-q", str(self.work))
            self.repository = str(self.work)

    def commit(self, message: str, *, date: str | None = None) -> str:
        git(self.work, "commit", "-q", "--allow-empty", "-m", message, date=date)
        self.publish()
        return git(self.work, "rev-parse", "HEAD")

    def publish(self, *, force: bool = False) -> None:
        if self.remote:
            branch = git(self.work, "rev-parse", "--abbrev-ref", "HEAD")
            git(self.work, "push", "-q", *(["--force"] if force else []), "origin",
                f"HEAD:refs/heads/{branch}")

    def rewrite(self, onto: str, message: str) -> str:
        """Force-push: ``main`` becomes ``onto`` plus a new commit."""
        git(self.work, "reset", "-q", "--hard", onto)
        git(self.work, "commit", "-q", "--allow-empty", "-m", message)
        self.publish(force=True)
        return git(self.work, "rev-parse", "HEAD")

    def rev(self, ref: str) -> str | None:
        try:
            return git(self.store, "rev-parse", "--verify", "-q", ref)
        except subprocess.CalledProcessError:
            return None

    def uri(self, sha: str, ref: str = "main") -> str:
        return git_uri(self.repository, ref, sha)


@pytest.fixture(params=["local", "remote"])
def origin(request: pytest.FixtureRequest, tmp_path: Path) -> Origin:
    return Origin(tmp_path, remote=request.param == "remote")


def source_control(origin: Origin, tmp_path: Path, **kwargs: Any) -> GitSourceControl:
    kwargs.setdefault("cache_dir", tmp_path / "cache")
    return GitSourceControl(origin.repository, "main", kwargs.pop("promotion_ref",
                                                                  "verified-main"), **kwargs)


# --- head, ancestry, time -------------------------------------------------------------------


def test_it_is_a_source_control(origin: Origin, tmp_path: Path) -> None:
    sc: SourceControl = source_control(origin, tmp_path)
    assert sc is not None


def test_head_names_the_ref_and_the_full_sha(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    first = origin.commit("c1")
    assert run(sc.head()) == origin.uri(first) == f"git+{origin.repository}#main@{first}"
    assert len(first) == 40
    second = origin.commit("c2")  # a remote is fetched before each resolution
    assert run(sc.head()) == origin.uri(second)
    assert parse_uri(run(sc.head())).sha == second


def test_linear_history(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    c1, c2, c3 = (origin.commit(f"c{n}") for n in (1, 2, 3))
    assert run(sc.is_ancestor(origin.uri(c1), origin.uri(c3)))
    assert run(sc.is_ancestor(origin.uri(c2), origin.uri(c3)))
    assert not run(sc.is_ancestor(origin.uri(c3), origin.uri(c1)))
    assert run(sc.is_ancestor(origin.uri(c2), origin.uri(c2)))  # its own ancestor
    # the ref inside a URI is informational: a commit is a commit
    assert run(sc.is_ancestor(origin.uri(c1, "feature"), origin.uri(c3)))


def test_ancestry_through_the_second_parent_of_a_merge(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    base = origin.commit("base")
    git(origin.work, "checkout", "-q", "-b", "feature")
    feature = origin.commit("feature work")
    git(origin.work, "checkout", "-q", "main")
    mainline = origin.commit("main work")
    git(origin.work, "merge", "-q", "--no-ff", "feature", "-m", "merge feature")
    origin.publish()
    merge = git(origin.work, "rev-parse", "HEAD")
    assert git(origin.work, "rev-parse", "HEAD^2") == feature
    assert run(sc.head()) == origin.uri(merge)
    assert run(sc.is_ancestor(origin.uri(feature), origin.uri(merge)))  # via parent 2
    assert run(sc.is_ancestor(origin.uri(mainline), origin.uri(merge)))  # via parent 1
    assert run(sc.is_ancestor(origin.uri(base), origin.uri(merge)))
    assert not run(sc.is_ancestor(origin.uri(feature), origin.uri(mainline)))
    assert not run(sc.is_ancestor(origin.uri(merge), origin.uri(feature)))


def test_commits_between_walk_the_first_parent_history(origin: Origin,
                                                       tmp_path: Path) -> None:
    """What a culprit search bisects: the first-parent commits after the green one up to
    the red one, oldest first; a merged branch's own commits are not on it."""
    sc = source_control(origin, tmp_path)
    green = origin.commit("green")
    git(origin.work, "checkout", "-q", "-b", "feature")
    feature = origin.commit("feature work")
    git(origin.work, "checkout", "-q", "main")
    first = origin.commit("first: fix the widget", date="2026-11-30T10:00:00+00:00")
    git(origin.work, "merge", "-q", "--no-ff", "feature", "-m", "merge feature")
    origin.publish()
    merge = git(origin.work, "rev-parse", "HEAD")
    last = origin.commit("last")
    between = run(sc.commits_between(origin.uri(green), origin.uri(last), limit=10))
    assert [c.sha for c in between] == [first, merge, last]
    assert [c.subject for c in between] == ["first: fix the widget", "merge feature", "last"]
    assert between[0].author == "Stovepipe Test <test@stovepipe.invalid>"
    assert between[0].committed_at == datetime(2026, 11, 30, 10, tzinfo=UTC)
    assert between[0].parent_uri == origin.uri(green)
    assert between[1].parent_uri == origin.uri(first)  # the merge's first parent
    assert all(c.uri == origin.uri(c.sha) for c in between)
    assert run(sc.commits_between(origin.uri(last), origin.uri(last), limit=10)) == []
    # the feature commit is an ancestor, but not on the first-parent history
    with pytest.raises(NotOnFirstParent, match="first-parent"):
        run(sc.commits_between(origin.uri(feature), origin.uri(last), limit=10))
    with pytest.raises(TooManyCommits, match="more than 2 commits"):
        run(sc.commits_between(origin.uri(green), origin.uri(last), limit=2))
    with pytest.raises(CommitNotFound):
        run(sc.commits_between(origin.uri("0" * 40), origin.uri(last), limit=10))


def test_describe_names_subject_author_and_time(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    one = origin.commit("one", date="2026-12-01T08:00:00+00:00")
    two = origin.commit("two")
    described = {c.sha: c for c in run(sc.describe(
        [origin.uri(two), origin.uri(one), origin.uri("f" * 40), "fake://x/main/abc"]))}
    assert set(described) == {one, two}
    assert described[one].subject == "one" and described[one].parent_uri is None
    assert described[one].committed_at == datetime(2026, 12, 1, 8, tzinfo=UTC)
    assert described[two].parent_uri == origin.uri(one)


def test_commit_time_is_the_committer_date(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    sha = origin.commit("dated", date="2024-05-01T12:00:00+02:00")
    when = run(sc.commit_time(origin.uri(sha)))
    assert when == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
    assert when.tzinfo is not None


# --- promotion and force-pushes -------------------------------------------------------------


def test_promotion_moves_the_promotion_ref(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    c1 = origin.commit("c1")
    c2 = origin.commit("c2")
    run(_promote(sc, origin.uri(c2)))
    assert origin.rev("verified-main") == c2
    run(_promote(sc, origin.uri(c2)))  # idempotent
    assert origin.rev("verified-main") == c2
    run(_promote(sc, origin.uri(c1)))  # an older commit still on the ref may be promoted
    assert origin.rev("verified-main") == c1
    assert origin.rev("main") == c2  # the validated ref is never touched


def test_without_a_promotion_ref_promote_does_nothing(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path, promotion_ref=None)
    sha = origin.commit("c1")
    run(_promote(sc, origin.uri(sha)))
    assert origin.rev("verified-main") is None


def test_a_force_push_takes_old_commits_off_the_ref(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    c1 = origin.commit("c1")
    old = origin.commit("c2")
    run(_promote(sc, origin.uri(old)))
    new = origin.rewrite(c1, "c2 rewritten")
    assert run(sc.head()) == origin.uri(new)
    assert not run(sc.is_ancestor(origin.uri(old), origin.uri(new)))
    assert run(sc.is_ancestor(origin.uri(c1), origin.uri(new)))
    with pytest.raises(CommitNotFound, match="not on 'main'"):
        run(_promote(sc, origin.uri(old)))
    assert origin.rev("verified-main") == old  # left as it was
    run(_promote(sc, origin.uri(new)))
    assert origin.rev("verified-main") == new  # moved off the abandoned commit (forced)


def test_an_abandoned_commit_is_still_found_by_a_fresh_cache(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=True)
    c1 = origin.commit("c1")
    old = origin.commit("c2")
    new = origin.rewrite(c1, "c2 rewritten")
    # this cache never saw `old`: it is fetched by its sha
    sc = source_control(origin, tmp_path, cache_dir=tmp_path / "fresh-cache")
    assert not run(sc.is_ancestor(origin.uri(old), origin.uri(new)))


# --- errors -----------------------------------------------------------------------------------


def test_an_unknown_ref_or_repository_is_a_user_error(origin: Origin, tmp_path: Path) -> None:
    origin.commit("c1")
    cases = [GitSourceControl(origin.repository, "nope", cache_dir=tmp_path / "cache"),
             GitSourceControl(str(tmp_path / "missing"), "main"),
             GitSourceControl((tmp_path / "missing.git").as_uri(), "main",
                              cache_dir=tmp_path / "cache")]
    for sc in cases:
        with pytest.raises(UnknownRef) as info:
            run(sc.head())
        assert not info.value.retryable
        assert "nope" in str(info.value) or "missing" in str(info.value)


def test_an_empty_repository_has_no_ref(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q", "empty")
    with pytest.raises(UnknownRef, match="no branch 'main'"):
        run(GitSourceControl(str(tmp_path / "empty"), "main").head())


def test_a_directory_inside_another_repository_is_not_a_repository(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=False)
    origin.commit("c1")
    inner = origin.work / "sub" / "dir"
    inner.mkdir(parents=True)
    with pytest.raises(UnknownRef, match="not a git repository"):
        run(GitSourceControl(str(inner), "main").head())


def test_promoting_when_the_ref_is_gone_is_commit_not_found(origin: Origin,
                                                            tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    sha = origin.commit("c1")
    git(origin.work, "checkout", "-q", "-b", "other")
    origin.publish()
    git(origin.store, "update-ref", "-d", "refs/heads/main")
    with pytest.raises(CommitNotFound, match="not promoting"):
        run(_promote(sc, origin.uri(sha)))


def test_uris_that_name_no_commit_here(origin: Origin, tmp_path: Path) -> None:
    sc = source_control(origin, tmp_path)
    sha = origin.commit("c1")
    here = origin.uri(sha)
    unknown = origin.uri("0" * 40)
    for uri in ("fake://demo/main/c1", git_uri("/elsewhere", "main", sha),
                f"git+{origin.repository}#main@{sha[:12]}", unknown, "", "git+"):
        with pytest.raises(CommitNotFound):
            run(sc.is_ancestor(uri, here))
        with pytest.raises(CommitNotFound):
            run(sc.is_ancestor(here, uri))
        with pytest.raises(CommitNotFound):
            run(sc.commit_time(uri))
        with pytest.raises(CommitNotFound):
            run(_promote(sc, uri))
    assert origin.rev("verified-main") is None


def test_an_unreachable_remote_is_retryable(tmp_path: Path) -> None:
    sc = GitSourceControl("http://127.0.0.1:1/mono.git", "main", cache_dir=tmp_path)
    with pytest.raises(SourceControlError) as info:
        run(sc.head())
    assert info.value.retryable and not isinstance(info.value, UnknownRef)


def test_a_remote_that_hangs_is_stopped_and_retryable(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        port = server.getsockname()[1]
        sc = GitSourceControl(f"http://127.0.0.1:{port}/mono.git", "main",
                              cache_dir=tmp_path, remote_timeout=0.5)
        with pytest.raises(SourceControlError, match="did not finish within") as info:
            run(sc.head())
    assert info.value.retryable


# --- local and remote specifics ------------------------------------------------------------


def test_a_local_repository_is_used_in_place(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=False)
    sc = source_control(origin, tmp_path)
    assert sc.push is False and sc.repo.cache_path is None
    sha = origin.commit("c1")
    run(_promote(sc, origin.uri(sha)))
    assert origin.rev("verified-main") == sha
    assert not (tmp_path / "cache").exists()


def test_a_local_repository_may_be_pushed_to(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=False)
    sc = source_control(origin, tmp_path, push=True)
    sha = origin.commit("c1")
    run(_promote(sc, origin.uri(sha)))
    assert origin.rev("verified-main") == sha


def test_a_local_bare_repository_by_path(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=True)
    sha = origin.commit("c1")
    sc = GitSourceControl(str(origin.store), "main", "verified-main")  # path, not URL
    assert run(sc.head()) == git_uri(str(origin.store), "main", sha)
    run(_promote(sc, run(sc.head())))
    assert origin.rev("verified-main") == sha


def test_a_remote_is_read_through_its_cache_and_pushed_to(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=True)
    sc = source_control(origin, tmp_path)
    assert sc.push is True
    sha = origin.commit("c1")
    run(_promote(sc, run(sc.head())))
    assert origin.rev("verified-main") == sha  # on the remote
    cache = tmp_path / "cache" / cache_name(origin.repository)
    assert sc.repo.cache_path == cache
    assert git(cache, "rev-parse", "refs/remotes/origin/main") == sha
    assert git(cache, "config", "remote.origin.url") == origin.repository


def test_a_remote_without_push_keeps_the_promotion_in_its_cache(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=True)
    sc = source_control(origin, tmp_path, push=False)
    sha = origin.commit("c1")
    run(_promote(sc, origin.uri(sha)))
    assert origin.rev("verified-main") is None
    cache = tmp_path / "cache" / cache_name(origin.repository)
    assert git(cache, "rev-parse", "refs/heads/verified-main") == sha


def test_workers_share_a_cache(tmp_path: Path) -> None:
    origin = Origin(tmp_path, remote=True)
    sha = origin.commit("c1")
    git(origin.work, "checkout", "-q", "-b", "dev")
    dev = origin.commit("d1")

    async def many() -> list[str]:
        # separate instances, like separate workers (and queues) on one machine
        scs = [GitSourceControl(origin.repository, ref, cache_dir=tmp_path / "cache")
               for ref in ("main", "dev") * 4]
        return await asyncio.gather(*(sc.head() for sc in scs))

    assert run(many()) == [origin.uri(sha), origin.uri(dev, "dev")] * 4
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.suffix == ".git"] == [
        cache_name(origin.repository)]


# --- names --------------------------------------------------------------------------------


def test_uris_round_trip() -> None:
    sha = "a" * 40
    for repository in ("/srv/git/mono", "/srv/a#b/mono.git", "ssh://git@host/a#b/mono.git",
                       "git@github.com:acme/mono.git", "file:///tmp/x@y/origin.git"):
        commit = parse_uri(git_uri(repository, "release/1.x", sha))
        assert (commit.repository, commit.ref, commit.sha) == (repository, "release/1.x", sha)


def test_uris_name_a_repository_without_its_credentials() -> None:
    sha = "c" * 40
    for written, identity in (
            ("https://user:s3cret@example.com/mono.git", "https://example.com/mono.git"),
            ("https://t0ken@example.com/mono.git?access_token=x#frag",
             "https://example.com/mono.git"),
            ("ssh://git:s3cret@example.com/mono.git", "ssh://git@example.com/mono.git")):
        uri = git_uri(written, "main", sha)
        assert "s3cret" not in uri and "t0ken" not in uri and "access_token" not in uri
        assert parse_uri(uri).repository == identity == repository_identity(written)
        # another credential for the same repository: the same URI
        rotated = written.replace("s3cret", "n3w").replace("t0ken", "n3w")
        assert git_uri(rotated, "main", sha) == uri
    assert parse_uri(git_uri("/r", "main", "b" * 64)).sha == "b" * 64  # sha-256 repos


def test_what_is_a_remote() -> None:
    for url in ("https://github.com/acme/mono.git", "ssh://git@host/mono", "file:///srv/m",
                "git@github.com:acme/mono.git", "host:mono.git", "git://host/mono"):
        assert is_remote_url(url), url
    for path in ("/srv/git/mono", "mono", "./a:b", "../mono", "~/mono", "sub/dir:x"):
        assert not is_remote_url(path), path


def test_branch_names() -> None:
    for name in ("main", "release/1.x", "verified-main", "user@feature", "a.b_c-d"):
        assert check_branch_name(name) == name
    for name in ("", "refs/heads/main", "-x", "a..b", "a b", "a~1", "x^", "a:b", "a?",
                 "a*", "a[b", "a\\b", "a#b", "a/", "a.lock", "a//b", "@", "a@{1}", "/a",
                 ".a", "a/.b", "a.", "\tmain"):
        with pytest.raises(ValueError, match="invalid branch name"):
            check_branch_name(name)


@pytest.fixture(autouse=True)
def _no_git_redirection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """GIT_DIR and friends in the test's environment must not leak into the extension."""
    monkeypatch.setenv("GIT_DIR", "/nonexistent")
    yield
