"""The fake SourceControl: a repository held in one JSON file (design §8).

Tests edit the file while workers run, from any process, so a test can push and
force-push under a live pipeline: the file's format, how it is changed safely and the
test side (`FakeRepo`) are in `streams.extensions.sourcecontrol.fakefile`.

URIs are ``fake://<repo>/<ref>/<sha>``: ``<repo>`` is the name given in the queue
configuration (it does not appear in the file) and ``<sha>`` never contains ``/``. Only
this module parses them. A URI of another repository, or not a URI at all, names no
commit here: ``CommitNotFound``.

Fault injection, as the fake BuildRunner does it: a sha with the ``-``-separated token
``ancestryerror`` (or ``ancestryretry``) makes ``is_ancestor`` on it fail with a
non-retryable (or retryable) ``SourceControlError``, e.g. ``c7-ancestryerror``. An outage:
while the file ``<file>.down`` exists, every call fails with a retryable
``SourceControlError`` (the remote unreachable), as long as a test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions import ExtensionContext
from streams.extensions.sourcecontrol.contract import (
    CommitInfo,
    CommitNotFound,
    NotOnFirstParent,
    PromotionMoved,
    SourceControlError,
    TooManyCommits,
    TooManyPaths,
    UnknownRef,
    one_commit,
)
from streams.extensions.sourcecontrol.fakefile import (
    DOWN_SUFFIX,
    PROMOTION_HISTORY,
    URI_SCHEME,
    FakeRepo,
    State,
    fake_uri,
    read_state,
    update_state,
)
from streams.schema.fields import SPEC, ConfigPath, Duration, NonEmptyStr

__all__ = ["URI_SCHEME", "FakeRepo", "FakeSourceControl", "FakeSourceControlSpec", "fake_uri"]

LATENCY_CALLS = ("head", "is_ancestor", "promote")
_REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


# --- queues.yaml --------------------------------------------------------------------------


def _repo_name(value: object) -> str:
    if not isinstance(value, str) or not _REPO_NAME.fullmatch(value):
        raise ValueError(f"must be letters, digits, '.', '_' and '-', starting with a letter "
                         f"or digit, got {value!r}")
    return value


@spec_dataclass(frozen=True, config=SPEC)
class FakeSourceControlSpec:
    """`kind: fake`: a repository in a JSON file (this module)."""

    path: ConfigPath
    repo: Annotated[str, BeforeValidator(_repo_name)]
    ref: NonEmptyStr
    promotion_ref: NonEmptyStr | None = None
    # simulated call latencies, e.g. {head: 100ms, is_ancestor: 50ms} (benchmarks, tests)
    latency: dict[Literal["head", "is_ancestor", "promote"], Duration] | None = None
    kind: Literal["fake"] = "fake"

    @field_validator("promotion_ref")
    @classmethod
    def _own_ref(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value == info.data.get("ref"):
            raise ValueError(f"must differ from ref {value!r}: promotion moves a ref of its "
                             f"own")
        return value

    def shared_repository(self) -> str | None:
        return None  # nothing a build could check out

    def shared_git_cache(self, home: Path) -> Path:
        return home / "git"

    def hosted_repository(self) -> str | None:
        return None  # hosted nowhere: a queue maps webhooks to it by webhook_repository

    def build(self, context: ExtensionContext) -> FakeSourceControl:
        latency = {str(call): delay.total_seconds()
                   for call, delay in (self.latency or {}).items()}
        return FakeSourceControl(self.path, self.repo, self.ref, self.promotion_ref,
                                 latency=latency)


# --- the extension ----------------------------------------------------------------------


class FakeSourceControl:
    """One queue's view of a fake repository: ``ref`` in the JSON file at ``path``, with
    commit URIs minted under the name ``repo``; ``promote`` moves ``promotion_ref``.

    Every method reads or writes the file in a worker thread, never on the event loop.
    A missing file or ref is ``UnknownRef``; an unreadable or malformed file is a
    non-retryable ``SourceControlError``.
    """

    def __init__(self, path: Path | str, repo: str, ref: str,
                 promotion_ref: str | None = None, *,
                 latency: Mapping[str, float] | None = None) -> None:
        if not repo or "/" in repo:
            raise ValueError(f"a fake repository name is non-empty without '/', got {repo!r}")
        if not ref:
            raise ValueError("a fake repository ref must be non-empty")
        self.path = Path(path)
        self.repo = repo
        self.ref = ref
        self.promotion_ref = promotion_ref
        self.latency = dict(latency or {})

    def __repr__(self) -> str:
        return (f"FakeSourceControl({str(self.path)!r}, repo={self.repo!r}, ref={self.ref!r}, "
                f"promotion_ref={self.promotion_ref!r})")

    async def head(self) -> str:
        await self._wait()
        # the answer is read first and returned after the latency, as from a remote
        # server: the branch may have moved on by the time the caller sees it
        head = await asyncio.to_thread(self._head)
        await self._wait("head")
        return head

    async def is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        await self._wait("is_ancestor")
        return await asyncio.to_thread(self._is_ancestor, ancestor_uri, descendant_uri)

    async def promotion_target(self) -> str | None:
        if self.promotion_ref is None:
            return None
        await self._wait()
        sha = self._state().promoted.get(self.promotion_ref)
        return fake_uri(self.repo, self.ref, sha) if sha else None

    async def promote(self, uri: str, *, expected: str | None) -> None:
        if self.promotion_ref is None:
            return
        await self._wait("promote")
        await asyncio.to_thread(self._promote, uri, self.promotion_ref, expected)

    async def _wait(self, call: str = "") -> None:
        """An injected outage (``<file>.down``), else the call's simulated latency."""
        down = self.path.with_name(self.path.name + DOWN_SUFFIX)
        if await asyncio.to_thread(down.exists):
            raise SourceControlError(f"fake repository {self.repo!r} is unreachable "
                                     f"({down} exists: an injected outage)", retryable=True)
        if self.latency.get(call, 0.0) > 0:
            await asyncio.sleep(self.latency[call])

    async def commit_time(self, uri: str) -> datetime:
        await self._wait()
        return await asyncio.to_thread(self._commit_time, uri)

    async def commits_between(self, older_uri: str, newer_uri: str, *,
                              limit: int) -> list[CommitInfo]:
        await self._wait()
        return await asyncio.to_thread(self._commits_between, older_uri, newer_uri, limit)

    async def changed_paths(self, base_uri: str, head_uri: str, *, limit: int) -> list[str]:
        await self._wait()
        return await asyncio.to_thread(self._changed_paths, base_uri, head_uri, limit)

    async def describe(self, uris: Sequence[str]) -> list[CommitInfo]:
        await self._wait()
        state = await asyncio.to_thread(self._state)
        described = []
        for uri in uris:
            with contextlib.suppress(CommitNotFound, SourceControlError):
                described.append(self._info(state, self._known_sha(state, uri)))
        return described

    async def commit_uri(self, sha: str) -> str:
        wanted = sha.strip()
        if not wanted or "/" in wanted or any(c.isspace() for c in wanted):
            raise ValueError(f"{sha!r} is not a fake sha (a non-empty string without '/' "
                             f"or spaces)")
        commits = (await asyncio.to_thread(self._state)).commits
        found = [wanted] if wanted in commits else [c for c in commits if c.startswith(wanted)]
        return fake_uri(self.repo, self.ref,
                        one_commit(wanted, found, f"fake repository {self.repo!r}"))

    # --- blocking halves, run in a thread ---

    def _head(self) -> str:
        state = self._state()
        return fake_uri(self.repo, self.ref, self._head_sha(state))

    def _is_ancestor(self, ancestor_uri: str, descendant_uri: str) -> bool:
        state = self._state()
        ancestor = self._known_sha(state, ancestor_uri)
        descendant = self._known_sha(state, descendant_uri)
        for sha in (ancestor, descendant):
            tokens = sha.split("-")
            if "ancestryretry" in tokens or "ancestryerror" in tokens:
                raise SourceControlError(
                    f"fake repository {self.repo!r}: ancestry of {sha} unavailable "
                    f"(injected fault)", retryable="ancestryretry" in tokens)
        return state.is_ancestor(ancestor, descendant)

    def _promote(self, uri: str, promotion_ref: str, expected: str | None) -> None:
        sha = self._sha(uri)
        expected_sha = self._sha(expected) if expected is not None else None

        def point_promotion_ref(state: State) -> None:
            current = state.promoted.get(promotion_ref)
            if current != expected_sha:
                raise PromotionMoved(f"{promotion_ref!r} of fake repository {self.repo!r} "
                                     f"is at {current}, not {expected_sha}")
            head = self._head_sha(state)
            if not state.is_ancestor(sha, head):
                raise CommitNotFound(f"{uri} is not on {self.repo}/{self.ref} (head {head}); "
                                     f"not promoting it to {promotion_ref!r}")
            if current != sha:
                state.promoted[promotion_ref] = sha
                state.promotions = [*state.promotions, [promotion_ref, sha]][-PROMOTION_HISTORY:]

        try:
            update_state(self.path, point_promotion_ref, create=False)
        except FileNotFoundError:
            raise self._no_file() from None
        except OSError as exc:
            raise SourceControlError(f"{self.path}: cannot write: {exc}") from None

    def _commits_between(self, older_uri: str, newer_uri: str,
                         limit: int) -> list[CommitInfo]:
        state = self._state()
        older = self._known_sha(state, older_uri)
        newer = self._known_sha(state, newer_uri)
        walked: list[str] = []
        sha: str | None = newer
        while sha is not None and sha != older:
            if len(walked) == limit:
                raise TooManyCommits(f"more than {limit} commits lie between {older} and "
                                       f"{newer} on {self.ref!r}")
            walked.append(sha)
            parents = state.parents(sha)
            sha = parents[0] if parents else None
        if sha is None:
            raise NotOnFirstParent(f"{older} is not on the first-parent history of {newer} "
                                   f"in fake repository {self.repo!r}")
        return [self._info(state, commit) for commit in reversed(walked)]

    def _changed_paths(self, base_uri: str, head_uri: str, limit: int) -> list[str]:
        """The paths the commits ``head`` reaches and ``base`` does not say they change
        (a fake commit names its changed paths, `FakeRepo.push`'s ``paths``)."""
        state = self._state()
        base = self._known_sha(state, base_uri)
        head = self._known_sha(state, head_uri)

        def reachable(start: str) -> set[str]:
            seen, todo = set(), [start]
            while todo:
                sha = todo.pop()
                if sha not in seen:
                    seen.add(sha)
                    todo.extend(state.parents(sha))
            return seen

        changed = sorted({path for sha in reachable(head) - reachable(base)
                          for path in state.commits[sha].get("paths", [])})
        if len(changed) > limit:
            raise TooManyPaths(f"more than {limit} paths differ between {base} and {head}")
        return changed

    def _info(self, state: State, sha: str) -> CommitInfo:
        commit = state.commits[sha]
        parents = state.parents(sha)
        raw = commit.get("time")
        try:
            when = datetime.fromisoformat(raw) if isinstance(raw, str) else None
        except ValueError:
            when = None
        return CommitInfo(uri=fake_uri(self.repo, self.ref, sha), sha=sha,
                          subject=str(commit.get("subject") or sha),
                          author=str(commit.get("author") or "fake <fake@example.invalid>"),
                          committed_at=when,
                          parent_uri=fake_uri(self.repo, self.ref, parents[0])
                          if parents else None)

    def _commit_time(self, uri: str) -> datetime:
        state = self._state()
        sha = self._known_sha(state, uri)
        raw = state.commits[sha].get("time")
        try:
            when = datetime.fromisoformat(raw) if isinstance(raw, str) else None
        except ValueError:
            when = None
        if when is None:
            raise SourceControlError(f"{self.path}: commit {sha} has no valid 'time' "
                                     f"(ISO 8601), got {raw!r}")
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)

    # --- helpers ---

    def _state(self) -> State:
        state = read_state(self.path)
        if state is None:
            raise self._no_file()
        return state

    def _no_file(self) -> UnknownRef:
        return UnknownRef(f"fake repository {self.repo!r}: no file {self.path}")

    def _head_sha(self, state: State) -> str:
        sha = state.refs.get(self.ref)
        if sha is None:
            raise UnknownRef(f"fake repository {self.repo!r} ({self.path}) has no ref "
                             f"{self.ref!r}; it has {sorted(state.refs)}")
        if sha not in state.commits:
            raise SourceControlError(f"{self.path}: ref {self.ref!r} points at {sha}, "
                                     f"which is not in 'commits'")
        return sha

    def _sha(self, uri: str) -> str:
        """The sha of a URI minted for this repository (on any of its refs)."""
        prefix = f"{URI_SCHEME}{self.repo}/"
        ref, sep, sha = uri.removeprefix(prefix).rpartition("/")
        if not (uri.startswith(prefix) and ref and sep and sha):
            raise CommitNotFound(f"{uri!r} is not a commit URI of fake repository "
                                 f"{self.repo!r} (want {prefix}<ref>/<sha>)")
        return sha

    def _known_sha(self, state: State, uri: str) -> str:
        sha = self._sha(uri)
        if sha not in state.commits:
            raise CommitNotFound(f"fake repository {self.repo!r} ({self.path}) has no "
                                 f"commit {sha} (from {uri})")
        return sha
