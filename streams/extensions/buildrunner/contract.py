"""The BuildRunner contract. Build ids are minted by the runner and opaque elsewhere.

Each runner classifies its own failures: `BuildRunnerError.retryable` (e.g. HTTP
5xx/429/408 from a hosted CI) or not (a bad configuration, a rejected trigger). A
retryable error may say how long to wait first (`retry_after`, seconds: a provider's
``Retry-After``); the delivery runtime then retries no earlier than that.

A `failed` report is a red verdict unless the runner says the build could not validate
the commit (`BuildReport.unvalidated`): only a build that ran gives a verdict.

A hang is measured from the build's start, never from its trigger (design §5,
buildsignal): a runner reports when the build started running (`BuildReport.started_at`,
the provider's own time when it has one), and, for a build that is not terminal and not
running now, what it waits for (`BuildReport.waiting`: an agent, a person at a block
step, an approval, its own cancel). A build that waits at its deadline says nothing about
the commit.

A runner whose builds run on the worker's own host may also have ``async def tend()``: the
worker calls it every few seconds (`streams.stages.pipeline.tend_build_runners`) to
watch, launch and heartbeat those builds (the command runner does). A hosted runner may
have ``def build_url(build_id) -> str | None``: the page where people look at the build
(Buildkite, GitHub Actions), which the surfaces link to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
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
    # for an `unvalidated` build: its cause will not go away by building again (a workflow
    # that cannot start, a checkout that fails): only a person's retry validates the
    # commit again (design §4)
    permanent: bool = False
    # for a build not yet terminal that is not running now: what it waits for, in words
    # ("queued for an agent", "blocked at a block step, waiting for a person", "waiting
    # for an environment approval", "canceling"); empty while it runs
    waiting: str = ""
    # when the build started running, as the provider tells it (None: not started, or the
    # provider does not say: then the first poll that sees it running is its start)
    started_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.waiting and self.status.is_terminal:
            raise ValueError(f"a {self.status} build waits for nothing")
        if self.permanent and not self.unvalidated:
            raise ValueError("only a build that could not validate has a permanent cause")
        if self.started_at is not None and self.started_at.tzinfo is None:
            raise ValueError("started_at must carry its time zone")

    @property
    def running_now(self) -> bool:
        """Started, and running rather than waiting for something."""
        return self.status is BuildStatus.RUNNING and not self.waiting


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
