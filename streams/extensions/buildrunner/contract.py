"""The BuildRunner contract. Build ids are minted by the runner and opaque elsewhere.

Each runner classifies its own failures: `BuildRunnerError.retryable` (e.g. HTTP
5xx/429/408 from a hosted CI) or not (a bad configuration, a rejected trigger). A
retryable error may say how long to wait first (`retry_after`, seconds: a provider's
``Retry-After``); the delivery runtime then retries no earlier than that.

A `failed` report is a red verdict unless the runner says the build could not validate
the commit (`BuildReport.unvalidated`): only a build that ran gives a verdict.

A runner whose builds run on the worker's own host may also have ``async def tend()``: the
worker calls it every few seconds (`streams.stages.pipeline.tend_build_runners`) to
watch, launch and heartbeat those builds (the command runner does). A hosted runner may
have ``def build_url(build_id) -> str | None``: the page where people look at the build
(Buildkite, GitHub Actions), which the surfaces link to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from store.entities import BuildStatus


class BuildRunnerError(Exception):
    """A failure of the runner. Non-retryable unless marked."""

    retryable: bool = False
    retry_after: float | None = None

    def __init__(self, message: str, *, retryable: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after if retryable else None


@dataclass(frozen=True)
class BuildReport:
    status: BuildStatus
    metadata: Mapping[str, str] = field(default_factory=dict)
    # for a `failed` build: why it could not validate the commit (its host was lost, it
    # never ran) in words; empty when the build ran and failed: a red verdict (design §4)
    unvalidated: str = ""


class BuildRunner(Protocol):
    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        """Start a build of ``head_uri`` (incremental from ``base_uri`` when given, full
        when None) and return its build id."""
        ...

    async def status(self, build_id: str) -> BuildReport:
        """The build's current status. Any worker may ask about any build."""
        ...

    async def cancel(self, build_id: str) -> None:
        """Stop the build; idempotent; a finished build stays as it ended."""
        ...
