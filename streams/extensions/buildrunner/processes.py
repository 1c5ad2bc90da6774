"""How the command BuildRunner launches a build detached from the worker, and how it sees
the build afterwards: through small files in the build's state directory and /proc.
See `streams.extensions.buildrunner.command` for the whole protocol.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store.entities import split_scope
from streams.extensions.sourcecontrol.gitrepo import (
    GIT_LOCATION_VARIABLES,
)

# the files of a build's state directory (see the command module's docstring)
BUILD_FILE, LAUNCHING, PID, PGID, START_TIME = ("build.json", "launching", "pid", "pgid",
                                                "start_time")
LOG, EXIT_CODE, CANCELLED, TIMED_OUT, CHECKOUT = ("log", "exit_code", "cancelled",
                                                  "timed_out", "checkout")
# written before the exit code when the command itself never ran (the launch was aborted,
# the checkout failed): the build gives no verdict on the commit
NOT_RUN = "not_run"


# $1 state dir, $2 clone source, $3 head sha, $4 command; fd 3: the "go" pipe.
WRAPPER = r"""
state=$1 source=$2 sha=$3 command=$4
IFS= read -r go <&3 || go=
exec 3<&-
finish() {
  printf '%s\n' "$1" > "$state/exit_code.tmp" && mv -f "$state/exit_code.tmp" "$state/exit_code"
  exit "$1"
}
not_run() {
  : > "$state/not_run"
  finish 125
}
if [ "$go" != go ]; then
  echo "stovepipe: the worker stopped before the build was recorded; not running it" >&2
  not_run
fi
echo "stovepipe: build $STOVEPIPE_BUILD_ID: checking out $sha" >&2
if ! { git clone --quiet --shared --no-checkout -- "$source" "$state/checkout" &&
       git -C "$state/checkout" checkout --quiet --detach "$sha"; }; then
  echo "stovepipe: cannot check out $sha from $source" >&2
  not_run
fi
cd "$state/checkout" || not_run
if [ -n "${STOVEPIPE_PROJECT:-}" ] && [ -n "$STOVEPIPE_BASE_SHA" ] &&
   git diff --name-only --no-renames "$STOVEPIPE_BASE_SHA" "$sha" -- \
       >"$state/changed_paths" 2>/dev/null; then
  export STOVEPIPE_CHANGED_PATHS="$state/changed_paths"
fi
echo "stovepipe: running: $command" >&2
sh -c "$command"
finish $?
"""
# In a new session (the launcher is its leader): start the wrapper in the background,
# print its pid, exit. $1 wrapper script, $2..$5 its arguments, $6 the log; stdin: the pipe.
LAUNCHER = r"""
exec 3<&0 </dev/null
sh -c "$1" stovepipe-build "$2" "$3" "$4" "$5" >>"$6" 2>&1 &
echo $!
"""


@dataclass(frozen=True)
class BuildProcess:
    pid: int
    pgid: int
    start_time: int  # field 22 of /proc/<pid>/stat
    started_at: float  # epoch seconds (when it was recorded)


def build_environment(spec: Mapping[str, Any]) -> dict[str, str]:
    """The worker's environment without git redirections or Stovepipe's own settings,
    plus the build's variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in GIT_LOCATION_VARIABLES and not k.startswith("STOVEPIPE_")}
    env.update({
        "STOVEPIPE_BUILD_ID": spec["build_id"],
        # a project's build (its scope `<queue>#<project>`) names its queue and project
        "STOVEPIPE_QUEUE": split_scope(spec.get("queue", ""))[0],
        "STOVEPIPE_REQUEST_ID": spec.get("request_id", ""),
        "STOVEPIPE_HEAD_URI": spec["head_uri"],
        "STOVEPIPE_HEAD_SHA": spec["head_sha"],
        "STOVEPIPE_BASE_URI": spec.get("base_uri", ""),
        "STOVEPIPE_BASE_SHA": spec.get("base_sha", ""),
    })
    project = split_scope(spec.get("queue", ""))[1]
    if project:  # a queue without projects builds with exactly the variables it had
        env["STOVEPIPE_PROJECT"] = project
    return env


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="utf-8").strip())
    except (FileNotFoundError, ValueError):
        return None


def mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def read_process(state: Path) -> BuildProcess | None:
    pid = read_int(state / PID)
    if pid is None:
        return None
    pgid, start_time = read_int(state / PGID), read_int(state / START_TIME)
    started_at = mtime_ns(state / PID)
    if pgid is None or start_time is None or started_at is None:
        return None
    return BuildProcess(pid, pgid, start_time, started_at / 1e9)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 first); None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            text = stat.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2].split()


def stat_fields(pid: int) -> tuple[int, int]:
    """(pgid, start time) of a live process; OSError when it is gone."""
    fields = proc_stat(pid)
    if fields is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return int(fields[2]), int(fields[19])


def leader_alive(process: BuildProcess) -> bool:
    """The wrapper still runs: same pid, same start time, not a zombie."""
    fields = proc_stat(process.pid)
    return (fields is not None and fields[0] not in ("Z", "X")
            and int(fields[19]) == process.start_time and int(fields[2]) == process.pgid)


def group_members(pgid: int, build_id: str) -> list[int]:
    """Live processes in group ``pgid`` whose environment names ``build_id``."""
    marker = f"STOVEPIPE_BUILD_ID={build_id}".encode()
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = proc_stat(int(name))
        if fields is None or fields[0] in ("Z", "X") or int(fields[2]) != pgid:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if marker in environ.read().split(b"\0"):
                    members.append(int(name))
        except OSError:
            continue
    return members


def remove_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
