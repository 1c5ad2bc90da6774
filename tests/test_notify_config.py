"""queues.yaml's ``notify`` section: every channel off by default, the GitHub repository
taken from the queue's git URL, clear messages for what is wrong, secrets by variable
name only, and the notifiers built from the environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from streams.config.queues import Extensions, QueueConfigError, load_queues
from streams.extensions.notify import NotifyError
from streams.extensions.notify.github_status import github_repository

FAKE_SC = {"kind": "fake", "path": "repo.json", "repo": "demo", "ref": "main"}


def _load(tmp_path: Path, notify: Any, source_control: dict[str, Any] | None = None,
          defaults: dict[str, Any] | None = None) -> Any:
    body: dict[str, Any] = {"source_control": source_control or FAKE_SC,
                            "build_runner": {"kind": "fake"}}
    if notify is not None:
        body["notify"] = notify
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump({"defaults": defaults or {}, "queues": {"q": body}}))
    return load_queues(path)


def _problems(tmp_path: Path, notify: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(QueueConfigError) as info:
        _load(tmp_path, notify, **kwargs)
    return info.value.problems


def test_off_by_default(tmp_path: Path) -> None:
    queue = _load(tmp_path, None).get("q")
    assert queue.notify is None
    assert queue.status_channels == () and queue.alert_channels == ()


def test_every_channel(tmp_path: Path) -> None:
    queue = _load(tmp_path, {
        "github_status": {"repository": "acme/mono", "token_env": "GH_TOKEN"},
        "webhook": {"url": "https://hooks.example/x", "headers_env": {"X-Key": "HOOK_KEY"}},
        "slack": {"url_env": "SLACK_URL"}, "stale_after": "30m"}).get("q")
    assert queue.status_channels == ("github_status",)
    assert queue.alert_channels == ("webhook", "slack")
    github = queue.notify.github_status
    assert (github.api_url, github.context) == ("https://api.github.com",
                                                "stovepipe/validation")
    assert queue.notify.stale_after.total_seconds() == 1800


def test_a_queue_replaces_the_default_section_whole(tmp_path: Path) -> None:
    queue = _load(tmp_path, {"slack": {"url_env": "SLACK_URL"}},
                  defaults={"notify": {"webhook": {"url_env": "HOOK"},
                                       "stale_after": "1h"}}).get("q")
    assert queue.alert_channels == ("slack",) and queue.notify.stale_after is None


@pytest.mark.parametrize("url", [
    "git@github.com:acme/mono.git", "https://github.com/acme/mono",
    "https://x-access-token:secret@github.com/acme/mono.git",
    "ssh://git@github.com/acme/mono.git"])
def test_the_repository_comes_from_a_github_url(tmp_path: Path, url: str) -> None:
    assert github_repository(url) == "acme/mono"
    queue = _load(tmp_path, {"github_status": {"token_env": "GH_TOKEN"}},
                  source_control={"kind": "git", "repository": url, "ref": "main"}).get("q")
    assert queue.notify.github_status.repository == "acme/mono"


def test_problems_are_named(tmp_path: Path) -> None:
    assert _problems(tmp_path, {"github_status": {"token_env": "GH_TOKEN"}}) == [
        "queues.q.notify.github_status: missing 'repository' (owner/name), and the queue's "
        "source_control is not a github.com repository it could be taken from, e.g. "
        "repository: acme/monorepo"]
    assert _problems(tmp_path, {"github_status": {"repository": "acme/mono",
                                                  "token_env": "ghp_abc-123"}}) == [
        "queues.q.notify.github_status.token_env: expected the NAME of an environment "
        "variable (letters, digits and '_', not starting with a digit), e.g. "
        "STOVEPIPE_GITHUB_TOKEN; the secret itself belongs in that variable, never in this "
        "file (the value given is not shown)"]
    assert _problems(tmp_path, {"webhook": {"url": "https://h.example/", "url_env": "X"}}) \
        == ["queues.q.notify.webhook: set exactly one of 'url_env' (the name of the variable "
            "holding the URL) and 'url'"]
    assert _problems(tmp_path, {"slack": {"url": "https://hooks.slack.com/x"}}) == [
        "queues.q.notify.slack: missing 'url_env'",
        "queues.q.notify.slack: unknown field 'url'; expected one of ['url_env']"]
    assert _problems(tmp_path, {"email": {}})[0].startswith(
        "queues.q.notify: unknown field 'email'")


def test_notifiers_read_their_secrets_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queues = _load(tmp_path, {"github_status": {"repository": "acme/mono",
                                                "token_env": "STOVEPIPE_T_TOKEN"}})
    extensions = Extensions(queues, None)
    monkeypatch.delenv("STOVEPIPE_T_TOKEN", raising=False)
    with pytest.raises(NotifyError, match="STOVEPIPE_T_TOKEN is not set") as info:
        extensions.notifier("q", "github_status")
    assert info.value.retryable
    monkeypatch.setenv("STOVEPIPE_T_TOKEN", "ghp_SECRET")
    notifier = extensions.notifier("q", "github_status")
    assert "ghp_SECRET" not in repr(notifier)
    with pytest.raises(NotifyError, match=r"no notify\.slack") as info:
        extensions.notifier("q", "slack")
    assert not info.value.retryable


def test_the_shipped_file_s_commented_notify_example_is_valid(tmp_path: Path) -> None:
    from streams.config.settings import REPO_ROOT

    lines = (REPO_ROOT / "queues.yaml").read_text().splitlines()
    start = lines.index("  # monorepo/main:")
    example = [line.replace("# ", "", 1) for line in lines[start:] if line.startswith("  # ")]
    path = tmp_path / "queues.yaml"
    path.write_text("queues:\n" + "\n".join(example) + "\n")
    notify = load_queues(path).get("monorepo/main").notify
    assert notify is not None
    assert (notify.github_status.repository, notify.github_status.token_env) == (
        "acme/monorepo", "STOVEPIPE_GITHUB_TOKEN")
    assert notify.webhook.url_env == "STOVEPIPE_ALERT_WEBHOOK_URL"
    assert notify.webhook.headers_env == {"Authorization": "STOVEPIPE_ALERT_WEBHOOK_AUTH"}
    assert notify.slack.url_env == "STOVEPIPE_SLACK_WEBHOOK_URL"
    assert notify.stale_after.total_seconds() == 7200


def _monorepo(tmp_path: Path, unaffected: Any) -> Any:
    status: dict[str, Any] = {"repository": "acme/mono", "token_env": "GH_TOKEN"}
    if unaffected is not None:
        status["unaffected"] = unaffected
    body = {"source_control": FAKE_SC, "build_runner": {"kind": "fake"},
            "projects": {"api": {"paths": ["api/**"]}, "web": {"paths": ["web/**"]}},
            "notify": {"github_status": status}}
    path = tmp_path / "queues.yaml"
    path.write_text(yaml.safe_dump({"queues": {"mono": body}}))
    return load_queues(path)


@pytest.mark.parametrize(("unaffected", "posted"), [
    (None, []), ("none", []), ("all", ["api", "web"]), (["web"], ["web"]), ([], [])])
def test_which_unaffected_projects_get_a_status(tmp_path: Path, unaffected: Any,
                                                posted: list[str]) -> None:
    """None by default: every head would cost a GitHub call per unaffected project."""
    queue = _monorepo(tmp_path, unaffected).get("mono")
    assert [p for p in ("api", "web") if queue.posts_unaffected_status(p)] == posted


def test_unaffected_names_the_queue_s_projects(tmp_path: Path) -> None:
    with pytest.raises(QueueConfigError) as info:
        _monorepo(tmp_path, ["api", "mobile"])
    assert info.value.problems == [
        "queues.mono.notify.github_status.unaffected: names no project of this queue: "
        "mobile; its projects are api, web"]
    with pytest.raises(QueueConfigError) as info:
        _monorepo(tmp_path, "some")
    assert info.value.problems == [
        "queues.mono.notify.github_status.unaffected: expected all, none or a list of the "
        "queue's project names, e.g. [api, web], got 'some'"]

