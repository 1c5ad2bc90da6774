"""Issue 25, item 1: the image's worker validates a commit. `make test-deploy` builds the
image (`make image`) and runs this module; `make test` leaves it out (marker `image`).

The worker runs from the image's filesystem with `buildah run --isolation chroot` (no
container engine can run here), as the image's own user, its entrypoint and command as the
image declares them, against the local stack with this test's topics and schema. The
queue is a git repository with the command build runner, so the image's git and shell do
the work: the commit, ingested with the image's CLI, is validated green and its promotion
ref moved.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipeline_support import Pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow, pytest.mark.image]

IMAGE_USER = 10001  # Containerfile's USER
BUILD_SH = 'grep -qx "answer = 42" app.txt\n'


def _image() -> str:
    """The image `make image` tagged (STOVEPIPE_IMAGE overrides it)."""
    from streams import __version__

    return os.environ.get("STOVEPIPE_IMAGE") or f"localhost/stovepipe:{__version__}"


def _buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True,
                          timeout=300).stdout.strip()


@pytest.fixture
def container() -> Iterator[tuple[str, list[str]]]:
    """A working container of the image, and the command its config runs."""
    image = _image()
    if shutil.which("buildah") is None or os.geteuid() != 0:
        pytest.fail("the image test needs buildah and root: run `make test-deploy`")
    inspected = subprocess.run(["buildah", "inspect", "--type", "image", image],
                               capture_output=True, text=True)
    if inspected.returncode != 0:
        pytest.fail(f"no image {image}: run `make image` (or `make test-deploy`)")
    config = json.loads(inspected.stdout)["OCIv1"]["config"]
    name = _buildah("from", "--quiet", "--pull=never", image)
    try:
        yield name, [*config["Entrypoint"], *config["Cmd"]]
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "safe.directory=*", "-c", "user.name=t",
                           "-c", "user.email=t@t.invalid", "-C", str(repo), *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_the_images_worker_validates_a_commit(pipeline: Pipeline,
                                              container: tuple[str, list[str]]) -> None:
    name, command = container
    assert command[-1] == "worker", command
    repo = pipeline.root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "build.sh").write_text(BUILD_SH)
    (repo / "app.txt").write_text("answer = 42\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "the answer")
    sha = _git(repo, "rev-parse", "HEAD")
    pipeline.add_raw_queue("demo/main", {
        "source_control": {"kind": "git", "repository": str(repo), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": "sh ./build.sh",
                         "work_dir": str(pipeline.root / "builds")},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
    })
    # the worker runs as the image's user: everything of this test it touches is its
    for path in [pipeline.root, *pipeline.root.rglob("*")]:
        os.chown(path, IMAGE_USER, IMAGE_USER, follow_symlinks=False)

    mount = f"{pipeline.root}:{pipeline.root}"
    env = [f"--env={k}={v}" for k, v in pipeline.env.items() if k.startswith("STOVEPIPE_")]
    with open(pipeline.root / "worker-image.log", "wb") as log:
        worker = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", "--volume", mount, *env, name, "--",
             *command, "--loglevel", "info", "--no-web"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pipeline.workers.append(worker)  # stopped with its process group by the fixture

    # the image's CLI too: the ingest reads the repository with the image's git
    ingest = subprocess.run(["buildah", "run", "--isolation", "chroot", "--volume", mount,
                             *env, name, "--", "stovepipe", "ingest", "demo/main"],
                            capture_output=True, text=True, timeout=300)
    assert ingest.returncode == 0, ingest.stderr
    request_id = ingest.stdout.strip()
    pipeline.wait_quiet(timeout=180)
    assert pipeline.states() == {request_id: "succeeded"}, pipeline.logs()
    [(uri, degree)] = pipeline.query("SELECT uri, degree FROM validation_fact")
    assert uri.endswith(sha) and degree == 0
    assert _git(repo, "rev-parse", "verified-main") == sha  # promoted by the image's git

    # stopped as Kubernetes stops it: SIGTERM to the container's first process (tini),
    # which hands it to the worker; the worker leaves cleanly and the container exits 0
    [init] = [pid for pid in _descendants(worker.pid) if _program(pid) == "tini"]
    [stovepipe] = [pid for pid, parent in _parents().items() if parent == init]
    assert {_uid(init), _uid(stovepipe)} == {IMAGE_USER}  # not root
    os.kill(init, signal.SIGTERM)
    assert worker.wait(timeout=120) == 0
    log = (pipeline.root / "worker-image.log").read_text(errors="replace")
    assert "Traceback" not in log and "[^Worker]: Stopping..." in log, log[-3000:]


def _program(pid: int) -> str:
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name
    except OSError:
        return ""


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parents


def _descendants(pid: int) -> list[int]:
    parents = _parents()
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found
