"""Notifiers: commit statuses and transition alerts (issue 11), each channel a module with
its queues.yaml spec and its notifier, the contract in `contract`.

A queue's ``notify`` section (`NotifySpec`) names the channels it uses; every channel is
off unless configured. Commit statuses go to `github_status`; alerts go to `webhook`
and `slack`. A spec names the environment variables holding its secrets
(``env_names()``); whoever builds the notifier reads them and hands their values to
``build`` — extensions read no environment.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions.notify.contract import (
    ALERT_EVENTS,
    STATUS_STATES,
    Notice,
    Notifier,
    NotifyError,
    NotifyPostponed,
)
from streams.extensions.notify.github_status import (
    GitHubStatusSpec,
    github_repository,
)
from streams.extensions.notify.slack import SlackSpec
from streams.extensions.notify.webhook import WebhookSpec
from streams.schema.fields import SPEC, Duration

ChannelSpec = GitHubStatusSpec | WebhookSpec | SlackSpec
STATUS_CHANNELS = ("github_status",)
ALERT_CHANNELS = ("webhook", "slack")

__all__ = ["ALERT_CHANNELS", "ALERT_EVENTS", "STATUS_CHANNELS", "STATUS_STATES",
           "ChannelSpec", "GitHubStatusSpec", "Notice", "Notifier", "NotifyError",
           "NotifyPostponed", "NotifySpec", "SlackSpec", "WebhookSpec", "build_notifier",
           "github_repository"]


@spec_dataclass(frozen=True, config=SPEC)
class NotifySpec:
    """A queue's ``notify`` section: every channel off unless given."""

    github_status: GitHubStatusSpec | None = None
    webhook: WebhookSpec | None = None
    slack: SlackSpec | None = None
    # alert once when the bookmark has been behind the branch head this long
    stale_after: Duration | None = None

    def channel(self, name: str) -> ChannelSpec | None:
        """The spec of channel ``name``; None when the queue does not use it."""
        specs: dict[str, ChannelSpec | None] = {
            "github_status": self.github_status, "webhook": self.webhook,
            "slack": self.slack}
        return specs.get(name)

    @property
    def status_channels(self) -> tuple[str, ...]:
        return tuple(c for c in STATUS_CHANNELS if self.channel(c) is not None)

    @property
    def alert_channels(self) -> tuple[str, ...]:
        return tuple(c for c in ALERT_CHANNELS if self.channel(c) is not None)


def build_notifier(spec: ChannelSpec, environ: Mapping[str, str]) -> Notifier:
    """The channel's notifier, with its secrets read from ``environ``; a variable that is
    not set is a NotifyError naming it (retryable: the worker's environment is wrong,
    not the notice — it is sent once a worker with the variable set runs)."""
    missing = [name for name in spec.env_names() if not environ.get(name)]
    if missing:
        raise NotifyError(f"{spec.channel}: environment variable {missing[0]} is not set",
                          retryable=True)
    return spec.build({name: environ[name] for name in spec.env_names()})
