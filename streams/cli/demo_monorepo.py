"""The monorepo act of `stovepipe demo`: one repository, three projects, each green or red
on its own (design §11).

The repository holds `api` (services/api/), `web` (web/) and `docs` (docs/); api and web
also use the shared libs/common/, and docs is being brought up (``blocking: false``: its
red never makes the whole repository red). The queue `demo/mono` builds each affected
project on its own with the command runner: `sh ./build.sh` runs the tests of the project
named in STOVEPIPE_PROJECT. Five pushes land, one at a time: the import builds every
project; a web change builds web alone (api and docs inherit their answer); a push of
three commits breaks api — api is red, web and docs green, the repository red — and api's
own culprit search (scope `demo/mono#api`) names the commit; a web change builds web
while api stays red by inheritance; the fix turns api and the repository green again.

The act prints each push as it is decided, then every commit's answer per project (the
reads of `stovepipe fact --project`) and each project's last green commit (those of
`stovepipe last-green --project`), the whole repository's bookmark and `verified-main`.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from store import NotFound, ValidationFact
from streams.cli.common import open_db
from streams.cli.demo_kit import (
    DEMO_KNOBS,
    DemoRun,
    culprit_words,
    git,
    newest_search,
    search_ended,
)
from streams.config.projects import scope_name
from streams.config.queues import Extensions, load_queues
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.stages.deps import Deps
from streams.web.project_answers import LastGreenAnswer, ProjectFact, last_green, project_fact

QUEUE = "demo/mono"
PROJECTS: dict[str, dict[str, Any]] = {
    "api": {"paths": ["services/api/**", "libs/common/**"]},
    "web": {"paths": ["web/**", "libs/common/**"]},
    "docs": {"paths": ["docs/**"], "blocking": False},
}
CELL = 21  # width of a project's column: "green from <sha>" and two spaces

BUILD_SH = """#!/bin/sh
# The monorepo's build: Stovepipe builds one project at a time and names it in
# STOVEPIPE_PROJECT; each project's tests live in its own directory.
set -e
case "$STOVEPIPE_PROJECT" in
  api) dir=services/api ;;
  web) dir=web ;;
  docs) dir=docs ;;
  *) echo "no such project: '$STOVEPIPE_PROJECT'"; exit 2 ;;
esac
echo "building $STOVEPIPE_PROJECT at $STOVEPIPE_HEAD_SHA"
sh "$dir/test.sh"
"""

API_TEST = """#!/bin/sh
# api's tests: /answer answers 42, with the shared parser
test -s libs/common/parser.txt || { echo "api: the shared parser is missing"; exit 1; }
grep -q '^answer = 42$' services/api/answer.txt || { echo "api: /answer is not 42"; exit 1; }
echo "api: tests passed"
"""

WEB_TEST = """#!/bin/sh
# web's tests: the landing page has a title, and the shared parser is there
test -s libs/common/parser.txt || { echo "web: the shared parser is missing"; exit 1; }
grep -q '<h1>' web/index.html || { echo "web: the landing page has no title"; exit 1; }
echo "web: tests passed"
"""

DOCS_TEST = """#!/bin/sh
# docs' tests: the guide is not empty
test -s docs/guide.md || { echo "docs: the guide is empty"; exit 1; }
echo "docs: tests passed"
"""


@dataclass(frozen=True)
class Change:
    """One commit of the monorepo: its subject and the files it writes."""

    subject: str
    files: Mapping[str, str]


PUSHES: tuple[tuple[Change, ...], ...] = (
    (Change("import api, web and docs", {
        "build.sh": BUILD_SH, "services/api/test.sh": API_TEST, "web/test.sh": WEB_TEST,
        "docs/test.sh": DOCS_TEST, "services/api/answer.txt": "answer = 42\n",
        "web/index.html": "<h1>Demo</h1>\n", "docs/guide.md": "# Guide\n",
        "libs/common/parser.txt": "parser v1\n"}),),
    (Change("web: a new landing page", {"web/index.html": "<h1>Welcome</h1>\n"}),),
    (Change("docs: describe /answer", {"docs/guide.md": "# Guide\n\n/answer says 42.\n"}),
     Change("api: /answer says 43", {"services/api/answer.txt": "answer = 43\n"}),
     Change("libs/common: a faster parser", {"libs/common/parser.txt": "parser v2\n"})),
    (Change("web: dark mode", {"web/style.css": "body { background: black; }\n"}),),
    (Change("api: /answer says 42 again", {"services/api/answer.txt": "answer = 42\n"}),),
)
STORY = "Five pushes, one at a time: the third breaks api, the fifth fixes it"


def queue_config(repo: Path, work_dir: Path) -> dict[str, Any]:
    """The act's queue in the demo's queues.yaml."""
    return {
        "source_control": {"kind": "git", "repository": str(repo), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": "sh ./build.sh",
                         "work_dir": str(work_dir)},
        **DEMO_KNOBS,
        "projects": PROJECTS,
    }


class Monorepo:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits: dict[str, tuple[str, str]] = {}  # uri -> (sha, subject), in order

    def create(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        git(self.path, "init", "-q", "-b", "main")

    def land(self, change: Change) -> str:
        for name, content in change.files.items():
            target = self.path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", change.subject)
        sha = git(self.path, "rev-parse", "HEAD")
        self.commits[git_uri(str(self.path), "main", sha)] = (sha, change.subject)
        return sha


def introduce(repo: Monorepo, queues_file: Path) -> None:
    click.echo(f"   {repo.path} (branch main), queue {QUEUE}; config {queues_file}")
    click.echo(f"   {'project':<9}{'paths':<34}blocking")
    for name, spec in PROJECTS.items():
        blocking = ("yes" if spec.get("blocking", True) else
                    "no: being brought up, its red never makes the repository red")
        click.echo(f"   {name:<9}{', '.join(spec['paths']):<34}{blocking}")
    click.echo("   A push builds only the projects whose paths it changes (`sh ./build.sh` "
               "runs the tests of the\n   project named in STOVEPIPE_PROJECT); the others "
               "keep their answer from the commit\n   where they were last built.")


def play(run: DemoRun, repo: Monorepo, heading: Callable[[str], None],
         dashboard: str) -> None:
    """Land the pushes one at a time, each decided before the next; then the tables."""
    heading(STORY)
    click.echo(f"   {'push':<6}{'head':<10}{'commits':<9}{'built':<17}the repository")
    request_id = ""
    for number, push in enumerate(PUSHES, 1):
        head = [repo.land(change) for change in push][-1]
        request_id = run.ingest(QUEUE)
        run.wait_until(functools.partial(_decided, run, request_id),
                       f"{request_id} was not decided")
        [(affected, verdict)] = run.query(
            "SELECT p.affected, r.verdict FROM request r JOIN request_plan p"
            " ON p.queue = r.queue AND p.request_id = r.id"
            " WHERE r.queue = %s AND r.id = %s", QUEUE, request_id)
        answers = {project: (degree, inherited) for project, degree, inherited in run.query(
            "SELECT project, degree, inherited FROM project_answer"
            " WHERE queue = %s AND request_id = %s", QUEUE, request_id)}
        built = [p for p in PROJECTS if p in affected]
        click.echo(f"   {number:<6}{head[:8]:<10}{len(push):<9}{', '.join(built):<17}"
                   + _coloured(_verdict_words(verdict, answers)))
        for project in built:
            if answers.get(project, (0.0, False))[0] == 0:
                continue
            scope = scope_name(QUEUE, project)
            run.wait_until(functools.partial(search_ended, run, scope),
                           f"{project}'s culprit search did not end")
            search = newest_search(run, scope)
            assert search is not None
            click.echo(f"   {'':<6}{project}'s own culprit search ({scope}) builds {project} "
                       f"alone at the commits nobody built:\n   {'':<6}"
                       + culprit_words(search, repo.commits))
    run.wait_until(lambda: _promoted(run, repo, request_id),
                   "the bookmark and verified-main did not reach the last push")
    _print_summary(run, repo, dashboard)


def _verdict_words(verdict: str | None, answers: Mapping[str, tuple[float, bool]]) -> str:
    """The repository's verdict, and which blocking projects made it red."""
    if verdict != "red":
        return verdict or "not validated"
    red = [(p, inherited) for p, (degree, inherited) in answers.items()
           if degree != 0 and PROJECTS[p].get("blocking", True)]
    return "red: " + ", ".join(f"{p} is still red (unaffected)" if inherited else f"{p} is red"
                               for p, inherited in red)


def _decided(run: DemoRun, request_id: str) -> bool:
    """The Request has ended and, with a verdict, its whole-repository fact is written."""
    rows = run.query("SELECT r.state, r.verdict, EXISTS (SELECT 1 FROM validation_fact f"
                     " WHERE f.queue = r.queue AND f.request_id = r.id AND f.project = '')"
                     " FROM request r WHERE r.queue = %s AND r.id = %s", QUEUE, request_id)
    if not rows or rows[0][0] not in ("succeeded", "failed", "cancelled", "superseded"):
        return False
    return rows[0][1] is None or bool(rows[0][2])


def _promoted(run: DemoRun, repo: Monorepo, request_id: str) -> bool:
    rows = run.query("SELECT last_green_request_id, last_green_uri FROM queue"
                     " WHERE name = %s", QUEUE)
    if not rows or rows[0][0] != request_id:
        return False
    return git(repo.path, "rev-parse", "-q", "--verify", "verified-main") == \
        repo.commits[rows[0][1]][0]


@dataclass(frozen=True)
class _Outcome:
    cells: dict[tuple[str, str], ProjectFact | None]  # (uri, project) -> its answer
    whole: dict[str, ValidationFact | None]  # uri -> the whole repository's fact
    last_green: dict[str, LastGreenAnswer]  # project -> its last green commit
    bookmark: LastGreenAnswer


async def _read(run: DemoRun, repo: Monorepo) -> _Outcome:
    """What a deploy gate would ask: each commit's answer per project, each project's last
    green commit, the queue's bookmark."""
    queues = load_queues(run.queues_file)
    db = await open_db(dsn=run.dsn)
    try:
        deps = Deps(db=db, queues=queues, extensions=Extensions(queues, db))
        cells = {(uri, p): await project_fact(deps, QUEUE, p, uri)
                 for uri in repo.commits for p in PROJECTS}
        whole: dict[str, ValidationFact | None] = {}
        for uri in repo.commits:
            try:
                whole[uri] = await db.facts.get(QUEUE, uri)
            except NotFound:
                whole[uri] = None
        greens = {p: await last_green(deps, QUEUE, [p]) for p in PROJECTS}
        return _Outcome(cells, whole, greens, await last_green(deps, QUEUE, []))
    finally:
        await db.close()


def _coloured(text: str, width: int = 0) -> str:
    colour = {"green": "green", "red": "red"}.get(text.split()[0])
    return click.style(f"{text:<{width}}", fg=colour)


def _cell(fact: ProjectFact | None) -> str:
    if fact is None:
        return "-"
    colour = "green" if fact.is_green else "red"
    if fact.unaffected:
        return f"{colour} from {(fact.inherited_from or '?')[:8]}"
    return colour


def _print_summary(run: DemoRun, repo: Monorepo, dashboard: str) -> None:
    outcome = asyncio.run(_read(run, repo))
    click.secho(f"\nGreenness of {QUEUE}, per project", bold=True)
    click.echo(f"  {'commit':<10}{'subject':<30}"
               + "".join(f"{p:<{CELL}}" for p in PROJECTS) + "the repository")
    for uri, (sha, subject) in repo.commits.items():
        whole = outcome.whole[uri]
        click.echo(f"  {sha[:8]:<10}{subject:<30}"
                   + "".join(_coloured(_cell(outcome.cells[uri, p]), CELL) for p in PROJECTS)
                   + _coloured("-" if whole is None else "green" if whole.degree == 0
                               else "red"))
    click.echo("  green, red: built at that commit. green from C, red from C: the commit did "
               "not touch the\n  project, which keeps its answer at C. -: not validated "
               "(a push is validated at its head).")
    for line in _story(outcome, repo):
        click.echo(f"  {line}")

    click.secho("\nLast green commit of each project", bold=True)
    click.echo(f"  {'project':<16}{'commit':<10}")
    for project, answer in outcome.last_green.items():
        fact = answer.facts.get(project)
        how = ("never green yet" if fact is None else
               f"unaffected there: inherits green from {(fact.inherited_from or '?')[:8]}"
               if fact.unaffected else "built green there")
        click.echo(f"  {project:<16}{(answer.sha or '-')[:8]:<10}{how}")
    bookmark = outcome.bookmark
    click.echo(f"  {'the repository':<16}{(bookmark.sha or '-')[:8]:<10}its bookmark: every "
               f"blocking project green; verified-main is there")
    click.echo(f"  a URL answering a project's last green sha: "
               f"{dashboard}api/queues/{QUEUE}/projects/api?format=text")


def _story(outcome: _Outcome, repo: Monorepo) -> list[str]:
    """Which projects broke and were fixed where (by their built answers), and which
    stayed green."""
    lines, steady = [], []
    for project in PROJECTS:
        built = [(uri, fact.is_green) for uri in repo.commits
                 if (fact := outcome.cells[uri, project]) is not None and not fact.unaffected]
        changes = [(uri, green) for n, (uri, green) in enumerate(built)
                   if green != (built[n - 1][1] if n else True)]
        if not changes:
            steady.append(project)
            continue
        lines.append(f"{project} " + ", then ".join(
            f"{'was fixed' if green else 'broke'} at {repo.commits[uri][0][:8]} "
            f"{repo.commits[uri][1]!r}" for uri, green in changes) + ".")
    if steady:
        lines.append(f"{' and '.join(steady)} stayed green.")
    return lines
