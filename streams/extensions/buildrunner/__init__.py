"""BuildRunner: how Stovepipe runs a build for a queue (design §8).

The kinds a queue may name in queues.yaml are the members of `BuildRunnerSpec`: add a
kind by writing its module (a spec class with ``kind``, ``wants_repository`` and
``build``, and the runner) and adding its spec here.
"""

from streams.extensions.buildrunner.buildkite import BuildkiteBuildRunnerSpec
from streams.extensions.buildrunner.command import CommandBuildRunnerSpec
from streams.extensions.buildrunner.contract import BuildReport, BuildRunner, BuildRunnerError
from streams.extensions.buildrunner.fake import FakeBuildRunnerSpec
from streams.extensions.buildrunner.github_actions import GitHubActionsBuildRunnerSpec

# The registry of kinds, in the order error messages list them.
BuildRunnerSpec = (FakeBuildRunnerSpec | CommandBuildRunnerSpec | BuildkiteBuildRunnerSpec
                   | GitHubActionsBuildRunnerSpec)

__all__ = ["BuildReport", "BuildRunner", "BuildRunnerError", "BuildRunnerSpec"]
