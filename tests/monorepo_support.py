"""A real git monorepo whose projects' builds their own files decide, for the tests of
greenness per project (issue 24): project P lives in ``P/`` (``services/api`` for api) and
its build reads ``<dir>/outcome`` — ``green``, ``red``, or ``hold:<latch>`` (running
until the test releases the latch, then green). Every build is the command runner's, in a
clean checkout, on a real worker; each writes what it built to a log the test reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tests.pipeline_support import Pipeline

QUEUE = "mono/main"
DIRS = {"api": "services/api", "web": "web", "docs": "docs"}

BUILD_SCRIPT = """\
set -u
out="{out}"
case "$STOVEPIPE_PROJECT" in
  api) dir=services/api ;;
  web) dir=web ;;
  docs) dir=docs ;;
  *) dir=. ;;
esac
echo "$STOVEPIPE_HEAD_SHA $STOVEPIPE_PROJECT $STOVEPIPE_REQUEST_ID $STOVEPIPE_QUEUE" \\
    >> "$out/started"
if [ -n "${{STOVEPIPE_CHANGED_PATHS:-}}" ]; then
  cp "$STOVEPIPE_CHANGED_PATHS" "$out/changed-$STOVEPIPE_PROJECT-$STOVEPIPE_HEAD_SHA"
fi
# a file outside every project's paths that breaks one (what wrong path rules miss)
if [ -e "config/break-$STOVEPIPE_PROJECT" ]; then exit 1; fi
outcome=$(cat "$dir/outcome" 2>/dev/null || echo green)
case "$outcome" in
  hold:*)
    while [ ! -e "$out/release-${{outcome#hold:}}" ]; do sleep 0.1; done
    exit 0 ;;
  green) exit 0 ;;
  *) exit 1 ;;
esac
"""


def git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=Ada Lovelace",
                           "-c", "user.email=ada@example.invalid", "-C", str(work), *args],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


class Monorepo:
    """``main`` of a real repository at ``root/mono`` with the projects of `DIRS` and a
    shared ``libs/common``."""

    def __init__(self, root: Path) -> None:
        self.work = root / "mono"
        self.out = root / "build-out"
        self.out.mkdir()
        self.script = root / "build.sh"
        self.script.write_text(BUILD_SCRIPT.format(out=self.out))
        self.work.mkdir()
        git(self.work, "init", "-q", "-b", "main")
        self.shas: dict[str, str] = {}

    def commit(self, name: str, files: dict[str, str]) -> str:
        """Commit ``files`` (path → content; ``None``-like '' removes nothing) as ``name``."""
        for path, content in files.items():
            target = self.work / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        git(self.work, "add", "-A")
        git(self.work, "commit", "-q", "--allow-empty", "-m", name)
        sha = git(self.work, "rev-parse", "HEAD")
        self.shas[name] = sha
        return sha

    def outcome(self, project: str, outcome: str) -> dict[str, str]:
        return {f"{DIRS[project]}/outcome": f"{outcome}\n"}

    def uri(self, name: str) -> str:
        return f"git+{self.work}#main@{self.shas[name]}"

    def release(self, latch: str) -> None:
        (self.out / f"release-{latch}").touch()

    def built(self, name: str) -> set[str]:
        """The projects whose build of commit ``name`` started."""
        started = self.out / "started"
        if not started.exists():
            return set()
        sha = self.shas[name]
        return {fields[1] for fields in (line.split() for line in
                                         started.read_text().splitlines())
                if fields[0] == sha}

    def started_lines(self) -> list[list[str]]:
        started = self.out / "started"
        return [line.split() for line in started.read_text().splitlines()] \
            if started.exists() else []


def projects_queue(repo: Monorepo, **knobs: Any) -> dict[str, Any]:
    projects = knobs.pop("projects", {
        "api": {"paths": ["services/api/**", "libs/common/**"]},
        "web": {"paths": ["web/**", "libs/common/**", "!web/docs/**"],
                "promotion_ref": "verified/web"},
        "docs": {"paths": ["docs/**"], "blocking": False},
    })
    return {
        "source_control": {"kind": "git", "repository": str(repo.work), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": f"sh {repo.script}",
                         "max_parallel": 4},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
        "poll_deadline": "5m", "projects": projects, **knobs}


def add_projects_queue(pipeline: Pipeline, repo: Monorepo, **knobs: Any) -> None:
    pipeline.add_raw_queue(QUEUE, projects_queue(repo, **knobs))


def answers(pipeline: Pipeline, request_id: str) -> dict[str, tuple[float, bool]]:
    """project → (degree, inherited) of a Request's answers."""
    return {p: (d, i) for p, d, i in pipeline.query(
        "SELECT project, degree, inherited FROM project_answer"
        " WHERE queue = %s AND request_id = %s", QUEUE, request_id)}
