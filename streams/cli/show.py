"""`stovepipe request | queue | fact`: what the pipeline knows, from the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from store import NotFound, ValidationFact
from streams.cli.common import emit, json_option, open_db, run_async
from streams.config.queues import Extensions, UnknownQueue, load_queues
from streams.extensions.sourcecontrol import AmbiguousCommit, CommitNotFound
from streams.stages.deps import Deps
from streams.web import gate, queries
from streams.web.gate import GreenAnswer


@click.command("request")
@click.argument("request_id")
@json_option
def request_command(request_id: str, as_json: bool) -> None:
    """Show a Request: state, strategy, builds and its fact."""
    try:
        queries.parse_request_path(request_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None

    async def run() -> dict[str, Any]:
        db = await open_db()
        try:
            try:
                detail = await queries.request_detail(db, request_id)
            except NotFound:
                raise click.ClickException(f"no request {request_id!r}") from None
            return {"request": detail.request, "builds": detail.builds, "fact": detail.fact}
        finally:
            await db.close()

    data = run_async(run)
    r = data["request"]
    lines = [f"{r.id}  {r.state}", f"  uri       {r.uri}",
             f"  strategy  {r.build_strategy or '-'}" + (f" (base {r.base_uri})"
                                                          if r.base_uri else ""),
             f"  updated   {r.updated_at.isoformat()}"]
    lines += [f"  build     {b.id}  {b.status}" for b in data["builds"]]
    fact = data["fact"]
    lines.append(f"  fact      degree {fact.degree:g} ({'green' if fact.is_green else 'red'})"
                 if fact else "  fact      none")
    emit(as_json, data, lines)


@click.command("queue")
@click.argument("name")
@json_option
def queue_command(name: str, as_json: bool) -> None:
    """Show a queue: last-green bookmark, in-flight builds, latest Request."""

    async def run() -> Any:
        db = await open_db()
        try:
            return await db.queues.get(name)
        except NotFound:
            raise click.ClickException(
                f"queue {name!r} has no state yet (nothing was ingested for it)") from None
        finally:
            await db.close()

    q = run_async(run)
    emit(as_json, {"queue": q}, [
        f"{q.name}",
        f"  last green  {q.last_green_uri or '-'}"
        + (f"  ({q.last_green_request_id})" if q.last_green_request_id else ""),
        f"  in flight   {q.in_flight_count}",
        f"  latest      {q.latest_request_id or '-'}",
    ])


@click.command("fact")
@click.argument("queue")
@click.argument("commit")
@click.option("--queues-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The queue configuration (default: STOVEPIPE_QUEUES_FILE, "
                                 "else queues.yaml).")
@json_option
def fact_command(queue: str, commit: str, queues_file: Path | None, as_json: bool) -> None:
    """Is COMMIT green on QUEUE? COMMIT is a full sha, a unique prefix of one, or the
    commit's URI. When it is not green, says its newest green ancestor and its oldest
    green descendant. Exit status 0 when green, 3 when red or unknown (no fact means not
    green), so a deploy gate can use it directly."""
    queues = load_queues(queues_file)

    async def run() -> GreenAnswer:
        db = await open_db()
        try:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            try:
                uri = await gate.resolve_commit(deps, queue, commit)
                return await gate.green_answer(deps, queue, uri)
            except (CommitNotFound, AmbiguousCommit, UnknownQueue, ValueError) as exc:
                raise click.ClickException(str(exc)) from None
        finally:
            await db.close()

    answer = run_async(run)
    fact = answer.fact
    if fact is None:
        verdict = "no fact (not green)"
    else:
        verdict = (f"degree {fact.degree:g} ({'green' if fact.is_green else 'red'}), "
                   f"by {fact.request_id} at {fact.created_at.isoformat()}")
    lines = [f"{answer.uri}: {verdict}"]
    if not answer.green:
        lines += [f"  newest green ancestor   {_green_line(answer.prior_green)}",
                  f"  oldest green descendant {_green_line(answer.next_green)}"]
        if not answer.complete:
            lines.append(f"  (searched the {answer.searched} nearest green commits only)")
    emit(as_json, {"uri": answer.uri, "fact": fact, "green": answer.green,
                   "prior_green": answer.prior_green, "next_green": answer.next_green,
                   "complete": answer.complete}, lines)
    if not answer.green:
        raise SystemExit(3)


def _green_line(fact: ValidationFact | None) -> str:
    return f"{fact.uri}  ({fact.request_id})" if fact is not None else "none"
