"""The API's reads (design §9): queues, Requests, facts and deploy-gate answers, the
branch's story, its health, its green commits, a build's log and the dead letters. The
handlers only read; `streams.web.api.Api` adds the writes and mounts them all."""

from __future__ import annotations

import asyncio
from functools import cached_property
from typing import Any

from aiohttp import web

from store import NotFound, ValidationFact
from streams.config.names import (
    UnknownQueue,
    validate_queue_name,
    validate_queue_or_scope_name,
)
from streams.extensions.sourcecontrol import CommitNotFound, commit_sha
from streams.runtime.stage import Delivery
from streams.stages import gauges
from streams.stages.deps import Deps
from streams.web import (
    gate,
    greens,
    grid,
    history,
    project_answers,
    project_states,
    project_story,
    queries,
    story,
)
from streams.web.errors import ApiError
from streams.web.params import (
    commit_param,
    format_param,
    int_param,
    project_param,
    required_param,
)
from streams.web.project_answers import ProjectFact, check_projects
from streams.web.responses import json_answer, text_answer

READ_DEADLINE = 5.0  # seconds a read may take before it answers 503
GATE_DEADLINE = 15.0  # a green search also asks the repository about ancestry
GREENS_DESCRIBE_DEADLINE = 8.0  # seconds the green list waits for the commits' shas
DEFAULT_RECENT_LIMIT = 20


class Reads:
    """The read handlers; each returns a response or raises (see
    `streams.web.responses.error_response`)."""

    dead_letters: queries.DeadLetterDepths

    def _delivery(self) -> Delivery[Deps]:
        raise NotImplementedError  # the API knows whether the worker is ready

    async def queues(self, request: web.Request) -> web.Response:
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            overviews = [await self._overview(deps, name, lag_deadline=0.0)
                         for name in deps.queues.names()]
        return json_answer({"queues": overviews})

    async def queue(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            return json_answer(await self._overview(deps, queue,
                                              lag_deadline=gauges.LAG_DEADLINE_API))

    async def queue_requests(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", DEFAULT_RECENT_LIMIT, 1,
                           queries.MAX_RECENT_REQUESTS)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            recent = await queries.recent_requests(deps.db, queue, limit)
        return json_answer({"queue": queue, "requests": [
            {"request": r.request, "fact": r.fact, "green": r.green} for r in recent]})

    async def queue_history(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", history.DEFAULT_LIMIT, 1, history.MAX_LIMIT)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            return json_answer(await history.queue_history(deps, queue, limit,
                                                     self._commit_descriptions))

    async def queue_grid(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", grid.DEFAULT_LIMIT, 1, grid.MAX_LIMIT)
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            return json_answer(await grid.project_grid(deps, queue, limit,
                                                       self._commit_descriptions))

    @cached_property
    def _commit_descriptions(self) -> history.CommitDescriptions:
        return history.CommitDescriptions()

    async def request(self, request: web.Request, request_id: str) -> web.Response:
        try:
            queries.parse_request_path(request_id)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        deps = self._delivery().deps
        async with asyncio.timeout(READ_DEADLINE):
            try:
                detail = await queries.request_detail(deps.db, request_id)
            except NotFound:
                raise ApiError(404, f"no request {request_id!r}") from None
        return json_answer({"request": detail.request, "builds": detail.builds,
                      "fact": detail.fact, "commit_fact": detail.commit_fact,
                      "newest_for_commit": detail.newest_for_commit,
                      "green": detail.green})

    async def fact(self, request: web.Request) -> web.Response:
        queue = required_param(request, "queue")
        by, commit = commit_param(request)
        project = project_param(request)
        validate_queue_name(queue)
        deps = self._delivery().deps
        body: dict[str, Any] = {"queue": queue, by: commit,
                                **({"project": project} if project is not None else {})}
        if by == "uri":
            try:
                deps.queue_config(queue)
            except UnknownQueue as exc:  # still not green, and say why
                return json_answer({**body, "green": False, "fact": None, "known": False,
                              "reason": str(exc), "note": str(exc)})
        if project is not None:
            check_projects(deps.queue_config(queue), [project])
        try:
            async with asyncio.timeout(GATE_DEADLINE):
                uri = await _resolved(deps, queue, commit) if by == "sha" else commit
                body["uri"] = uri
                fact: ValidationFact | ProjectFact | None = (
                    await queries.fact_or_none(deps.db, queue, uri) if project is None
                    else await project_answers.project_fact(deps, queue, project, uri))
                if fact is None:  # a fact proves the commit; without one, ask
                    await deps.extensions.source_control(queue).commit_time(uri)
        except CommitNotFound as exc:
            return json_answer(_unknown_commit(body, exc))
        return json_answer({**body, "green": fact is not None and fact.is_green, "fact": fact,
                      "known": True, **_inheritance(project, fact)})

    async def green(self, request: web.Request, queue: str) -> web.Response:
        by, commit = commit_param(request)
        project = project_param(request)
        validate_queue_name(queue)
        deps = self._delivery().deps
        config = deps.queue_config(queue)
        if project is not None:
            check_projects(config, [project])
        body: dict[str, Any] = {"queue": queue, by: commit,
                                **({"project": project} if project is not None else {})}
        try:
            async with asyncio.timeout(GATE_DEADLINE):
                uri = await _resolved(deps, queue, commit) if by == "sha" else commit
                body["uri"] = uri
                answer: gate.GreenAnswer | project_answers.ProjectGreenAnswer = (
                    await gate.green_answer(deps, queue, uri) if project is None else
                    await project_answers.project_green_answer(deps, queue, project, uri))
        except CommitNotFound as exc:
            return json_answer(_unknown_commit(body, exc))
        return json_answer({**body, "uri": answer.uri, "committed_at": answer.committed_at,
                      "green": answer.green, "known": True, "fact": answer.fact,
                      "prior_green": answer.prior_green, "next_green": answer.next_green,
                      "searched": answer.searched, "complete": answer.complete,
                      **_inheritance(project, answer.fact)})

    # --- projects (issue 24): the newest commit green for several, each one's state ------

    async def last_green(self, request: web.Request, queue: str) -> web.Response:
        as_text = format_param(request) == "text"
        raw = request.query.getall("projects", [])
        names = project_answers.projects_param(",".join(raw)) if raw else []
        validate_queue_name(queue)
        deps = self._delivery().deps
        config = deps.queue_config(queue)
        projects = check_projects(config, names) if names else ()
        async with asyncio.timeout(READ_DEADLINE):
            answer = await project_answers.last_green(deps, queue, projects)
        if as_text:
            if not answer.found or answer.uri is None:
                raise ApiError(404, answer.reason or "no green commit")
            return text_answer(answer.sha or answer.uri)
        return json_answer(answer)

    async def projects(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        config = deps.queue_config(queue)
        check_projects(config, [])  # a queue without projects: 404 saying so
        async with asyncio.timeout(READ_DEADLINE):
            views = await project_states.project_views(deps, queue, list(config.projects),
                                                       self._commit_descriptions)
        return json_answer({"queue": queue, "projects": views})

    async def project(self, request: web.Request, queue: str, project: str) -> web.Response:
        as_text = format_param(request) == "text"
        validate_queue_name(queue)
        deps = self._delivery().deps
        check_projects(deps.queue_config(queue), [project])
        async with asyncio.timeout(READ_DEADLINE):
            if as_text:  # the bare sha of the project's last green commit, as Bazel's
                state = await deps.db.projects.state(queue, project)
                if state.last_green_uri is None:
                    raise ApiError(404, f"project {project!r} of queue {queue!r} has no "
                                        f"green commit yet")
                return text_answer(commit_sha(state.last_green_uri) or state.last_green_uri)
            [view] = await project_states.project_views(deps, queue, [project],
                                                        self._commit_descriptions)
        return json_answer({"queue": queue, **queries.jsonable(view)})

    # --- the branch's story, its health, its green commits, a build's log (issue 18) ----

    async def _overview(self, deps: Deps, queue: str, *,
                        lag_deadline: float) -> dict[str, Any]:
        """A queue at a glance, with its culprit ("red since C", or the search under way)
        and its health figures (the commit lag only as counted already when
        ``lag_deadline`` is 0)."""
        overview = await queries.queue_overview(deps, queue)
        culprit, search = await story.red_since(deps, queue, self._commit_descriptions)
        health = await gauges.queue_health(deps, queue, lag_deadline=lag_deadline)
        return {**queries.jsonable(overview), "culprit": culprit, "search": search,
                "health": health}

    async def explain(self, request: web.Request, queue: str) -> web.Response:
        project = project_param(request)
        validate_queue_name(queue)
        deps = self._delivery().deps
        config = deps.queue_config(queue)
        if project is not None:
            check_projects(config, [project])
        async with asyncio.timeout(READ_DEADLINE):
            told = (await story.explain(deps, queue, self._commit_descriptions)
                    if project is None else await project_story.explain_project(
                        deps, queue, project, self._commit_descriptions))
        return json_answer(told)

    async def queue_health(self, request: web.Request, queue: str) -> web.Response:
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            return json_answer(await gauges.queue_health(deps, queue,
                                                   lag_deadline=gauges.LAG_DEADLINE_API))

    async def greens(self, request: web.Request, queue: str) -> web.Response:
        limit = int_param(request, "limit", greens.DEFAULT_LIMIT, 1, greens.MAX_LIMIT)
        since = request.query.get("since")
        if since is not None and not since.strip():
            raise ApiError(400, "query parameter 'since' names a commit (a full sha, a "
                                "unique prefix or the URI); leave it out to list from the "
                                "first green commit")
        validate_queue_name(queue)
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(GATE_DEADLINE):
            since_uri = await _resolved(deps, queue, since.strip()) if since else None
            try:
                listed = await greens.greens_after(deps, queue, since_uri, limit,
                                                   self._green_descriptions)
            except greens.NeverValidated as exc:
                raise ApiError(404, str(exc)) from None
        return json_answer(listed)

    @cached_property
    def _green_descriptions(self) -> history.CommitDescriptions:
        # the green list waits longer for the commits' shas: release tooling wants them
        return history.CommitDescriptions(deadline=GREENS_DESCRIBE_DEADLINE)

    async def build_log(self, request: web.Request, queue: str,
                        build_id: str) -> web.Response:
        validate_queue_or_scope_name(queue)  # a project's builds are its scope's
        deps = self._delivery().deps
        deps.queue_config(queue)
        async with asyncio.timeout(READ_DEADLINE):
            try:
                build = await deps.db.command_builds.get(build_id)
            except NotFound:
                build = None
        if build is None or build.queue != queue:
            raise ApiError(404, f"queue {queue!r} has no command build {build_id!r} (only "
                                f"the command runner's builds have a log here)")
        return web.Response(text=build.log_tail, content_type="text/plain", charset="utf-8",
                            headers={"Cache-Control": "no-cache",
                                     "X-Content-Type-Options": "nosniff",
                                     "X-Build-Status": build.status.value})

    async def dlq(self, request: web.Request) -> web.Response:
        report = await self.dead_letters.report()
        body = {"group": report.group, "measured_at": report.measured_at,
                "topics": report.topics, "total": report.total, "error": report.error}
        return json_answer(body, status=503 if report.error else 200)


async def _resolved(deps: Deps, queue: str, commit: str) -> str:
    """The URI of a sha or prefix on the queue; not a sha at all is a 400."""
    try:
        return await gate.resolve_commit(deps, queue, commit)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _inheritance(project: str | None,
                 fact: ValidationFact | ProjectFact | None) -> dict[str, Any]:
    """What a project's answer adds: whether it is inherited, and from which commit."""
    if project is None:
        return {}
    inherited = isinstance(fact, ProjectFact) and fact.unaffected
    return {"unaffected": inherited,
            "inherited_from": fact.inherited_from if isinstance(fact, ProjectFact) else None}


def _unknown_commit(asked: dict[str, Any], exc: CommitNotFound) -> dict[str, Any]:
    """A gate's answer about a commit the repository does not have: not green, and why
    (a 200, so a gate reading `.green` needs no special case)."""
    return {"uri": None, **asked, "green": False, "fact": None, "known": False,
            "reason": str(exc), **_inheritance(asked.get("project"), None)}
