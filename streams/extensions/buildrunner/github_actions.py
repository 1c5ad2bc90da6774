"""The github_actions BuildRunner: a ``workflow_dispatch`` run of a GitHub Actions workflow
per Request (design §8).

Endpoints (GitHub REST API, https://docs.github.com/rest/actions):

- ``POST /repos/{owner}/{repo}/actions/workflows/{workflow}/dispatches`` with ``ref`` (the
  configured branch, else the head URI's ref), ``inputs`` — the head sha, the base sha
  (empty for a full build), a correlation id, for a monorepo project's build the project
  (the ``project_input``, which the workflow must then declare), and the queue's extra
  inputs — and
  ``return_run_details: true``, so GitHub answers ``200`` with the ``workflow_run_id`` it
  started. A GitHub that answers ``204`` without it (GitHub Enterprise Server before the
  feature) is asked for the run instead, below, for up to ``run_search`` seconds; one that
  refuses the parameter (``400`` or ``422``: no run started) is sent the dispatch again at
  once without it, its run is looked for the same way, and the runner remembers that its
  server does not know the parameter;
- ``GET /repos/{owner}/{repo}/actions/workflows/{workflow}/runs?event=workflow_dispatch
  &branch=<ref>&created=>=<time>`` finds a run by its correlation id, which the workflow
  must put in its ``run-name`` (so it is the run's ``display_title``). Before dispatching,
  a trigger looks for the run an earlier trigger with the same key started (within
  ``lookback``) and returns it instead of starting a second one;
- ``GET /repos/{owner}/{repo}/actions/runs/{run_id}`` is the status,
  ``POST /repos/{owner}/{repo}/actions/runs/{run_id}/cancel`` cancels (``409``: the run is
  completed already; it stays as it ended).

A build id is ``gha-<owner>/<repo>/<run id>``, known when the trigger returns (the run is
found at trigger time, with bounded waiting), so any worker answers status and cancel from
the id and the token alone, with no state of its own.

The correlation id is derived from the trigger key (the Request id) and the commits
(`hosted.correlation_id`): a trigger repeated after a crash finds the first run. A
dispatch answered ``204`` whose run does not show up within ``run_search`` is a retryable
error; the retry finds the run if it has appeared meanwhile, and dispatches again only if
it has not.

How a run's answers map to our statuses, what a run waits for, and how a completed run
ended (its jobs and their annotations, read once): `github_runs`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass as spec_dataclass

from store.entities import split_scope
from streams.extensions import ExtensionContext
from streams.extensions.buildrunner.contract import BuildReport, BuildRunnerError
from streams.extensions.buildrunner.github_runs import (
    WAITING,
    RunEndings,
    status_of,
)
from streams.extensions.buildrunner.hosted import (
    DEFAULT_RATE_LIMIT_WAIT,
    DEFAULT_REQUEST_TIMEOUT,
    ApiUrl,
    BranchName,
    Commits,
    HostedApi,
    TokenEnvName,
    correlation_id,
    number_header,
    retry_after_seconds,
)
from streams.extensions.buildrunner.snapshots import Snapshot, active_pipelines, snapshot_for
from streams.schema.fields import SPEC, Duration, Flag, PositiveFloat

BUILD_ID_PREFIX = "gha-"
DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
PROVIDER = "github_actions"
DEFAULT_RUN_SEARCH = 30.0  # seconds a trigger waits for a run GitHub did not name
DEFAULT_LOOKBACK = 3600.0  # seconds back a repeated trigger looks for its first run
RUN_SEARCH_POLL = 2.0  # seconds between two looks for the run
CLOCK_MARGIN = 300.0  # seconds: runs created "before" a dispatch by another clock
PAGES = 10  # GitHub lists at most 1,000 runs for a filtered search
PER_PAGE = 100
MAX_INPUTS = 25  # GitHub: a workflow_dispatch event has at most 25 inputs
DEFAULT_REQUESTS_PER_MINUTE = 2500 / 60  # half of a token's 5,000 an hour
# of those, the calls that create content (a commit status, a dispatch, a cancel): GitHub's
# secondary limit allows about 500 an hour ("Rate limits for the REST API", secondary
# rate limits); Stovepipe stays below it
DEFAULT_CONTENT_REQUESTS_PER_HOUR = 400.0
GITHUB_BUDGET = "github"  # the budget's name: shared with the commit-status notifier
LIST_PAGE = 100  # runs in one list answer (GitHub's largest page)
ACTIVE_WITHIN = 60.0  # seconds since its last poll that a workflow counts as polled

log = logging.getLogger("stovepipe.buildrunner.github_actions")
_REPOSITORY = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+")
_WORKFLOW = re.compile(r"[A-Za-z0-9_.-]+\.ya?ml|[1-9][0-9]*")
_INPUT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_BUILD_ID = re.compile(r"gha-([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)/([1-9][0-9]{0,18})")


SECONDARY_RATE_LIMIT_WAIT = 60.0  # GitHub: "wait for at least one minute before retrying"
_RATE_LIMIT_WORDS = ("rate limit", "abuse detection")  # secondary limits' older name


@dataclass(frozen=True)
class GitHubRateLimit:
    """An answer GitHub marks as a rate limit, and how long to leave it alone.
    ``stated``: GitHub said how long (``retry-after``, or the reset of a spent primary
    limit); otherwise ``wait`` is the documented minimum of a minute, and a caller that
    keeps being limited should back off further (exponentially)."""

    wait: float
    stated: bool


def github_rate_limit(status: int, headers: Mapping[str, str],
                      message: str) -> GitHubRateLimit | None:
    """What an answer of GitHub's REST API says about its rate limits (``headers`` with
    lower-case names; ``message`` the answer's message or body); None when it is no rate
    limit. The one classification of GitHub's rate limits, for the runner and the
    commit-status notifier alike.

    GitHub ("Rate limits for the REST API", *Exceeding the rate limit*) answers a spent
    primary limit with 403 or 429 and ``x-ratelimit-remaining: 0`` (wait until the epoch
    second in ``x-ratelimit-reset``), and a secondary limit with 403 or 429 and a message
    saying so, sometimes with ``retry-after`` and often with ``x-ratelimit-remaining``
    above 0 (wait ``retry-after`` if given, else at least a minute). A 403 that is none of
    these (no permission, a blocked token) is no rate limit."""
    if status not in (403, 429):
        return None
    asked = retry_after_seconds(headers.get("retry-after"))
    if asked is not None:
        return GitHubRateLimit(asked, stated=True)
    if headers.get("x-ratelimit-remaining", "").strip() == "0":
        reset = number_header(headers, "x-ratelimit-reset")
        if reset is not None:
            return GitHubRateLimit(max(0.0, reset - time.time()), stated=True)
        return GitHubRateLimit(DEFAULT_RATE_LIMIT_WAIT, stated=False)
    said = message.lower()
    if status == 429 or "retry-after" in headers or any(w in said for w in _RATE_LIMIT_WORDS):
        return GitHubRateLimit(SECONDARY_RATE_LIMIT_WAIT, stated=False)
    return None


def _rate_limit_wait(status: int, headers: Mapping[str, str], message: str) -> float | None:
    """`github_rate_limit`'s wait, as `HostedApi` asks for it."""
    limit = github_rate_limit(status, headers, message)
    return limit.wait if limit is not None else None


def _pattern(regex: re.Pattern[str], what: str, example: str) -> Any:
    def check(value: object) -> str:
        if not isinstance(value, str) or not regex.fullmatch(value):
            raise ValueError(f"expected {what}, e.g. {example}, got {value!r}")
        return value
    return BeforeValidator(check)


Repository = Annotated[str, _pattern(_REPOSITORY, "owner/name", "acme/monorepo")]
Workflow = Annotated[str, _pattern(_WORKFLOW, "a workflow file name or id", "ci.yml")]
InputName = Annotated[str, _pattern(_INPUT, "a workflow_dispatch input name", "head")]


def _extra_inputs(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and _INPUT.fullmatch(k) and isinstance(v, str)
            for k, v in value.items()):
        raise ValueError(f"expected a mapping of input names to strings, got {value!r}")
    return dict(value)


@spec_dataclass(frozen=True, config=SPEC)
class GitHubActionsBuildRunnerSpec:
    """`kind: github_actions`: a workflow_dispatch run of a GitHub Actions workflow (this
    module)."""

    wants_repository: ClassVar[bool] = False
    repository: Annotated[Repository, Field(examples=["repository: acme/monorepo"])]
    workflow: Annotated[Workflow, Field(examples=["workflow: stovepipe.yml"])]
    # the NAME of the environment variable holding the API token, never the token
    token_env: Annotated[TokenEnvName, Field(examples=["token_env: GITHUB_TOKEN"])]
    ref: BranchName | None = None  # the branch to dispatch on; None: the head URI's ref
    api_url: ApiUrl = DEFAULT_API_URL
    head_input: InputName = "head"
    base_input: InputName = "base"
    id_input: InputName = "stovepipe_id"
    project_input: InputName = "project"  # sent only for a project's build
    inputs: Annotated[dict[str, str], BeforeValidator(_extra_inputs)] | None = None
    run_search: Duration = timedelta(seconds=DEFAULT_RUN_SEARCH)
    lookback: Duration = timedelta(seconds=DEFAULT_LOOKBACK)
    request_timeout: Duration = timedelta(seconds=DEFAULT_REQUEST_TIMEOUT)
    # Stovepipe's share of the token's limit (5,000 an hour), divided among the workers:
    # half, leaving the other half to whatever else uses the token
    requests_per_minute: PositiveFloat = DEFAULT_REQUESTS_PER_MINUTE
    # of those, the calls that create content (dispatches, cancels; commit statuses on
    # the same token count too), an hour, divided among the workers: below the about 500
    # an hour GitHub allows
    content_requests_per_hour: PositiveFloat = DEFAULT_CONTENT_REQUESTS_PER_HOUR
    # poll a workflow's running runs with one list call (False: one call per run)
    batch_polls: Flag = True
    kind: Literal["github_actions"] = "github_actions"

    @model_validator(mode="after")
    def _distinct_inputs(self) -> GitHubActionsBuildRunnerSpec:
        names = [self.head_input, self.base_input, self.id_input]
        named = [*names, self.project_input]
        if len(set(named)) != len(named):
            raise ValueError(f"head_input, base_input, id_input and project_input must "
                             f"differ, got {named}")
        clash = sorted(set(named) & set(self.inputs or {}))
        if clash:
            raise ValueError(f"inputs {clash} are set by Stovepipe (head_input, base_input, "
                             f"id_input, project_input)")
        count = len(names) + len(self.inputs or {})
        if count > MAX_INPUTS:
            raise ValueError(f"a workflow_dispatch takes at most {MAX_INPUTS} inputs, and "
                             f"this runner would send {count}: Stovepipe's 3 (head_input, "
                             f"base_input, id_input) and {count - len(names)} under inputs")
        return self

    def build(self, context: ExtensionContext) -> GitHubActionsBuildRunner:
        return GitHubActionsBuildRunner(
            self.repository, self.workflow, self.token_env, ref=self.ref,
            api_url=self.api_url,
            input_names=(self.head_input, self.base_input, self.id_input),
            project_input=self.project_input, inputs=self.inputs,
            run_search=self.run_search.total_seconds(),
            lookback=self.lookback.total_seconds(),
            timeout=self.request_timeout.total_seconds(),
            requests_per_minute=self.requests_per_minute, batch_polls=self.batch_polls,
            content_per_hour=self.content_requests_per_hour)


class GitHubActionsBuildRunner:
    """Dispatches ``workflow`` of ``repository`` (owner/name) with the API token in the
    environment variable ``token_env`` (see the module docstring). ``input_names`` are the
    workflow_dispatch inputs for the head sha, the base sha and the correlation id."""

    def __init__(self, repository: str, workflow: str, token_env: str, *,
                 ref: str | None = None, api_url: str = DEFAULT_API_URL,
                 input_names: tuple[str, str, str] = ("head", "base", "stovepipe_id"),
                 project_input: str = "project",
                 inputs: Mapping[str, str] | None = None,
                 run_search: float = DEFAULT_RUN_SEARCH, lookback: float = DEFAULT_LOOKBACK,
                 timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 environ: Mapping[str, str] | None = None,
                 search_poll: float = RUN_SEARCH_POLL,
                 requests_per_minute: float | None = None,
                 batch_polls: bool = False,
                 content_per_hour: float | None = None) -> None:
        self.repository = repository
        self.batch_polls = batch_polls
        self.workflow = workflow
        self.ref = ref
        self.input_names = input_names
        self.project_input = project_input
        self.inputs = dict(inputs or {})
        self.run_search = run_search
        self.lookback = lookback
        self.search_poll = search_poll
        # whether the server takes `return_run_details` (None: not known yet; False: it
        # refused it with 400/422, an Enterprise Server without the feature)
        self.run_details: bool | None = None
        self.api = HostedApi(PROVIDER, api_url, token_env, timeout=timeout,
                             headers={"Accept": "application/vnd.github+json",
                                      "X-GitHub-Api-Version": API_VERSION},
                             rate_limit_wait=_rate_limit_wait, environ=environ,
                             requests_per_minute=requests_per_minute,
                             budget_name=GITHUB_BUDGET, content_per_hour=content_per_hour)
        self._runs = RunEndings(self.api)

    def __repr__(self) -> str:
        return (f"GitHubActionsBuildRunner({self.repository!r}, {self.workflow!r}, "
                f"token_env={self.api.token_env!r}, api_url={self.api.api_url!r})")

    async def trigger(self, base_uri: str | None, head_uri: str,
                      metadata: Mapping[str, str]) -> str:
        commits = Commits.of(PROVIDER, base_uri, head_uri)
        correlation = correlation_id(metadata, base_uri, head_uri)
        ref = self.ref or commits.head.ref
        if metadata.get("trigger_key"):
            found = await self._find_run(correlation, ref, time.time() - self.lookback)
            if found is not None:  # started by an earlier trigger of the same key
                return self._build_id(self.repository, found)
        head_input, base_input, id_input = self.input_names
        dispatched_at = time.time()
        dispatches = f"{self._workflow_path()}/dispatches"
        body: dict[str, Any] = {
            "ref": ref,
            "inputs": {**self.inputs, head_input: commits.head.sha,
                       base_input: commits.base.sha if commits.base else "",
                       id_input: correlation},
        }
        project = split_scope(metadata.get("queue") or "")[1]
        if project:  # a project's build; a queue without projects sends no such input
            body["inputs"][self.project_input] = project
        if self.run_details is not False:
            answer = await self.api.call("POST", dispatches, expect=(200, 204, 400, 422),
                                         body={**body, "return_run_details": True})
            if answer.status in (400, 422):
                # an Enterprise Server that does not know the parameter refuses the whole
                # dispatch (no run started): dispatch again at once without it
                answer = await self.api.call("POST", dispatches, expect=(200, 204),
                                             body=body)
                self.run_details = False  # it took the dispatch without: remember that
                log.warning("github_actions_dispatch_without_run_details api_url=%s "
                            "workflow=%s: the server refused return_run_details; runs "
                            "are found by their run-name", self.api.api_url, self.workflow)
            else:
                self.run_details = True
        else:
            answer = await self.api.call("POST", dispatches, expect=(200, 204), body=body)
        run_id = answer.body.get("workflow_run_id") if isinstance(answer.body, dict) else None
        if answer.status == 200 and isinstance(run_id, int) and _is_run_id(run_id):
            return self._build_id(self.repository, run_id)
        return self._build_id(self.repository,
                              await self._wait_for_run(correlation, ref, dispatched_at))

    async def status(self, build_id: str) -> BuildReport:
        repository, run_id = parse_build_id(build_id)
        snapshot = self._snapshot() if self.batch_polls and repository == self.repository \
            else None
        run = await snapshot.lookup(str(run_id)) if snapshot is not None else None
        if not isinstance(run, dict):  # not in the workflow's list: ask for it alone
            answer = await self.api.call("GET", f"/repos/{repository}/actions/runs/{run_id}")
            run = answer.body if isinstance(answer.body, dict) else {}
            if snapshot is not None:
                created = run.get("created_at")
                snapshot.remember(str(run_id), run,
                                  created if isinstance(created, str) else None)
        status, conclusion = run.get("status"), run.get("conclusion")
        if not isinstance(status, str):
            raise BuildRunnerError(f"{PROVIDER}: run {build_id} answered without a status")
        conclusion = conclusion if isinstance(conclusion, str) else None
        metadata = {"runner": PROVIDER, "status": status, "conclusion": conclusion or "",
                    "html_url": str(run.get("html_url") or "")}
        ours = status_of(status, conclusion)
        if not ours.is_terminal:
            return BuildReport(ours, metadata, waiting=WAITING.get(status, ""))
        return (await self._runs.ending_of(repository, run_id, run)).report(metadata)

    def build_url(self, build_id: str) -> str | None:
        """The run's page: on github.com for its API, on the server itself for a GitHub
        Enterprise Server (``https://<host>/api/v3``); None for a build id of another
        shape or an API elsewhere."""
        try:
            repository, run_id = parse_build_id(build_id)
        except BuildRunnerError:
            return None
        api_url = self.api.api_url
        if api_url == DEFAULT_API_URL:
            site = "https://github.com"
        elif api_url.endswith("/api/v3"):
            site = api_url.removesuffix("/api/v3")
        else:
            return None
        return f"{site}/{repository}/actions/runs/{run_id}"

    def poll_delay(self, build_id: str, configured: float) -> float:
        """How long a poll loop of ``build_id`` holds: the workflow's poll period — the
        configured delay, or longer when the token's budget allows no more — aligned with
        the workflow's next list, so one list answers every loop."""
        budget = self.api.budget()
        if not self.batch_polls or budget is None:
            return configured
        workflows = active_pipelines(f"{budget.key}|", within=ACTIVE_WITHIN)
        return self._snapshot().plan(budget.poll_period(max(1, workflows), floor=configured))

    def _snapshot(self) -> Snapshot:
        budget = self.api.budget()
        scope = budget.key if budget is not None else f"{PROVIDER}:{self.api.api_url}"
        return snapshot_for(f"{scope}|{self.repository}/{self.workflow}", self._list)

    async def _list(self, since: str | None) -> tuple[dict[str, Any], bool]:
        """The workflow's runs created since ``since`` (None: the newest), newest first,
        one page; and whether that was all of them."""
        params = {"per_page": str(LIST_PAGE)}
        if since:
            params["created"] = f">={since}"
        answer = await self.api.call("GET", f"{self._workflow_path()}/runs", params=params)
        body = answer.body if isinstance(answer.body, dict) else {}
        runs = [r for r in body.get("workflow_runs") or []
                if isinstance(r, dict) and _is_run_id(r.get("id"))]
        total = body.get("total_count")
        complete = isinstance(total, int) and total <= len(runs)
        return {str(r["id"]): r for r in runs}, complete

    async def cancel(self, build_id: str) -> None:
        repository, run_id = parse_build_id(build_id)
        # 409: the run is completed; it stays as it ended
        await self.api.call("POST", f"/repos/{repository}/actions/runs/{run_id}/cancel",
                            expect=(202, 409))

    async def aclose(self) -> None:
        await self.api.aclose()

    async def _wait_for_run(self, correlation: str, ref: str, dispatched_at: float) -> int:
        """The run a dispatch answered 204 started, looked for until ``run_search`` is
        over (bounded: this runs inside the build stage's handler)."""
        deadline = time.monotonic() + self.run_search
        while True:
            found = await self._find_run(correlation, ref, dispatched_at - CLOCK_MARGIN)
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BuildRunnerError(
                    f"{PROVIDER}: dispatched {self.workflow} on {ref}, but no run whose name "
                    f"contains {correlation} appeared within {self.run_search:g}s; the "
                    f"workflow's run-name must include the {self.input_names[2]} input",
                    retryable=True)
            await asyncio.sleep(min(self.search_poll, remaining))

    async def _find_run(self, correlation: str, ref: str, since: float) -> int | None:
        """The oldest run of the workflow on ``ref`` created since ``since`` (epoch s)
        whose name carries ``correlation``."""
        created = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        matches: list[int] = []
        for page in range(1, PAGES + 1):
            answer = await self.api.call("GET", f"{self._workflow_path()}/runs", params={
                "event": "workflow_dispatch", "branch": ref, "created": f">={created}",
                "per_page": str(PER_PAGE), "page": str(page)})
            runs = answer.body.get("workflow_runs") if isinstance(answer.body, dict) else None
            runs = runs if isinstance(runs, list) else []
            matches += [run["id"] for run in runs
                        if isinstance(run, dict) and _is_run_id(run.get("id"))
                        and correlation in str(run.get("display_title") or "")]
            if len(runs) < PER_PAGE:
                break
        return min(matches) if matches else None

    def _workflow_path(self) -> str:
        return f"/repos/{self.repository}/actions/workflows/{self.workflow}"

    @staticmethod
    def _build_id(repository: str, run_id: int) -> str:
        return f"{BUILD_ID_PREFIX}{repository}/{run_id}"


def parse_build_id(build_id: str) -> tuple[str, int]:
    """(owner/repo, run id) of a github_actions build id; a non-retryable BuildRunnerError
    for anything else."""
    match = _BUILD_ID.fullmatch(build_id)
    if match is None:
        raise BuildRunnerError(f"not a github_actions build id: {build_id!r} (want "
                               f"{BUILD_ID_PREFIX}<owner>/<repo>/<run id>)")
    return match.group(1), int(match.group(2))




def _is_run_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
