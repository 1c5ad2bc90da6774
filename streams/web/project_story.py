"""A project's story (design §11; issue 24, Deliver 6): `stovepipe explain QUEUE --project P`
and `GET /api/queues/{queue}/explain?project=P`.

It is the story of the project's scope `QUEUE#P` (`streams.web.story.explain`: its
builds, its culprit probes and its culprit, since the scope's last *built* green commit),
with, in their places, the queue's heads at which the project was unaffected — told
"unaffected, inherits green from <sha>" (or red) — since that commit. The one among them
that is the project's bookmark (its newest green answer, built or inherited) says so, and
when the queue's newest head left the project unaffected the summary begins with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from store import Order, Request, request_order
from store.culprits import CommitRecord
from store.projects import ProjectAnswer
from streams.config.projects import scope_name
from streams.web.queries import queue_state
from streams.web.story import MAX_STORY, CommitView, Descriptions, Entry, Story, explain

if TYPE_CHECKING:
    from streams.stages.deps import Deps


async def explain_project(deps: Deps, queue: str, project: str,
                          descriptions: Descriptions) -> Story:
    """The project's story. The caller has checked the project
    (`streams.web.project_answers.check_projects`)."""
    db = deps.db
    scope = scope_name(queue, project)
    told = await explain(deps, scope, descriptions)
    row = await queue_state(db, scope)
    built_green = row.last_green_request_id if row is not None else None
    heads = await db.requests.newer_than(
        queue, request_order(built_green) if built_green else None, MAX_STORY + 1)
    answers = await db.project_answers.of_requests(queue, project, [r.id for r in heads])
    unaffected = [(r, answers[r.id]) for r in heads[:MAX_STORY]
                  if r.id in answers and answers[r.id].inherited]
    if not unaffected:
        return told
    uris = list(dict.fromkeys(u for r, a in unaffected for u in (r.uri, a.source_uri)))
    commits = await descriptions.of(db, queue, uris,
                                    lambda: deps.extensions.source_control(queue))

    def name(uri: str) -> str:
        commit = commits.get(uri)
        return CommitView(uri, commit.sha if commit else None,
                          commit.subject if commit else None, None, None).name

    bookmark = (await db.projects.state(queue, project)).last_green_request_id
    told_inherited = [
        (r.order, _unaffected_entry(r, a, name, commits, bookmark=r.id == bookmark))
        for r, a in unaffected]
    story = _merged(told.story, told_inherited)
    cut = told.cut or len(story) > MAX_STORY or len(heads) > MAX_STORY
    newest = await _newest_head(deps, queue)
    head, summary = told.head, told.summary
    if newest is not None and newest.id in answers and answers[newest.id].inherited:
        head = next(e for _, e in told_inherited if e.request_id == newest.id)
        inherited = answers[newest.id]
        summary = (f"At the newest head {name(newest.uri)} {project} is unaffected: it "
                   f"inherits {'green' if inherited.degree == 0 else 'red'} from "
                   f"{name(inherited.source_uri)}. {summary}")
    return dataclasses.replace(told, story=story[:MAX_STORY], cut=cut, head=head,
                               summary=summary)


async def _newest_head(deps: Deps, queue: str) -> Request | None:
    row = await queue_state(deps.db, queue)
    if row is None or row.latest_request_id is None:
        return None
    return (await deps.db.requests.get_many(queue, [row.latest_request_id])).get(
        row.latest_request_id)


def _unaffected_entry(request: Request, answer: ProjectAnswer, name: Callable[[str], str],
                      commits: dict[str, CommitRecord], *, bookmark: bool) -> Entry:
    colour = "green" if answer.degree == 0 else "red"
    words = (f"unaffected, inherits {colour} from {name(answer.source_uri)} "
             f"({answer.source_request_id})")
    if bookmark:
        words += " — the project's bookmark (its last green commit)"
    commit = commits.get(request.uri)
    return Entry(request_id=request.id, uri=request.uri,
                 sha=commit.sha if commit else None,
                 subject=commit.subject if commit else None,
                 author=commit.author if commit else None, kind=request.kind.value,
                 state="unaffected", verdict=colour, words=words, build=None,
                 bookmark=bookmark, culprit=False)


def _merged(told: Sequence[Entry], inherited: Sequence[tuple[Order, Entry]]) -> list[Entry]:
    """The scope's story (newest first) with the inherited entries in their places; a
    commit the story tells without a Request (never built) keeps its place after the
    entry before it."""
    waiting = sorted(inherited, key=lambda t: t[0], reverse=True)
    merged: list[Entry] = []
    taken = 0
    for entry in told:
        if entry.request_id is not None:
            at = request_order(entry.request_id)
            while taken < len(waiting) and waiting[taken][0] > at:
                merged.append(waiting[taken][1])
                taken += 1
        merged.append(entry)
    merged += [entry for _, entry in waiting[taken:]]
    return merged
