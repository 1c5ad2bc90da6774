"""`stovepipe retry QUEUE [COMMIT]`: validate a commit again (design §4).

A commit whose newest Request failed (with a red verdict or because it could not be
validated), was cancelled or was superseded gets a new Request, `request/<queue>/<n>.<k>`;
the command prints its id. A commit being validated now is not validated twice: the
command prints the Request validating it and says so. A green commit is never validated
again: the command refuses with exit status 4, naming the fact.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from streams.cli.common import emit, json_option, queues_option, run_async, settings
from streams.cli.ingest import IngestClient
from streams.config.queues import load_queues
from streams.config.topics import TopicsConfigError, load_topics
from streams.stages.revalidate import AlreadyGreen, NeverIngested, Retried, validate_again
from streams.web import queries

REFUSED_GREEN = 4


class RetryClient:
    """Validates commits again through an open `IngestClient`: its database, its queues'
    extensions and its Kafka publisher."""

    def __init__(self, client: IngestClient) -> None:
        self.client = client

    async def retry(self, queue: str, commit: str | None) -> Retried:
        """Raises what `streams.stages.revalidate.validate_again` raises."""
        return await validate_again(self.client.deps, queue, commit, self.client.publisher)


@click.command("retry")
@click.argument("queue")
@click.argument("commit", required=False)
@queues_option
@json_option
def retry_command(queue: str, commit: str | None, queues_file: Path | None,
                  as_json: bool) -> None:
    """Validate COMMIT on QUEUE again (a full sha, a unique prefix or the commit's URI;
    default: the queue's newest head) and print the new Request's id.

    Exit status: 0 a new Request, or the one validating the commit now (said on stderr);
    4 refused: the commit is green, and a green commit is never validated again; 1 a
    commit the repository does not have or the queue never ingested, malformed input, or
    Stovepipe unreachable."""
    current = settings()

    async def run() -> Retried:
        try:
            topics = load_topics(current.topics_file)
        except TopicsConfigError as exc:
            raise click.ClickException(str(exc)) from None
        queues = load_queues(queues_file)
        async with IngestClient(current, queues, topics) as client:
            try:
                return await RetryClient(client).retry(queue, commit)
            except (NeverIngested, ValueError) as exc:
                raise click.ClickException(str(exc)) from None

    try:
        done = run_async(run)
    except AlreadyGreen as refused:
        if as_json:
            click.echo(json.dumps(queries.jsonable(
                {"error": str(refused), "uri": refused.uri, "fact": refused.fact}),
                indent=2, sort_keys=True))
        else:
            click.echo(f"Refused: {refused}", err=True)
        raise SystemExit(REFUSED_GREEN) from None
    emit(as_json, {"queue": done.queue, "uri": done.uri, "request_id": done.request_id,
                   "new": done.new, "previous_id": done.previous_id}, [done.request_id])
    if not done.new:
        click.echo(f"{done.request_id} is validating {done.uri} now: not starting another",
                   err=True)
