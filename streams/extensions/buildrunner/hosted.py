"""What the hosted-CI build runners share (Buildkite, GitHub Actions): one HTTP client per
runner, the classification of every failure, the token, and their queues.yaml value types.

Failures are `BuildRunnerError`s whose message names the provider, the method and path and
the answer, never the token (it is read from the environment variable the queue names, at
each call, and appears in no message, repr or log):

| failure                                           | retryable | waits (``retry_after``) |
|---------------------------------------------------|-----------|-------------------------|
| 429 Too Many Requests                             | yes       | (1)                     |
| 403 that the provider marks as a rate limit       | yes       | (1)                     |
| 408, 5xx                                          | yes       | ``Retry-After``, if any |
| a timeout, a refused or dropped connection        | yes       | the topic's backoff     |
| 401, 403, 404, 422, any other answer              | no        |                         |
| a missing token variable, a URI not git's         | no        |                         |

(1) ``Retry-After`` (seconds or an HTTP date), else the provider's rate-limit reset
header, else 60 s. A rate limit also pauses the credential for that long, for every call
of every runner and notifier on it (`streams.extensions.budget`): a call asked meanwhile
is not sent and fails the same way (retryable, ``retry_after`` the pause's remainder).

Every call first waits its turn in the credential's budget; a call that creates content
on GitHub (no GET) also in the token's content budget.

The delivery runtime retries no earlier than ``retry_after`` (streams/runtime/policy.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import BeforeValidator

from store.entities import BuildStatus, split_scope
from streams.extensions.budget import (
    Budget,
    BudgetWait,
    budget_for,
    budget_key,
    content_budget_for,
    pause,
    take_turns,
)
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.extensions.sourcecontrol.contract import CommitNotFound
from streams.extensions.sourcecontrol.gituri import GitCommit, check_branch_name, parse_uri
from streams.schema.fields import is_env_name

DEFAULT_REQUEST_TIMEOUT = 10.0  # seconds, per HTTP request
DEFAULT_RATE_LIMIT_WAIT = 60.0  # a rate limit that does not say how long
_MESSAGE_LIMIT = 300  # characters of a provider's error message kept in ours
_TOKEN_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,99}")
_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
CORRELATION_PREFIX = "sp-"

# --- queues.yaml value types ------------------------------------------------------------


def _token_env_name(value: object) -> str:
    # the value is never echoed: a token pasted here by mistake must not reach a message
    # (and upper case only turns away the tokens GitHub and Buildkite issue)
    if not isinstance(value, str) or not _TOKEN_ENV_NAME.fullmatch(value):
        raise ValueError("expected the NAME of the environment variable holding the token "
                         "(upper-case letters, digits and '_', e.g. BUILDKITE_API_TOKEN), "
                         "never the token itself; the value given is not shown")
    return value


def _api_url(value: object) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.username or parts.password or parts.query or parts.fragment):
        raise ValueError(f"expected an http(s) URL without credentials, query or fragment, "
                         f"e.g. https://api.example.com, got {value!r}")
    assert isinstance(value, str)
    return value.rstrip("/")


def _slug(value: object) -> str:
    if not isinstance(value, str) or not _SLUG.fullmatch(value):
        raise ValueError(f"expected a slug (letters, digits, '.', '_' and '-'), got {value!r}")
    return value


def _branch(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a branch name, got {value!r}")
    return check_branch_name(value)


def _extra_env(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of variable names to strings, got {value!r}")
    for name, text in value.items():
        if not is_env_name(name):
            raise ValueError(f"{name!r} is not an environment variable name (letters, "
                             f"digits and '_', not starting with a digit)")
        if name.startswith("STOVEPIPE_"):
            raise ValueError(f"{name!r}: the STOVEPIPE_ variables are set by Stovepipe")
        if not isinstance(text, str):
            raise ValueError(f"{name!r}: expected a string value, got {text!r}")
    return dict(value)


TokenEnvName = Annotated[str, BeforeValidator(_token_env_name)]
ApiUrl = Annotated[str, BeforeValidator(_api_url)]
Slug = Annotated[str, BeforeValidator(_slug)]
BranchName = Annotated[str, BeforeValidator(_branch)]
ExtraEnv = Annotated[dict[str, str], BeforeValidator(_extra_env)]


def check_slug(value: str, what: str) -> str:
    """``value`` if it is a slug, else ValueError naming ``what``."""
    try:
        return _slug(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


# --- what a trigger builds --------------------------------------------------------------


@dataclass(frozen=True)
class Commits:
    """The commits a trigger names, read from their git URIs."""

    head: GitCommit
    base: GitCommit | None

    @classmethod
    def of(cls, provider: str, base_uri: str | None, head_uri: str) -> Commits:
        """Raises a non-retryable BuildRunnerError for a URI that is not a git commit's."""
        try:
            return cls(parse_uri(head_uri), parse_uri(base_uri) if base_uri else None)
        except CommitNotFound as exc:
            raise BuildRunnerError(f"{provider}: builds git commits only: {exc}") from None


def correlation_id(metadata: Mapping[str, str], base_uri: str | None, head_uri: str) -> str:
    """The id a build carries so that the trigger that started it can find it again.

    Derived from the trigger key and the commits, so a trigger repeated after a crash (same
    key) finds the build the first one started, and a build found this way builds exactly
    what was asked. Without a trigger key it is random: every trigger is a new build."""
    key = metadata.get("trigger_key", "")
    if not key:
        return CORRELATION_PREFIX + secrets.token_hex(12)
    digest = hashlib.sha256(f"{key}\n{base_uri or ''}\n{head_uri}".encode()).hexdigest()
    return CORRELATION_PREFIX + digest[:24]


def build_environment(commits: Commits, metadata: Mapping[str, str], base_uri: str | None,
                      head_uri: str) -> dict[str, str]:
    """What the build sees as STOVEPIPE_* (URIs carry no credentials: design §8). A
    project's build (its scope `<queue>#<project>`) names its queue and its project."""
    queue, project = split_scope(metadata.get("queue", ""))
    return {
        "STOVEPIPE_HEAD_SHA": commits.head.sha,
        "STOVEPIPE_BASE_SHA": commits.base.sha if commits.base else "",
        "STOVEPIPE_HEAD_URI": head_uri,
        "STOVEPIPE_BASE_URI": base_uri or "",
        "STOVEPIPE_QUEUE": queue,
        "STOVEPIPE_PROJECT": project or "",
        "STOVEPIPE_REQUEST_ID": metadata.get("request_id", ""),
        "STOVEPIPE_STRATEGY": metadata.get("strategy", ""),
    }


# --- what a provider says of a build -------------------------------------------------


def provider_time(value: object) -> datetime | None:
    """A provider's ISO 8601 timestamp (``2015-05-09T21:05:59.874Z``) as an aware datetime;
    None when absent or not a time (a time without a zone is taken as UTC)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class Ending:
    """How a build its provider reports over ended, in Stovepipe's terms, as a runner
    tells it from what the provider answers (its jobs, their annotations)."""

    status: BuildStatus
    unvalidated: str = ""  # could not validate the commit: why, in words
    permanent: bool = False  # ... and building it again would end the same way
    waiting: str = ""  # not over after all: what it waits for
    detail: str = ""  # a red (or cancelled) one: what failed

    def report(self, metadata: Mapping[str, str],
               started_at: datetime | None = None) -> BuildReport:
        """The `BuildReport` of this ending (``detail`` joins the metadata)."""
        return BuildReport(self.status, {**metadata, **({"detail": self.detail}
                                                       if self.detail else {})},
                           self.unvalidated, permanent=self.permanent,
                           waiting=self.waiting, started_at=started_at)


def job_label(job: Mapping[str, Any], *fields: str) -> str:
    """A job's name for a reason in words: the first of ``fields`` it has, quoted and
    bounded."""
    name = next((job[f] for f in fields if job.get(f)), "?")
    return repr(" ".join(str(name).split())[:80])


def listed(what: str, items: list[str], most: int = 5) -> str:
    """``what`` (made plural for more than one) and the first ``most`` of ``items``."""
    shown = "; ".join(items[:most])
    more = f"; and {len(items) - most} more" if len(items) > most else ""
    return f"{what}{'s' if len(items) > 1 else ''} {shown}{more}"


ENDINGS_KEPT = 1000  # builds whose ending a runner remembers (`Endings`)


class Endings:
    """What a runner found out, with extra calls, about how a build ended (its jobs, their
    annotations), remembered per build for as long as the build answers the same: a
    build polled again (a redelivery, a duplicate loop, a status stored meanwhile) costs
    no second look. Bounded: the oldest are forgotten first."""

    def __init__(self, kept: int = ENDINGS_KEPT) -> None:
        self._kept = kept
        self._found: OrderedDict[Hashable, tuple[Hashable, Any]] = OrderedDict()

    def get(self, build: Hashable, answer: Hashable) -> Any | None:
        """What was found of ``build`` while it answered ``answer`` (None: nothing)."""
        found = self._found.get(build)
        if found is None or found[0] != answer:
            return None
        self._found.move_to_end(build)
        return found[1]

    def put(self, build: Hashable, answer: Hashable, ending: Any) -> None:
        self._found[build] = (answer, ending)
        self._found.move_to_end(build)
        while len(self._found) > self._kept:
            self._found.popitem(last=False)


# --- the HTTP client --------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any  # parsed JSON; None for an empty body


RateLimitWait = Callable[[int, Mapping[str, str], str], float | None]


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """A ``Retry-After`` header as seconds from now: delta-seconds or an HTTP date."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            moment = parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        seconds = moment - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


class HostedApi:
    """One provider's REST API as a runner calls it: a bearer token read from
    ``token_env`` at every call, ``timeout`` seconds per request, one aiohttp session per
    event loop (tests run several loops), every failure a classified BuildRunnerError.

    ``rate_limit_wait(status, headers, message)`` says, for an answer that is a rate limit
    in the provider's own words, how long to wait (None when it is no rate limit)."""

    def __init__(self, provider: str, api_url: str, token_env: str, *,
                 timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 headers: Mapping[str, str] | None = None,
                 rate_limit_wait: RateLimitWait | None = None,
                 environ: Mapping[str, str] | None = None,
                 requests_per_minute: float | None = None,
                 budget_scope: str | None = None,
                 budget_name: str | None = None,
                 content_per_hour: float | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if requests_per_minute is not None and requests_per_minute <= 0:
            raise ValueError(f"requests_per_minute must be positive, got "
                             f"{requests_per_minute}")
        if content_per_hour is not None and content_per_hour <= 0:
            raise ValueError(f"content_per_hour must be positive, got {content_per_hour}")
        self.provider = provider
        self.api_url = api_url.rstrip("/")
        self.token_env = token_env
        self.timeout = timeout
        # the deployment's share of the credential's limit (None: no budget); the limit
        # belongs to ``budget_scope`` when given (Buildkite: the organization), else to
        # the token
        self.requests_per_minute = requests_per_minute
        self.budget_scope = budget_scope
        self.budget_name = budget_name or provider  # one name per provider's limits
        # calls that are no GET also draw from the credential's budget of content-creating
        # calls (GitHub's secondary limit), when given
        self.content_per_hour = content_per_hour
        self._headers = {"User-Agent": "stovepipe", **(headers or {})}
        self._rate_limit_wait = rate_limit_wait or (lambda status, headers, message: None)
        self._environ = environ if environ is not None else os.environ
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return (f"HostedApi({self.provider!r}, {self.api_url!r}, "
                f"token_env={self.token_env!r})")

    def token(self) -> str:
        """The token, from the environment; a missing or empty variable is a configuration
        error naming the variable (never retried: it will not appear by itself)."""
        token = self._environ.get(self.token_env, "").strip()
        if not token:
            raise BuildRunnerError(f"{self.provider}: the environment variable "
                                   f"{self.token_env} (the queue's token_env) is not set or "
                                   f"empty; set it to the API token in every worker's "
                                   f"environment")
        return token

    def budget(self) -> Budget | None:
        """The worker's budget for this API's credential (shared with every runner and
        notifier on it), None without one."""
        if self.requests_per_minute is None:
            return None
        credential = self.budget_scope or self.token()
        return budget_for(budget_key(self.budget_name, self.api_url, credential),
                          self.requests_per_minute)

    def budgets(self, method: str) -> tuple[Budget, ...]:
        """The budgets a ``method`` call draws from: the credential's, and for a call that
        creates content its content budget too (none without a budget)."""
        budget = self.budget()
        if budget is None:
            return ()
        if method == "GET" or self.content_per_hour is None:
            return (budget,)
        return (budget, content_budget_for(budget.key, self.content_per_hour))

    async def call(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                   body: Any = None, expect: tuple[int, ...] = (200,)) -> Answer:
        """``method path`` answered with one of ``expect``; anything else raises. Waits
        for its turn in the credential's budgets first; while the credential is paused
        after a rate limit, raises a retryable error at once, without calling."""
        token = self.token()
        where = f"{self.provider}: {method} {path}"
        try:
            await take_turns(self.budgets(method))
        except BudgetWait as exc:
            raise BuildRunnerError(f"{where}: {exc}", retryable=True,
                                   retry_after=exc.wait) from None
        headers = {**self._headers, "Authorization": f"Bearer {token}"}
        try:
            async with self._client().request(method, self.api_url + path, params=params,
                                              json=body, headers=headers) as response:
                raw = await response.read()
                status, reason = response.status, response.reason or ""
                answer_headers = {k.lower(): v for k, v in response.headers.items()}
        except TimeoutError:
            raise BuildRunnerError(f"{where}: no answer within {self.timeout:g}s",
                                   retryable=True) from None
        except aiohttp.InvalidURL as exc:
            raise BuildRunnerError(f"{where}: invalid URL {exc}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise BuildRunnerError(f"{where}: {_redact(_describe(exc), token)}",
                                   retryable=True) from None
        except aiohttp.ClientError as exc:
            raise BuildRunnerError(f"{where}: {_redact(_describe(exc), token)}") from None
        text = raw.decode("utf-8", "replace")
        if status not in expect:
            raise self._failure(where, status, reason, answer_headers,
                                _redact(_message_of(text), token))
        if not raw.strip():
            return Answer(status, None)
        try:
            return Answer(status, json.loads(text))
        except ValueError:
            raise BuildRunnerError(f"{where} answered {status} with a body that is not "
                                   f"JSON; is api_url {self.api_url} the API?") from None

    def _failure(self, where: str, status: int, reason: str, headers: Mapping[str, str],
                 message: str) -> BuildRunnerError:
        said = f"{where} answered {status} {reason}".rstrip() + (f": {message}" if message
                                                                 else "")
        limited = self._rate_limit_wait(status, headers, message)
        asked = retry_after_seconds(headers.get("retry-after"))
        if status == 429 or limited is not None:
            wait = asked if asked is not None else (
                limited if limited is not None else DEFAULT_RATE_LIMIT_WAIT)
            budget = self.budget()
            if budget is not None:  # nobody calls the credential before the limit allows
                pause(budget.key, wait)
            return BuildRunnerError(f"{said} (rate limited; retry in {wait:.0f}s)",
                                    retryable=True, retry_after=wait)
        if status == 408 or status >= 500:
            return BuildRunnerError(said + (f" (retry in {asked:.0f}s)" if asked else ""),
                                    retryable=True, retry_after=asked)
        if status == 401:
            said += f" (is the token in {self.token_env} valid?)"
        return BuildRunnerError(said)

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout))
            self._session_loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close this event loop's session (a worker calls it when it stops)."""
        session, self._session = self._session, None
        if session is not None and not session.closed \
                and self._session_loop is asyncio.get_running_loop():
            await session.close()


def _message_of(text: str) -> str:
    """The provider's own words from an error body (``message``, GitHub's and Buildkite's
    field), bounded."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    message = parsed.get("message") if isinstance(parsed, dict) else None
    found = message if isinstance(message, str) else text
    found = " ".join(found.split())
    return found if len(found) <= _MESSAGE_LIMIT else found[:_MESSAGE_LIMIT] + "…"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _redact(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def number_header(headers: Mapping[str, str], name: str) -> float | None:
    """A numeric header's value (None when absent or not a number)."""
    try:
        value = float(headers.get(name, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None
