"""BuildRunner: how Stovepipe runs a build for a queue (design §8)."""

from streams.buildrunner.contract import BuildReport, BuildRunner, BuildRunnerError

__all__ = ["BuildReport", "BuildRunner", "BuildRunnerError"]
