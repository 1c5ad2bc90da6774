"""`stovepipe last-green QUEUE [--project P]… [--json]`: the newest commit at which every
listed project is green — built, or unaffected and inheriting green — with each project's
own answer there (`streams.web.project_answers.last_green`, which the API's
`GET /api/queues/{queue}/last-green?projects=…` answers the same way); without a project,
the queue's bookmark.

Exit status: 0 found (the first line is the commit's sha, or its URI when it has none);
3 no commit is green for all of them (yet); 1 unknown queue or project, a malformed
project name, or Stovepipe unreachable."""

from __future__ import annotations

from pathlib import Path

import click

from streams.cli.common import emit, json_option, open_db, queues_option, run_async
from streams.cli.show import NOT_GREEN
from streams.config.queues import Extensions, UnknownQueue, load_queues
from streams.stages.deps import Deps
from streams.web import project_answers
from streams.web.project_answers import LastGreenAnswer, UnknownProject, check_projects
from streams.web.queries import jsonable


@click.command("last-green")
@click.argument("queue")
@click.option("--project", "-p", "projects", multiple=True, metavar="P",
              help="A project that must be green (repeat for several; none: the queue's "
                   "bookmark, every blocking project green).")
@queues_option
@json_option
def last_green_command(queue: str, projects: tuple[str, ...], queues_file: Path | None,
                       as_json: bool) -> None:
    """The newest commit of QUEUE green for every project named with --project (directly
    or by inheritance), with each one's own answer; without --project, the queue's
    last-green bookmark. The base `nx affected --base` wants."""

    async def run() -> LastGreenAnswer:
        queues = load_queues(queues_file)
        try:
            listed = check_projects(queues.get(queue), projects) if projects else ()
        except (UnknownQueue, UnknownProject, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        db = await open_db()
        try:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            return await project_answers.last_green(deps, queue, listed)
        finally:
            await db.close()

    answer = run_async(run)
    if not answer.found:
        emit(as_json, jsonable(answer), [f"none — {answer.reason}"])
        raise SystemExit(NOT_GREEN)
    lines = [answer.sha or answer.uri or "",
             f"  {answer.uri}  ({answer.request_id})"]
    if not answer.projects:
        lines.append("  the queue's bookmark: every blocking project green")
    for project, fact in answer.facts.items():
        how = (f"unaffected, inherits green from {fact.inherited_from} "
               f"({fact.source_request_id})" if fact.unaffected
               else f"green, built by {fact.source_request_id}")
        flaky = " (flaky)" if fact.flaky else ""
        lines.append(f"  {project:<20} {how}{flaky}")
    emit(as_json, jsonable(answer), lines)
