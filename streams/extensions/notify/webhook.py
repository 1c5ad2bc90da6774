"""`webhook`: transition alerts as a JSON POST to any HTTP endpoint.

The body::

    {"event": "red" | "green" | "stale" | "culprit", "queue": ..., "project": ... | null,
     "uri": ..., "sha": ..., "request_id": ..., "previous": "green" | "red" | null,
     "at": ISO 8601, "link": ... | null, ...details}

``project`` names the queue's project the alert is about (its own greenness, Request and
culprit), null for the whole repository; a red alert of a queue with projects adds
``red_projects``, the blocking projects red at that head.

For ``red`` and ``green`` the commit is the newest validated head that changed the
queue's greenness; for ``stale`` it is the bookmarked last green commit (null when the
queue was never green), and the details add ``latest_request_id`` and ``behind_since``;
for ``culprit`` it is the break a culprit search named, and ``culprit.confirmed`` says
whether it is confirmed as the break the red head is red for (``unconfirmed_reason``:
why not).
Any 2xx is delivered; 408, 429 and 5xx are retried, other answers given up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import model_validator
from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions.notify.contract import Notice, NotifyError
from streams.extensions.notify.github_status import HttpUrl
from streams.extensions.notify.http import post_json
from streams.schema.fields import SPEC, SecretEnvName


@spec_dataclass(frozen=True, config=SPEC)
class WebhookSpec:
    """``notify.webhook`` in queues.yaml: ``url_env`` (the URL is a secret) or ``url``,
    and optional ``headers_env`` mapping a header to the variable holding its value."""

    url_env: SecretEnvName | None = None
    url: HttpUrl | None = None
    headers_env: dict[str, SecretEnvName] | None = None
    channel: ClassVar[str] = "webhook"

    @model_validator(mode="after")
    def _one_url(self) -> WebhookSpec:
        if (self.url_env is None) == (self.url is None):
            raise ValueError("set exactly one of 'url_env' (the name of the variable "
                             "holding the URL) and 'url'")
        return self

    def env_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.url_env, *(self.headers_env or {}).values()) if n)

    def build(self, env: Mapping[str, str]) -> WebhookNotifier:
        url = env[self.url_env] if self.url_env else self.url
        assert url is not None
        headers = {header: env[name] for header, name in (self.headers_env or {}).items()}
        return WebhookNotifier(url, headers)


def alert_body(notice: Notice) -> dict[str, Any]:
    return {"event": notice.event, "queue": notice.queue, "project": notice.project,
            "uri": notice.uri,
            "sha": notice.sha, "request_id": notice.request_id,
            "previous": notice.previous, "at": notice.at, "link": notice.link,
            **notice.details}


class WebhookNotifier:
    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        self._url, self._headers = url, dict(headers)

    def __repr__(self) -> str:  # neither the URL nor a header: both may be secrets
        return "WebhookNotifier()"

    async def send(self, notice: Notice) -> None:
        if notice.kind != "alert":
            raise NotifyError("webhook posts alerts, not commit statuses")
        await post_json("the webhook", self._url, alert_body(notice),
                        headers={"User-Agent": "stovepipe", **self._headers})
