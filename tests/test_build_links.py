"""Where people look at a hosted runner's build (`build_url`, shown by the story, the
history and the culprit): the provider's page, from the build id alone."""

from __future__ import annotations

from streams.extensions.buildrunner.buildkite import BuildkiteBuildRunner
from streams.extensions.buildrunner.github_actions import GitHubActionsBuildRunner


def test_buildkite_build_pages() -> None:
    runner = BuildkiteBuildRunner("acme", "mono", "BK_TOKEN", environ={})
    assert runner.build_url("bk-acme/mono/42") == "https://buildkite.com/acme/mono/builds/42"
    assert runner.build_url("gha-acme/mono/42") is None
    elsewhere = BuildkiteBuildRunner("acme", "mono", "BK_TOKEN", environ={},
                                     api_url="http://127.0.0.1:9/")
    assert elsewhere.build_url("bk-acme/mono/42") is None  # its pages are not known there


def test_github_actions_run_pages() -> None:
    runner = GitHubActionsBuildRunner("acme/mono", "ci.yml", "GH_TOKEN", environ={})
    assert runner.build_url("gha-acme/mono/123") == (
        "https://github.com/acme/mono/actions/runs/123")
    assert runner.build_url("bk-acme/mono/1") is None
    server = GitHubActionsBuildRunner("acme/mono", "ci.yml", "GH_TOKEN", environ={},
                                      api_url="https://git.example.com/api/v3")
    assert server.build_url("gha-acme/mono/7") == (
        "https://git.example.com/acme/mono/actions/runs/7")
    assert GitHubActionsBuildRunner("acme/mono", "ci.yml", "GH_TOKEN", environ={},
                                    api_url="http://127.0.0.1:9").build_url(
        "gha-acme/mono/7") is None
