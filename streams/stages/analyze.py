"""analyze(request id): plan which projects a Request of a queue with projects builds,
and decide the Request from its projects' answers (design §11).

A Request of a queue with projects has no build of its own. Once admitted (process takes
the queue's slot as for any Request), its BuildRequest comes here (the build stage hands
it over: keyed by request id, never the queue's single writer — git and the ``affected``
command run without holding it, or any database connection):

1. **Plan, once.** Each project's *base* is its nearest validated ancestor: the newest
   fact of its scope that sorts before the Request. The repository says whether a base
   is an ancestor of the head and which paths changed (one diff however many commits
   lie between), or the ``affected`` command names the projects. A project whose answer
   at the previous planned head came from its base (inherited it, or was built there) is
   decided by the one diff from that head; the others by one diff per distinct base. In
   a chain of heads that is one diff a head, however many projects and bases there are.
   `streams.stages.affected.plan_projects` decides: affected projects get a
   Request of their scope (numbered as this one, admitted at once, taking the scope's
   slot), unaffected ones their inherited answer. One statement writes it all; a
   redelivery finds the plan and writes nothing.
2. **Decide.** When every planned project's Request has ended — each with a verdict has
   its answer (record writes it after the fact, `record_child_answer`) — the Request
   settles from the blocking projects' answers: red if one is red, green if every one is
   green (built or inherited), else without a verdict; its slot is released and record
   writes its whole-repository fact. Whoever sees the last child end decides; a
   redelivery, or the sweeper re-publishing the Request's BuildRequest, decides again
   (a no-op once decided).

While its projects build, the Request's loop says it is back within `PLANNED_QUIET`, so the
sweeper re-publishes it now and then, never while the children are fresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from contract import BuildRequest, Record, TopicKey
from store import Request, RequestState, Verdict, split_scope
from store.projects import Child, ProjectBase, UnaffectedStatus
from streams.config.projects import scope_name
from streams.config.queues import QueueConfig, UnknownQueue
from streams.extensions.sourcecontrol import (
    CommitNotFound,
    SourceControl,
    TooManyPaths,
    commit_sha,
)
from streams.runtime import ACK, Outcome, metrics
from streams.stages.affected import Base, Changes, PathRules, Plan, plan_projects
from streams.stages.deps import Deps, StageContext
from streams.stages.kit import dependency_wait, is_dependency_unavailable, seconds

# seconds a planned Request's loop stays "seen" while its projects build: the sweeper
# re-publishes it this often at most (its children carry their own loops)
PLANNED_QUIET = 60.0
_NAMES = re.compile(r"[\s,]+")


def child_id(request_id: str, project: str) -> str:
    """The id of ``project``'s Request for Request ``request_id``: the same number in the
    project's scope (`request/<queue>#<project>/<n>`)."""
    prefix, _, tail = request_id.rpartition("/")
    return f"{prefix}#{project}/{tail}"


async def handle_parent(ctx: StageContext, request: Request, config: QueueConfig) -> Outcome:
    """build's hand-over for a `processing` Request of a queue with projects."""
    deps: Deps = ctx.deps
    plan = await deps.db.projects.plan_of(request.queue, request.id)
    if plan is None:
        try:
            planned = await _compute(deps, request, config)
        except Exception as exc:
            if not is_dependency_unavailable(exc):
                raise
            if ctx.waiting_for < seconds(config.trigger_deadline):
                return dependency_wait(ctx, exc, floor=1.0)
            # the repository stayed down: build every project (a sound plan needs no git)
            why = f"the repository did not answer: {exc}"
            planned = _Planned(Plan(dict.fromkeys(config.projects, why), everything=why),
                               {}, backstop=False)
        children = await _write(deps, request, config, planned)
        metrics.PROJECTS_PLANNED.labels(queue=request.queue, how="built").inc(
            len(planned.plan.affected))
        metrics.PROJECTS_PLANNED.labels(queue=request.queue, how="inherited").inc(
            len(planned.plan.inherited))
        ctx.log.info("planned affected=%s inherited=%d reason=%s",
                     ",".join(sorted(planned.plan.affected)) or "-",
                     len(planned.plan.inherited), planned.plan.everything or "-")
        for child in children:
            await ctx.publish(TopicKey.BUILD, BuildRequest(
                id=child.id, queue_name=child.queue, nonce=child.nonce, attempt=1,
                project=split_scope(child.queue)[1] or ""))
    await decide(ctx, request.queue, request.id)
    current = await deps.db.requests.get(request.queue, request.id)
    if current.state is RequestState.PROCESSING:
        await deps.db.requests.touch_loop(request.queue, request.id, quiet=PLANNED_QUIET)
    return ACK


@dataclass(frozen=True)
class _Planned:
    plan: Plan
    bases: Mapping[str, ProjectBase]
    backstop: bool
    rules_unaffected: tuple[str, ...] = ()  # a backstop's: what the rules would not build


async def _compute(deps: Deps, request: Request, config: QueueConfig) -> _Planned:
    """Each project's base, the changes that decide it (from the previous planned head or
    from its base), and the plan."""
    projects = list(config.projects)
    bases = await deps.db.projects.bases(request.queue, projects, request.id)
    previous = await deps.db.projects.previous_plan(request.queue, request.id)
    source_control = deps.extensions.source_control(request.queue)
    limit = config.affected.max_changed_paths
    changes: dict[str, Changes] = {}
    diffed_from: dict[str, str] = {}
    diffs = 0
    if previous is not None:
        # the projects whose answer at the previous planned head came from their base: one
        # diff from that head decides them all (`plan_projects` says why that is sound)
        via = [p for p, b in bases.items() if previous.sources.get(p) == b.request_id]
        if via:
            since = await _changes(source_control, previous.uri, request.uri, limit)
            diffs += 1
            if since.paths is not None:  # else (rewritten away, too large): their bases
                changes[previous.uri] = since
                diffed_from = dict.fromkeys(via, previous.uri)
    for uri in sorted({b.uri for p, b in bases.items() if p not in diffed_from}
                      - set(changes)):
        changes[uri] = await _changes(source_control, uri, request.uri, limit)
        diffs += 1
    metrics.AFFECTED_DIFFS.labels(queue=request.queue).inc(diffs)
    named: dict[str, frozenset[str]] | None = None
    everything = ""
    if config.affected.command and not any(c.paths is None for c in changes.values()):
        named = {}
        for uri, change in changes.items():
            found = await run_affected_command(config, uri, request.uri, change,
                                               source_control)
            if isinstance(found, str):
                everything = found
                break
            named[uri] = found
    plan = plan_projects(
        {p: PathRules(spec.paths) for p, spec in config.projects.items()},
        {p: (Base(b.uri, b.request_id, b.degree) if (b := bases.get(p)) else None)
         for p in projects},
        changes, named=named, everything=everything, diffed_from=diffed_from)
    if config.backstop is not None and await _backstop_due(deps, request.queue, config):
        # every project regardless — remembering which the rules would have left alone
        why = f"backstop: every project is validated every {seconds(config.backstop):.0f}s"
        return _Planned(Plan(dict.fromkeys(projects, why), everything=why), bases,
                        backstop=True, rules_unaffected=tuple(sorted(plan.inherited)))
    return _Planned(plan, bases, backstop=False)


async def _backstop_due(deps: Deps, queue: str, config: QueueConfig) -> bool:
    if config.backstop is None:
        return False
    last = await deps.db.projects.last_backstop(queue)
    return last is None or datetime.now(UTC) - last >= config.backstop


async def _changes(source_control: SourceControl, base_uri: str, head_uri: str,
                   limit: int) -> Changes:
    """The paths changed from a base to the head, or why they cannot be known soundly."""
    try:
        if not await source_control.is_ancestor(base_uri, head_uri):
            return Changes(None, f"history rewrite: the base {_short(base_uri)} is not an "
                                 f"ancestor of the head")
        return Changes(frozenset(await source_control.changed_paths(base_uri, head_uri,
                                                                     limit=limit)))
    except CommitNotFound:
        return Changes(None, f"the repository no longer has the base {_short(base_uri)}")
    except TooManyPaths:
        return Changes(None, f"more than {limit} paths changed since {_short(base_uri)}")


def _short(uri: str) -> str:
    sha = commit_sha(uri)
    return sha[:12] if sha else uri


async def run_affected_command(config: QueueConfig, base_uri: str, head_uri: str,
                               changes: Changes,
                               source_control: SourceControl) -> frozenset[str] | str:
    """The projects the queue's ``affected`` command names for base..head, or why it gave
    no sound answer (it failed, timed out, or named an unknown project). It runs with
    ``sh -c`` in a scratch directory, given STOVEPIPE_BASE_SHA, STOVEPIPE_HEAD_SHA, their
    URIs, STOVEPIPE_REPOSITORY, STOVEPIPE_QUEUE, STOVEPIPE_PROJECTS and
    STOVEPIPE_CHANGED_PATHS (a file listing the changed paths, one per line)."""
    command = config.affected.command
    assert command is not None
    timeout = seconds(config.affected.timeout)
    with tempfile.TemporaryDirectory(prefix="stovepipe-affected-") as scratch:
        listing = os.path.join(scratch, "changed_paths")
        with open(listing, "w", encoding="utf-8") as out:  # noqa: ASYNC230 - a small file
            out.write("".join(f"{p}\n" for p in sorted(changes.paths or ())))
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("STOVEPIPE_")},
               "STOVEPIPE_QUEUE": config.name, "STOVEPIPE_BASE_URI": base_uri,
               "STOVEPIPE_HEAD_URI": head_uri,
               "STOVEPIPE_BASE_SHA": commit_sha(base_uri) or "",
               "STOVEPIPE_HEAD_SHA": commit_sha(head_uri) or "",
               "STOVEPIPE_REPOSITORY": config.source_control.shared_repository() or "",
               "STOVEPIPE_PROJECTS": " ".join(config.projects),
               "STOVEPIPE_CHANGED_PATHS": listing}
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", command, cwd=scratch, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out_bytes, err_bytes = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            return f"the affected command did not answer within {timeout:.0f}s"
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
    if proc.returncode != 0:
        detail = err_bytes.decode("utf-8", "replace").strip().replace("\n", " | ")[:300]
        return (f"the affected command failed (exit status {proc.returncode})"
                + (f": {detail}" if detail else ""))
    names = frozenset(n for n in _NAMES.split(out_bytes.decode("utf-8", "replace")) if n)
    unknown = sorted(names - set(config.projects))
    if unknown:
        return f"the affected command named unknown projects: {', '.join(unknown[:5])}"
    return names


async def _write(deps: Deps, request: Request, config: QueueConfig,
                 planned: _Planned) -> list[Request]:
    """Write the plan (one statement), and return the children it minted (none when
    another delivery planned first)."""
    plan = planned.plan
    children = []
    statuses: dict[str, Sequence[str]] = {}
    for project in sorted(plan.affected):
        scope = scope_name(request.queue, project)
        base = planned.bases.get(project)
        incremental = base is not None and base.degree == 0 and not plan.everything
        children.append(Child(scope, child_id(request.id, project),
                              "incremental" if incremental else "full",
                              base.uri if incremental and base is not None else None))
        with contextlib.suppress(UnknownQueue):
            statuses[scope] = deps.queue_config(scope).status_channels
    inherited = {p: ProjectBase(b.uri, b.request_id, b.degree)
                 for p, b in plan.inherited.items()}
    unaffected = [UnaffectedStatus(project, channel, child_id(request.id, project))
                  for project in sorted(plan.inherited)
                  if config.posts_unaffected_status(project)
                  for channel in _status_channels(deps, scope_name(request.queue, project))]
    wrote = await deps.db.projects.plan(
        request, affected=sorted(plan.affected), reason=plan.everything,
        backstop=planned.backstop, rules_unaffected=planned.rules_unaffected,
        children=children, inherited=inherited,
        status_channels=statuses, unaffected_statuses=unaffected)
    if not wrote:
        return []
    return [await deps.db.requests.get(c.scope, c.request_id) for c in children]


def _status_channels(deps: Deps, scope: str) -> tuple[str, ...]:
    try:
        return deps.queue_config(scope).status_channels
    except UnknownQueue:
        return ()


async def decide(ctx: StageContext, queue: str, request_id: str) -> None:
    """Decide Request ``request_id`` from its projects' answers if every planned project
    is done; then hand it to record. A no-op while a project builds, or once decided."""
    deps: Deps = ctx.deps
    plan = await deps.db.projects.plan_of(queue, request_id)
    if plan is None or plan.completed:
        return
    config = deps.queue_config(queue)
    completed = await deps.db.projects.complete(
        queue, request_id,
        children={p: child_id(request_id, p) for p in plan.affected},
        blocking=config.blocking_projects, status_channels=config.status_channels)
    settled = completed.request
    if settled is None:
        return
    how = (settled.verdict.value if settled.verdict is not None else "unvalidated")
    metrics.REQUESTS_SETTLED.labels(queue=queue, outcome=how).inc()
    ctx.log.info("decided request_id=%s outcome=%s verdict=%s reason=%s", settled.id,
                 settled.state, how, settled.reason or "-")
    await ctx.publish(TopicKey.RECORD, Record(id=settled.id, queue_name=queue,
                                              nonce=settled.nonce))


async def record_child_answer(ctx: StageContext, child: Request) -> None:
    """After record ended a project's Request (with its fact, or without a verdict):
    its answer for its parent, then the parent decided if it was the last."""
    queue, project = split_scope(child.queue)
    if project is None or child.kind.value != "head":
        return  # a culprit probe of the scope: no parent
    parent_id = child.id.replace(f"{queue}#{project}/", f"{queue}/", 1)
    await ctx.deps.db.projects.answer_from_fact(queue, parent_id, child)
    if child.verdict is Verdict.RED:
        plan = await ctx.deps.db.projects.plan_of(queue, parent_id)
        if plan is not None and plan.backstop and project in plan.rules_unaffected:
            # the path rules said it was not affected: they are wrong, or a dependency
            # outside its paths broke it
            metrics.BACKSTOP_MISSES.labels(queue=queue, project=project).inc()
            ctx.log.warning("backstop_red_where_unaffected project=%s request_id=%s: the "
                            "path rules said this project was unaffected", project,
                            child.id)
    await decide(ctx, queue, parent_id)
