"""`stovepipe pin QUEUE COMMIT --reason TEXT [--project P]` and `stovepipe unpin QUEUE
[--project P]`: hold the promotion ref (a project's, with --project) at a green commit
during an incident, and let it follow the bookmark again (`streams.stages.pins`,
`streams.stages.project_pins`)."""

from __future__ import annotations

import getpass
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import click

from streams.cli.common import emit, json_option, open_db, queues_option, run_async
from streams.config.queues import Extensions, UnknownQueue, load_queues
from streams.stages.deps import Deps
from streams.stages.pins import (
    Pinned,
    PinNotApplied,
    PinRefused,
    Unpinned,
    pin_promotion,
    unpin_promotion,
)
from streams.stages.project_pins import (
    ProjectPinned,
    ProjectUnpinned,
    pin_project,
    unpin_project,
)
from streams.web.project_answers import UnknownProject, check_projects

T = TypeVar("T")
REFUSED = 4


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name: the host still says something
        user = "someone"
    return f"{user}@{socket.gethostname()}"


by_option = click.option("--by", default=None,
                         help="Who pins or unpins (default: user@host of this shell).")
project_option = click.option("--project", default=None, metavar="P",
                              help="The project of a monorepo queue whose own promotion "
                                   "ref (projects.P.promotion_ref) this is about.")


def _check_project(queues_file: Path | None, queue: str, project: str) -> None:
    try:
        check_projects(load_queues(queues_file).get(queue), [project])
    except (UnknownQueue, UnknownProject, ValueError) as exc:
        raise click.ClickException(str(exc)) from None


async def _with_deps(queues_file: Path | None, action: Callable[[Deps], Awaitable[T]]) -> T:
    queues = load_queues(queues_file)
    db = await open_db()
    deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
    try:
        return await action(deps)
    finally:
        await deps.extensions.aclose()
        await db.close()


def _refused(exc: Exception) -> None:
    click.echo(f"Refused: {exc}", err=True)
    raise SystemExit(REFUSED)


@click.command("pin")
@click.argument("queue")
@click.argument("commit")
@click.option("--reason", required=True, help="Why the promotion ref is held (kept and "
                                              "shown with it).")
@by_option
@project_option
@queues_option
@json_option
def pin_command(queue: str, commit: str, reason: str, by: str | None, project: str | None,
                queues_file: Path | None, as_json: bool) -> None:
    """Hold QUEUE's promotion ref at COMMIT (a green commit of the queue: a full sha, a
    unique prefix or its URI) while the bookmark keeps moving: for an incident. Who,
    when and why are kept and shown wherever the ref is; `stovepipe unpin` lets it follow
    the bookmark again.

    The ref is moved first to the pin's commit; when it cannot be (the repository refuses
    or does not answer in time), the pin is rolled back and the reason kept (`stovepipe
    queue` shows it beside the ref).

    Exit status: 0 pinned; 4 refused (the commit is red, was never validated or is no
    longer on the branch, or the queue has no promotion ref); 1 the ref could not be
    moved (nothing changed), malformed input, an unknown queue or commit, or Stovepipe
    unreachable.

    With --project P, the project's own promotion ref is held at COMMIT, a commit green
    for P (built there, or unaffected and inheriting green); the same statuses hold."""
    if project is not None:
        _pin_project(queue, project, commit, reason, by, queues_file, as_json)
        return
    try:
        done: Pinned = run_async(lambda: _with_deps(queues_file, lambda deps: pin_promotion(
            deps, queue, commit, by=by or _who(), reason=reason)))
    except PinRefused as exc:
        _refused(exc)
        return
    except PinNotApplied as exc:  # nothing changed; why is kept and shown with the ref
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    q = done.queue
    emit(as_json, {"queue": q.name, "pinned_uri": q.pinned_uri,
                   "pinned_request_id": q.pinned_request_id, "pinned_by": q.pinned_by,
                   "pinned_reason": q.pinned_reason, "pinned_at": q.pinned_at,
                   "previous_target": done.previous_target,
                   "last_green_uri": q.last_green_uri},
         [f"{q.name}: promotion ref pinned at {q.pinned_uri}",
          f"  by {q.pinned_by} at {q.pinned_at.isoformat() if q.pinned_at else '?'}: "
          f"{q.pinned_reason}",
          f"  was at {done.previous_target or '-'}; the bookmark is at "
          f"{q.last_green_uri or '-'} and keeps moving"])


@click.command("unpin")
@click.argument("queue")
@by_option
@project_option
@queues_option
@json_option
def unpin_command(queue: str, by: str | None, project: str | None, queues_file: Path | None,
                  as_json: bool) -> None:
    """Let QUEUE's promotion ref follow the bookmark again, moving it to the bookmark now.

    Exit status: 0 unpinned (or nothing was pinned: said on stderr); 4 refused (the queue
    has no promotion ref, or no state yet); 1 malformed input or Stovepipe unreachable.

    With --project P, the project's own promotion ref follows the project's bookmark
    again."""
    if project is not None:
        _unpin_project(queue, project, by, queues_file, as_json)
        return
    try:
        done: Unpinned = run_async(lambda: _with_deps(queues_file, lambda deps: (
            unpin_promotion(deps, queue, by=by or _who()))))
    except PinRefused as exc:
        _refused(exc)
        return
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    emit(as_json, {"queue": done.queue.name, "was_pinned": done.was_pinned,
                   "target": done.target, "last_green_uri": done.queue.last_green_uri},
         [f"{done.queue.name}: promotion ref follows the bookmark again, now at "
          f"{done.target or '-'}"])
    if done.was_pinned is None:
        click.echo(f"{queue} was not pinned", err=True)


def _pin_project(queue: str, project: str, commit: str, reason: str, by: str | None,
                 queues_file: Path | None, as_json: bool) -> None:
    _check_project(queues_file, queue, project)
    try:
        done: ProjectPinned = run_async(lambda: _with_deps(
            queues_file, lambda deps: pin_project(deps, queue, project, commit,
                                                  by=by or _who(), reason=reason)))
    except PinRefused as exc:
        _refused(exc)
        return
    except (PinNotApplied, ValueError) as exc:  # nothing changed; why is kept with the ref
        raise click.ClickException(str(exc)) from None
    inherits = f" (unaffected there, inherits green from {done.inherited_from})" \
        if done.inherited_from else ""
    emit(as_json, {"queue": done.queue, "project": done.project,
                   "pinned_uri": done.pinned_uri,
                   "pinned_request_id": done.pinned_request_id,
                   "inherited_from": done.inherited_from,
                   "previous_target": done.previous_target,
                   "last_green_uri": done.last_green_uri},
         [f"{done.queue} project {done.project}: promotion ref pinned at "
          f"{done.pinned_uri}{inherits}",
          f"  was at {done.previous_target or '-'}; the project's bookmark is at "
          f"{done.last_green_uri or '-'} and keeps moving"])


def _unpin_project(queue: str, project: str, by: str | None, queues_file: Path | None,
                   as_json: bool) -> None:
    _check_project(queues_file, queue, project)
    try:
        done: ProjectUnpinned = run_async(lambda: _with_deps(
            queues_file, lambda deps: unpin_project(deps, queue, project, by=by or _who())))
    except PinRefused as exc:
        _refused(exc)
        return
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    emit(as_json, {"queue": done.queue, "project": done.project,
                   "was_pinned": done.was_pinned, "target": done.target,
                   "last_green_uri": done.last_green_uri},
         [f"{done.queue} project {done.project}: promotion ref follows the project's "
          f"bookmark again, now at {done.target or '-'}"])
    if done.was_pinned is None:
        click.echo(f"project {project} of {queue} was not pinned", err=True)
