"""A commit as a person or a deploy gate names it: a full sha, a unique prefix of one, or
our own commit URI. Shared by the deploy-gate answers and by validating a commit again."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streams.stages.deps import Deps


def names_a_uri(commit: str) -> bool:
    """Whether ``commit`` is a commit URI rather than a sha or a prefix of one."""
    return "://" in commit or commit.startswith("git+")


async def resolve_commit(deps: Deps, queue: str, commit: str) -> str:
    """The URI of ``commit`` (a URI, a full sha or a unique sha prefix) on ``queue``.
    Raises UnknownQueue, ValueError (not a sha), CommitNotFound, AmbiguousCommit, or the
    source control's error when the repository cannot be read."""
    deps.queue_config(queue)
    if names_a_uri(commit):
        return commit
    return await deps.extensions.source_control(queue).commit_uri(commit)
