"""What GitHub and GitLab push webhooks say (streams/web/pushes.py), and how a hosted
repository is named from a git URL: pure functions, no server."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any
from urllib.parse import urlencode

import pytest

from streams.extensions.sourcecontrol.gituri import repository_path
from streams.web.pushes import (
    BadPayload,
    Ignored,
    Ping,
    Push,
    delivery_id,
    github_event,
    github_signature_matches,
    gitlab_event,
    gitlab_token_matches,
)

SHA = "9" * 40
JSON = "application/json"


def _body(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def github_push(ref: str = "refs/heads/main", **extra: Any) -> dict[str, Any]:
    return {"ref": ref, "before": "0" * 40, "after": SHA, "deleted": False,
            "repository": {"full_name": "acme/monorepo", "name": "monorepo"}, **extra}


def gitlab_push(ref: str = "refs/heads/main", after: str = SHA,
                **extra: Any) -> dict[str, Any]:
    return {"object_kind": "push", "event_name": "push", "ref": ref, "after": after,
            "checkout_sha": after, "project": {"path_with_namespace": "group/sub/project"},
            **extra}


# --- authenticity --------------------------------------------------------------------------


def test_github_s_documented_signature_example() -> None:
    # the example in GitHub's "Validating webhook deliveries"
    signature = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert github_signature_matches("It's a Secret to Everybody", b"Hello, World!", signature)


@pytest.mark.parametrize("signature", [
    "sha256=" + "0" * 64,
    "sha1=" + hmac.new(b"s3cret", b"{}", hashlib.sha1).hexdigest(),
    hmac.new(b"s3cret", b"{}", hashlib.sha256).hexdigest(),  # without its sha256= prefix
    "sha256=" + hmac.new(b"other", b"{}", hashlib.sha256).hexdigest(),
    "sha256=" + hmac.new(b"s3cret", b"{} ", hashlib.sha256).hexdigest(),  # another body
    "sha256=\u00e9",
    "",
])
def test_a_wrong_signature_does_not_match(signature: str) -> None:
    assert not github_signature_matches("s3cret", b"{}", signature)


def test_a_right_signature_matches_whatever_the_body() -> None:
    body = "{\"ä\": 1}\n".encode()
    signature = "sha256=" + hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    assert github_signature_matches("s3cret", body, signature)
    assert github_signature_matches("s3cret", body, f" {signature} ")


def test_gitlab_tokens_match_exactly() -> None:
    assert gitlab_token_matches("s3cret-token", "s3cret-token")
    for wrong in ("s3cret-toke", "s3cret-token ", "S3CRET-TOKEN", "", "s3cret-token\u00e9"):
        assert not gitlab_token_matches("s3cret-token", wrong), wrong


def test_the_delivery_id_is_the_header_else_a_hash_of_the_body() -> None:
    assert delivery_id("72d3162e-cc78-11e3-81ab-4c9367dc0958", b"{}") == \
        "72d3162e-cc78-11e3-81ab-4c9367dc0958"
    hashed = delivery_id(None, b"{}")
    assert hashed == "sha256:" + hashlib.sha256(b"{}").hexdigest()
    assert delivery_id("  ", b"{}") == hashed
    assert delivery_id(None, b"{ }") != hashed
    for bad in ("a b", "x" * 201, "caf\u00e9"):
        with pytest.raises(BadPayload, match="delivery id"):
            delivery_id(bad, b"{}")


# --- GitHub ---------------------------------------------------------------------------------


def test_a_github_push_to_a_branch() -> None:
    assert github_event("push", JSON, _body(github_push("refs/heads/release/2.0"))) == Push(
        repository="acme/monorepo", branch="release/2.0", after=SHA)


def test_a_github_push_form_encoded() -> None:
    body = urlencode({"payload": json.dumps(github_push())}).encode()
    assert github_event("push", "application/x-www-form-urlencoded; charset=utf-8",
                        body) == Push("acme/monorepo", "main", SHA)


@pytest.mark.parametrize(("event", "body", "reason"), [
    ("issues", b"not even json", "event 'issues' is not a push"),
    ("create", _body(github_push()), "event 'create' is not a push"),
    ("push", _body(github_push("refs/tags/v1.0")), "refs/tags/v1.0 is not a branch"),
    ("push", _body(github_push(deleted=True, after="0" * 40)), "branch 'main' was deleted"),
])
def test_github_deliveries_that_ask_nothing(event: str, body: bytes, reason: str) -> None:
    ignored = github_event(event, JSON, body)
    assert isinstance(ignored, Ignored)
    assert reason in ignored.reason


def test_github_s_ping() -> None:
    assert github_event("ping", JSON, _body({"zen": "Keep it logically awesome.",
                                              "hook_id": 1})) == Ping()


@pytest.mark.parametrize(("event", "content_type", "body", "message"), [
    ("", JSON, _body(github_push()), "missing the X-GitHub-Event header"),
    ("push", JSON, b"{not json", "the body is not JSON"),
    ("push", JSON, b"\xff\xfe", "the body is not JSON"),
    ("push", JSON, b"[1, 2]", "JSON list, not an object"),
    ("push", JSON, _body({"ref": "refs/heads/main"}), "no 'repository' object"),
    ("push", JSON, _body({**github_push(), "repository": {"name": "x"}}),
     "no 'repository.full_name' string"),
    ("push", JSON, _body({**github_push(), "ref": 7}), "no 'ref' string"),
    ("push", "application/x-www-form-urlencoded", b"other=1", "no single 'payload' field"),
    ("push", "application/x-www-form-urlencoded", b"payload=%7Bx", "not JSON"),
])
def test_unreadable_github_deliveries(event: str, content_type: str, body: bytes,
                                      message: str) -> None:
    with pytest.raises(BadPayload, match=message.replace("(", r"\(")):
        github_event(event, content_type, body)


# --- GitLab ---------------------------------------------------------------------------------


def test_a_gitlab_push_to_a_branch_and_a_system_hook_push() -> None:
    expected = Push(repository="group/sub/project", branch="main", after=SHA)
    assert gitlab_event("Push Hook", _body(gitlab_push())) == expected
    system = gitlab_push()
    del system["object_kind"]
    assert gitlab_event("System Hook", _body(system)) == expected


@pytest.mark.parametrize(("event", "payload", "reason"), [
    ("Tag Push Hook", gitlab_push("refs/tags/v1"), "event 'Tag Push Hook' is not a push"),
    ("Merge Request Hook", {"object_kind": "merge_request"}, "is not a push"),
    ("Push Hook", gitlab_push("refs/tags/v1"), "refs/tags/v1 is not a branch"),
    ("Push Hook", gitlab_push(after="0" * 40), "branch 'main' was deleted"),
    ("System Hook", {"event_name": "project_create"}, "kind 'project_create' is not a push"),
])
def test_gitlab_deliveries_that_ask_nothing(event: str, payload: dict[str, Any],
                                            reason: str) -> None:
    ignored = gitlab_event(event, _body(payload))
    assert isinstance(ignored, Ignored)
    assert reason in ignored.reason


@pytest.mark.parametrize(("event", "body", "message"), [
    ("", _body(gitlab_push()), "missing the X-Gitlab-Event header"),
    ("Push Hook", b"", "the body is not JSON"),
    ("Push Hook", _body({**gitlab_push(), "project": None}), "no 'project' object"),
    ("Push Hook", _body({**gitlab_push(), "project": {"name": "p"}}),
     "no 'project.path_with_namespace' string"),
])
def test_unreadable_gitlab_deliveries(event: str, body: bytes, message: str) -> None:
    with pytest.raises(BadPayload, match=message):
        gitlab_event(event, body)


# --- naming a hosted repository from its URL -----------------------------------------------


@pytest.mark.parametrize(("url", "path"), [
    ("git@github.com:acme/monorepo.git", "acme/monorepo"),
    ("git@github.com:acme/monorepo", "acme/monorepo"),
    ("github.com:acme/monorepo.git", "acme/monorepo"),
    ("https://github.com/acme/monorepo.git", "acme/monorepo"),
    ("https://github.com/acme/monorepo/", "acme/monorepo"),
    ("https://x-access-token:ghp_SECRET@github.com/acme/monorepo.git?token=t#frag",
     "acme/monorepo"),
    ("ssh://git@gitlab.example.com/group/sub/project.git", "group/sub/project"),
    ("ssh://git@gitlab.example.com:2222/group/sub/project.git", "group/sub/project"),
    ("git://example.com/Acme/Repo.git", "Acme/Repo"),
    ("file:///srv/git/acme/monorepo.git", None),
    ("/srv/git/monorepo", None),
    ("./monorepo", None),
    ("https://github.com/", None),
])
def test_the_hosted_path_of_a_repository(url: str, path: str | None) -> None:
    assert repository_path(url) == path
