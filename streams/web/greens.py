"""The queue's green commits in history order, for release tooling (issue 18, Deliver 8):
`GET /api/queues/{queue}/greens?since=COMMIT&limit=N`.

A green commit is one with a green whole-repo fact (degree 0). They are listed by their
Requests' order — request_rank: ingest order, a backfilled commit at its place in the
branch's history — oldest first, on index validation_fact_green_rank, each once (a green
commit is never validated again).

``since`` names a commit as a deploy gate does (a full sha, a unique prefix or the URI);
the list starts after it: after every validation of that commit, at the place of its first
Request. A commit the queue never ingested has no place (`NeverValidated`). Without
``since`` the list starts at the queue's first green commit. At most ``limit`` commits are
listed; ``next`` is then the URI to pass as ``since`` for the following page.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from store import NotFound, commit_request_id, request_order
from store.culprits import CommitRecord
from streams.web.history import CommitDescriptions

if TYPE_CHECKING:
    from streams.stages.deps import Deps

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
_EVERY_VALIDATION = 2**63 - 1  # a rank's validation part after every validation of a commit


class NeverValidated(LookupError):
    """The commit has no Request on the queue, so no place in its history."""


@dataclass(frozen=True)
class GreenCommit:
    uri: str
    sha: str | None  # None: the repository has not described the commit (yet)
    subject: str | None
    author: str | None
    committed_at: datetime | None
    request_id: str  # the Request whose fact made it green
    green_at: datetime  # when that fact was recorded
    flaky: bool  # green on a re-run of a red build
    attempts: int


@dataclass(frozen=True)
class GreenList:
    queue: str
    since: str | None  # the URI the list starts after; None: from the start
    greens: list[GreenCommit]
    next: str | None  # `since` for the next page; None: this page is the last
    described: bool  # every commit listed has its sha, subject and author


async def greens_after(deps: Deps, queue: str, since_uri: str | None, limit: int,
                       descriptions: CommitDescriptions) -> GreenList:
    """Up to ``limit`` green commits of ``queue`` after ``since_uri`` (None: from the
    start), oldest first. NeverValidated for a ``since_uri`` the queue never ingested,
    ValueError for a limit out of range. The caller has checked the queue is
    configured."""
    if not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    rank = (0, 0, 0)
    if since_uri is not None:
        try:
            first = commit_request_id((await deps.db.request_uris.get(queue, since_uri))
                                      .request_id)
        except NotFound:
            raise NeverValidated(f"queue {queue!r} never validated commit {since_uri}; "
                                 f"name one of its commits, or leave out 'since' to list "
                                 f"from the first green commit") from None
        n, position, _ = request_order(first)
        rank = (n, position, _EVERY_VALIDATION)
    facts = await deps.db.facts.green_newer_than(queue, rank, limit + 1)
    page = facts[:limit]
    described = await descriptions.of(deps.db, queue, [f.uri for f in page],
                                      lambda: deps.extensions.source_control(queue))
    greens = [_green(fact.uri, described.get(fact.uri), fact.request_id, fact.created_at,
                     fact.flaky, fact.attempts) for fact in page]
    return GreenList(queue=queue, since=since_uri, greens=greens,
                     next=page[-1].uri if len(facts) > limit else None,
                     described=all(g.sha is not None for g in greens))


def _green(uri: str, commit: CommitRecord | None, request_id: str, green_at: datetime,
           flaky: bool, attempts: int) -> GreenCommit:
    return GreenCommit(uri=uri, sha=commit.sha if commit else None,
                       subject=commit.subject if commit else None,
                       author=commit.author if commit else None,
                       committed_at=commit.committed_at if commit else None,
                       request_id=request_id, green_at=green_at, flaky=flaky,
                       attempts=attempts)
