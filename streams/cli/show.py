"""`stovepipe request | queue | fact`: what the pipeline knows, from the database."""

from __future__ import annotations

from typing import Any

import click

from store import NotFound
from streams.cli.common import emit, json_option, open_db, run_async
from streams.web import queries


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
@click.argument("uri")
@json_option
def fact_command(queue: str, uri: str, as_json: bool) -> None:
    """Is URI green on QUEUE? Exit status 0 when green, 3 when red or unknown (no fact
    means not green), so a deploy gate can use it directly."""

    async def run() -> Any:
        db = await open_db()
        try:
            return await queries.fact_or_none(db, queue, uri)
        finally:
            await db.close()

    fact = run_async(run)
    if fact is None:
        emit(as_json, {"fact": None, "green": False},
              [f"{uri}: no fact (not green)"])
    else:
        emit(as_json, {"fact": fact, "green": fact.is_green},
              [f"{uri}: degree {fact.degree:g} ({'green' if fact.is_green else 'red'}), "
               f"by {fact.request_id} at {fact.created_at.isoformat()}"])
    if fact is None or not fact.is_green:
        raise SystemExit(3)
