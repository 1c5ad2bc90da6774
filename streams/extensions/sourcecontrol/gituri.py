"""Git commit URIs and repository names: how a commit of a git repository is named
outside it, and how a repository is named without its credentials (design §8).

URIs are ``git+<repository identity>#<ref>@<full sha>``. Only the git extensions mint and
parse them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from streams.extensions.sourcecontrol.contract import CommitNotFound

_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
URI_PREFIX = "git+"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_SCP_LIKE = re.compile(r"[^/]+:")  # git@host:path, host:path (a ':' before any '/')
_BAD_REF_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\#]")
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@'\"]*@")
_URL_QUERY = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s?'\"]*)\?[^\s'\"]*")
_TOKEN_SCHEMES = frozenset({"http", "https", "ftp", "ftps"})


@dataclass(frozen=True)
class GitCommit:
    """What a git URI names: ``sha`` as seen on ``ref`` of ``repository``."""

    repository: str
    ref: str
    sha: str


def git_uri(repository: str, ref: str, sha: str) -> str:
    """The URI minted for ``sha`` on ``ref`` of ``repository`` (named by its identity:
    credentials never reach a URI)."""
    return f"{URI_PREFIX}{repository_identity(repository)}#{ref}@{sha}"


def repository_identity(repository: str) -> str:
    """The repository as Stovepipe names it in URIs, messages and cache names: a URL
    without its credentials — the password always, and for http(s), where tokens travel as
    user names and query parameters, the whole user part, the query and the fragment.
    scp-like addresses (``git@host:path``) and local paths carry none and stay as written.
    So rotating a credential changes no URI, and no URI shows one."""
    if not _URL.match(repository):
        return repository
    parts = urlsplit(repository)
    userinfo, at, host = parts.netloc.rpartition("@")
    tokens_travel = parts.scheme.lower() in _TOKEN_SCHEMES
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{host}" if at and user and not tokens_travel else host
    query, fragment = ("", "") if tokens_travel else (parts.query, parts.fragment)
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def repository_path(repository: str) -> str | None:
    """The repository's path on its host, without host, credentials or ``.git``: what
    GitHub calls ``full_name`` and GitLab ``path_with_namespace``
    (``git@github.com:acme/monorepo.git`` and ``https://token@github.com/acme/monorepo``
    both give ``acme/monorepo``). None for a local path or a ``file:`` URL, which name no
    hosted repository."""
    if _URL.match(repository):
        parts = urlsplit(repository)
        if parts.scheme.lower() == "file":
            return None
        path = parts.path
    elif is_remote_url(repository):  # scp-like: host:path, or user@host:path
        path = repository.split(":", 1)[1]
    else:
        return None
    path = path.strip("/").removesuffix(".git").strip("/")
    return path or None


def redact(text: str) -> str:
    """``text`` (git's own messages) with the credentials of any URL in it removed."""
    return _URL_QUERY.sub(r"\1", _URL_USERINFO.sub(r"\1", text))


def parse_uri(uri: str) -> GitCommit:
    """The commit a git URI names. Raises CommitNotFound for anything else.

    Unambiguous because a sha is hex and a ref never contains '#' (`check_branch_name`);
    the repository is whatever precedes the last '#'."""
    rest, _, sha = uri.removeprefix(URI_PREFIX).rpartition("@")
    repository, _, ref = rest.rpartition("#")
    if not (uri.startswith(URI_PREFIX) and _SHA.fullmatch(sha) and repository and ref):
        raise CommitNotFound(f"{uri!r} is not a git commit URI "
                             f"(want {URI_PREFIX}<repository>#<ref>@<full sha>)")
    return GitCommit(repository, ref, sha)


def is_remote_url(repository: str) -> bool:
    """Whether git reads ``repository`` as a URL (scheme://…, or scp-like host:path) rather
    than a local path; the same rule git applies."""
    return bool(_URL.match(repository)
                or (_SCP_LIKE.match(repository) and not repository.startswith(("./", "/"))))


def check_branch_name(name: str) -> str:
    """``name`` if it is a usable branch name (without ``refs/heads/``), else ValueError.

    A subset of git's rule (git check-ref-format), plus no '#' so URIs stay unambiguous."""
    problem = None
    if not name:
        problem = "it is empty"
    elif name.startswith("refs/"):
        problem = "give the branch name without 'refs/…', e.g. 'main'"
    elif name.startswith(("-", "/", ".")) or name.endswith(("/", ".", ".lock")):
        problem = "it starts with '-', '/' or '.', or ends with '/', '.' or '.lock'"
    elif ".." in name or "//" in name or "@{" in name or name == "@" or "/." in name:
        problem = "it contains '..', '//', '/.' or '@{', or is '@'"
    elif (bad := _BAD_REF_CHARS.search(name)) is not None:
        problem = f"it contains {bad.group()!r}"
    if problem:
        raise ValueError(f"invalid branch name {name!r}: {problem}")
    return name


def cache_name(url: str) -> str:
    """The cache directory name of a remote: readable, and unique per URL."""
    tail = url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", tail).strip(".-")[:40] or "repo"
    return f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:16]}.git"
