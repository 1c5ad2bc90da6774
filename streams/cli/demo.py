"""`stovepipe demo`: the whole pipeline on real git repositories, in one command.

It brings up the local stack, migrates a schema of its own, creates a fresh set of topics,
builds a demo repository whose history has a broken commit and a force-push, points a
queue with the `command` build runner at it, starts a worker, lands the commits one by
one (ingesting each), then one push of several commits that breaks the build, shows
progress until every Request is terminal and the culprit search has named the commit
that broke it, and prints the greenness table, the promotion ref, the culprit and the
dashboard URL. Then the monorepo act (`streams.cli.demo_monorepo`): three projects of one
repository, one of which breaks and is fixed while the others stay green. Every run
starts afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psycopg
import yaml
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from store import request_order
from store.migrations import migrate
from streams.cli import demo_monorepo
from streams.cli.demo_kit import DEMO_KNOBS, DemoRun, culprit_words, git, newest_search
from streams.cli.kafka import kafka_security_or_fail
from streams.config import settings as settings_mod
from streams.config.topics import load_topics
from streams.devstack import ensure_up
from streams.extensions.sourcecontrol.gituri import git_uri
from streams.runtime.topic_admin import admin_conf_for, ensure_topics

QUEUE = "demo/main"
TERMINAL = {"superseded", "succeeded", "failed", "cancelled"}

BUILD_SH = """#!/bin/sh
# The demo's build: "compile", then run the tests. Stovepipe passes the commits in the
# environment; an incremental build could test only what changed since the base.
set -e
echo "building ${STOVEPIPE_HEAD_SHA} (base: ${STOVEPIPE_BASE_SHA:-none, a full build})"
sleep 1
sh ./test.sh
"""

TEST_SH = """#!/bin/sh
# The demo's test suite: the answer must be 42.
grep -q '^answer = 42$' app.txt || { echo "test failed: the answer is not 42"; exit 1; }
echo "tests passed"
"""


@dataclass(frozen=True)
class Step:
    """One thing that happens to the demo repository."""

    subject: str
    answer: int | None = None  # a commit setting app.txt's answer
    rewrite_to: int | None = None  # force-push: reset main to the n-th commit first


STEPS = (
    Step("initial import: app and tests", answer=42),
    Step("add a feature", answer=42),
    Step("refactor, and break the build", answer=41),
    Step("fix the build", answer=42),
    Step("rewrite history: squash the fix (force-push)", answer=42, rewrite_to=2),
    Step("add another feature", answer=42),
)
# then one push of several commits, one of which breaks the build: the head is red, and
# Stovepipe validates the commits nobody built to name the culprit and confirm it
PUSH = (
    Step("tidy the docs", answer=42),
    Step("speed up the parser", answer=43),
    Step("add logging", answer=43),
    Step("bump the version", answer=43),
)


class DemoRepository:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits: list[tuple[str, str]] = []  # (sha, subject) in the order they landed

    def create(self) -> None:
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        git(self.path, "init", "-q", "-b", "main")
        (self.path / "build.sh").write_text(BUILD_SH)
        (self.path / "test.sh").write_text(TEST_SH)

    def land(self, step: Step) -> str:
        if step.rewrite_to is not None:
            git(self.path, "reset", "-q", "--hard", self.commits[step.rewrite_to - 1][0])
        (self.path / "app.txt").write_text(f"answer = {step.answer}\n")
        with open(self.path / "CHANGES", "a") as changes:
            changes.write(f"- {step.subject}\n")
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", step.subject)
        sha = git(self.path, "rev-parse", "HEAD")
        self.commits.append((sha, step.subject))
        return sha

    def rev(self, ref: str) -> str | None:
        try:
            return git(self.path, "rev-parse", "--verify", "-q", ref)
        except subprocess.CalledProcessError:
            return None


def _demo_queues_file(home: Path, repo: Path, monorepo: Path) -> Path:
    path = home / "queues.yaml"
    path.write_text(yaml.safe_dump({
        "queues": {
            QUEUE: {
                "source_control": {"kind": "git", "repository": str(repo), "ref": "main",
                                   "promotion_ref": "verified-main"},
                "build_runner": {"kind": "command", "command": "sh ./build.sh",
                                 "work_dir": str(home / "builds")},
                **DEMO_KNOBS,
            },
            demo_monorepo.QUEUE: demo_monorepo.queue_config(monorepo, home / "mono-builds"),
        },
    }, sort_keys=False))
    return path


def demo_names(home: Path) -> tuple[str, str]:
    """The schema and the topic-name stem of the demo kept in ``home``: demos with other
    homes (tests, people sharing one stack) never drop this one's schema or delete its
    topics, and a demo run again in the same home replaces its own."""
    key = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:8]
    return f"stovepipe_demo_{key}", f"demo.{key}."


def _fresh_schema(dsn: str, schema: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    schema_dsn = make_conninfo(dsn, options=f"-c search_path={schema}")

    migrate(schema_dsn)
    return schema_dsn


def _fresh_topics(bootstrap: str, topics_file: Path, stem: str) -> Any:
    """A topic prefix of this run's own; the topics of older runs in the same home are
    deleted."""
    admin = AdminClient(admin_conf_for(bootstrap))
    stale = [t for t in admin.list_topics(timeout=10).topics if t.startswith(stem)]
    if stale:
        for fut in admin.delete_topics(stale, operation_timeout=30).values():
            # best effort: a leftover topic of an older run harms nothing
            with contextlib.suppress(Exception):
                fut.result(timeout=30)
    prefix = f"{stem}{time.strftime('%Y%m%d%H%M%S')}."
    config = load_topics(topics_file, prefix=prefix)
    report = ensure_topics(admin_conf_for(bootstrap), config)
    if not report.ok:
        raise click.ClickException("could not create the demo topics: " + "; ".join(
            f"{s.name}: {s.detail}" for s in report if not s.ok))
    return config


def _rows(dsn: str) -> dict[str, tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return {rid: (uri, state) for rid, uri, state in
                conn.execute("SELECT id, uri, state FROM request").fetchall()}


class Progress:
    """Prints a line whenever a Request of the first act changes state."""

    def __init__(self, run: DemoRun, commits: dict[str, tuple[str, str]]) -> None:
        self.run = run
        self.commits = commits  # uri -> (sha, subject); URIs stay opaque here
        self.seen: dict[str, str] = {}

    def poll(self) -> dict[str, tuple[str, str]]:
        rows = _rows(self.run.dsn)
        for rid in sorted(rows, key=request_order):
            uri, state = rows[rid]
            if self.seen.get(rid) != state:
                self.seen[rid] = state
                sha, subject = self.commits.get(uri, ("?", ""))
                colour = {"succeeded": "green", "failed": "red",
                          "superseded": "yellow"}.get(state)
                click.echo(f"  {rid:<22} {sha[:8]}  {subject:<46} "
                           + click.style(state, fg=colour))
        return rows

    def wait_terminal(self, request_id: str) -> None:
        self.run.wait_until(lambda: self.poll().get(request_id, ("", ""))[1] in TERMINAL,
                            f"{request_id} did not finish")

    def wait_culprit(self) -> None:
        def ended() -> bool:
            self.poll()
            search = newest_search(self.run, QUEUE)
            return search is not None and search[0] != "bisecting"

        self.run.wait_until(ended, "the culprit search did not end")
        self.poll()


ACTS = ("all", "repository", "monorepo")


@click.command("demo")
@click.option("--web-port", type=click.IntRange(1, 65535), default=6066, show_default=True,
              help="Port of the worker's dashboard and HTTP API.")
@click.option("--keep-running/--exit", default=None,
              help="Keep the worker (and its dashboard) running after the demo until "
                   "Ctrl-C. Default: keep running when attached to a terminal.")
@click.option("--act", type=click.Choice(ACTS), default="all", show_default=True,
              help="Which story to play: a repository validated as a whole (a break, a "
                   "force-push, a culprit), a monorepo of three projects validated each "
                   "on its own, or both.")
def demo_command(web_port: int, keep_running: bool | None, act: str) -> None:
    """Run Stovepipe end to end on demo git repositories."""
    started = time.monotonic()
    # stopped by SIGTERM as by Ctrl-C: the worker it started is stopped too
    signal.signal(signal.SIGTERM, _interrupted)
    # brand-new topics answer "not leader" for a moment; the client retries, quietly
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    settings = settings_mod.load_settings()
    kafka_security_or_fail()  # a bad TLS or SASL variable is named before anything starts
    home = settings.home / "demo"
    home.mkdir(parents=True, exist_ok=True)
    numbers = itertools.count(1)

    def heading(text: str) -> None:
        click.secho(f"{next(numbers)}. {text}", bold=True)

    heading("The local stack")
    stack = ensure_up(settings, quiet=True)
    click.echo(f"   Kafka {stack.kafka_bootstrap}, PostgreSQL {stack.postgres_dsn}")
    schema, stem = demo_names(home)
    dsn = _fresh_schema(stack.postgres_dsn, schema)
    topics = _fresh_topics(stack.kafka_bootstrap, settings.topics_file, stem)
    click.echo(f"   schema {schema} migrated; topics {topics.prefix}* created")

    repo = DemoRepository(home / "repo")
    repo.create()
    monorepo = demo_monorepo.Monorepo(home / "mono")
    monorepo.create()
    queues_file = _demo_queues_file(home, repo.path, monorepo.path)
    if act != "monorepo":
        heading("A demo repository with the command build runner")
        click.echo(f"   {repo.path} (branch main, promotion ref verified-main)")
        click.echo(f"   queue {QUEUE}: build = `sh ./build.sh` in a clean checkout; "
                   f"config {queues_file}")

    heading("A worker")
    log = home / "worker.log"
    env = dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=stack.kafka_bootstrap,
               STOVEPIPE_POSTGRES_DSN=dsn, STOVEPIPE_TOPIC_PREFIX=topics.prefix,
               STOVEPIPE_QUEUES_FILE=str(queues_file),
               STOVEPIPE_APP_ID=f"{topics.prefix}stovepipe")
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "streams.cli", "worker", "--web-port", str(web_port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{web_port}/"
    click.echo(f"   pid {worker.pid}, log {log}, dashboard {dashboard}")
    try:
        run = DemoRun(dataclasses.replace(settings, postgres_dsn=dsn,
                                          kafka_bootstrap=stack.kafka_bootstrap),
                      topics, queues_file, dsn, worker, log)
        if act != "monorepo":
            _repository_act(run, repo, dashboard, heading)
        if act != "repository":
            heading("A monorepo: three projects, each green or red on its own")
            demo_monorepo.introduce(monorepo, queues_file)
            demo_monorepo.play(run, monorepo, heading, dashboard)
        click.echo(f"\nDemo finished in {time.monotonic() - started:.0f} s.")
        if keep_running is None:
            keep_running = sys.stdin.isatty()
        if keep_running:
            click.echo(f"The worker keeps serving {dashboard} — press Ctrl-C to stop it.")
            with contextlib.suppress(KeyboardInterrupt):
                worker.wait()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)


def _repository_act(run: DemoRun, repo: DemoRepository, dashboard: str,
                    heading: Callable[[str], None]) -> None:
    """The first act: a repository validated as a whole."""
    heading("Commits land; each is ingested and validated")
    commits: dict[str, tuple[str, str]] = {}
    progress = Progress(run, commits)
    for step in STEPS:
        sha = repo.land(step)
        request_id = run.ingest(QUEUE)
        commits[_rows(run.dsn)[request_id][0]] = (sha, step.subject)
        progress.wait_terminal(request_id)
    heading(f"One push of {len(PUSH)} commits; one of them breaks the build")
    for step in PUSH:
        sha = repo.land(step)
        commits[git_uri(str(repo.path), "main", sha)] = (sha, step.subject)
    request_id = run.ingest(QUEUE)
    progress.wait_terminal(request_id)
    click.echo("   the head is red: validating commits nobody built to find the break "
               "it is red for (backfill Requests, ids …~<n>)")
    progress.wait_culprit()
    _print_summary(run, repo, commits, dashboard)


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _print_summary(run: DemoRun, repo: DemoRepository,
                   commits: dict[str, tuple[str, str]], dashboard: str) -> None:
    dsn = run.dsn
    with psycopg.connect(dsn) as conn:
        facts: dict[str, float] = dict(conn.execute(
            "SELECT uri, degree FROM validation_fact WHERE queue = %s", (QUEUE,)).fetchall())
        requests = {uri: (rid, state, strategy or "-") for rid, uri, state, strategy in
                    conn.execute("SELECT id, uri, state, build_strategy FROM request "
                                 "WHERE queue = %s", (QUEUE,)).fetchall()}
        bookmark = conn.execute("SELECT last_green_uri, last_green_request_id FROM queue "
                                "WHERE name = %s", (QUEUE,)).fetchone()
    on_main = set(git(repo.path, "rev-list", "main").split())
    click.secho("\nGreenness of demo/main", bold=True)
    click.echo(f"  {'commit':<9} {'subject':<46} {'request':<22} {'build':<12} "
               f"{'state':<10} fact")
    for uri, (sha, subject) in commits.items():
        rid, state, strategy = requests.get(uri, ("-", "-", "-"))
        degree = facts.get(uri)
        fact = ("green" if degree == 0 else "red") if degree is not None else "none"
        note = "" if sha in on_main else "  (rewritten away)"
        click.echo(f"  {sha[:8]:<9} {subject:<46} {rid:<22} {strategy:<12} {state:<10} "
                   + click.style(fact, fg={"green": "green", "red": "red"}.get(fact))
                   + note)
    promoted = repo.rev("verified-main")
    last_green = commits.get(bookmark[0], ("-", ""))[0] if bookmark and bookmark[0] else None
    click.echo(f"\n  last-green bookmark: {last_green or '-'} "
               f"({bookmark[1] if bookmark else '-'})")
    click.echo(f"  promotion ref verified-main: {promoted or '-'}  "
               f"(git -C {repo.path} rev-parse verified-main)")
    search = newest_search(run, QUEUE)
    if search is not None:
        click.echo("  " + culprit_words(search, commits))
    click.echo(f"  why the bookmark is where it is: stovepipe explain {QUEUE}")
    click.echo(f"  dashboard: {dashboard}")
