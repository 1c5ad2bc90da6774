"""`stovepipe explain QUEUE [--project P] [--json]`: why the bookmark is where it is — the
branch's story since its last green commit, newest first, in plain words
(`streams.web.story`, which the API's `GET /api/queues/{queue}/explain` tells the same
way); with --project, project P's (`streams.web.project_story`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import click

from store import Database
from streams.cli.common import emit, json_option, open_db, queues_option, run_async
from streams.config.queues import Extensions, QueueConfigError, QueuesConfig, load_queues
from streams.stages.deps import Deps
from streams.web import history, story
from streams.web.project_answers import InvalidProjectName, UnknownProject, check_projects
from streams.web.project_story import explain_project
from streams.web.story import Entry, Story

DESCRIBE_DEADLINE = 5.0  # seconds the command waits for the repository to describe commits
WIDTH = 100


@click.command("explain")
@click.argument("queue")
@click.option("--project", "project", default=None, metavar="P",
              help="Tell project P's story: its scope QUEUE#P's builds, probes and culprit, "
                   "and the heads at which it was unaffected (what it inherited from where).")
@queues_option
@json_option
def explain_command(queue: str, project: str | None, queues_file: Path | None,
                    as_json: bool) -> None:
    """Tell QUEUE's story since its last green commit: each head and built commit, newest
    first, with its state and why — superseded by which head, waiting for a slot behind
    which build, building for how long, red (and the culprit, when known), could not be
    validated (why) — then the bookmark; and where the promotion ref is."""

    async def run() -> Story:
        queues = load_queues(queues_file)
        config = queues.get(queue)  # UnknownQueue: a one-line message
        if project is not None:
            try:
                check_projects(config, [project])
            except (UnknownProject, InvalidProjectName) as exc:
                raise click.ClickException(str(exc)) from None
        db = await open_db()
        try:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            descriptions = history.CommitDescriptions(deadline=DESCRIBE_DEADLINE)
            if project is not None:
                return await explain_project(deps, queue, project, descriptions)
            return await story.explain(deps, queue, descriptions)
        finally:
            await db.close()

    told = run_async(run)
    emit(as_json, {"queue": told.queue, "bookmark": told.bookmark,
                   "promotion": told.promotion, "head": told.head, "culprit": told.culprit,
                   "search": told.search, "summary": told.summary, "story": told.story,
                   "cut": told.cut}, story_lines(told))


def story_lines(told: Story) -> list[str]:
    lines = [*textwrap.wrap(told.summary, WIDTH), ""]
    if told.culprit is not None:
        c = told.culprit
        who = f" by {c.author}" if c.author else ""
        lines.append(f"{'culprit' if c.confirmed else 'a break':<11}{c.sha or c.uri}{who}")
        if not c.confirmed:
            lines += _wrapped("           ", f"not confirmed as the head's: "
                                            f"{c.unconfirmed_reason}")
        if c.subject:
            lines.append(f"           {c.subject}")
        if c.committed_at:
            lines.append(f"           committed {story.moment(c.committed_at)}")
        if c.build is not None:
            lines.append(f"           build {c.build.id}" + (f"  {c.build.url}"
                                                             if c.build.url else ""))
    if told.search is not None:
        lines += _wrapped("search     ", told.search.words)
    if told.promotion.ref is not None:
        where = told.promotion.uri if told.promotion.known else "(the repository did not say)"
        if told.bookmark is not None and where == told.bookmark.uri:
            where = f"the bookmark, {(told.bookmark.sha or told.bookmark.uri)[:12]}"
        pin = told.promotion.pinned
        held = (f"  pinned by {pin.by or '?'}: {pin.reason or ''}".rstrip(": ")
                if pin is not None else "")
        lines.append(f"promotion  {told.promotion.ref} at {where or 'nothing yet'}{held}")
    lines += ["", "newest first:"] if told.story else ["", "nothing was ingested yet"]
    for entry in told.story:
        lines += _entry_lines(entry)
    if told.cut:
        lines.append(f"  … older entries left out (at most {story.MAX_STORY} are told)")
    return lines


def _entry_lines(entry: Entry) -> list[str]:
    name = (entry.sha or entry.uri)[:12] if entry.sha else entry.uri
    subject = f"  {entry.subject}" if entry.subject else ""
    lines = [f"  {entry.request_id or '(not built)':<28} {entry.kind:<8} {name}{subject}"]
    lines += _wrapped("      ", entry.words)
    if entry.build is not None and entry.build.url:
        lines.append(f"      build {entry.build.id}  {entry.build.url}")
    return lines


def _wrapped(prefix: str, text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=prefix,
                         subsequent_indent=" " * len(prefix)) or [prefix.rstrip()]


async def culprit_lines(db: Database, queue: str, queues_file: Path | None) -> tuple[
        story.CulpritView | None, story.SearchView | None]:
    """The queue's culprit and search for `stovepipe queue`: described by the repository
    when the queue is configured here, else from what the database remembers."""
    try:
        queues = load_queues(queues_file)
        queues.get(queue)
        descriptions: story.Descriptions = history.CommitDescriptions(
            deadline=DESCRIBE_DEADLINE)
    except (QueueConfigError, LookupError):
        queues = QueuesConfig(Path("queues.yaml"), {})
        descriptions = story.StoredDescriptions()
    deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
    return await story.red_since(deps, queue, descriptions)
