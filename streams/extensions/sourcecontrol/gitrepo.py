"""A git repository as Stovepipe reads it, through the git CLI: shared by the git
SourceControl (`streams.extensions.sourcecontrol.git`) and the command BuildRunner.

Two kinds of repository, told apart by how they are written:

- a **local path** (``/srv/git/monorepo``, bare or with a work tree) is used in place.
  No cache: the repository is on this machine already, and a copy could only be staler.
- a **remote URL** (``https://…``, ``ssh://…``, ``git@host:path``, ``file:///…``) is read
  through a bare cache under ``<cache_root>/<name>-<hash of the URL>.git``. Fetched refs
  land under ``refs/remotes/origin/`` of the cache, so a cache shared by several queues
  (and by the command BuildRunner, which clones from it) holds every queue's ref side by
  side.

URIs are ``git+<repository>#<ref>@<sha>`` with the full sha. Only the git extensions parse
them (`parse_uri`).

Errors: a repository or ref that does not exist is ``UnknownRef`` (fix the queue
configuration). A remote that cannot be reached (network, timeout, a server error) is a
*retryable* ``SourceControlError``; refused credentials are not. Local failures are
non-retryable, except a lock held by a concurrent git process.

Every git call is an ``asyncio`` subprocess with a deadline (its process group is killed
when it passes), so nothing here blocks the event loop. Writes to a cache (its creation,
every fetch, a promotion kept in it) hold an exclusive ``flock`` on ``<cache>.lock``,
polled without blocking, so any number of workers on one machine can share a cache, and
a git lock file left by a git that died mid-write is removed by the next holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from streams.extensions.sourcecontrol.contract import (
    CommitNotFound,
    PromotionMoved,
    SourceControlError,
    UnknownRef,
)
from streams.extensions.sourcecontrol.gitlocks import (
    hold_file_lock,
    remove_lock_left_since,
    remove_stale_locks,
)
from streams.extensions.sourcecontrol.gituri import (
    cache_name,
    is_remote_url,
    redact,
    repository_identity,
)

log = logging.getLogger("stovepipe.git")

DEFAULT_LOCAL_TIMEOUT = 60.0  # seconds for a git command on this machine
DEFAULT_REMOTE_TIMEOUT = 300.0  # seconds for a fetch or a push

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_ZERO_SHA = "0" * 40  # update-ref's "must not exist yet"
# variables that would point git (and builds) at another repository than the one named
GIT_LOCATION_VARIABLES = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                          "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_COMMON_DIR",
                          "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES", "GIT_PREFIX")

# how a failed remote operation says the repository or ref is not there (LC_ALL=C)
_REMOTE_MISSING = ("does not appear to be a git repository", "repository not found",
                   "not found", "no such file or directory", "couldn't find remote ref")
_REMOTE_DENIED = ("authentication failed", "permission denied", "could not read username",
                  "could not read password", "terminal prompts disabled",
                  "host key verification failed", "access denied",
                  "the requested url returned error: 401",
                  "the requested url returned error: 403")
_REMOTE_SHA_REFUSED = ("not our ref", "unadvertised object", "couldn't find remote ref",
                       "no such remote ref", "bad object")
_LOCK_CONTENTION = ("cannot lock ref", "unable to create", "index.lock", "is locked")


def git_environment() -> dict[str, str]:
    """The environment for git commands: ours, without variables that would redirect git
    to another repository, with prompts disabled and messages in English (classified)."""
    env = {k: v for k, v in os.environ.items() if k not in GIT_LOCATION_VARIABLES}
    env.update(GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    return env


# --- running git --------------------------------------------------------------------------


@dataclass(frozen=True)
class GitResult:
    code: int
    stdout: str
    stderr: str

    def detail(self) -> str:
        text = redact((self.stderr.strip() or self.stdout.strip()).replace("\n", " | "))
        return text[:500] or f"exit status {self.code}"


async def run_git(args: Sequence[str], *, deadline: float,
                  env: dict[str, str] | None = None) -> GitResult:
    """Run ``git <args>`` without blocking the loop. A run past ``deadline`` seconds is
    killed (with its process group: ssh, remote helpers) and is a retryable error."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "git", *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env if env is not None else git_environment(),
            start_new_session=True)
    except FileNotFoundError:
        raise SourceControlError("git is not installed (no 'git' on PATH)") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), deadline)
    except TimeoutError:
        raise SourceControlError(f"git {args[0] if args else ''} did not finish within "
                                 f"{deadline:.0f}s", retryable=True) from None
    finally:
        if proc.returncode is None:  # timed out or cancelled: stop it, leave no zombie
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return GitResult(proc.returncode if proc.returncode is not None else -1,
                     out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _remote_failure(repository: str, what: str, result: GitResult) -> SourceControlError:
    """Classify a failed fetch/push: missing → UnknownRef, refused credentials → not
    retryable, anything else (network, server errors, timeouts) → retryable; the retry
    policy bounds how long an unreachable remote is retried."""
    text = result.stderr.lower()
    message = f"git repository {repository}: {what} failed: {result.detail()}"
    if any(s in text for s in _REMOTE_DENIED):
        return SourceControlError(message + " (check the credentials of the worker)")
    if any(s in text for s in _REMOTE_MISSING):
        return UnknownRef(message + " (check 'repository' and 'ref' in the queue "
                                    "configuration)")
    return SourceControlError(message, retryable=True)


def _local_failure(repository: str, what: str, result: GitResult) -> SourceControlError:
    text = result.stderr.lower()
    contended = any(s in text for s in _LOCK_CONTENTION) and ".lock" in text
    return SourceControlError(f"git repository {repository}: {what} failed: "
                              f"{result.detail()}", retryable=contended)


# --- a repository -------------------------------------------------------------------------


_FIELD_END = "\x1f"
_RECORD_END = "\x1e"
_LOG_FORMAT = _FIELD_END.join(("%H", "%P", "%an", "%ae", "%cI", "%s")) + _RECORD_END


@dataclass(frozen=True)
class LoggedCommit:
    """One commit as ``git log`` describes it."""

    sha: str
    parents: tuple[str, ...]
    author: str  # "Name <email>"
    committed_at: datetime | None
    subject: str


class GitRepository:
    """A repository as Stovepipe reads it: a local one in place, a remote one through its
    bare cache (see the module docstring). Shared by GitSourceControl and the command
    BuildRunner. Raises the SourceControl errors."""

    def __init__(self, repository: str, *, cache_root: Path | str | None = None,
                 local_timeout: float = DEFAULT_LOCAL_TIMEOUT,
                 remote_timeout: float = DEFAULT_REMOTE_TIMEOUT) -> None:
        if not repository:
            raise ValueError("a git repository (a local path or a URL) must be non-empty")
        self.is_remote = is_remote_url(repository)
        # the address git fetches from, credentials and all: never shown, never in a URI
        self._address = (repository if self.is_remote
                         else os.path.abspath(os.path.expanduser(repository)))
        # how it is named everywhere else
        self.repository = repository_identity(self._address)
        if self.is_remote and cache_root is None:
            raise ValueError(f"the remote repository {self.repository} needs a cache "
                             f"directory (cache_root) to fetch into")
        self.cache_path: Path | None = (Path(cache_root) / cache_name(self.repository)
                                        if self.is_remote and cache_root is not None else None)
        self.local_timeout = local_timeout
        self.remote_timeout = remote_timeout
        self._git_dir: Path | None = None

    def __repr__(self) -> str:
        return f"GitRepository({self.repository!r}, cache={self.cache_path})"

    def tracking_ref(self, branch: str) -> str:
        """Where ``branch`` of the repository is read: the cache's copy for a remote."""
        return f"refs/remotes/origin/{branch}" if self.is_remote else f"refs/heads/{branch}"

    async def git_dir(self) -> Path:
        """The git directory commands run in (the cache for a remote, created on first use).
        UnknownRef when a local path is not a git repository."""
        if self._git_dir is None:
            self._git_dir = await (self._create_cache() if self.is_remote
                                   else self._discover_local())
        return self._git_dir

    async def git(self, *args: str, remote: bool = False) -> GitResult:
        """``git --git-dir=<git_dir> <args>``; ``remote`` gives it the network deadline."""
        git_dir = await self.git_dir()
        # a cache's automatic gc runs inside the command (so under the cache's lock), never
        # detached after it
        cache = ("-c", "gc.autoDetach=false", "-c", "maintenance.autoDetach=false"
                 ) if self.is_remote else ()
        return await run_git([*cache, f"--git-dir={git_dir}", *args],
                             deadline=self.remote_timeout if remote else self.local_timeout)

    async def has_commit(self, sha: str) -> bool:
        result = await self.git("cat-file", "-e", f"{sha}^{{commit}}")
        return result.code == 0

    async def resolve(self, branch: str, *, fetch: bool = True) -> str:
        """The sha ``branch`` points at now (fetched first for a remote). UnknownRef when
        the repository or the branch does not exist."""
        if self.is_remote and fetch:
            await self.fetch_branch(branch)
        result = await self.git("rev-parse", "--verify", "--quiet",
                                f"{self.tracking_ref(branch)}^{{commit}}")
        sha = result.stdout.strip()
        if result.code == 1 or (result.code == 0 and not _SHA.fullmatch(sha)):
            raise UnknownRef(f"git repository {self.repository} has no branch {branch!r} "
                             f"(check 'ref' in the queue configuration)")
        if result.code != 0:
            raise _local_failure(self.repository, f"rev-parse {branch}", result)
        return sha

    async def fetch_branch(self, branch: str) -> None:
        """Bring the remote's ``branch`` into the cache (forced: it may have been
        rewritten). UnknownRef when the remote or the branch does not exist."""
        spec = f"+refs/heads/{branch}:{self.tracking_ref(branch)}"
        async with self._cache_lock():
            result = await self.git("fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                                    "origin", spec, remote=True)
        if result.code != 0:
            raise _remote_failure(self.repository, f"fetch of branch {branch!r}", result)

    async def ensure_commit(self, sha: str, branch: str | None = None) -> bool:
        """Whether the commit is (or, for a remote, can be fetched) here: tries ``branch``,
        then the sha itself (servers may refuse a sha no ref reaches)."""
        if await self.has_commit(sha):
            return True
        if not self.is_remote:
            return False
        if branch is not None:
            with contextlib.suppress(UnknownRef):  # the branch may be gone; try the sha
                await self.fetch_branch(branch)
            if await self.has_commit(sha):
                return True
        async with self._cache_lock():
            result = await self.git("fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                                    "origin", sha, remote=True)
        if result.code != 0:
            if any(s in result.stderr.lower() for s in _REMOTE_SHA_REFUSED):
                return False
            raise _remote_failure(self.repository, f"fetch of commit {sha}", result)
        return await self.has_commit(sha)

    async def commits_with_prefix(self, prefix: str) -> list[str]:
        """The full shas of the commits whose sha starts with ``prefix`` (at least 4 hex
        digits), as the repository has them now."""
        listed = await self.git("rev-parse", f"--disambiguate={prefix}")
        if listed.code != 0:
            raise _local_failure(self.repository, f"rev-parse --disambiguate={prefix}", listed)
        commits = []
        for name in listed.stdout.split():  # any object type: keep the commits
            kind = await self.git("cat-file", "-t", name)
            if kind.code == 0 and kind.stdout.strip() == "commit":
                commits.append(name)
        return commits

    async def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        """``git merge-base --is-ancestor``: a commit is its own ancestor. CommitNotFound
        when either commit is not in the repository."""
        result = await self.git("merge-base", "--is-ancestor", ancestor, descendant)
        if result.code in (0, 1):
            return result.code == 0
        for sha in (ancestor, descendant):
            if not await self.has_commit(sha):
                raise CommitNotFound(f"git repository {self.repository} has no commit {sha}")
        raise _local_failure(self.repository, f"merge-base {ancestor} {descendant}", result)

    async def commit_time(self, sha: str) -> datetime:
        result = await self.git("show", "--no-patch", "--format=%cI", f"{sha}^{{commit}}")
        if result.code != 0:
            if not await self.has_commit(sha):
                raise CommitNotFound(f"git repository {self.repository} has no commit {sha}")
            raise _local_failure(self.repository, f"show {sha}", result)
        try:
            when = datetime.fromisoformat(result.stdout.strip())
        except ValueError:
            raise SourceControlError(f"git repository {self.repository}: commit {sha} has "
                                     f"an unreadable date {result.stdout.strip()!r}") from None
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)

    async def first_parent_log(self, older: str, newer: str,
                               limit: int) -> list[LoggedCommit]:
        """The commits of ``newer``'s first-parent history that ``older`` cannot reach,
        newest first, at most ``limit``: ``git log --first-parent older..newer``."""
        return await self._log(["--first-parent", f"--max-count={limit}",
                                f"{older}..{newer}"], f"log {older}..{newer}")

    async def changed_paths(self, base: str, head: str) -> list[str]:
        """``git diff --name-only --no-renames base head``: a rename is both its paths."""
        result = await self.git("diff", "--name-only", "-z", "--no-renames",
                                "--no-ext-diff", base, head, "--")
        if result.code != 0:
            for sha in (base, head):
                if not await self.has_commit(sha):
                    raise CommitNotFound(f"git repository {self.repository} has no commit "
                                         f"{sha}")
            raise _local_failure(self.repository, f"diff {base} {head}", result)
        return [path for path in result.stdout.split("\0") if path]

    async def describe(self, shas: Sequence[str]) -> list[LoggedCommit]:
        """The commits ``shas`` names, which the repository must have (any order)."""
        if not shas:
            return []
        return await self._log(["--no-walk=unsorted", *shas], "log --no-walk")

    async def _log(self, args: list[str], what: str) -> list[LoggedCommit]:
        result = await self.git("log", f"--format={_LOG_FORMAT}", *args, "--")
        if result.code != 0:
            raise _local_failure(self.repository, what, result)
        commits = []
        for record in result.stdout.split(_RECORD_END):
            fields = record.strip("\n").split(_FIELD_END)
            if len(fields) != 6:
                continue
            sha, parents, name, email, when, subject = fields
            try:
                committed = datetime.fromisoformat(when)
            except ValueError:
                committed = None
            commits.append(LoggedCommit(sha, tuple(parents.split()), f"{name} <{email}>",
                                        committed, subject))
        return commits

    async def branch_sha(self, branch: str, *, pushed: bool) -> str | None:
        """The sha ``branch`` points at, None when it does not exist: asked of the remote
        itself when ``pushed`` (that is where `set_branch` moves it), else read in the git
        directory."""
        if pushed and self.is_remote:
            result = await self.git("ls-remote", "origin", f"refs/heads/{branch}",
                                    remote=True)
            if result.code != 0:
                raise _remote_failure(self.repository, f"ls-remote {branch!r}", result)
            sha = result.stdout.split()[0] if result.stdout.strip() else ""
            return sha if _SHA.fullmatch(sha) else None
        result = await self.git("rev-parse", "--verify", "--quiet",
                                f"refs/heads/{branch}^{{commit}}")
        sha = result.stdout.strip()
        return sha if result.code == 0 and _SHA.fullmatch(sha) else None

    async def set_branch(self, branch: str, sha: str, *, push: bool,
                         expected: str | None) -> None:
        """Point ``branch`` at ``sha`` if it points at ``expected`` now (None: it must not
        exist) — a compare-and-set, pushed with a lease to the repository, or updated in
        the git directory itself (the repository when local, the cache when remote).
        PromotionMoved when the branch is elsewhere."""
        if push:
            target = "origin" if self.is_remote else str(await self.git_dir())
            lease = f"--force-with-lease=refs/heads/{branch}:{expected or ''}"
            result = await self.git("push", "--quiet", "--porcelain", lease, "--no-verify",
                                    target, f"{sha}:refs/heads/{branch}", remote=True)
            if result.code != 0:
                if "stale info" in (result.stdout + result.stderr):
                    raise PromotionMoved(f"{branch!r} of {self.repository} is no longer at "
                                         f"{expected}; not moving it to {sha}")
                if self.is_remote:
                    raise _remote_failure(self.repository, f"push to {branch!r}", result)
                raise _local_failure(self.repository, f"push to {branch!r}", result)
            return
        async with (self._cache_lock() if self.is_remote else contextlib.nullcontext()):
            began = time.time()
            try:
                result = await self.git("update-ref", "-m", "stovepipe: promote",
                                        f"refs/heads/{branch}", sha, expected or _ZERO_SHA)
            except BaseException:
                # killed at its deadline (or with its caller) while it held the ref's
                # lock: the lock it left would refuse every later move of the branch
                # (a cache's stale locks are removed by its next flock holder instead)
                if not self.is_remote:
                    lock = await self.git_dir() / "refs" / "heads" / f"{branch}.lock"
                    await asyncio.to_thread(remove_lock_left_since, lock, began)
                raise
        if result.code != 0:
            text = result.stderr.lower()
            if "but expected" in text or "already exists" in text or "unable to resolve" in text:
                raise PromotionMoved(f"{branch!r} of {self.repository} is no longer at "
                                     f"{expected}; not moving it to {sha}")
            raise _local_failure(self.repository, f"update-ref {branch}", result)

    # --- helpers ---

    @contextlib.asynccontextmanager
    async def _cache_lock(self, *, created: bool = True) -> AsyncIterator[None]:
        """Holds the cache's lock (not re-entrant): for writes to the cache."""
        assert self.cache_path is not None
        if created:
            await self.git_dir()  # creating the cache takes the lock itself
        async with hold_file_lock(self.cache_path.with_name(self.cache_path.name + ".lock")):
            if created:
                await asyncio.to_thread(remove_stale_locks, self.cache_path)
            yield

    async def _discover_local(self) -> Path:
        path = self._address
        env = git_environment()
        # never walk up: a plain directory inside some other repository is not a repository
        env["GIT_CEILING_DIRECTORIES"] = os.path.dirname(path.rstrip("/")) or "/"
        result = await run_git(["-C", path, "rev-parse", "--absolute-git-dir"],
                               deadline=self.local_timeout, env=env)
        if result.code != 0:
            text = result.stderr.lower()
            if "not a git repository" in text or "cannot change to" in text:
                raise UnknownRef(f"{path} is not a git repository (check 'repository' in "
                                 f"the queue configuration): {result.detail()}")
            raise _local_failure(path, "rev-parse --absolute-git-dir", result)
        return Path(result.stdout.strip())

    async def _create_cache(self) -> Path:
        cache = self.cache_path
        assert cache is not None
        async with self._cache_lock(created=False):
            if await asyncio.to_thread((cache / "HEAD").exists):
                # named by identity: after a credential rotation the cache is the same,
                # and fetches from the address configured now
                await self._set_origin(cache)
                return cache
            # build it aside and rename it in: a crash never leaves a half-made cache
            scratch = cache.with_name(f".{cache.name}.{uuid.uuid4().hex[:8]}.tmp")
            result = await run_git(["init", "--quiet", "--bare", str(scratch)],
                                   deadline=self.local_timeout)
            if result.code != 0:
                raise SourceControlError(f"cannot create the cache {cache} of "
                                         f"{self.repository}: {result.detail()}")
            await self._set_origin(scratch)
            await asyncio.to_thread(os.rename, scratch, cache)
        return cache

    async def _set_origin(self, git_dir: Path) -> None:
        current = await run_git([f"--git-dir={git_dir}", "config", "--get",
                                 "remote.origin.url"], deadline=self.local_timeout)
        if current.code == 0 and current.stdout.strip() == self._address:
            return
        result = await run_git([f"--git-dir={git_dir}", "config", "remote.origin.url",
                                self._address], deadline=self.local_timeout)
        if result.code != 0:
            raise SourceControlError(f"cannot configure the cache {git_dir} of "
                                     f"{self.repository}: {result.detail()}")
