"""A git killed while it writes a cache (at its deadline, or with its worker) leaves git's
lock files behind; the next fetch must not be refused by them forever. Real git: a fetch
held inside its ref transaction by a `reference-transaction` hook and killed there."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from streams.extensions.sourcecontrol import SourceControlError
from streams.extensions.sourcecontrol.git import GitSourceControl
from streams.extensions.sourcecontrol.gitrepo import GIT_LOCATION_VARIABLES
from streams.extensions.sourcecontrol.gituri import git_uri


def _git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", *args], cwd=cwd, env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


def _commit(work: Path, message: str) -> str:
    _git(work, "commit", "-q", "--allow-empty", "-m", message)
    _git(work, "push", "-q", "origin", "HEAD:main")
    return _git(work, "rev-parse", "HEAD")


def _hold_ref_updates(git_dir: Path, hooks: Path) -> None:
    """Make every ref transaction in ``git_dir`` hang once its locks are taken."""
    hooks.mkdir(exist_ok=True)
    hook = hooks / "reference-transaction"
    hook.write_text('#!/bin/sh\n[ "$1" = prepared ] && sleep 60\nexit 0\n')
    hook.chmod(hook.stat().st_mode | stat.S_IXUSR)
    _git(git_dir, "--git-dir", str(git_dir), "config", "core.hooksPath", str(hooks))


def test_a_fetch_killed_inside_its_ref_update_does_not_wedge_the_cache(
        tmp_path: Path) -> None:
    store = tmp_path / "origin.git"
    _git(tmp_path, "init", "-q", "--bare", str(store))
    work = tmp_path / "work"
    _git(tmp_path, "clone", "-q", str(store), str(work))
    first = _commit(work, "c1")
    sc = GitSourceControl(store.as_uri(), "main", cache_dir=tmp_path / "cache",
                          remote_timeout=3.0)
    assert asyncio.run(sc.head()) == git_uri(store.as_uri(), "main", first)
    [cache] = [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".git"]

    _commit(work, "c2")
    _hold_ref_updates(cache, tmp_path / "hooks")
    began = time.monotonic()
    with pytest.raises(SourceControlError, match="did not finish within") as info:
        asyncio.run(sc.head())  # killed at its deadline while holding the ref's lock
    assert info.value.retryable and time.monotonic() - began < 30
    left = cache / "refs" / "remotes" / "origin" / "main.lock"
    assert left.exists(), "the killed fetch should have left git's lock on the ref"

    _git(cache, "--git-dir", str(cache), "config", "--unset", "core.hooksPath")
    third = _commit(work, "c3")
    # the next holder of the cache's lock removes what the dead git left, and fetches
    assert asyncio.run(sc.head()) == git_uri(store.as_uri(), "main", third)
    assert not left.exists()
