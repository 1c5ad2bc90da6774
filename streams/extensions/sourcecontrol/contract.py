"""The SourceControl contract. URIs are opaque outside the implementation that minted them.

Errors: `UnknownRef` (the queue's ref or repository does not exist: a user error, never
retried), `CommitNotFound` (the commit is not on the ref any more, e.g. after a
force-push), `PromotionMoved` (a promotion's compare-and-set lost), `NotOnFirstParent`
(a commit is not on another's first-parent history), and
`AmbiguousCommit` (a sha prefix names several commits), and `SourceControlError` whose
`retryable` says whether to try again.

URIs carry no secrets: they are built from a credential-free identity of the repository,
so rotating a credential changes no URI (design §8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol


class SourceControlError(Exception):
    """A failure talking to the repository. Non-retryable unless marked."""

    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class UnknownRef(SourceControlError):
    """The configured repository or ref does not exist: fix the queue configuration."""


class CommitNotFound(SourceControlError):
    """The commit named by a URI is not (or no longer) on the queue's ref."""


class AmbiguousCommit(SourceControlError):
    """A sha prefix names more than one commit: give more digits."""


class PromotionMoved(SourceControlError):
    """The promotion ref was not where the caller expected: another promotion moved it
    in between. Decide again from what it points at now."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class NotOnFirstParent(SourceControlError):
    """The older commit is not on the newer one's first-parent history (the branch was
    rewritten, or the older commit came in through a merge's second parent)."""


class TooManyCommits(NotOnFirstParent):
    """More commits lie between the two than the caller would list: the older one may
    well be on the history, further back."""


class TooManyPaths(SourceControlError):
    """More paths changed between two commits than the caller would list."""


@dataclass(frozen=True)
class CommitInfo:
    """What a person recognises a commit by."""

    uri: str
    sha: str
    subject: str
    author: str  # "Name <email>"
    committed_at: datetime | None
    parent_uri: str | None  # its first parent; None for a root commit


class SourceControl(Protocol):
    """One queue's view of its repository and ref."""

    async def head(self) -> str:
        """The URI of the ref's current head commit."""
        ...

    async def is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        """Whether ``ancestor_uri`` is an ancestor of (or equal to) ``descendant_uri``.

        Raises CommitNotFound when either commit is unknown."""
        ...

    async def promotion_target(self) -> str | None:
        """The URI the promotion ref points at now; None while it does not exist, or when
        the queue promotes nothing."""
        ...

    async def promote(self, uri: str, *, expected: str | None) -> None:
        """Point the promotion ref at ``uri`` if it still points at ``expected`` (None:
        the ref does not exist yet) — a compare-and-set, so two promotions racing never
        move it backwards. Raises PromotionMoved when the ref is elsewhere, CommitNotFound
        when the commit is no longer on the ref. A queue without a promotion ref does
        nothing."""
        ...

    async def commit_time(self, uri: str) -> datetime:
        """The commit's timestamp (timezone-aware)."""
        ...

    async def commit_uri(self, sha: str) -> str:
        """The URI this queue names the commit ``sha`` by: a full sha or a unique prefix
        (as a deploy gate has it). CommitNotFound when the repository has no such commit,
        AmbiguousCommit when a prefix names several, ValueError when ``sha`` cannot be
        one."""
        ...


    async def commits_between(self, older_uri: str, newer_uri: str, *,
                              limit: int) -> list[CommitInfo]:
        """The commits after ``older_uri`` up to and including ``newer_uri`` on
        ``newer_uri``'s first-parent history, oldest first (git: ``rev-list
        --first-parent older..newer``); empty when they are the same commit.
        NotOnFirstParent when ``older_uri`` is not on that history, TooManyCommits (a
        NotOnFirstParent) when more than ``limit`` commits lie between them;
        CommitNotFound when either is unknown."""
        ...

    async def describe(self, uris: Sequence[str]) -> list[CommitInfo]:
        """Subject, author, time and first parent of each commit the repository has
        (unknown ones are left out), in any order."""
        ...

    async def changed_paths(self, base_uri: str, head_uri: str, *, limit: int) -> list[str]:
        """The paths (relative to the repository's root) whose content differs between
        the two commits, a renamed file under both its names (git: ``diff --name-only
        --no-renames base head``), in any order. TooManyPaths when more than ``limit``
        differ; CommitNotFound when either commit is unknown."""
        ...


def one_commit(asked: str, matches: list[str], where: str) -> str:
    """The one commit ``asked`` (a sha or a prefix of one) names among ``matches``:
    CommitNotFound for none, AmbiguousCommit naming a few of them for several."""
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CommitNotFound(f"{where} has no commit {asked!r}")
    shown = ", ".join(sorted(matches)[:5]) + (", …" if len(matches) > 5 else "")
    raise AmbiguousCommit(f"{asked!r} names {len(matches)} commits of {where} ({shown}); "
                          f"give more digits")
