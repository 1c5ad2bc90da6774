"""The locks of git directories: a flock its writers hold on a cache, and the lock files a
git killed mid-write leaves behind (removed, or every later write of that ref fails)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

log = logging.getLogger("stovepipe.git")

LOCK_POLL_INTERVAL = 0.05


@contextlib.asynccontextmanager
async def hold_file_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on ``path`` (created if needed), waited for without blocking the
    loop. Separate holders in one process exclude each other too (one fd each)."""
    fd = await asyncio.to_thread(_open_lock_file, path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(LOCK_POLL_INTERVAL)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_lock_left_since(lock: Path, began: float) -> None:
    """Remove ``lock`` if it was made at or after ``began``: the one a git killed since
    then left (an older one is another holder's)."""
    try:
        if lock.stat().st_mtime >= began - 1.0:
            lock.unlink()
            log.warning("git_stale_lock_removed path=%s", lock)
    except FileNotFoundError:
        pass


def remove_stale_locks(git_dir: Path) -> None:
    """Every git that writes a cache holds its flock, so a git lock file found by the
    flock's holder was left by a git that died mid-write (killed at its deadline, or with
    its worker); left there, it would fail every later fetch. Objects need no cleaning."""
    for lock in [*git_dir.glob("*.lock"), *(git_dir / "refs").rglob("*.lock")]:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            log.warning("git_stale_lock_removed path=%s", lock)


def _open_lock_file(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
