"""A real git branch whose builds' outcomes the commits decide, for the culprit-finding
tests (issue 18): each commit carries an ``outcome`` file — ``green``, ``red``, or
``flaky`` (red on its first build, green after) — and may carry a ``hold`` file naming a
latch its build waits for. The queue builds with the command runner in a clean checkout,
on a real worker, so every backfill is a real Request, build and fact.

An outage of the build machines (`Branch.set_down`): while it lasts, every build that
gets past its latch is lost with its processes — it kills its own process group before
it can say anything, so the command runner finds it vanished: the attempt could not
validate (no verdict), as when a build host dies."""

from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

QUEUE = "mono/main"

BUILD_SCRIPT = """\
set -u
out="{out}"
echo "$STOVEPIPE_HEAD_SHA $STOVEPIPE_REQUEST_ID" >> "$out/started"
if [ -f hold ]; then
  while [ ! -e "$out/release-$(cat hold)" ]; do sleep 0.1; done
fi
if [ -e "$out/down" ]; then
  echo "$STOVEPIPE_HEAD_SHA $STOVEPIPE_REQUEST_ID" >> "$out/lost"
  kill -KILL 0
fi
case "$(cat outcome)" in
  green) exit 0 ;;
  flaky)
    if [ -e "$out/flaked-$STOVEPIPE_HEAD_SHA" ]; then exit 0; fi
    touch "$out/flaked-$STOVEPIPE_HEAD_SHA"; exit 1 ;;
  *) exit 1 ;;
esac
"""


def git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=Ada Lovelace",
                           "-c", "user.email=ada@example.invalid", "-C", str(work), *args],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


class Branch:
    """``main`` of a real repository at ``root/mono``; every commit says how its build
    ends."""

    def __init__(self, root: Path) -> None:
        self.work = root / "mono"
        self.out = root / "build-out"
        self.out.mkdir()
        self.script = root / "build.sh"
        self.script.write_text(BUILD_SCRIPT.format(out=self.out))
        self.work.mkdir()
        git(self.work, "init", "-q", "-b", "main")
        self.shas: dict[str, str] = {}

    def commit(self, name: str, outcome: str = "green", *, hold: str | None = None) -> str:
        (self.work / "outcome").write_text(f"{outcome}\n")
        with (self.work / "changes").open("a") as changes:
            changes.write(f"{name}\n")
        hold_file = self.work / "hold"
        if hold is not None:
            hold_file.write_text(f"{hold}\n")
        elif hold_file.exists():
            hold_file.unlink()
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "-m", f"{name}: make it {outcome}")
        sha = git(self.work, "rev-parse", "HEAD")
        self.shas[name] = sha
        return sha

    def uri(self, name: str) -> str:
        return f"git+{self.work}#main@{self.shas[name]}"

    def name_of(self, uri: str) -> str:
        sha = uri.rpartition("@")[2]
        return next(name for name, s in self.shas.items() if s == sha)

    def release(self, latch: str) -> None:
        (self.out / f"release-{latch}").touch()

    def set_down(self, down: bool) -> None:
        """Start or end an outage of the build machines (see the module docstring)."""
        if down:
            (self.out / "down").touch()
        else:
            (self.out / "down").unlink(missing_ok=True)

    def lost(self) -> list[tuple[str, str]]:
        """(commit name, request id) of every build lost in an outage, in order."""
        return self._builds("lost")

    def started(self) -> list[tuple[str, str]]:
        """(commit name, request id) of every build that started, in order."""
        return self._builds("started")

    def _builds(self, file: str) -> list[tuple[str, str]]:
        listed = self.out / file
        if not listed.exists():
            return []
        names = {sha: name for name, sha in self.shas.items()}
        return [(names.get(sha, sha), request_id) for sha, request_id in
                (line.split() for line in listed.read_text().splitlines())]


def add_culprit_queue(pipeline: Pipeline, branch: Branch, **knobs: Any) -> None:
    backfill = knobs.pop("backfill", {"mode": "bisect", "max_builds": 4})
    pipeline.add_raw_queue(QUEUE, {
        "source_control": {"kind": "git", "repository": str(branch.work), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": f"sh {branch.script}",
                         "max_parallel": 3},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
        "poll_deadline": "5m", "backfill": backfill, **knobs})


def request_of(pipeline: Pipeline, branch: Branch, name: str) -> tuple[str, str, str | None]:
    """(id, state, verdict) of the newest Request of commit ``name``."""
    rows = pipeline.query(
        "SELECT r.id, r.state, r.verdict FROM request_uri m JOIN request r"
        " ON r.queue = m.queue AND r.id = m.request_id WHERE m.queue = %s AND m.uri = %s",
        QUEUE, branch.uri(name))
    assert rows, f"no Request of {name}"
    return rows[0]  # type: ignore[return-value]


def facts_by_commit(pipeline: Pipeline, branch: Branch) -> dict[str, tuple[str, float]]:
    """commit name → (request id, degree) of its newest fact."""
    facts: dict[str, tuple[str, float]] = {}
    for uri, request_id, degree in pipeline.query(
            "SELECT uri, request_id, degree FROM validation_fact WHERE queue = %s"
            " ORDER BY request_rank(request_id)", QUEUE):
        facts[branch.name_of(uri)] = (request_id, degree)
    return facts


def search_row(pipeline: Pipeline) -> dict[str, Any]:
    rows = pipeline.query(
        "SELECT red_request_id, state, culprit_uri, builds, lo, hi, cardinality(commits),"
        " probes, detail, confirmed, unconfirmed_reason FROM culprit_search"
        " WHERE queue = %s ORDER BY request_rank(red_request_id) DESC", QUEUE)
    assert rows, "no culprit search"
    keys = ("red", "state", "culprit", "builds", "lo", "hi", "commits", "probes", "detail",
            "confirmed", "unconfirmed")
    return dict(zip(keys, rows[0], strict=True))


def wait_search(pipeline: Pipeline, state: str, timeout: float = 180) -> dict[str, Any]:
    def ended() -> bool:
        for proc in pipeline.workers:
            assert proc.poll() is None, pipeline.logs()
        rows = pipeline.query("SELECT state FROM culprit_search WHERE queue = %s", QUEUE)
        return bool(rows) and rows[0][0] != "bisecting"

    wait_until(ended, timeout=timeout, what=f"the culprit search to end {state}",
               interval=0.3)
    found = search_row(pipeline)
    assert found["state"] == state, (found, pipeline.logs())
    return found


def backfill_builds(pipeline: Pipeline) -> list[tuple[str, int, str]]:
    """(request id, attempt, status) of every build of a backfill Request."""
    return pipeline.query(  # type: ignore[return-value]
        "SELECT b.request_id, b.attempt, b.status FROM build b JOIN request r"
        " ON r.queue = b.queue AND r.id = b.request_id"
        " WHERE r.queue = %s AND r.kind = 'backfill' ORDER BY b.created_at", QUEUE)


def backfill_builds_that_ran(pipeline: Pipeline) -> int:
    """Builds of backfill Requests that gave a verdict (green or red)."""
    [(ran,)] = pipeline.query(
        "SELECT count(*) FROM build b JOIN request r ON r.queue = b.queue"
        " AND r.id = b.request_id WHERE r.queue = %s AND r.kind = 'backfill'"
        " AND b.verdict IS NOT NULL", QUEUE)
    return int(ran)


def promoted(branch: Branch) -> str | None:
    try:
        return git(branch.work, "rev-parse", "--verify", "-q", "refs/heads/verified-main")
    except subprocess.CalledProcessError:
        return None


def promotion_history(branch: Branch) -> list[str]:
    """Every commit the promotion ref pointed at, oldest first (its reflog)."""
    try:
        log = git(branch.work, "reflog", "show", "--format=%H", "refs/heads/verified-main")
    except subprocess.CalledProcessError:
        return []
    return list(reversed(log.split()))


def assert_promotion_only_moved_forward(branch: Branch) -> None:
    """Each commit the promotion ref moved to descends from the one before."""
    history = promotion_history(branch)
    assert history, "the promotion ref never moved"
    for older, newer in itertools.pairwise(history):
        moved = subprocess.run(["git", "-C", str(branch.work), "merge-base", "--is-ancestor",
                                older, newer], check=False).returncode == 0
        assert moved, f"the promotion ref moved back from {older} to {newer}: {history}"
