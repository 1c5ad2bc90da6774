"""What the acts of `stovepipe demo` share: git in the demo's repositories, and the run —
its settings, topics, queues file, schema and worker — to ingest a queue as `stovepipe
ingest` does and to wait on the worker. Every wait has a deadline and stops at once when
the worker exits, naming its log."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psycopg

from streams.cli.ingest import IngestClient
from streams.config import settings as settings_mod
from streams.config.queues import load_queues

POLL_EVERY = 0.3  # seconds between two looks at the demo's database


def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="Demo", GIT_AUTHOR_EMAIL="demo@stovepipe.invalid",
               GIT_COMMITTER_NAME="Demo", GIT_COMMITTER_EMAIL="demo@stovepipe.invalid")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, text=True,
                          capture_output=True).stdout.strip()


@dataclass(frozen=True)
class DemoRun:
    """One run of the demo: its worker, and where that worker keeps its state."""

    settings: settings_mod.Settings  # pointed at the demo's schema and broker
    topics: Any  # streams.config.topics.TopicsConfig with the run's prefix
    queues_file: Path
    dsn: str  # the demo's schema
    worker: subprocess.Popen[bytes]
    log: Path

    def ingest(self, queue: str) -> str:
        """What `stovepipe ingest QUEUE` does, against the demo's schema and topics: the
        new Request's id."""

        async def run() -> str:
            async with IngestClient(self.settings, load_queues(self.queues_file),
                                    self.topics) as client:
                return (await client.ingest(queue)).request_id

        return asyncio.run(run())

    def query(self, statement: str, *params: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return conn.execute(statement, params).fetchall()

    def wait_until(self, done: Callable[[], bool], failure: str, timeout: float = 120) -> None:
        """Until ``done()``; a ClickException saying ``failure`` (e.g. "X did not finish")
        after ``timeout`` seconds, or at once when the worker has exited."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.worker.poll() is not None:
                raise click.ClickException(f"the worker exited; see {self.log}")
            if done():
                return
            time.sleep(POLL_EVERY)
        raise click.ClickException(f"{failure} in {timeout:.0f}s; see {self.log}")


# the knobs both demo queues share: quick polls, one build at a time per queue (and per
# project), and culprit searches of a few builds
DEMO_KNOBS: dict[str, Any] = {
    "max_concurrent": 1,
    "gate_delay": "300ms",
    "poll_delay_queued": "300ms",
    "poll_delay_running": "300ms",
    "poll_deadline": "2m",
    "backfill": {"mode": "bisect", "max_builds": 4},
}

_NEWEST_SEARCH = (
    "SELECT state, culprit_uri, builds, cardinality(commits) - 2, detail, confirmed"
    " FROM culprit_search WHERE queue = %s ORDER BY created_at DESC LIMIT 1")


def newest_search(run: DemoRun, queue: str) -> tuple[Any, ...] | None:
    """The queue's newest culprit search: (state, culprit uri, builds, commits nobody
    built, detail, confirmed); None before one."""
    rows = run.query(_NEWEST_SEARCH, queue)
    return rows[0] if rows else None


def search_ended(run: DemoRun, queue: str) -> bool:
    search = newest_search(run, queue)
    return search is not None and search[0] != "bisecting"


def culprit_words(search: tuple[Any, ...], commits: Mapping[str, tuple[str, str]]) -> str:
    """"red since: C" with how the search found it (``commits``: uri -> (sha, subject))."""
    state, culprit, builds, unbuilt, detail, confirmed = search
    if culprit is None:
        return f"culprit search: {state} ({detail})"
    sha, subject = commits.get(culprit, ("?", "?"))
    what = ("the culprit, confirmed (every commit after it is red)" if confirmed
            else "a break, not confirmed as the head's")
    return ("red since: " + click.style(f"{sha[:8]} {subject!r}", fg="red", bold=True)
            + f" by Demo — {what}, found among {unbuilt} commits nobody built with "
              f"{builds} backfill builds")
