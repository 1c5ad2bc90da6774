"""Validate a commit again, on request (design §4): `stovepipe retry`, `POST
/api/queues/{queue}/retry` and the dashboard's Request view share this.

A commit whose newest Request is not green — it `failed` (with a red verdict or without
one), was `cancelled`, or `superseded` — gets a new Request validating it again,
`request/<queue>/<n>.<k>`, which sorts where the commit was first ingested: it supersedes
no newer head and nothing supersedes it, and it never moves the bookmark or the promotion
ref to an older commit. The commit's answer is then its newest Request's verdict; every
earlier fact stays readable. A green commit is never validated again; a commit being
validated now is not validated twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract import ProcessRequest, TopicKey
from store import NotFound, RequestState, ValidationFact
from streams.config.names import validate_queue_name
from streams.extensions import tracing
from streams.runtime.stage import Publisher
from streams.stages.commits import resolve_commit
from streams.stages.deps import Deps


class AlreadyGreen(Exception):
    """The commit is green: it is never validated again."""

    def __init__(self, uri: str, fact: ValidationFact) -> None:
        super().__init__(f"{uri} is green (fact of {fact.request_id}, "
                         f"{fact.created_at.isoformat()}): a green commit is never "
                         f"validated again")
        self.uri = uri
        self.fact = fact


class NeverIngested(LookupError):
    """The queue never ingested the commit (nor does it have a Request to retry)."""


@dataclass(frozen=True)
class Retried:
    queue: str
    uri: str
    request_id: str  # the new Request; or the one validating the commit now
    new: bool  # False: the commit was already being validated (accepted or processing)
    previous_id: str | None  # the commit's newest Request before this call


async def validate_again(deps: Deps, queue: str, commit: str | None,
                         publish: Publisher) -> Retried:
    """Validate ``commit`` (a sha, a unique prefix or a URI; None: the queue's newest
    head) on ``queue`` again. Raises InvalidQueueName, UnknownQueue, ValueError (not a
    sha), CommitNotFound / AmbiguousCommit (the repository's answer), NeverIngested, and
    AlreadyGreen."""
    validate_queue_name(queue)
    deps.queue_config(queue)
    uri = await _commit_uri(deps, queue, commit)
    with tracing.span(f"retry {queue}", attributes={"stovepipe.queue": queue}):
        again = await deps.db.steps.validate_again(queue, uri,
                                                   trace_id=tracing.current_trace_id())
    if again.newest_id is None or again.newest_state is None:
        raise NeverIngested(f"queue {queue!r} never ingested {uri}: only a commit it has "
                            f"validated (or passed over) can be validated again")
    if again.minted_id is None:
        if again.newest_state is RequestState.SUCCEEDED:
            fact = await deps.db.facts.get(queue, uri)
            raise AlreadyGreen(uri, fact)
        # accepted or processing: it is being validated now
        return Retried(queue, uri, again.newest_id, False, again.newest_id)
    minted = await deps.db.requests.get(queue, again.minted_id)
    # a fresh publication; if it never happens, the sweeper publishes it (design §6)
    await publish(TopicKey.PROCESS, ProcessRequest(id=minted.id, queue_name=queue,
                                                   nonce=minted.nonce))
    return Retried(queue, uri, minted.id, True, again.newest_id)


async def _commit_uri(deps: Deps, queue: str, commit: str | None) -> str:
    if commit is not None:
        return await resolve_commit(deps, queue, commit)
    try:
        latest = (await deps.db.queues.get(queue)).latest_request_id
    except NotFound:
        latest = None
    if latest is None:
        raise NeverIngested(f"queue {queue!r} has no head yet: nothing to validate again")
    return (await deps.db.requests.get(queue, latest)).uri
