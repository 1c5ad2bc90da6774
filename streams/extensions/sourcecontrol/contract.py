"""The SourceControl contract. URIs are opaque outside the implementation that minted them.

Errors: `UnknownRef` (the queue's ref or repository does not exist: a user error, never
retried), `CommitNotFound` (the commit is not on the ref any more, e.g. after a
force-push), and `SourceControlError` whose `retryable` says whether to try again.
"""

from __future__ import annotations

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


class SourceControl(Protocol):
    """One queue's view of its repository and ref."""

    async def head(self) -> str:
        """The URI of the ref's current head commit."""
        ...

    async def is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        """Whether ``ancestor_uri`` is an ancestor of (or equal to) ``descendant_uri``.

        Raises CommitNotFound when either commit is unknown."""
        ...

    async def promote(self, uri: str) -> None:
        """Point the promotion ref at ``uri``. Raises CommitNotFound when the commit is no
        longer on the ref. Idempotent. A queue without a promotion ref does nothing."""
        ...

    async def commit_time(self, uri: str) -> datetime:
        """The commit's timestamp (timezone-aware)."""
        ...
