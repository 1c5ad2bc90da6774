"""The Notifier contract: how one queue tells the outside world about its commits and its
greenness (issue 11).

A `Notice` is one thing to say — a commit status (`pending`, `success`, `failure`,
`error`) or an alert (`red`, `green`, `stale`, `culprit`) — with the ids it is about. A notifier
posts it to one channel (GitHub's commit statuses, a JSON webhook, a Slack incoming
webhook) and classifies its own failures: `NotifyError.retryable` (HTTP 5xx, 408, 429,
rate limits, timeouts, refused connections), optionally with how long the service asked
to be left alone (`retry_after`); anything else is permanent and the notice is given up.
A notice whose turn in a rate budget is not yet due is `NotifyPostponed`: nothing failed.

Secrets (tokens, webhook URLs) are handed to a notifier by whoever builds it; they never
appear in an error message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

STATUS_STATES = ("pending", "success", "failure", "error")
ALERT_EVENTS = ("red", "green", "stale", "culprit")


class NotifyError(Exception):
    """A notice was not delivered. Non-retryable unless marked."""

    def __init__(self, message: str, *, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class NotifyPostponed(Exception):
    """The notice was not posted, and nothing failed: the channel's budget gives it its
    turn only ``delay`` seconds from now (or its credential is paused after a rate
    limit). Its sender posts it then, without counting an attempt."""

    def __init__(self, delay: float, message: str) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass(frozen=True)
class Notice:
    """One commit status or alert about ``queue`` — or, with ``project``, about that
    project of the queue (its scope's statuses and greenness).

    ``event`` is a status state (STATUS_STATES) for ``kind == "status"`` and an alert
    event (ALERT_EVENTS) for ``kind == "alert"``. ``sha`` is the commit ``uri`` names
    (None when its source control cannot say); ``link`` is where a person reads more (the
    Request in Stovepipe's API), None without a public URL. ``at`` is when the cause was
    recorded (ISO 8601). ``details`` carries what a kind adds: ``description`` for a
    status; ``latest_request_id`` and ``behind_since`` for a stale alert; for a red alert
    ``culprit`` (sha, subject, author, committed_at, request_id, link, builds, found_at,
    ``confirmed`` and ``unconfirmed_reason``) when the commit that broke the branch is
    known, ``bisecting`` (commits left, builds) while it is being looked for; a
    ``culprit`` alert (the culprit found after the red alert) carries ``culprit`` and
    ``red_since``. A culprit with ``confirmed`` false is a break that is not confirmed as
    the one the head is red for, and must be worded so ("a break, not confirmed as the
    head's"). A status of a project the head does not affect carries ``inherited_from``
    (the sha of the commit whose answer it inherits; ``request_id`` is that commit's
    Request); a red alert of a queue with projects, ``red_projects`` (its blocking
    projects red at the head)."""

    kind: Literal["status", "alert"]
    event: str
    queue: str  # the queue, never a project's scope
    request_id: str | None
    uri: str | None
    sha: str | None
    at: str
    link: str | None = None
    previous: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    project: str | None = None  # the queue's project it is about; None: the whole repository


class Notifier(Protocol):
    async def send(self, notice: Notice) -> None:
        """Deliver ``notice``; raise NotifyError when it was not delivered."""
        ...
