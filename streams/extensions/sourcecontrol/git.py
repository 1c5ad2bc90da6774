"""The git SourceControl: a real repository through the git CLI (design §8).

The repository is read as `gitrepo.GitRepository` reads it: a local
path in place, a remote URL through a bare cache fetched before every ``head()`` and
``promote()``. The promotion ref is updated in a local repository (``git update-ref``) and
pushed to a remote one (``git push --force origin <sha>:refs/heads/<promotion_ref>``).

URIs are ``git+<repository>#<ref>@<sha>`` (`gitrepo.git_uri`); a URI of another
repository names no commit here: ``CommitNotFound``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions import ExtensionContext
from streams.extensions.sourcecontrol.contract import (
    CommitInfo,
    CommitNotFound,
    NotOnFirstParent,
    TooManyCommits,
    TooManyPaths,
    UnknownRef,
    one_commit,
)
from streams.extensions.sourcecontrol.gitrepo import (
    DEFAULT_LOCAL_TIMEOUT,
    DEFAULT_REMOTE_TIMEOUT,
    GitRepository,
    LoggedCommit,
)
from streams.extensions.sourcecontrol.gituri import (
    check_branch_name,
    git_uri,
    parse_uri,
    repository_path,
)
from streams.extensions.sourcecontrol.gitvalues import BranchName, Repository
from streams.schema.fields import SPEC, ConfigPath, Flag

_SHA_PREFIX = re.compile(r"[0-9a-f]{4,64}")
_FULL_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


@spec_dataclass(frozen=True, config=SPEC)
class GitSourceControlSpec:
    """`kind: git`: a real repository, local path or remote URL (this module)."""

    repository: Repository  # a URL as written, or an absolute local path
    ref: BranchName
    promotion_ref: BranchName | None = None
    push: Flag | None = None  # None: push to a remote URL, update a local path in place
    cache_dir: ConfigPath | None = None  # where remotes are cached; None: <home>/git
    kind: Literal["git"] = "git"

    @field_validator("promotion_ref")
    @classmethod
    def _own_ref(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value == info.data.get("ref"):
            raise ValueError(f"must differ from ref {value!r}: promotion moves a ref of its "
                             f"own")
        return value

    def shared_repository(self) -> str | None:
        return self.repository  # what a build of this queue checks out, by default

    def shared_git_cache(self, home: Path) -> Path:
        return self.cache_dir or home / "git"  # one cache per remote, fetched once

    def hosted_repository(self) -> str | None:
        # what a push webhook names the repository by (GitHub's full_name); none locally
        return repository_path(self.repository)

    def build(self, context: ExtensionContext) -> GitSourceControl:
        return GitSourceControl(self.repository, self.ref, self.promotion_ref, push=self.push,
                                cache_dir=self.shared_git_cache(context.home))


# --- the extension ----------------------------------------------------------------------


class GitSourceControl:
    """One queue's view of ``ref`` in a git repository; ``promote`` moves
    ``promotion_ref`` (pushed when ``push``, default: for remote URLs only)."""

    def __init__(self, repository: str, ref: str, promotion_ref: str | None = None, *,
                 push: bool | None = None, cache_dir: Path | str | None = None,
                 local_timeout: float = DEFAULT_LOCAL_TIMEOUT,
                 remote_timeout: float = DEFAULT_REMOTE_TIMEOUT) -> None:
        check_branch_name(ref)
        if promotion_ref is not None:
            check_branch_name(promotion_ref)
            if promotion_ref == ref:
                raise ValueError(f"the promotion ref must differ from the ref {ref!r}")
        self.repo = GitRepository(repository, cache_root=cache_dir,
                                  local_timeout=local_timeout, remote_timeout=remote_timeout)
        self.ref = ref
        self.promotion_ref = promotion_ref
        self.push = self.repo.is_remote if push is None else push

    @property
    def repository(self) -> str:
        return self.repo.repository

    def __repr__(self) -> str:
        return (f"GitSourceControl({self.repository!r}, ref={self.ref!r}, "
                f"promotion_ref={self.promotion_ref!r}, push={self.push})")

    async def head(self) -> str:
        return git_uri(self.repository, self.ref, await self.repo.resolve(self.ref))

    async def is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        ancestor, descendant = self._sha(ancestor_uri), self._sha(descendant_uri)
        for sha, uri in ((ancestor, ancestor_uri), (descendant, descendant_uri)):
            if not await self.repo.ensure_commit(sha, self.ref):
                raise CommitNotFound(f"git repository {self.repository} has no commit {sha} "
                                     f"(from {uri})")
        return await self.repo.is_ancestor(ancestor, descendant)

    async def promotion_target(self) -> str | None:
        if self.promotion_ref is None:
            return None
        sha = await self.repo.branch_sha(self.promotion_ref, pushed=self.push)
        return git_uri(self.repository, self.ref, sha) if sha else None

    async def promote(self, uri: str, *, expected: str | None) -> None:
        if self.promotion_ref is None:
            return
        sha = self._sha(uri)
        expected_sha = self._sha(expected) if expected is not None else None
        try:
            head = await self.repo.resolve(self.ref)
        except UnknownRef as exc:
            raise CommitNotFound(f"not promoting {uri}: {exc}") from exc
        # a commit on the ref is in the freshly fetched history; absent means not on it
        if not (await self.repo.has_commit(sha) and await self.repo.is_ancestor(sha, head)):
            raise CommitNotFound(f"{uri} is not on {self.ref!r} of {self.repository} (head "
                                 f"{head}); not promoting it to {self.promotion_ref!r}")
        # The check and the move are two steps: a force-push in between can promote a
        # commit that just left the ref. The promotion ref lags the bookmark by design and
        # the next green commit moves it on.
        await self.repo.set_branch(self.promotion_ref, sha, push=self.push,
                                   expected=expected_sha)

    async def commit_time(self, uri: str) -> datetime:
        sha = self._sha(uri)
        if not await self.repo.ensure_commit(sha, self.ref):
            raise CommitNotFound(f"git repository {self.repository} has no commit {sha} "
                                 f"(from {uri})")
        return await self.repo.commit_time(sha)

    async def commit_uri(self, sha: str) -> str:
        wanted = sha.strip().lower()
        if not _SHA_PREFIX.fullmatch(wanted):
            raise ValueError(f"{sha!r} is not a commit sha: want 4 to 64 hex digits")
        if _FULL_SHA.fullmatch(wanted):  # names itself: no need to ask the repository
            return git_uri(self.repository, self.ref, wanted)
        with contextlib.suppress(UnknownRef):  # fetch the ref first: the commit may be new
            await self.repo.resolve(self.ref)
        found = await self.repo.commits_with_prefix(wanted)
        return git_uri(self.repository, self.ref,
                       one_commit(wanted, found, f"git repository {self.repository}"))

    async def commits_between(self, older_uri: str, newer_uri: str, *,
                              limit: int) -> list[CommitInfo]:
        older, newer = self._sha(older_uri), self._sha(newer_uri)
        for sha, uri in ((older, older_uri), (newer, newer_uri)):
            if not await self.repo.ensure_commit(sha, self.ref):
                raise CommitNotFound(f"git repository {self.repository} has no commit {sha} "
                                     f"(from {uri})")
        if older == newer:
            return []
        logged = await self.repo.first_parent_log(older, newer, limit + 1)
        if len(logged) > limit:
            raise TooManyCommits(f"more than {limit} commits lie between {older[:12]} and "
                                   f"{newer[:12]} on {self.ref!r}")
        # older..newer stops at the first commit older reaches: older itself when it is
        # on the first-parent history, else the merge base or a root
        if not logged or logged[-1].parents[:1] != (older,):
            raise NotOnFirstParent(f"{older[:12]} is not on the first-parent history of "
                                   f"{newer[:12]} in {self.repository}")
        return [self._info(commit) for commit in reversed(logged)]

    async def changed_paths(self, base_uri: str, head_uri: str, *, limit: int) -> list[str]:
        base, head = self._sha(base_uri), self._sha(head_uri)
        for sha, uri in ((base, base_uri), (head, head_uri)):
            if not await self.repo.ensure_commit(sha, self.ref):
                raise CommitNotFound(f"git repository {self.repository} has no commit {sha} "
                                     f"(from {uri})")
        paths = await self.repo.changed_paths(base, head)
        if len(paths) > limit:
            raise TooManyPaths(f"more than {limit} paths differ between {base[:12]} and "
                               f"{head[:12]}")
        return paths

    async def describe(self, uris: Sequence[str]) -> list[CommitInfo]:
        shas: list[str] = []
        for uri in uris:
            with contextlib.suppress(CommitNotFound):  # another repository's: unknown here
                sha = self._sha(uri)
                if sha not in shas and await self.repo.ensure_commit(sha, self.ref):
                    shas.append(sha)
        return [self._info(commit) for commit in await self.repo.describe(shas)]

    def _info(self, commit: LoggedCommit) -> CommitInfo:
        parent = commit.parents[0] if commit.parents else None
        return CommitInfo(uri=git_uri(self.repository, self.ref, commit.sha), sha=commit.sha,
                          subject=commit.subject, author=commit.author,
                          committed_at=commit.committed_at,
                          parent_uri=git_uri(self.repository, self.ref, parent)
                          if parent else None)

    def _sha(self, uri: str) -> str:
        commit = parse_uri(uri)
        if commit.repository != self.repository:
            raise CommitNotFound(f"{uri!r} names a commit of {commit.repository}, not of "
                                 f"{self.repository}")
        return commit.sha
