"""What GitHub and GitLab push webhooks say, read from their headers and raw body: the
signature or token check, the delivery id, and the event — a push to a branch, a ping,
or something Stovepipe ignores. Plain functions over bytes and strings; the HTTP handling
is `streams.web.webhooks`.

Provider facts relied on (their public webhook documentation):

- GitHub signs the raw body with HMAC-SHA256 under the webhook's secret and sends
  ``X-Hub-Signature-256: sha256=<hex>``; ``X-GitHub-Event`` names the event (``push``,
  ``ping``, ...); ``X-GitHub-Delivery`` is a GUID kept by a redelivery. A push names
  ``ref`` (``refs/heads/<branch>`` or ``refs/tags/<tag>``), ``deleted`` and
  ``repository.full_name``. The body is JSON, or ``payload=<JSON>`` form-encoded when the
  webhook's content type is ``application/x-www-form-urlencoded``.
- GitLab sends the webhook's secret token as it is in ``X-Gitlab-Token``;
  ``X-Gitlab-Event`` is ``Push Hook`` (``System Hook`` for an instance's system hooks,
  whose push payload has ``event_name: push``). ``Idempotency-Key`` (GitLab 17.4 and
  later) is kept by retries and resends of one delivery. ``X-Gitlab-Event-UUID`` is not
  one delivery's: GitLab gives the same UUID to every hook that one originating request
  fires (pushes to several projects, a project hook and a system hook), so it identifies
  a delivery only together with what the hook is about (`gitlab_delivery_id`). A push
  names ``ref``, ``before``, ``after`` (all zeros when the branch was deleted), the
  project (``project_id``, ``project.path_with_namespace``) and the project's URLs
  (``project.web_url``, ``project.git_http_url``), which carry the instance's path
  prefix when it is served under one (``https://example.com/gitlab/group/project``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from streams.runtime.logs import bounded

BRANCH_PREFIX = "refs/heads/"
_DELIVERY_ID = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII, no spaces
_ZEROS = re.compile(r"0+")


Body = bytes | bytearray  # a delivery's raw body, read once (see streams.web.webhooks)


class BadPayload(ValueError):
    """A delivery Stovepipe cannot read (answered 400): the message says what is wrong."""


@dataclass(frozen=True)
class Push:
    """A branch moved: ``branch`` of the hosted ``repository`` (``acme/monorepo``).

    ``prefix`` is the path the provider's instance is served under, as the delivery
    states it: ``""`` none (github.com, or a GitLab at the root of its host), ``"gitlab"``
    for ``https://example.com/gitlab/group/project``, None when the delivery does not
    say (`names`). ``key`` tells this push from any other the same request fired (GitLab:
    project, ref, before, after)."""

    repository: str
    branch: str
    after: str  # the commit the provider says the branch moved to (informational)
    prefix: str | None = ""
    key: str = ""

    def names(self, hosted: str) -> bool:
        """Whether a repository whose path on its host is ``hosted`` (a queue's
        ``webhook_repository``, or the path in its git URL) is the one pushed to: the same
        path, compared without regard to case, or that path under the instance's prefix —
        on a path-segment boundary under any prefix when the delivery does not say which
        (so ``gitlab/group/project`` is ``group/project``, ``mygroup/project`` is not)."""
        hosted, wanted = hosted.casefold().strip("/"), self.repository.casefold()
        if hosted == wanted:
            return True
        if self.prefix is None:
            return hosted.endswith("/" + wanted)
        return bool(self.prefix) and hosted == f"{self.prefix.casefold()}/{wanted}"


@dataclass(frozen=True)
class Ping:
    """GitHub's ping, sent when a webhook is created: it proves the secret matches."""


@dataclass(frozen=True)
class Ignored:
    """A verified delivery that asks nothing of Stovepipe, and why."""

    reason: str


Event = Push | Ping | Ignored


# --- authenticity ---------------------------------------------------------------------------


def github_signature_matches(secret: str, body: Body, signature: str) -> bool:
    """Whether ``signature`` (``sha256=<hex>``) is the HMAC-SHA256 of ``body`` under
    ``secret``, compared in constant time."""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), signature.strip().encode(errors="replace"))


def gitlab_token_matches(secret: str, token: str) -> bool:
    """Whether ``token`` is ``secret``. Both are hashed first, so the comparison takes the
    same time whatever the token's length or content."""
    given = hashlib.sha256(token.encode(errors="replace")).digest()
    return hmac.compare_digest(given, hashlib.sha256(secret.encode()).digest())


def delivery_id(header: str | None, body: Body) -> str:
    """The provider's delivery id, or ``sha256:<hex of the body>`` when it sent none (two
    deliveries with the same body are the same push). BadPayload for a malformed one."""
    if header is None or not header.strip():
        return "sha256:" + hashlib.sha256(body).hexdigest()
    value = header.strip()
    if not _DELIVERY_ID.fullmatch(value):
        raise BadPayload(f"the delivery id {bounded(value, 80)!r} is not 1-200 printable "
                         f"characters")
    return value


def gitlab_delivery_id(idempotency_key: str | None, event_uuid: str | None, body: Body,
                       event: Event) -> str:
    """GitLab's delivery id: ``Idempotency-Key`` when sent (GitLab 17.4 and later: one per
    delivery, kept by its retries). Else ``X-Gitlab-Event-UUID`` with a digest of what
    this hook is about — for a push its project, ref, before and after (`Push.key`), for
    anything else the body — as ``<uuid>/<32 hex>``: the UUID is shared by every hook one
    request fires, so pushes to two projects under one UUID are two deliveries, and the
    same push sent again is one. Neither: a digest of the body (`delivery_id`)."""
    if idempotency_key is not None and idempotency_key.strip():
        return delivery_id(idempotency_key, body)
    if event_uuid is None or not event_uuid.strip():
        return delivery_id(None, body)
    about = event.key.encode() if isinstance(event, Push) and event.key else body
    return f"{delivery_id(event_uuid, body)}/{hashlib.sha256(about).hexdigest()[:32]}"


# --- GitHub ---------------------------------------------------------------------------------


def github_event(event: str, content_type: str, body: Body) -> Event:
    """What a verified GitHub delivery of ``event`` (``X-GitHub-Event``) asks."""
    if not event:
        raise BadPayload("missing the X-GitHub-Event header")
    if event == "ping":
        return Ping()
    if event != "push":
        return Ignored(f"event {bounded(event, 80)!r} is not a push; Stovepipe acts on push "
                       f"events only (choose 'Just the push event' in the webhook)")
    payload = _github_payload(content_type, body)
    ref = _text(payload, "ref")
    branch = _branch(ref)
    if branch is None:
        return Ignored(f"{bounded(ref, 120)} is not a branch")
    if payload.get("deleted") is True:
        return Ignored(f"branch {bounded(branch, 120)!r} was deleted")
    repository = _text(_object(payload, "repository"), "full_name", "repository.full_name")
    return Push(repository=repository, branch=branch, after=_sha(payload.get("after")))


def _github_payload(content_type: str, body: Body) -> dict[str, Any]:
    if content_type.split(";")[0].strip().lower() == "application/x-www-form-urlencoded":
        try:
            fields = parse_qs(body.decode(), strict_parsing=True)
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadPayload(f"the form-encoded body cannot be read: {exc}") from None
        if len(fields.get("payload", [])) != 1:
            raise BadPayload("the form-encoded body has no single 'payload' field")
        return _json_object(fields["payload"][0].encode())
    return _json_object(body)


# --- GitLab ---------------------------------------------------------------------------------


def gitlab_event(event: str, body: Body) -> Event:
    """What a verified GitLab delivery of ``event`` (``X-Gitlab-Event``) asks."""
    if not event:
        raise BadPayload("missing the X-Gitlab-Event header")
    if event not in ("Push Hook", "System Hook"):
        return Ignored(f"event {bounded(event, 80)!r} is not a push; Stovepipe acts on push "
                       f"events only (tick only 'Push events' in the webhook)")
    payload = _json_object(body)
    kind = payload.get("event_name") if event == "System Hook" else payload.get("object_kind")
    if kind != "push":
        return Ignored(f"{event} of kind {bounded(kind, 80)!r} is not a push")
    ref = _text(payload, "ref")
    branch = _branch(ref)
    if branch is None:
        return Ignored(f"{bounded(ref, 120)} is not a branch")
    after = _sha(payload.get("after"))
    if _ZEROS.fullmatch(after):
        return Ignored(f"branch {bounded(branch, 120)!r} was deleted")
    project = _object(payload, "project")
    repository = _text(project, "path_with_namespace", "project.path_with_namespace")
    project_id = payload.get("project_id", project.get("id"))
    key = json.dumps(["gitlab-push", project_id if project_id is not None else repository,
                      ref, _sha(payload.get("before")), after])
    return Push(repository=repository, branch=branch, after=after,
                prefix=_gitlab_prefix(project, repository), key=key)


def _gitlab_prefix(project: dict[str, Any], repository: str) -> str | None:
    """The path the GitLab instance is served under, read from the project's URL (which
    ends with its path_with_namespace); None when the payload has no such URL."""
    for field in ("web_url", "git_http_url", "http_url", "homepage"):
        url = project.get(field)
        if not isinstance(url, str):
            continue
        try:
            path = urlsplit(url).path.strip("/").removesuffix(".git")
        except ValueError:
            continue
        if path.casefold() == repository.casefold():
            return ""
        if path.casefold().endswith("/" + repository.casefold()):
            return path[:-len(repository) - 1]
    return None


# --- reading JSON ----------------------------------------------------------------------------


def _json_object(body: Body) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadPayload(f"the body is not JSON: {bounded(exc, 200)}") from None
    if not isinstance(payload, dict):
        raise BadPayload(f"the body is JSON {type(payload).__name__}, not an object")
    return payload


def _object(payload: dict[str, Any], name: str) -> dict[str, Any]:
    value = payload.get(name)
    if not isinstance(value, dict):
        raise BadPayload(f"the push payload has no {name!r} object")
    return value


def _text(payload: dict[str, Any], name: str, path: str | None = None) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value.strip():
        raise BadPayload(f"the push payload has no {path or name!r} string")
    return value


def _branch(ref: str) -> str | None:
    branch = ref.removeprefix(BRANCH_PREFIX)
    return branch if ref.startswith(BRANCH_PREFIX) and branch else None


def _sha(value: object) -> str:
    return value if isinstance(value, str) else ""
