"""Posting JSON over HTTP for the notifiers, and the one classification of its failures.

Retryable: HTTP 408, 429 and 5xx (with the service's Retry-After when it gives one),
an answer the service's own ``rate_limit`` rule calls a rate limit (GitHub's 403s, with
the wait that rule gives), timeouts, refused or reset connections and other transport
errors. Anything else a service answers is permanent. Error messages name the service and
the status, never the URL (a Slack webhook URL is a secret) or a header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from streams.extensions.notify.contract import NotifyError

DEFAULT_TIMEOUT = 10.0  # seconds for one whole request: connect, send, answer
_BODY_EXCERPT = 200  # characters of an error answer kept in the message
_RETRYABLE_STATUSES = frozenset({408, 429})


RateLimit = Callable[[int, Mapping[str, str], str], float | None]
"""A service's own reading of an error answer (status, headers with lower-case names,
body): the seconds to wait when the answer is a rate limit, None when it is not."""


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds the service asked us to wait (Retry-After as seconds or an HTTP date);
    None when it said nothing."""
    value = headers.get("Retry-After")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def classify_answer(service: str, status: int, headers: Mapping[str, str],
                    body: str, rate_limit: RateLimit | None = None) -> NotifyError:
    """The error for a non-2xx answer (``rate_limit``: the service's own rule, read
    first)."""
    excerpt = " ".join(body.split())[:_BODY_EXCERPT]
    message = f"{service} answered HTTP {status}" + (f": {excerpt}" if excerpt else "")
    limited = rate_limit(status, {k.lower(): v for k, v in headers.items()}, body) \
        if rate_limit is not None else None
    if limited is not None:
        return NotifyError(message, retryable=True, retry_after=limited)
    if status in _RETRYABLE_STATUSES or status >= 500:
        return NotifyError(message, retryable=True, retry_after=retry_after(headers))
    return NotifyError(message, retryable=False)


async def post_json(service: str, url: str, body: Any, *,
                    headers: Mapping[str, str] | None = None,
                    seconds: float | None = None,
                    rate_limit: RateLimit | None = None) -> None:
    """POST ``body`` as JSON to ``url`` within ``seconds`` (default DEFAULT_TIMEOUT);
    NotifyError unless the answer is 2xx (``rate_limit``: see `classify_answer`)."""
    seconds = DEFAULT_TIMEOUT if seconds is None else seconds
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=seconds)) \
                as session, session.post(url, json=body, headers=dict(headers or {}),
                                         allow_redirects=False) as answer:
            if 200 <= answer.status < 300:
                return
            text = await answer.text(errors="replace")
            raise classify_answer(service, answer.status, answer.headers, text, rate_limit)
    except NotifyError:
        raise
    except aiohttp.InvalidURL:
        raise NotifyError(f"{service}: the configured URL is not a valid URL",
                          retryable=False) from None
    except TimeoutError:
        raise NotifyError(f"{service} did not answer within {seconds:g} s",
                          retryable=True) from None
    except (aiohttp.ClientError, OSError) as exc:
        # the class only: aiohttp's messages may carry the URL
        raise NotifyError(f"{service} unreachable ({type(exc).__name__})",
                          retryable=True) from None
