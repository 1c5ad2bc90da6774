"""What GitHub and GitLab push webhooks say (streams/web/pushes.py), which queues a push
moves (streams/web/webhooks.py `watching`), and how a hosted repository is named from a
git URL: pure functions, no server."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml

from streams.config.queues import load_queues
from streams.extensions.sourcecontrol.gituri import repository_path
from streams.web.pushes import (
    BadPayload,
    Ignored,
    Ping,
    Push,
    delivery_id,
    github_event,
    github_signature_matches,
    gitlab_delivery_id,
    gitlab_event,
    gitlab_token_matches,
)
from streams.web.webhooks import watching

SHA = "9" * 40
JSON = "application/json"


def _body(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def github_push(ref: str = "refs/heads/main", **extra: Any) -> dict[str, Any]:
    return {"ref": ref, "before": "0" * 40, "after": SHA, "deleted": False,
            "repository": {"full_name": "acme/monorepo", "name": "monorepo"}, **extra}


GITLAB = "https://gitlab.example.com"


def gitlab_project(path: str = "group/sub/project", project_id: int = 41,
                   base: str = GITLAB) -> dict[str, Any]:
    """A push's ``project`` object as GitLab's "Webhook events" documentation shows it
    (https://docs.gitlab.com/user/project/integrations/webhook_events/#push-events)."""
    host = base.split("://", 1)[1].split("/", 1)[0]
    return {"id": project_id, "name": path.rsplit("/", 1)[-1], "description": "",
            "web_url": f"{base}/{path}", "avatar_url": None,
            "git_ssh_url": f"git@{host}:{path}.git", "git_http_url": f"{base}/{path}.git",
            "namespace": path.split("/")[0], "visibility_level": 0,
            "path_with_namespace": path, "default_branch": "main",
            "homepage": f"{base}/{path}", "url": f"git@{host}:{path}.git",
            "ssh_url": f"git@{host}:{path}.git", "http_url": f"{base}/{path}.git"}


def gitlab_push(ref: str = "refs/heads/main", after: str = SHA, *,
                project: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A push hook's payload as GitLab's "Webhook events" documentation describes it
    (section "Push events"; our own values)."""
    project = project or gitlab_project()
    return {"object_kind": "push", "event_name": "push", "before": "1" * 40,
            "after": after, "ref": ref, "ref_protected": True, "checkout_sha": after,
            "user_id": 7, "user_name": "Ada Lovelace", "user_username": "ada",
            "user_email": "", "user_avatar": None, "project_id": project["id"],
            "project": project,
            "repository": {"name": project["name"], "url": project["git_ssh_url"],
                           "description": "", "homepage": project["web_url"],
                           "git_http_url": project["git_http_url"],
                           "git_ssh_url": project["git_ssh_url"], "visibility_level": 0},
            "commits": [], "total_commits_count": 0, **extra}


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
    pushed = gitlab_event("Push Hook", _body(gitlab_push()))
    assert isinstance(pushed, Push)
    assert (pushed.repository, pushed.branch, pushed.after, pushed.prefix) == (
        "group/sub/project", "main", SHA, "")
    # a system hook's push (GitLab's "System hooks" page): no object_kind, no project.id
    system = gitlab_push()
    del system["object_kind"]
    system["project"] = {k: v for k, v in system["project"].items() if k != "id"}
    assert gitlab_event("System Hook", _body(system)) == pushed  # the same push
    # GitLab 11 and older: no event_name, no ref_protected
    old = {k: v for k, v in gitlab_push().items() if k not in ("event_name", "ref_protected")}
    assert gitlab_event("Push Hook", _body(old)) == pushed


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


EVENT_UUID = "0b6c3f6e-5d7a-4f8e-9a61-2c4d8e1f7a90"


def _gitlab_id(body: bytes, key: str | None = None, event_uuid: str | None = None,
               event: str = "Push Hook") -> str:
    return gitlab_delivery_id(key, event_uuid, body, gitlab_event(event, body))


def test_one_event_uuid_for_two_projects_is_two_gitlab_deliveries() -> None:
    """GitLab gives every hook one request fires the same X-Gitlab-Event-UUID ("Webhook
    events"; "Webhooks": the UUID identifies the originating request, Idempotency-Key the
    delivery): the UUID alone would take the second project's push for the first's."""
    one = _body(gitlab_push(project=gitlab_project("group/one", 1)))
    two = _body(gitlab_push(project=gitlab_project("group/two", 2)))
    first = _gitlab_id(one, event_uuid=EVENT_UUID)
    assert first.startswith(EVENT_UUID + "/") and len(first) == len(EVENT_UUID) + 33
    assert _gitlab_id(two, event_uuid=EVENT_UUID) != first
    # the same hook sent again — byte for byte, or serialised anew — is one delivery
    assert _gitlab_id(one, event_uuid=EVENT_UUID) == first
    assert _gitlab_id(json.dumps(json.loads(one), indent=2).encode(),
                      event_uuid=EVENT_UUID) == first
    # and so is the system hook of the same push (same project, ref, before, after)
    system = json.loads(one)
    del system["object_kind"]
    assert _gitlab_id(_body(system), event_uuid=EVENT_UUID, event="System Hook") == first
    # another push of the project under that UUID is another delivery
    later = _body(gitlab_push(after="2" * 40, project=gitlab_project("group/one", 1)))
    assert _gitlab_id(later, event_uuid=EVENT_UUID) != first


def test_a_gitlab_idempotency_key_decides_alone() -> None:
    one = _body(gitlab_push(project=gitlab_project("group/one", 1)))
    two = _body(gitlab_push(project=gitlab_project("group/two", 2)))
    assert _gitlab_id(one, "key-1", EVENT_UUID) == "key-1" == _gitlab_id(two, "key-1")
    assert _gitlab_id(one, "key-2", EVENT_UUID) == "key-2"
    assert _gitlab_id(one, "  ", EVENT_UUID) == _gitlab_id(one, None, EVENT_UUID)
    with pytest.raises(BadPayload, match="delivery id"):
        _gitlab_id(one, "has space", EVENT_UUID)
    with pytest.raises(BadPayload, match="delivery id"):
        _gitlab_id(one, None, "has space")


def test_a_gitlab_delivery_without_ids_or_that_is_no_push() -> None:
    one = _body(gitlab_push())
    assert _gitlab_id(one) == delivery_id(None, one)  # no header: the body's digest
    merge = _body({"object_kind": "merge_request"})
    assert _gitlab_id(merge, event_uuid=EVENT_UUID, event="Merge Request Hook") == (
        f"{EVENT_UUID}/{hashlib.sha256(merge).hexdigest()[:32]}")


def _queues(tmp_path: Path, repositories: dict[str, str]) -> Any:
    """Queues validating ``main`` of each repository (in name order: safe_dump sorts)."""
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump({"defaults": {"build_runner": {"kind": "fake"}},
                                    "queues": {name: {"source_control": {
                                        "kind": "git", "repository": url, "ref": "main"}}
                                        for name, url in repositories.items()}}))
    return load_queues(path)


def test_a_gitlab_served_under_a_path_prefix_moves_its_queues(tmp_path: Path) -> None:
    """GitLab under a relative URL root: project URLs carry the prefix
    (https://example.com/gitlab/group/project), ``path_with_namespace`` does not."""
    queues = _queues(tmp_path, {
        "https/main": "https://example.com/gitlab/group/project.git",
        "ssh/main": "git@example.com:group/project.git",  # no prefix over ssh
        "token/main": "https://oauth2:glpat-SECRET@example.com/gitlab/group/project",
        "other/main": "https://example.com/gitlab/mygroup/project.git",
        "deeper/main": "https://example.com/gitlab/sub/group/project.git",
        "root/main": "https://example.com/gitlab/project.git",
    })
    prefixed = gitlab_push(project=gitlab_project("group/project", 5,
                                                  "https://example.com/gitlab"))
    push = gitlab_event("Push Hook", _body(prefixed))
    assert isinstance(push, Push) and push.prefix == "gitlab"
    assert watching(queues, push) == ("https/main", "ssh/main", "token/main")
    # a delivery that names no URL of the project: any prefix, on a segment boundary
    bare = {**prefixed, "project": {"path_with_namespace": "group/project"}}
    push = gitlab_event("Push Hook", _body(bare))
    assert isinstance(push, Push) and push.prefix is None
    assert watching(queues, push) == ("deeper/main", "https/main", "ssh/main", "token/main")
    # an instance at the root of its host: its gitlab/group/project is another project
    rooted = gitlab_event("Push Hook", _body(gitlab_push(project=gitlab_project(
        "group/project", 6, "https://example.com"))))
    assert isinstance(rooted, Push) and rooted.prefix == ""
    assert watching(queues, rooted) == ("ssh/main",)
    # GitHub names the whole path: never by a suffix
    github = github_event("push", JSON, _body(github_push(
        repository={"full_name": "group/project", "name": "project"})))
    assert isinstance(github, Push)
    assert watching(queues, github) == ("ssh/main",)


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
