"""`github_status`: commit statuses on GitHub (REST: "Create a commit status").

``POST {api_url}/repos/{owner}/{repo}/statuses/{sha}`` with
``{"state", "target_url", "description", "context"}``, authenticated with a token that
may write commit statuses (classic: ``repo:status``; fine-grained: "Commit statuses:
write"). A Request's statuses: ``pending`` when it is admitted to build, then ``success``
with a green fact, ``failure`` with a red one, ``error`` when it ended without a fact
(cancelled, or failed by a reconciler). GitHub answers 201; 401, 404, 422 and a 403 that
is no rate limit are permanent (a bad token, no access, an unknown repository or commit),
5xx and GitHub's rate limits are retried. A rate limit is read as the github_actions runner reads it
(`github_actions.github_rate_limit`): a 403 or 429 with ``x-ratelimit-remaining: 0``
waits until ``x-ratelimit-reset``, one with ``retry-after`` that long, and a secondary
limit that says neither (a 403 or 429 whose message says "secondary rate limit", often
with ``x-ratelimit-remaining`` above 0) a minute at first, then — while GitHub keeps limiting
this notifier — as long as the limiting has lasted so far, so the waits double, up to
`LIMIT_WAIT_CAP` (GitHub: "wait for at least one minute ... then for an exponentially
increasing amount of time").

Budgets: a status draws a turn from the token's budget (shared with any github_actions
runner on the same token) and from the token's budget of content-creating calls
(``content_requests_per_hour``, default 400: below the about 500 an hour GitHub allows).
A status whose turn is more than `TURN_WAIT` seconds away is postponed to it (looked at
again within `TURN_RECHECK`: the share may grow), and every status while the token is
paused, until the pause ends (`NotifyPostponed`); a rate-limit answer
pauses the token for every caller on it, polls and dispatches included
(`streams.extensions.budget`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar
from urllib.parse import quote, urlsplit

from pydantic import BeforeValidator
from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions.budget import (
    CredentialPaused,
    TurnTooFar,
    budget_for,
    budget_key,
    content_budget_for,
    pause,
    take_turns,
)
from streams.extensions.buildrunner.github_actions import (
    DEFAULT_CONTENT_REQUESTS_PER_HOUR,
    DEFAULT_REQUESTS_PER_MINUTE,
    GITHUB_BUDGET,
    github_rate_limit,
)
from streams.extensions.notify.contract import Notice, NotifyError, NotifyPostponed
from streams.extensions.notify.http import post_json
from streams.extensions.sourcecontrol.gituri import repository_identity
from streams.schema.fields import SPEC, NonEmptyStr, PositiveFloat, SecretEnvName

DEFAULT_API_URL = "https://api.github.com"
DEFAULT_CONTEXT = "stovepipe/validation"
API_VERSION = "2022-11-28"
DESCRIPTION_LIMIT = 140  # GitHub keeps descriptions short
LIMIT_WAIT_CAP = 600.0  # seconds: the longest wait the sender honours (stages/notify.py)
LIMIT_STREAK_GAP = 2 * LIMIT_WAIT_CAP  # seconds without a rate limit that end a streak
TURN_WAIT = 5.0  # seconds a status waits for its budget's turn; a later turn postpones it
# a status postponed for its turn is looked at again after at most this many seconds (the
# share may have grown meanwhile: the worker counted the others, or some stopped)
TURN_RECHECK = 10.0
_clock = time.monotonic
_OWNER_REPO = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")
_GITHUB_REMOTE = re.compile(
    r"(?:https?://(?:[^/@]*@)?github\.com/|ssh://git@github\.com/|git@github\.com:)"
    r"(?P<repo>[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+?)(?:\.git)?/?")


def _owner_repo(value: object) -> str:
    if not isinstance(value, str) or not _OWNER_REPO.fullmatch(value):
        raise ValueError(f"expected owner/name of a GitHub repository, e.g. acme/monorepo, "
                         f"got {value!r}")
    return value


def _http_url(value: object) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc \
            or parts.username or parts.password:
        raise ValueError(f"expected an http(s) URL without credentials, got {value!r}")
    return str(value).rstrip("/")


HttpUrl = Annotated[str, BeforeValidator(_http_url)]


def _unaffected(value: object) -> object:
    """``unaffected``: ``none`` (the default), ``all``, or a list of project names."""
    if value is None or value == "none":
        return ()
    if value == "all":
        return "all"
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(f"expected all, none or a list of the queue's project names, e.g. "
                     f"[api, web], got {value!r}")


Unaffected = Annotated[str | tuple[str, ...], BeforeValidator(_unaffected)]


def github_repository(repository: str | None) -> str | None:
    """owner/name when ``repository`` (a git URL) is on github.com; None otherwise."""
    if repository is None:
        return None
    match = _GITHUB_REMOTE.fullmatch(repository_identity(repository))
    return match["repo"] if match else None


@spec_dataclass(frozen=True, config=SPEC)
class GitHubStatusSpec:
    """``notify.github_status`` in queues.yaml."""

    token_env: SecretEnvName
    # owner/name; None: taken from the queue's git repository when it is on github.com
    repository: Annotated[str, BeforeValidator(_owner_repo)] | None = None
    api_url: HttpUrl = DEFAULT_API_URL
    context: NonEmptyStr = DEFAULT_CONTEXT
    # a queue with projects: the projects whose `stovepipe/<project>` status is set on
    # the heads that do not affect them (the answer they inherit); none by default, as
    # each costs a content-creating call to GitHub per head (docs/guide.md, "Commit statuses
    # and alerts")
    unaffected: Unaffected = ()
    # the token's content-creating calls an hour (statuses, and a github_actions runner's
    # dispatches and cancels on the same token), divided among the workers
    content_requests_per_hour: PositiveFloat = DEFAULT_CONTENT_REQUESTS_PER_HOUR
    channel: ClassVar[str] = "github_status"

    def env_names(self) -> tuple[str, ...]:
        return (self.token_env,)

    def posts_unaffected(self, project: str) -> bool:
        """Whether ``project`` gets a status on the heads that do not affect it."""
        return self.unaffected == "all" or (isinstance(self.unaffected, tuple)
                                            and project in self.unaffected)

    def build(self, env: Mapping[str, str]) -> GitHubStatusNotifier:
        if self.repository is None:
            raise NotifyError("github_status has no repository", retryable=False)
        return GitHubStatusNotifier(self.api_url, self.repository, env[self.token_env],
                                    self.context,
                                    content_per_hour=self.content_requests_per_hour)


class GitHubStatusNotifier:
    """Posts a commit status per status notice; alerts are not its business."""

    def __init__(self, api_url: str, repository: str, token: str, context: str, *,
                 content_per_hour: float = DEFAULT_CONTENT_REQUESTS_PER_HOUR) -> None:
        self.api_url, self.repository, self.context = api_url.rstrip("/"), repository, context
        self._token = token
        self.content_per_hour = content_per_hour
        # the token's budget: shared with any GitHub Actions runner using the same token
        self._credential = budget_key(GITHUB_BUDGET, self.api_url, token)
        # monotonic seconds: when GitHub began limiting us without saying for how long,
        # and when it last did (None: it is not limiting us)
        self._limited_since: float | None = None
        self._limited_last = 0.0

    def __repr__(self) -> str:  # never the token
        return f"GitHubStatusNotifier({self.api_url!r}, {self.repository!r})"

    def body(self, notice: Notice) -> dict[str, Any]:
        body: dict[str, Any] = {"state": notice.event, "context": self.context,
                                "description": describe(notice)[:DESCRIPTION_LIMIT]}
        if notice.link:
            body["target_url"] = notice.link
        return body

    async def send(self, notice: Notice) -> None:
        if notice.kind != "status":
            raise NotifyError(f"github_status posts commit statuses, not {notice.kind}s")
        if not notice.sha:
            raise NotifyError(f"{notice.uri!r} names no commit GitHub could know")
        owner, _, name = self.repository.partition("/")
        url = (f"{self.api_url}/repos/{quote(owner, safe='')}/{quote(name, safe='')}"
               f"/statuses/{quote(notice.sha, safe='')}")
        try:
            await take_turns((budget_for(self._credential, DEFAULT_REQUESTS_PER_MINUTE),
                              content_budget_for(self._credential, self.content_per_hour)),
                             max_wait=TURN_WAIT)
        except CredentialPaused as exc:
            raise NotifyPostponed(exc.wait, f"GitHub: {exc}") from None
        except TurnTooFar as exc:
            raise NotifyPostponed(min(exc.wait, TURN_RECHECK), f"GitHub: {exc}") from None
        await post_json("GitHub", url, self.body(notice), headers={
            "Accept": "application/vnd.github+json",
            "Authorization": f"Bearer {self._token}",
            "X-GitHub-Api-Version": API_VERSION,
            "User-Agent": "stovepipe",
        }, rate_limit=self._rate_limit)
        self._limited_since = None  # accepted: any limiting is over

    def _rate_limit(self, status: int, headers: Mapping[str, str], body: str) -> float | None:
        """Seconds to wait when GitHub's answer is a rate limit (see the module
        docstring), None when it is not."""
        limit = github_rate_limit(status, headers, body)
        if limit is None:
            return None
        if limit.stated:
            wait = limit.wait
        else:
            now = _clock()
            if self._limited_since is None or now - self._limited_last > LIMIT_STREAK_GAP:
                self._limited_since = now
            self._limited_last = now
            # a minute at first; while it goes on, as long as it has lasted: 60, 60, 120 …
            wait = min(max(limit.wait, now - self._limited_since), LIMIT_WAIT_CAP)
        pause(self._credential, wait)  # no call on the token before the limit allows
        return wait


def describe(notice: Notice) -> str:
    """The status's one-line description."""
    request = notice.request_id or "?"
    source = notice.details.get("inherited_from")
    if source and notice.event in ("success", "failure"):
        # an unaffected project: the answer of the commit it inherits from, and its Request
        colour = "green" if notice.event == "success" else "red"
        return f"Unaffected: inherits {colour} from {str(source)[:12]} ({request})"
    green = (f"Green on attempt {notice.details.get('attempts')} after a red build "
             f"(flaky; {request})" if notice.details.get("flaky")
             else f"Green: validated by {request}")
    text = {"pending": f"Validating ({request})",
            "success": green,
            "failure": f"Red: the build failed ({request})"}.get(notice.event)
    if text is None:
        reason = notice.details.get("description") or "no result"
        text = f"No verdict: {reason} ({request})"
    return text
