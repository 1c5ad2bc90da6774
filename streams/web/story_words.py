"""The branch's story in words (issue 18, Deliver 3, 4): what `streams.web.story` tells,
and the pure functions that word it — `request_words`, `unbuilt_words`, `search_view`,
`summary` — from what the reads found, so they are tested without a database."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from store import (
    Build,
    BuildStatus,
    Request,
    RequestKind,
    RequestState,
    ValidationFact,
    Verdict,
    request_order,
)
from store.culprits import CulpritSearch, SearchState
from streams.web.queries import Pin

MAX_STORY = 100  # entries told at most, newest first

# --- what the story is made of ----------------------------------------------------------


@dataclass(frozen=True)
class CommitView:
    """A commit as a person recognises it (sha, subject, author: None until described)."""

    uri: str
    sha: str | None
    subject: str | None
    author: str | None
    committed_at: datetime | None

    @property
    def name(self) -> str:
        """``1a2b3c4d5e6f "subject"``, or the URI while the commit is not described."""
        if self.sha is None:
            return self.uri
        return f'{self.sha[:12]} "{self.subject}"' if self.subject else self.sha[:12]


@dataclass(frozen=True)
class BuildView:
    id: str
    status: str
    url: str | None  # the provider's page, the command runner's log, or None
    attempt: int
    started_at: datetime
    running_for_s: float | None  # while it is not over: seconds since it was started


@dataclass(frozen=True)
class Entry:
    """One line of the story: a Request, or a commit of the search's range never built
    (``request_id`` None, ``kind`` "commit", ``state`` "unbuilt")."""

    request_id: str | None
    uri: str
    sha: str | None
    subject: str | None
    author: str | None
    kind: str
    state: str
    verdict: str | None
    words: str
    build: BuildView | None
    bookmark: bool  # the queue's last green commit
    culprit: bool  # the commit the current search named


@dataclass(frozen=True)
class CulpritView:
    """"Red since C": the commit the current search named. ``confirmed``: it is the break
    the red head is red for (every commit from it to the head is known red); otherwise it
    is a break, not confirmed as the head's, for ``unconfirmed_reason``."""

    uri: str
    sha: str | None
    subject: str | None
    author: str | None
    committed_at: datetime | None
    request_id: str | None
    build: BuildView | None
    red_since: datetime  # when the search was opened (the red verdict after the green)
    found_at: datetime | None
    confirmed: bool = True
    unconfirmed_reason: str | None = None


@dataclass(frozen=True)
class SearchView:
    state: str  # bisecting, found, fixed, budget_spent, inconclusive, no_range
    words: str
    red_request_id: str
    red_uri: str
    green_uri: str | None
    commits: int  # commits of the range after its green end
    commits_left: int  # the culprit is among these (1 once found)
    builds: int  # backfill builds that ran (gave a verdict)
    max_builds: int
    opened_at: datetime
    ended_at: datetime | None
    confirmed: bool | None = None  # found: whether the culprit is confirmed as the head's
    candidate_uri: str | None = None  # bisecting: a break found, being confirmed
    waiting_until: datetime | None = None  # bisecting: a commit is probed again then


@dataclass(frozen=True)
class Promotion:
    ref: str | None  # None: the queue promotes nothing
    uri: str | None  # where it points now; None: nowhere yet, or the repository is away
    known: bool  # the repository answered
    pinned: Pin | None  # None: it follows the bookmark


@dataclass(frozen=True)
class Story:
    queue: str
    bookmark: Entry | None
    promotion: Promotion
    head: Entry | None  # the newest head
    culprit: CulpritView | None
    search: SearchView | None
    summary: str
    story: list[Entry]
    cut: bool  # older entries were left out (MAX_STORY)


# --- the words --------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 5 s``, ``2 h 10 min``, ``3 d 4 h``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min" if s % 3600 // 60 else f"{s // 3600} h"
    return f"{s // 86400} d {s % 86400 // 3600} h" if s % 86400 // 3600 else f"{s // 86400} d"


def moment(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def build_words(request: Request, build: Build | None, now: datetime) -> str:
    """What a processing Request's current attempt is doing."""
    attempt = max(request.attempt, 1)
    if build is None or build.attempt < attempt:
        if request.attempt_due_in > 0:
            why = ("a red build is run again (retry.red)" if request.red_reruns
                   else "an attempt could not validate")
            return f"attempt {attempt} starts in {duration(request.attempt_due_in)} ({why})"
        return f"admitted: starting its build (attempt {attempt})"
    since = duration((now - build.created_at).total_seconds())
    if build.status is BuildStatus.ACCEPTED:
        return (f"queued at the build runner for {since} (attempt {build.attempt}, "
                f"triggered {moment(build.created_at)})")
    if build.status is BuildStatus.RUNNING:
        return (f"building for {since} (attempt {build.attempt}, started "
                f"{moment(build.created_at)})")
    return f"attempt {build.attempt} ended {build.status.value}; its outcome is being settled"


def request_words(request: Request, build: Build | None, fact: ValidationFact | None, *,
                  now: datetime, newer_head: Request | None,
                  holders: Sequence[tuple[Request, Build | None]],
                  search: CulpritSearch | None, name: Callable[[str], str]) -> str:
    """A Request's state and why, in words. ``newer_head``: the next newer head (None: it
    is the newest); ``holders``: the queue's processing Requests with their latest
    builds; ``search``: the current culprit search."""
    state = request.state
    if state is RequestState.SUPERSEDED:
        if request.kind is RequestKind.BACKFILL:
            return f"passed over: {request.reason or 'its culprit search ended first'}"
        if newer_head is not None:
            return (f"superseded by {newer_head.id} ({name(newer_head.uri)}), a newer head: "
                    f"never built")
        return "superseded by a newer head: never built"
    if state is RequestState.ACCEPTED:
        if request.kind is RequestKind.HEAD and newer_head is not None:
            return (f"waiting; a newer head, {newer_head.id} ({name(newer_head.uri)}), "
                    f"supersedes it when it is next looked at")
        backfill = request.kind is RequestKind.BACKFILL
        blocking = [(h, b) for h, b in holders
                    if (h.kind is RequestKind.BACKFILL) == backfill and h.id != request.id]
        behind = "; ".join(f"{h.id} ({name(h.uri)}, {build_words(h, b, now)})"
                           for h, b in blocking)
        waited = duration((now - request.created_at).total_seconds())
        if backfill:
            return (f"waiting {waited} for spare capacity (a backfill builds only while "
                    f"the heads leave a slot free)" + (f", behind {behind}" if behind else ""))
        if blocking:
            return f"waiting {waited} for a slot behind {behind}"
        return f"waiting {waited} to be admitted"
    if state is RequestState.PROCESSING:
        return build_words(request, build, now)
    if state is RequestState.SUCCEEDED:
        words = "green"
        if fact is not None and fact.flaky:
            words += " (flaky: red first, green when run again)"
        if request.attempt > 1:
            words += f" after {request.attempt} attempts"
        return words
    if state is RequestState.CANCELLED:
        return f"cancelled: {request.reason}" if request.reason else "cancelled"
    if request.verdict is not Verdict.RED:  # failed without a verdict
        reason = request.reason or "no reason recorded"
        return reason if reason.startswith("could not be validated") else (
            f"could not be validated: {reason}")
    words = "red" + (f" after {request.attempt} attempts" if request.attempt > 1 else "")
    return words + _red_words(request, search, name)


def _red_words(request: Request, search: CulpritSearch | None,
               name: Callable[[str], str]) -> str:
    if search is None:
        return ""
    confirmed = search.culprit_confirmed
    if search.culprit_uri == request.uri:
        if confirmed:
            return " — the culprit: its first parent is green and every commit after it is red"
        return (f" — a break (its first parent is green), not confirmed as the head's: "
                f"{search.unconfirmed_why}")
    if search.culprit_uri is not None and search.culprit_request_id is not None:
        if request.order > request_order(search.culprit_request_id):
            if confirmed:
                return f" — broken since the culprit {name(search.culprit_uri)}"
            return (f" — after {name(search.culprit_uri)}, a break not confirmed as the "
                    f"head's")
        return (" — a break fixed before the culprit" if confirmed
                else f" — a break fixed before {name(search.culprit_uri)}")
    left = search.hi - search.lo
    if search.state is SearchState.BISECTING:
        if search.candidate_uri == request.uri:
            return (" — a break (its first parent is green); the commits between it and "
                    "the head are being built to confirm it is the head's")
        if search.candidate_uri is not None:
            return (f" — finding the culprit: confirming the break "
                    f"{name(search.candidate_uri)}")
        return f" — finding the culprit: it is among {_plural(left, 'commit')}"
    return f" — the culprit is not known: {search.detail}"


def unbuilt_words(search: CulpritSearch, index: int, name: Callable[[str], str]) -> str:
    """A commit of the search's range that was never built (``index`` in its range)."""
    left = search.hi - search.lo
    if search.culprit_uri is not None:
        culprit = search.commits.index(search.culprit_uri)
        if not search.culprit_confirmed:
            if index > culprit:
                return (f"never built: between the break {name(search.culprit_uri)} and "
                        f"the head, so a later fix and break could hide here")
            return f"never built: before the break {name(search.culprit_uri)}"
        if index > culprit:
            return f"never built: after the culprit {name(search.culprit_uri)}"
        return "never built: before the culprit"
    if search.state is SearchState.BISECTING and search.candidate_uri is not None:
        candidate = search.commits.index(search.candidate_uri)
        if index > candidate:
            return (f"not built yet: between the break {name(search.candidate_uri)} and the "
                    f"head; built to confirm it is the head's")
        return f"not built yet: before the break {name(search.candidate_uri)}"
    if search.lo < index <= search.hi:
        if search.state is SearchState.BISECTING:
            return (f"not built yet: the culprit may be this commit (it is among "
                    f"{_plural(left, 'commit')})")
        return f"never built: the culprit is among these {_plural(left, 'commit')}"
    return "never built"


def search_view(search: CulpritSearch, name: Callable[[str], str]) -> SearchView:
    left = search.hi - search.lo
    builds = search.builds  # builds that ran: one that could not validate is not counted
    spent = f"{_plural(builds, 'backfill build')} spent (at most {search.max_builds})"
    if search.state is SearchState.FOUND:
        culprit = name(search.culprit_uri) if search.culprit_uri else "?"
        if not search.culprit_confirmed:
            words = (f"a break, not confirmed as the head's: {culprit}, found after "
                     f"{_plural(builds, 'backfill build')} ({search.unconfirmed_why})")
        elif builds == 0:
            words = (f"found {culprit}: its first parent is the last green commit, so no "
                     f"backfill build was needed")
        else:
            words = (f"found {culprit} after {_plural(builds, 'backfill build')}; "
                     f"confirmed: every commit from it to the head is red")
    elif search.state is SearchState.BISECTING:
        if search.candidate_uri is not None:
            words = (f"confirming {name(search.candidate_uri)}, a break after "
                     f"{name(search.commits[search.lo])}: the commits between it and the "
                     f"head are being built; {spent}")
        else:
            words = (f"bisecting: the culprit is among {_plural(left, 'commit')} after "
                     f"{name(search.commits[search.lo])}; {spent}")
        if search.wake_at is not None:
            words += (f"; a commit whose probe could not validate it is probed again at "
                      f"{moment(search.wake_at)}")
    elif search.state is SearchState.FIXED:
        words = f"stopped: the branch went green again ({search.detail})"
    elif search.state in (SearchState.BUDGET_SPENT, SearchState.INCONCLUSIVE):
        words = f"stopped: {search.detail}"
    else:
        words = f"not searched: {search.detail}"
    return SearchView(state=search.state.value, words=words,
                      red_request_id=search.red_request_id, red_uri=search.red_uri,
                      green_uri=search.green_uri, commits=max(len(search.commits) - 1, 0),
                      commits_left=left, builds=builds, max_builds=search.max_builds,
                      opened_at=search.created_at, ended_at=search.ended_at,
                      confirmed=search.culprit_confirmed
                      if search.state is SearchState.FOUND else None,
                      candidate_uri=search.candidate_uri
                      if search.state is SearchState.BISECTING else None,
                      waiting_until=search.wake_at
                      if search.state is SearchState.BISECTING else None)


def summary(queue: str, *, head: Entry | None, bookmark: Entry | None,
            search: SearchView | None, culprit: CulpritView | None, promotion: Promotion,
            bookmark_name: str | None, ingested: bool, cut: bool) -> str:
    """The story in one paragraph."""
    if not ingested or head is None:
        return f"{queue} has validated nothing yet."
    sentences = []
    head_name = _entry_name(head)
    if bookmark is None:
        sentences.append(f"{queue} has no green commit yet.")
    elif head.request_id == bookmark.request_id:
        sentences.append(f"{queue} is green at its newest head {head_name}.")
    elif culprit is not None:
        by = f" by {culprit.author}" if culprit.author else ""
        how = ""
        if search is not None:
            how = (f", found after {_plural(search.builds, 'backfill build')}"
                   if search.builds else ", the commit after the last green one")
        if culprit.confirmed:
            sentences.append(f"{queue} is red since {_culprit_name(culprit)}{by}{how}.")
        else:
            sentences.append(f"{queue} is red; a break, not confirmed as the head's: "
                             f"{_culprit_name(culprit)}{by}{how} "
                             f"({culprit.unconfirmed_reason}).")
    elif search is not None:
        sentences.append(f"{queue} is red; {search.words}.")
    elif head.verdict == "red":
        sentences.append(f"{queue} is red.")
    else:
        sentences.append(f"{queue} has no verdict yet on the heads after its last green "
                         f"commit.")
    if not (bookmark is not None and head.request_id == bookmark.request_id):
        sentences.append(f"The newest head is {head_name} ({head.request_id}): "
                         f"{head.words}.")
    if bookmark is not None and bookmark_name is not None:
        sentences.append(f"The bookmark, its last green commit, is {bookmark_name} "
                         f"({bookmark.request_id}).")
    if promotion.ref is not None:
        pin = promotion.pinned
        if pin is not None:
            who = f" by {pin.by}" if pin.by else ""
            when = f" since {moment(pin.at)}" if pin.at else ""
            why = f": {pin.reason}" if pin.reason else ""
            sentences.append(f"The promotion ref {promotion.ref} is pinned at {pin.uri}"
                             f"{who}{when}{why}; it does not follow the bookmark until it "
                             f"is unpinned.")
        elif not promotion.known:
            sentences.append(f"Where the promotion ref {promotion.ref} points is not known "
                             f"now (the repository did not answer).")
        elif bookmark is not None and promotion.uri == bookmark.uri:
            sentences.append(f"The promotion ref {promotion.ref} is at the bookmark.")
        else:
            where = promotion.uri or "nowhere yet"
            sentences.append(f"The promotion ref {promotion.ref} is at {where}; it follows "
                             f"the bookmark.")
    if cut:
        sentences.append(f"Only the {MAX_STORY} newest entries are told.")
    return " ".join(sentences)


def _entry_name(entry: Entry) -> str:
    if entry.sha is None:
        return entry.uri
    return f'{entry.sha[:12]} "{entry.subject}"' if entry.subject else entry.sha[:12]


def _culprit_name(culprit: CulpritView) -> str:
    return CommitView(culprit.uri, culprit.sha, culprit.subject, None, None).name
