"""`slack`: transition alerts to a Slack-compatible incoming webhook.

POSTs ``{"text": ...}`` (Slack's incoming-webhook payload; Mattermost and others accept
the same) to the URL held in the environment variable ``url_env`` — an incoming webhook
URL is a secret, so it is never written in queues.yaml. Slack answers 200 ``ok``; 400
(invalid_payload), 403 (action_prohibited), 404 (no_service, channel_not_found) and 410
(channel_is_archived) are permanent, 429 and 5xx are retried.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic.dataclasses import dataclass as spec_dataclass

from streams.extensions.notify.contract import Notice, NotifyError
from streams.extensions.notify.http import post_json
from streams.schema.fields import SPEC, SecretEnvName


@spec_dataclass(frozen=True, config=SPEC)
class SlackSpec:
    """``notify.slack`` in queues.yaml."""

    url_env: SecretEnvName
    channel: ClassVar[str] = "slack"

    def env_names(self) -> tuple[str, ...]:
        return (self.url_env,)

    def build(self, env: Mapping[str, str]) -> SlackNotifier:
        return SlackNotifier(env[self.url_env])


def alert_text(notice: Notice) -> str:
    """One line a person reads in a channel."""
    commit = (notice.sha or notice.uri or "?")[:12]
    link = f" <{notice.link}|details>" if notice.link else ""
    # "mono/main" or "mono/main, project api," before a verb
    who = f"{notice.queue}, project {notice.project}," if notice.project else notice.queue
    if notice.event == "stale":
        since = notice.details.get("behind_since") or "?"
        last = f"its last green commit {commit} ({notice.request_id})" \
            if notice.request_id else "it has never been green and"
        return (f":hourglass: Stovepipe: {who} is stale: {last} has been behind "
                f"the branch head since {since} (newest head "
                f"{notice.details.get('latest_request_id')}).{link}")
    culprit = notice.details.get("culprit")
    if notice.event == "culprit":
        since = notice.details.get("red_since") or "?"
        if not culprit:
            return f":mag: Stovepipe: {who.rstrip(',')}: culprit found.{link}"
        builds = f"found after {culprit.get('builds', 0)} backfill builds"
        if not is_confirmed(culprit):
            return (f":mag: Stovepipe: {who} has been red since {since}; a break, "
                    f"not confirmed as the head's: {culprit_words(culprit)} ({builds}; "
                    f"{culprit.get('unconfirmed_reason') or 'not confirmed'}).{link}")
        return (f":mag: Stovepipe: {who} has been red since {since}; the culprit "
                f"is {culprit_words(culprit)} ({builds}).{link}")
    icon = ":red_circle:" if notice.event == "red" else ":large_green_circle:"
    was = f"was {notice.previous}" if notice.previous else "first result"
    flake = (f" Flaky: green on attempt {notice.details.get('attempts')} after a red build "
             f"of the same commit." if notice.details.get("flaky") else "")
    why = ""
    if notice.event == "red" and notice.details.get("red_projects"):
        why = f" Red projects: {', '.join(notice.details['red_projects'])}."
    if notice.event == "red" and culprit and not is_confirmed(culprit):
        why += (f" A break, not confirmed as the head's: {culprit_words(culprit)} "
                f"({culprit.get('unconfirmed_reason') or 'not confirmed'}).")
    elif notice.event == "red" and culprit:
        why += f" Culprit: {culprit_words(culprit)}."
    elif notice.event == "red" and notice.details.get("bisecting"):
        left = notice.details["bisecting"].get("commits")
        why += (f" Finding the culprit among {left} commits (bisecting); a message follows "
                f"when it is found.")
    return (f"{icon} Stovepipe: {who} is {notice.event.upper()} at {commit} "
            f"({notice.request_id}; {was}).{why}{flake}{link}")


def is_confirmed(culprit: Mapping[str, Any]) -> bool:
    """The culprit is the break the red head is red for (a notice written before
    confirmation was recorded says nothing: it named the culprit as such)."""
    return culprit.get("confirmed", True) is not False


def culprit_words(culprit: Mapping[str, Any]) -> str:
    """``1a2b3c4d5e6f "subject" by Name <email>``: the commit as a person knows it."""
    sha = str(culprit.get("sha") or culprit.get("uri") or "?")[:12]
    subject = f' "{culprit["subject"]}"' if culprit.get("subject") else ""
    author = f" by {culprit['author']}" if culprit.get("author") else ""
    return f"{sha}{subject}{author}"


class SlackNotifier:
    def __init__(self, url: str) -> None:
        self._url = url

    def __repr__(self) -> str:  # never the URL
        return "SlackNotifier()"

    async def send(self, notice: Notice) -> None:
        if notice.kind != "alert":
            raise NotifyError("slack posts alerts, not commit statuses")
        await post_json("Slack", self._url, {"text": alert_text(notice)},
                        headers={"User-Agent": "stovepipe"})
