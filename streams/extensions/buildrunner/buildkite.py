"""The buildkite BuildRunner: a build of a Buildkite pipeline per Request (design §8).

Endpoints (Buildkite REST API v2, https://buildkite.com/docs/apis/rest-api/builds):

- ``POST /v2/organizations/{org}/pipelines/{pipeline}/builds`` creates the build: ``commit``
  the head sha, ``branch`` (the configured one, else the head URI's ref), a ``message``,
  ``env`` with STOVEPIPE_HEAD_SHA, STOVEPIPE_BASE_SHA (empty for a full build),
  STOVEPIPE_HEAD_URI, STOVEPIPE_BASE_URI, STOVEPIPE_QUEUE, STOVEPIPE_PROJECT (empty
  unless the build is a monorepo project's), STOVEPIPE_REQUEST_ID and STOVEPIPE_STRATEGY
  (plus the queue's extra ``env``), and ``meta_data`` ``stovepipe-trigger`` (the
  correlation id of the trigger key, see `hosted.correlation_id`), ``stovepipe-request``
  and, for a project's build, ``stovepipe-project``;
- ``GET …/builds?meta_data[stovepipe-trigger]=<id>&commit=<sha>`` (list builds, filtered):
  before creating, a trigger looks for the build an earlier trigger with the same key
  started (a trigger repeated after a crash), and returns it instead of a second build;
- ``GET …/builds/{number}`` is the status, ``PUT …/builds/{number}/cancel`` cancels (a
  ``422``, "cannot be canceled", means it is already over or canceling: cancel is
  idempotent and a finished build stays as it ended).

A build id is ``bk-<org>/<pipeline>/<number>``: any worker answers status and cancel from
it and the token alone.

How a build's answers map to our statuses, what a build waits for, when it started, and
how a failed or cancelled build ended: `buildkite_builds`. A failed build's jobs are read
with one more call (``GET …/builds/{number}`` with its jobs), once per build.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass as spec_dataclass

from store.entities import BuildStatus
from streams.extensions import ExtensionContext
from streams.extensions.buildrunner.buildkite_builds import (
    ending_of_canceled,
    ending_of_failed,
    ending_of_never_run,
    started_at_of,
    status_of,
    waiting_of,
)
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.extensions.buildrunner.hosted import (
    DEFAULT_REQUEST_TIMEOUT,
    ApiUrl,
    BranchName,
    Commits,
    Ending,
    Endings,
    ExtraEnv,
    HostedApi,
    Slug,
    TokenEnvName,
    build_environment,
    correlation_id,
    number_header,
)
from streams.extensions.buildrunner.snapshots import Snapshot, active_pipelines, snapshot_for
from streams.schema.fields import SPEC, Duration, Flag, PositiveFloat

BUILD_ID_PREFIX = "bk-"
DEFAULT_REQUESTS_PER_MINUTE = 100.0  # half of the organization's 200 a minute
LIST_PAGE = 100  # builds in one list answer (Buildkite's largest page)
ACTIVE_WITHIN = 60.0  # seconds since its last poll that a pipeline counts as polled
DEFAULT_API_URL = "https://api.buildkite.com"
WEB_URL = "https://buildkite.com"  # where people look at the builds of DEFAULT_API_URL
TRIGGER_META = "stovepipe-trigger"
REQUEST_META = "stovepipe-request"
PROJECT_META = "stovepipe-project"
_BUILD_ID = re.compile(r"bk-([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)/"
                       r"([1-9][0-9]{0,17})")
PROVIDER = "buildkite"
log = logging.getLogger("stovepipe.buildrunner.buildkite")

def _rate_limit_wait(status: int, headers: Mapping[str, str], message: str) -> float | None:
    """Buildkite ("REST API rate limits", https://buildkite.com/docs/apis/rest-api/limits)
    counts 200 requests a minute per organization and reports that limit on every answer:
    ``RateLimit-Remaining``, ``RateLimit-Limit`` and ``RateLimit-Reset`` (seconds until
    the window starts anew); once it is spent it answers 429 with ``RateLimit-Remaining:
    0``, and nothing should be asked before ``RateLimit-Reset``. So a 429 waits for the
    reset of the limit it reports exhausted. A 429 whose ``RateLimit-Remaining`` is above
    0 was refused by some other limit, which that reset says nothing about: None (the
    caller then waits ``Retry-After``, else its default minute)."""
    if status != 429:
        return None
    reset = number_header(headers, "ratelimit-reset")
    remaining = number_header(headers, "ratelimit-remaining")
    if reset is None or (remaining is not None and remaining > 0):
        return None
    return max(0.0, reset)


@spec_dataclass(frozen=True, config=SPEC)
class BuildkiteBuildRunnerSpec:
    """`kind: buildkite`: a build of a Buildkite pipeline (this module)."""

    wants_repository: ClassVar[bool] = False
    organization: Annotated[Slug, Field(examples=["organization: acme"])]
    pipeline: Annotated[Slug, Field(examples=["pipeline: monorepo"])]
    # the NAME of the environment variable holding the API token, never the token
    token_env: Annotated[TokenEnvName, Field(examples=["token_env: BUILDKITE_API_TOKEN"])]
    api_url: ApiUrl = DEFAULT_API_URL
    branch: BranchName | None = None  # None: the head URI's ref
    env: ExtraEnv | None = None  # more environment variables for the build
    request_timeout: Duration = timedelta(seconds=DEFAULT_REQUEST_TIMEOUT)
    # Stovepipe's share of the organization's REST limit (200 a minute for all its users
    # and tools together), divided among the workers: half, leaving the other half to
    # the people and tools that share the organization
    requests_per_minute: PositiveFloat = DEFAULT_REQUESTS_PER_MINUTE
    # poll a pipeline's running builds with one list call (False: one call per build)
    batch_polls: Flag = True
    kind: Literal["buildkite"] = "buildkite"

    def build(self, context: ExtensionContext) -> BuildkiteBuildRunner:
        return BuildkiteBuildRunner(
            self.organization, self.pipeline, self.token_env, api_url=self.api_url,
            branch=self.branch, env=self.env, queue=context.queue,
            timeout=self.request_timeout.total_seconds(),
            requests_per_minute=self.requests_per_minute, batch_polls=self.batch_polls)


class BuildkiteBuildRunner:
    """Builds on the Buildkite pipeline ``organization``/``pipeline`` with the API token
    in the environment variable ``token_env`` (see the module docstring)."""

    def __init__(self, organization: str, pipeline: str, token_env: str, *,
                 api_url: str = DEFAULT_API_URL, branch: str | None = None,
                 env: Mapping[str, str] | None = None, queue: str = "",
                 timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 environ: Mapping[str, str] | None = None,
                 requests_per_minute: float | None = None,
                 batch_polls: bool = False) -> None:
        self.organization = organization
        self.pipeline = pipeline
        self.branch = branch
        self.env = dict(env or {})
        self.queue = queue
        self.batch_polls = batch_polls
        self._endings = Endings()
        # Buildkite limits an organization, whatever the token: the budget is its
        self.api = HostedApi(PROVIDER, api_url, token_env, timeout=timeout,
                             headers={"Accept": "application/json"},
                             rate_limit_wait=_rate_limit_wait, environ=environ,
                             requests_per_minute=requests_per_minute,
                             budget_scope=f"organization:{organization}")

    def __repr__(self) -> str:
        return (f"BuildkiteBuildRunner({self.organization!r}, {self.pipeline!r}, "
                f"token_env={self.api.token_env!r}, api_url={self.api.api_url!r})")

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        commits = Commits.of(PROVIDER, base_uri, head_uri)
        correlation = correlation_id(metadata, base_uri, head_uri)
        builds = _builds_path(self.organization, self.pipeline)
        if metadata.get("trigger_key"):
            found = await self.api.call("GET", builds, params={
                f"meta_data[{TRIGGER_META}]": correlation, "commit": commits.head.sha,
                "per_page": "100"})
            # the filter is the server's; the match is checked here too, so a server that
            # ignored it could never hand over another trigger's build
            numbers = [b["number"] for b in found.body or []
                       if _is_build(b) and b.get("commit") == commits.head.sha
                       and (b.get("meta_data") or {}).get(TRIGGER_META) == correlation]
            if numbers:  # started by an earlier trigger of the same key
                return _build_id(self.organization, self.pipeline, min(numbers))
        queue = metadata.get("queue") or self.queue
        env = {**self.env, **build_environment(commits, {**metadata, "queue": queue},
                                               base_uri, head_uri)}
        meta_data = {TRIGGER_META: correlation, REQUEST_META: metadata.get("request_id", "")}
        if env["STOVEPIPE_PROJECT"]:  # Buildkite refuses an empty meta-data value
            meta_data[PROJECT_META] = env["STOVEPIPE_PROJECT"]
        created = await self.api.call("POST", builds, expect=(200, 201), body={
            "commit": commits.head.sha,
            "branch": self.branch or commits.head.ref,
            "message": _message(queue, commits, metadata),
            "env": env,
            "meta_data": meta_data,
        })
        if not _is_build(created.body):
            raise BuildRunnerError(f"{PROVIDER}: POST {builds} answered without a build "
                                   f"number")
        return _build_id(self.organization, self.pipeline, created.body["number"])

    async def status(self, build_id: str) -> BuildReport:
        organization, pipeline, number = parse_build_id(build_id)
        snapshot = self._snapshot(organization, pipeline) if self.batch_polls else None
        build = await snapshot.lookup(str(number)) if snapshot is not None else None
        if not isinstance(build, dict):  # not in the pipeline's list: ask for it alone
            answer = await self.api.call(
                "GET", f"{_builds_path(organization, pipeline)}/{number}",
                params={"exclude_jobs": "true"})
            build = answer.body if isinstance(answer.body, dict) else {}
            if snapshot is not None:
                created = build.get("created_at")
                snapshot.remember(str(number), build,
                                  created if isinstance(created, str) else None)
        state = build.get("state")
        if not isinstance(state, str):
            raise BuildRunnerError(f"{PROVIDER}: build {build_id} answered without a state")
        blocked = build.get("blocked") is True
        metadata = {"runner": PROVIDER, "state": state, "blocked": str(blocked).lower(),
                    "web_url": str(build.get("web_url") or "")}
        status = status_of(state, blocked)
        if state in ("skipped", "not_run"):
            ending = ending_of_never_run(state)
        elif status is BuildStatus.FAILED:
            ending = await self._ending_of_failed(organization, pipeline, number, build)
        elif status is BuildStatus.CANCELLED:
            ending = ending_of_canceled(build)
        else:
            ending = Ending(status, waiting=waiting_of(state, blocked))
        return ending.report(metadata, started_at_of(build))

    async def _ending_of_failed(self, organization: str, pipeline: str, number: int,
                                build: Mapping[str, Any]) -> Ending:
        """`ending_of_failed` from the build's jobs: one call, once per build while it
        answers the same (a failed build paused at a block step is asked again only
        when it changes)."""
        key = (organization, pipeline, number)
        answer = (build.get("state"), build.get("blocked") is True, build.get("finished_at"))
        known = self._endings.get(key, answer)
        if isinstance(known, Ending):
            return known
        try:
            found = await self.api.call(
                "GET", f"{_builds_path(organization, pipeline)}/{number}")
        except BuildRunnerError as exc:
            if exc.retryable:
                raise
            # its jobs cannot be read: red, as a failed build always was
            log.warning("buildkite_jobs_unreadable build=%s/%s/%d error=%s", organization,
                        pipeline, number, exc)
            return Ending(BuildStatus.FAILED, detail=f"Buildkite reports it failed (its "
                                                     f"jobs could not be read: {exc})")
        jobs = found.body.get("jobs") if isinstance(found.body, dict) else None
        ending = ending_of_failed(jobs if isinstance(jobs, list) else [],
                                  build.get("blocked") is True)
        self._endings.put(key, answer, ending)
        return ending

    def build_url(self, build_id: str) -> str | None:
        """The build's page on Buildkite; None for a build id of another shape, or an
        ``api_url`` other than Buildkite's own (its pages are not known there)."""
        if self.api.api_url != DEFAULT_API_URL:
            return None
        try:
            organization, pipeline, number = parse_build_id(build_id)
        except BuildRunnerError:
            return None
        return f"{WEB_URL}/{organization}/{pipeline}/builds/{number}"

    async def cancel(self, build_id: str) -> None:
        organization, pipeline, number = parse_build_id(build_id)
        # 422: Buildkite cancels only scheduled, running or failing builds; any other is
        # over already (or canceling), and stays as it ended
        await self.api.call("PUT", f"{_builds_path(organization, pipeline)}/{number}/cancel",
                            expect=(200, 422))

    def poll_delay(self, build_id: str, configured: float) -> float:
        """How long a poll loop of ``build_id`` holds: the pipeline's poll period — the
        configured delay, or longer when the organization's budget allows no more — and
        aligned with the pipeline's next list, so one list answers every loop."""
        budget = self.api.budget()
        if not self.batch_polls or budget is None:
            return configured
        organization, pipeline, _ = parse_build_id(build_id)
        snapshot = self._snapshot(organization, pipeline)
        pipelines = active_pipelines(f"{budget.key}|", within=ACTIVE_WITHIN)
        return snapshot.plan(budget.poll_period(max(1, pipelines), floor=configured))

    def _snapshot(self, organization: str, pipeline: str) -> Snapshot:
        budget = self.api.budget()
        scope = budget.key if budget is not None else f"{PROVIDER}:{self.api.api_url}"
        return snapshot_for(f"{scope}|{organization}/{pipeline}",
                            lambda since: self._list(organization, pipeline, since))

    async def _list(self, organization: str, pipeline: str,
                    since: str | None) -> tuple[dict[str, Any], bool]:
        """The pipeline's builds created since ``since`` (None: the newest), newest first,
        one page; and whether that was all of them."""
        params = {"per_page": str(LIST_PAGE), "exclude_jobs": "true"}
        if since:
            params["created_from"] = since
        answer = await self.api.call("GET", _builds_path(organization, pipeline),
                                     params=params)
        builds = [b for b in answer.body or [] if _is_build(b)] \
            if isinstance(answer.body, list) else []
        return {str(b["number"]): b for b in builds}, len(builds) < LIST_PAGE

    async def aclose(self) -> None:
        await self.api.aclose()


def parse_build_id(build_id: str) -> tuple[str, str, int]:
    """(organization, pipeline, number) of a buildkite build id; a non-retryable
    BuildRunnerError for anything else."""
    match = _BUILD_ID.fullmatch(build_id)
    if match is None:
        raise BuildRunnerError(f"not a buildkite build id: {build_id!r} (want "
                               f"{BUILD_ID_PREFIX}<organization>/<pipeline>/<number>)")
    return match.group(1), match.group(2), int(match.group(3))


def _build_id(organization: str, pipeline: str, number: int) -> str:
    return f"{BUILD_ID_PREFIX}{organization}/{pipeline}/{number}"


def _builds_path(organization: str, pipeline: str) -> str:
    return f"/v2/organizations/{organization}/pipelines/{pipeline}/builds"


def _is_build(value: Any) -> bool:
    number = value.get("number") if isinstance(value, dict) else None
    return isinstance(number, int) and not isinstance(number, bool) and number > 0


def _message(queue: str, commits: Commits, metadata: Mapping[str, str]) -> str:
    strategy = metadata.get("strategy") or ("incremental" if commits.base else "full")
    request = metadata.get("request_id")
    return (f"Stovepipe: validate {queue or commits.head.ref} at {commits.head.sha[:12]} "
            f"({strategy}{', ' + request if request else ''})")
