"""The fake repository's file: one JSON document that tests edit while workers read it
(`streams.extensions.sourcecontrol.fake` is the SourceControl reading it). The file::

    {"commits":  {"<sha>": {"parents": ["<sha>", ...], "time": "<ISO 8601>",
                            "subject": "...", "author": "..."}},
     "refs":     {"main": "<sha>"},
     "promoted": {"verified-main": "<sha>"}}

Commits are immutable and never deleted; a force-push only moves a ref, so a commit it
abandoned still exists but is no longer reachable from the ref. `FakeRepo` is the test
side: commit, push, force-push, an outage (``<file>.down``).

Concurrency: every change is a read-modify-write under an exclusive ``flock`` on the
sidecar ``<file>.lock`` and lands by ``os.replace`` of a complete temporary file; readers
take the shared lock. A reader therefore sees the whole file before or after a change,
never a mixture, and two writers never lose each other's change.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from streams.extensions.sourcecontrol.contract import SourceControlError

URI_SCHEME = "fake://"
LOCK_SUFFIX = ".lock"
PROMOTION_HISTORY = 1000
DOWN_SUFFIX = ".down"  # <file>.down: the repository is unreachable while it exists

T = TypeVar("T")


def fake_uri(repo: str, ref: str, sha: str) -> str:
    """The URI the fake SourceControl mints for ``sha`` on ``repo``'s ``ref``."""
    return f"{URI_SCHEME}{repo}/{ref}/{sha}"


# --- the file ---------------------------------------------------------------------------


@dataclass
class State:
    commits: dict[str, dict[str, Any]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    promoted: dict[str, str] = field(default_factory=dict)
    # every promotion, oldest first, as [ref, sha] (the last PROMOTION_HISTORY kept)
    promotions: list[list[str]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"commits": self.commits, "refs": self.refs,
                           "promoted": self.promoted, "promotions": self.promotions},
                          indent=1, sort_keys=True)

    def parents(self, sha: str) -> list[str]:
        return list(self.commits[sha].get("parents", []))

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        """Walks parents from ``descendant``; a commit is its own ancestor."""
        stack, seen = [descendant], set()
        while stack:
            sha = stack.pop()
            if sha == ancestor:
                return True
            if sha in seen or sha not in self.commits:
                continue
            seen.add(sha)
            stack.extend(self.parents(sha))
        return False


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


@contextlib.contextmanager
def _locked(path: Path, *, exclusive: bool) -> Iterator[None]:
    """Holds the sidecar lock of ``path``. FileNotFoundError when its directory is absent."""
    fd = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # releases the lock


def _parse(text: str, path: Path) -> State:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SourceControlError(f"{path}: not a fake repository file: {exc}") from None
    if not isinstance(raw, dict):
        raise SourceControlError(f"{path}: not a fake repository file: expected an object")
    parts: dict[str, Any] = {}
    for key in ("commits", "refs", "promoted"):
        value = raw.get(key, {})
        if not isinstance(value, dict):
            raise SourceControlError(f"{path}: not a fake repository file: {key!r} is not "
                                     f"an object")
        parts[key] = value
    history = raw.get("promotions", [])
    if not isinstance(history, list):
        raise SourceControlError(f"{path}: not a fake repository file: 'promotions' is not "
                                 f"a list")
    return State(**parts, promotions=history)


def read_state(path: Path) -> State | None:
    """The file's content under the shared lock; None when there is no such file."""
    try:
        with _locked(path, exclusive=False):
            text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SourceControlError(f"{path}: cannot read: {exc}") from None
    return _parse(text, path)


def write_atomically(path: Path, state: State) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(state.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def update_state(path: Path, change: Callable[[State], T], *, create: bool) -> T:
    """Apply ``change`` to the file under the exclusive lock and write it back if it
    changed anything. A missing file is an empty repository when ``create``, else
    FileNotFoundError."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path, exclusive=True):
        try:
            before = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if not create:
                raise
            before = ""
        state = _parse(before, path) if before else State()
        result = change(state)
        if state.to_json() != before:
            write_atomically(path, state)
        return result


# --- the test side ----------------------------------------------------------------------


def _check_sha(sha: str) -> str:
    if not isinstance(sha, str) or not sha or "/" in sha or any(c.isspace() for c in sha):
        raise ValueError(f"a fake sha is a non-empty string without '/' or spaces, got {sha!r}")
    return sha


class FakeRepo:
    """Edits a fake repository file the way a developer edits a repository: commit, push,
    force-push. Safe to use from any process while workers read the file. Synchronous:
    for tests and demos, not for the event loop."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)

    uri = staticmethod(fake_uri)

    def set_reachable(self, reachable: bool) -> None:
        """Make the repository unreachable to every worker (an outage), or reachable."""
        down = self.path.with_name(self.path.name + DOWN_SUFFIX)
        down.unlink(missing_ok=True) if reachable else down.touch()

    def commit(self, sha: str, *, parents: Sequence[str] = (),
               time: datetime | None = None) -> str:
        """Add a commit without moving any ref. Re-adding it with the same parents does
        nothing; with other parents is a ValueError (commits are immutable)."""
        parents = [_check_sha(p) for p in parents]
        when = (time or datetime.now(UTC)).isoformat()
        update_state(self.path, lambda s: self._add_commit(s, _check_sha(sha), parents, when),
                create=True)
        return sha

    def push(self, ref: str, *shas: str, time: datetime | None = None,
             author: str | None = None, subjects: Mapping[str, str] | None = None,
             paths: Mapping[str, Sequence[str]] | None = None) -> str:
        """Append new commits on top of ``ref``'s head (or start it), each the child of the
        one before, and move ``ref`` to the last (``subjects`` by sha and ``author``
        describe them; ``paths`` by sha, the files each changes). Returns the new head."""
        if not shas:
            raise ValueError("push needs at least one commit")
        for sha in shas:
            _check_sha(sha)
        when = (time or datetime.now(UTC)).isoformat()

        def fast_forward(state: State) -> str:
            parent = state.refs.get(ref)
            for sha in shas:
                if sha in state.commits:
                    raise ValueError(f"commit {sha} already exists; push adds new commits")
                self._add_commit(state, sha, [parent] if parent else [], when)
                if author:
                    state.commits[sha]["author"] = author
                if subjects and sha in subjects:
                    state.commits[sha]["subject"] = subjects[sha]
                if paths and sha in paths:
                    state.commits[sha]["paths"] = list(paths[sha])
                parent = sha
            state.refs[ref] = shas[-1]
            return shas[-1]

        return update_state(self.path, fast_forward, create=True)

    def force_push(self, ref: str, sha: str, parents: Sequence[str] = (),
                   time: datetime | None = None) -> str:
        """Point ``ref`` at ``sha`` whatever its history, creating the commit with
        ``parents`` if it is new. Commits left behind stay in the file, off the ref."""
        parents = [_check_sha(p) for p in parents]
        when = (time or datetime.now(UTC)).isoformat()

        def rewrite(state: State) -> str:
            if sha not in state.commits or parents:
                self._add_commit(state, _check_sha(sha), parents, when)
            state.refs[ref] = sha
            return sha

        return update_state(self.path, rewrite, create=True)

    def head(self, ref: str) -> str | None:
        state = read_state(self.path)
        return state.refs.get(ref) if state else None

    def promoted(self, ref: str) -> str | None:
        """Where the promotion ref ``ref`` points, or None if it was never promoted."""
        state = read_state(self.path)
        return state.promoted.get(ref) if state else None

    def promotions(self, ref: str) -> list[str]:
        """Every sha the promotion ref ``ref`` was moved to, oldest first."""
        state = read_state(self.path)
        return [sha for name, sha in (state.promotions if state else []) if name == ref]

    @staticmethod
    def _add_commit(state: State, sha: str, parents: list[str], when: str) -> None:
        for parent in parents:
            if parent not in state.commits:
                raise ValueError(f"parent {parent} of {sha} is not a commit")
        existing = state.commits.get(sha)
        if existing is not None:
            if list(existing.get("parents", [])) != parents:
                raise ValueError(f"commit {sha} exists with parents {existing['parents']}, "
                                 f"not {parents}")
            return
        state.commits[sha] = {"parents": parents, "time": when}
