"""`stovepipe request | queue | fact`: what the pipeline knows, from the database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from store import (
    Build,
    BuildStatus,
    NotFound,
    Queue,
    Request,
    RequestState,
    UnvalidatedCause,
    ValidationFact,
)
from streams.cli.common import emit, json_option, open_db, queues_option, run_async
from streams.cli.explain import culprit_lines
from streams.config.names import QueueConfigError
from streams.config.queues import Extensions, UnknownQueue, load_queues
from streams.extensions.sourcecontrol import AmbiguousCommit, CommitNotFound
from streams.stages.deps import Deps
from streams.web import gate, queries
from streams.web.gate import GreenAnswer
from streams.web.project_answers import (
    ProjectFact,
    ProjectGreenAnswer,
    UnknownProject,
    check_projects,
    project_green_answer,
)
from streams.web.story import CulpritView, SearchView

NOT_GREEN = 3  # `stovepipe fact`: the commit is not green, or not one the queue can name


@click.command("request")
@click.argument("request_id")
@json_option
def request_command(request_id: str, as_json: bool) -> None:
    """Show a Request: its state and why, its attempts (builds), its own fact and, when
    another Request of the commit answers for it now, the commit's answer."""
    try:
        queries.parse_request_path(request_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None

    async def run() -> queries.RequestDetail:
        db = await open_db()
        try:
            try:
                return await queries.request_detail(db, request_id)
            except NotFound:
                raise click.ClickException(f"no request {request_id!r}") from None
        finally:
            await db.close()

    detail = run_async(run)
    r = detail.request
    lines = [f"{r.id}  {state_text(r)}", f"  kind      {r.kind}", f"  uri       {r.uri}",
             f"  strategy  {r.build_strategy or '-'}" + (f" (base {r.base_uri})"
                                                          if r.base_uri else ""),
             f"  verdict   {r.verdict or 'none'}"]
    if r.reason and not r.unvalidated:  # an unvalidated Request's reason is in its state
        lines.append(f"  reason    {r.reason}")
    if r.unvalidated:
        lines.append(f"  again     {revalidation_text(r)}")
    lines.append(f"  attempts  {r.attempt}")
    lines += [f"  attempt {b.attempt}  {b.id}  {_build_outcome(b)}" for b in detail.builds]
    lines.append(f"  fact      {_fact_text(detail.fact)}")
    answer = detail.commit_fact
    if answer is not None and (detail.fact is None
                               or answer.request_id != detail.fact.request_id):
        lines.append(f"  answer    {_fact_text(answer)} (the commit's answer now)")
    newest = detail.newest_for_commit
    if newest is not None and newest.id != r.id:
        lines.append(f"  newest    {newest.id}  {state_text(newest)}")
    lines.append(f"  updated   {r.updated_at.isoformat()}")
    emit(as_json, {"request": r, "builds": detail.builds, "fact": detail.fact,
                   "commit_fact": answer, "newest_for_commit": newest,
                   "green": detail.green}, lines)


def state_text(request: Request) -> str:
    """The state as a person reads it: a failure says which kind it was."""
    if request.unvalidated:
        return f"failed — {why_unvalidated(request.reason)}"
    if request.state is RequestState.FAILED:
        return "failed (red verdict)"
    if request.state is RequestState.CANCELLED and request.reason:
        return f"cancelled: {request.reason}"
    return str(request.state)


def revalidation_text(request: Request) -> str:
    """For a Request that could not validate its commit: who validates the commit again
    (design §4)."""
    if request.unvalidated_cause is UnvalidatedCause.PERMANENT:
        return ("only on request (stovepipe retry): its cause is permanent, building it "
                "again would fail the same way")
    done = request.revalidations
    return (f"by the next ingest of the head, after a growing spacing, while the queue's "
            f"retry.unvalidated allows ({done} automatic re-validation"
            f"{'s' if done != 1 else ''} of this commit before it): its cause looks "
            f"transient")


def why_unvalidated(reason: str) -> str:
    """A failure without a verdict in words: `could not be validated: <why>` (the
    pipeline's own reasons begin so already)."""
    if reason.startswith("could not be validated"):
        return reason
    return f"could not be validated: {reason or 'no reason recorded'}"


def _build_outcome(build: Build) -> str:
    if build.verdict is not None:
        return f"{build.status}  {build.verdict}"
    if build.status is BuildStatus.FAILED:
        return f"failed  could not validate: {build.reason or 'no reason recorded'}"
    return f"{build.status}  {build.reason}".rstrip()


def _fact_text(fact: ValidationFact | None) -> str:
    if fact is None:
        return "none"
    colour = ("green (flaky)" if fact.flaky else "green") if fact.is_green else "red"
    attempts = f", {fact.attempts} attempts" if fact.attempts > 1 else ""
    return f"degree {fact.degree:g} ({colour}) by {fact.request_id}{attempts}"


@click.command("queue")
@click.argument("name")
@queues_option
@json_option
def queue_command(name: str, queues_file: Path | None, as_json: bool) -> None:
    """Show a queue: last-green bookmark, in-flight builds, latest Request and its state,
    and while it is red, its culprit ("red since C") or the search for it."""

    async def run() -> tuple[Queue, Request | None, CulpritView | None, SearchView | None,
                             queries.PromotionRef | None]:
        db = await open_db()
        try:
            try:
                q = await db.queues.get(name)
            except NotFound:
                raise click.ClickException(
                    f"queue {name!r} has no state yet (nothing was ingested for it)") from None
            latest = None
            if q.latest_request_id is not None:
                latest = await db.requests.get(name, q.latest_request_id)
            culprit, search = await culprit_lines(db, name, queues_file)
            return q, latest, culprit, search, await _promotion_ref(db, q, queues_file)
        finally:
            await db.close()

    q, latest, culprit, search, ref = run_async(run)
    emit(as_json, {"queue": q, "latest_request": latest, "culprit": culprit,
                   "search": search, "promotion_ref": ref}, [
        f"{q.name}",
        f"  last green  {q.last_green_uri or '-'}"
        + (f"  ({q.last_green_request_id})" if q.last_green_request_id else ""),
        f"  in flight   {q.in_flight_count}",
        *([f"  pinned      promotion ref held at {q.pinned_uri} by {q.pinned_by} since "
           f"{q.pinned_at.isoformat() if q.pinned_at else '?'}: {q.pinned_reason}"]
          if q.pinned_uri else []),
        *_promotion_lines(ref),
        f"  latest      {latest.id}  {state_text(latest)}" if latest else "  latest      -",
        *_red_since_lines(culprit, search),
    ])


async def _promotion_ref(db: Any, q: Queue,
                         queues_file: Path | None) -> queries.PromotionRef | None:
    """The queue's promotion ref as the repository has it (None when the queue is not
    configured here, or promotes nothing)."""
    try:
        queues = load_queues(queues_file)
        queues.get(q.name)
    except (QueueConfigError, UnknownQueue):
        return None
    extensions = Extensions(queues, db)
    try:
        return await queries.promotion_ref(Deps(db=db, queues=queues, extensions=extensions),
                                           q.name, queries.pin_of(q), q)
    finally:
        await extensions.aclose()


def _promotion_lines(ref: queries.PromotionRef | None) -> list[str]:
    """Where the promotion ref really is, beside where the queue says it belongs."""
    if ref is None:
        return []
    where = ref.target or "-" if ref.target_known else "unknown (the repository did not answer)"
    lines = [f"  promotion   {ref.name} at {where}"]
    if ref.differs:
        lines.append(f"              not where it belongs ({ref.wanted}, the "
                     f"{'pin' if ref.pinned else 'bookmark'}): the sweeper moves it")
    if ref.problem is not None:
        lines.append(f"              since {ref.problem.since.isoformat()}: "
                     f"{ref.problem.reason}")
    return lines


def _red_since_lines(culprit: CulpritView | None, search: SearchView | None) -> list[str]:
    lines = []
    if culprit is not None:
        who = f" by {culprit.author}" if culprit.author else ""
        label = "red since" if culprit.confirmed else "a break  "
        lines.append(f"  {label}   {culprit.sha or culprit.uri}{who}")
        if not culprit.confirmed:
            lines.append(f"              not confirmed as the head's: "
                         f"{culprit.unconfirmed_reason}")
        if culprit.subject:
            lines.append(f"              {culprit.subject}")
        if culprit.committed_at:
            lines.append(f"              committed {culprit.committed_at.isoformat()}")
        if culprit.build is not None:
            lines.append(f"              build {culprit.build.id}"
                         + (f"  {culprit.build.url}" if culprit.build.url else ""))
    if search is not None:
        lines.append(f"  culprit     {search.words}")
    return lines


@click.command("fact")
@click.argument("queue")
@click.argument("commit")
@click.option("--queues-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The queue configuration (default: STOVEPIPE_QUEUES_FILE, "
                                 "else queues.yaml).")
@click.option("--project", "project", default=None, metavar="P",
              help="Ask about project P of the queue: its own answer, built at the commit "
                   "or inherited from its nearest validated ancestor (unaffected).")
@json_option
def fact_command(queue: str, commit: str, queues_file: Path | None, project: str | None,
                 as_json: bool) -> None:
    """Is COMMIT green on QUEUE (or, with --project, for project P)? COMMIT is a full sha,
    a unique prefix of one, or the commit's URI. When it is not green, says its newest
    green ancestor and its oldest green descendant.

    Exit status: 0 green (for a project: built green, or unaffected and inheriting green);
    3 not green — red, not validated, or a commit the queue cannot name (the repository
    does not have it, or the prefix names several); 1 malformed COMMIT, unknown QUEUE or
    project, or Stovepipe unreachable. A deploy gate can use it directly."""

    async def run() -> tuple[GreenAnswer | ProjectGreenAnswer, Request | None] | dict[
            str, Any]:
        queues = load_queues(queues_file)
        db = await open_db()
        try:
            deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
            uri = commit if gate.names_a_uri(commit) else None
            try:
                if project is not None:
                    check_projects(queues.get(queue), [project])
                uri = await gate.resolve_commit(deps, queue, commit)
                answer: GreenAnswer | ProjectGreenAnswer = (
                    await gate.green_answer(deps, queue, uri) if project is None else
                    await project_green_answer(deps, queue, project, uri))
            except (CommitNotFound, AmbiguousCommit) as exc:
                return {"uri": uri, "green": False, "fact": None, "known": False,
                        "reason": str(exc), **_project_fields(project, None)}
            except (UnknownQueue, UnknownProject, ValueError) as exc:
                raise click.ClickException(str(exc)) from None
            return answer, await db.requests.newest_for_commit(queue, answer.uri)
        finally:
            await db.close()

    found = run_async(run)
    if isinstance(found, dict):
        emit(as_json, found, [f"{commit}: not green — {found['reason']}"])
        raise SystemExit(NOT_GREEN)
    answer, newest = found
    fact = answer.fact
    lines = [f"{answer.uri}: {_verdict_text(fact)}"]
    if not answer.green:
        lines += _newest_lines(newest, fact)
        lines += [f"  newest green ancestor   {_green_line(answer.prior_green)}",
                  f"  oldest green descendant {_green_line(answer.next_green)}"]
        if not answer.complete:
            lines.append(f"  (searched the {answer.searched} nearest green commits only)")
    emit(as_json, {"uri": answer.uri, "fact": fact, "green": answer.green, "known": True,
                   "prior_green": answer.prior_green, "next_green": answer.next_green,
                   "complete": answer.complete,
                   **_project_fields(project, fact if isinstance(fact, ProjectFact) else None)},
         lines)
    if not answer.green:
        raise SystemExit(NOT_GREEN)


def _project_fields(project: str | None, fact: ProjectFact | None) -> dict[str, Any]:
    """What a project's answer adds to `fact --json`."""
    if project is None:
        return {}
    return {"project": project, "unaffected": fact is not None and fact.unaffected,
            "inherited_from": fact.inherited_from if fact is not None else None}


def _verdict_text(fact: ValidationFact | ProjectFact | None) -> str:
    if fact is None:
        return "no fact (not green)"
    colour = "green" if fact.is_green else "red"
    if isinstance(fact, ProjectFact):
        if fact.unaffected:
            return (f"project {fact.project} unaffected, inherits {colour} from "
                    f"{fact.inherited_from} ({fact.source_request_id}), at {fact.request_id}")
        return (f"project {fact.project}: degree {fact.degree:g} ({colour}), built by "
                f"{fact.source_request_id} at {fact.created_at.isoformat()}")
    return (f"degree {fact.degree:g} ({colour}), by {fact.request_id} at "
            f"{fact.created_at.isoformat()}")


def _newest_lines(newest: Request | None,
                  fact: ValidationFact | ProjectFact | None) -> list[str]:
    """What the commit's newest Request adds to its answer (the newest fact) when that
    Request has no fact of its own: it could not validate, or it is still under way."""
    if newest is None or (fact is not None and fact.request_id == newest.id):
        return []
    if newest.unvalidated:
        return [f"  newest request {newest.id}: {why_unvalidated(newest.reason)}"]
    if not newest.state.is_terminal:
        _, _, validation = newest.order
        again = " again" if fact is not None or validation > 1 else ""
        return [f"  being validated{again} now by {newest.id} ({newest.state})"]
    return [f"  newest request {newest.id}: {state_text(newest)}"]


def _green_line(fact: ValidationFact | ProjectFact | None) -> str:
    return f"{fact.uri}  ({fact.request_id})" if fact is not None else "none"
