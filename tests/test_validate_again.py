"""Issue 16, items 2 to 5 and 8 on real git repositories and real command builds, with real
workers on the real broker and database: what a `failed` means, flaky builds re-run,
validating a commit again (explicitly, and by itself after an ingest), the bookmark and
the promotion ref never moving back, and a settled Request whose `record` was lost.

A build's verdict is chosen by a file outside the repository, per commit sha, so one
commit can be red and later green: ``red`` fails, ``once-red`` fails once then passes,
anything else (or nothing) passes; ``hang`` sleeps until the test kills it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from store import BuildStatus, BuildStrategy, Database, RequestState, Verdict
from streams.config.queues import RetrySpec
from streams.stages import attempts
from streams.stages.attempts import Observed
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

QUEUE = "mono/main"


def _git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


class Repo:
    """A git repository whose commits' verdicts the test chooses."""

    def __init__(self, root: Path) -> None:
        self.work = root / "mono"
        self.work.mkdir()
        self.verdicts = root / "verdicts"
        self.verdicts.mkdir()
        _git(self.work, "init", "-q")

    def commit(self, name: str, verdict: str = "green") -> str:
        (self.work / "app.txt").write_text(f"{name}\n")
        _git(self.work, "add", "app.txt")
        _git(self.work, "commit", "-q", "-m", name)
        sha = _git(self.work, "rev-parse", "HEAD")
        self.judge(sha, verdict)
        return sha

    def judge(self, sha: str, verdict: str) -> None:
        (self.verdicts / sha).write_text(f"{verdict}\n")

    @property
    def command(self) -> str:
        v = f'"{self.verdicts}/$STOVEPIPE_HEAD_SHA"'
        return (f'v=$(cat {v}); echo "verdict $v"; '
                f'if [ "$v" = hang ]; then sleep 600; fi; '
                f'if [ "$v" = once-red ]; then echo green > {v}; exit 1; fi; '
                f'[ "$v" != red ]')


def _queue(pipeline: Pipeline, repo: Repo, **knobs: Any) -> None:
    pipeline.add_raw_queue(QUEUE, {
        "source_control": {"kind": "git", "repository": str(repo.work), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": repo.command},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
        "poll_deadline": "5m", **knobs})


def _promoted(repo: Repo) -> str | None:
    try:
        return _git(repo.work, "rev-parse", "refs/heads/verified-main")
    except subprocess.CalledProcessError:
        return None


def _settle(pipeline: Pipeline, request_id: str) -> str:
    pipeline.wait_terminal([request_id], timeout=120)
    pipeline.wait_quiet(timeout=120)
    return pipeline.states()[request_id]


def _facts(pipeline: Pipeline) -> dict[str, tuple[float, int, bool]]:
    return {r: (d, a, f) for r, d, a, f in pipeline.query(
        "SELECT request_id, degree, attempts, flaky FROM validation_fact")}


def _fact_exit(pipeline: Pipeline, sha: str) -> tuple[int, dict[str, Any]]:
    done = pipeline.cli("fact", QUEUE, sha, "--json", check=False)
    return done.returncode, json.loads(done.stdout)


def test_a_flaky_build_is_run_again_and_its_green_is_marked_flaky(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """retry.red: 1 — a build that fails once then passes: the Request succeeds on its
    second attempt with a green fact marked flaky (attempts 2); a build red twice is the
    red verdict, after two attempts."""
    repo = Repo(tmp_path)
    _queue(pipeline, repo, retry={"red": 1})
    pipeline.start_worker()
    repo.commit("c1", "once-red")
    first = pipeline.ingest(QUEUE)
    assert _settle(pipeline, first) == "succeeded"
    assert _facts(pipeline) == {first: (0.0, 2, True)}
    builds = pipeline.query("SELECT attempt, status, verdict FROM build ORDER BY attempt")
    assert builds == [(1, "failed", "red"), (2, "succeeded", "green")]

    repo.commit("c2", "red")
    second = pipeline.ingest(QUEUE)
    assert _settle(pipeline, second) == "failed"
    assert _facts(pipeline)[second] == (1.0, 2, False)
    assert pipeline.query("SELECT verdict, red_reruns FROM request WHERE id = %s",
                          second) == [("red", 1)]
    assert pipeline.dead_letters() == 0


def test_a_failed_head_is_validated_again_on_request_and_its_new_verdict_answers(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = Repo(tmp_path)
    _queue(pipeline, repo)
    pipeline.start_worker()
    c1 = repo.commit("c1", "red")
    first = pipeline.ingest(QUEUE)
    assert _settle(pipeline, first) == "failed"
    assert _facts(pipeline) == {first: (1.0, 1, False)}
    # an ingest of the same head after a red verdict validates nothing again
    assert pipeline.ingest(QUEUE) == first

    repo.judge(c1, "green")  # the flake is fixed, or the infrastructure: ask again
    again = pipeline.cli("retry", QUEUE).stdout.strip()
    assert again == f"{first}.2"
    assert _settle(pipeline, again) == "succeeded"
    # each Request keeps its own fact; the commit's answer is its newest Request's verdict
    assert _facts(pipeline) == {first: (1.0, 1, False), again: (0.0, 1, False)}
    assert pipeline.request(first)["fact"]["degree"] == 1.0
    code, answer = _fact_exit(pipeline, c1)
    assert code == 0 and answer["green"] and answer["fact"]["request_id"] == again
    assert pipeline.queue(QUEUE)["last_green_request_id"] == again
    assert _promoted(repo) == c1

    # a green commit is never validated again
    refused = pipeline.cli("retry", QUEUE, c1, check=False)
    assert refused.returncode == 4, refused.stderr
    assert "green" in refused.stderr
    assert pipeline.query("SELECT count(*) FROM request") == [(2,)]


def test_validating_an_older_commit_again_moves_neither_the_bookmark_nor_the_ref_back(
        pipeline: Pipeline, tmp_path: Path) -> None:
    repo = Repo(tmp_path)
    _queue(pipeline, repo)
    pipeline.start_worker()
    c1 = repo.commit("c1", "red")
    first = pipeline.ingest(QUEUE)
    assert _settle(pipeline, first) == "failed"
    c2 = repo.commit("c2")
    second = pipeline.ingest(QUEUE)
    assert _settle(pipeline, second) == "succeeded"
    assert _promoted(repo) == c2

    repo.judge(c1, "green")
    again = pipeline.cli("retry", QUEUE, c1[:10]).stdout.strip()
    assert again == f"{first}.2"
    assert _settle(pipeline, again) == "succeeded"
    # c1 is green now, and sorts where it was first ingested: before c2
    queue = pipeline.queue(QUEUE)
    assert (queue["last_green_request_id"], queue["latest_request_id"]) == (second, second)
    assert _promoted(repo) == c2
    code, answer = _fact_exit(pipeline, c1)
    assert code == 0 and answer["fact"]["request_id"] == again
    # it superseded nothing, and nothing superseded it
    assert pipeline.states() == {first: "failed", second: "succeeded", again: "succeeded"}
    assert pipeline.invariant_violations(strict_bookmark=False) == []


def test_a_head_that_could_not_be_validated_is_validated_again_when_ingested(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """retry.unvalidated: 0 — a build whose process vanishes (killed behind our back) gives
    no verdict: the Request fails without one (no fact, no red alert, its reason shown,
    an `error` commit status), and the next ingest of the same head validates it again."""
    repo = Repo(tmp_path)
    _queue(pipeline, repo, retry={"unvalidated": 0})
    pipeline.start_worker()
    c1 = repo.commit("c1", "hang")
    first = pipeline.ingest(QUEUE)

    def running() -> list[tuple[Any, ...]]:
        return pipeline.query("SELECT pgid FROM command_build WHERE status = 'running'"
                              " AND pgid IS NOT NULL")

    wait_until(lambda: bool(running()), timeout=120, what="the build to run")
    [(pgid,)] = running()
    os.killpg(pgid, signal.SIGKILL)
    pipeline.wait_terminal([first], timeout=120)
    assert pipeline.states() == {first: "failed"}
    request = pipeline.request(first)["request"]
    assert request["verdict"] is None
    assert request["reason"].startswith("could not be validated (1 attempt): its process "
                                        "vanished")
    wait_until(lambda: pipeline.query("SELECT recorded FROM request") == [(False,)],
               timeout=5, what="no record of a Request without a verdict")
    assert _facts(pipeline) == {}
    code, answer = _fact_exit(pipeline, c1)
    assert code == 3 and answer["fact"] is None

    repo.judge(c1, "green")
    again = pipeline.ingest(QUEUE)  # the same head: validated again by itself
    assert again == f"{first}.2"
    assert _settle(pipeline, again) == "succeeded"
    assert pipeline.queue(QUEUE)["latest_request_id"] == again
    assert _promoted(repo) == c1
    assert pipeline.ingest(QUEUE) == again  # green: never again


def test_a_settled_request_whose_record_was_lost_gets_its_fact_from_the_sweeper(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """A Request settled green whose `record` message was never delivered (it
    dead-lettered on its publish): the sweeper finds the verdict without a fact, and
    record writes it, moves the bookmark and the promotion ref."""

    repo = Repo(tmp_path)
    _queue(pipeline, repo)
    c1 = repo.commit("c1")
    uri = f"git+{repo.work}#main@{c1}"

    async def settle_without_record() -> str:
        db = await Database.open(pipeline.dsn)
        try:
            async with db.queue_transaction(QUEUE) as tx:
                minted = await tx.steps.find_or_mint(QUEUE, uri)
            assert minted is not None
            request = await db.requests.get(QUEUE, minted.request_id)
            admitted = await db.steps.admit(request, strategy=BuildStrategy.FULL,
                                            base_uri=None, max_concurrent=1,
                                            last_green_request_id=None)
            assert admitted is not None
            build = await db.builds.create(QUEUE, "cmd-" + "0" * 32, admitted.id)
            observed = Observed(BuildStatus.SUCCEEDED, Verdict.GREEN)
            end = attempts.decide(admitted, observed, RetrySpec())
            ended = await db.steps.end_attempt(admitted, end, build=build,
                                               build_status=observed.status,
                                               build_verdict=observed.verdict)
            assert ended.request is not None
            assert ended.request.state is RequestState.SUCCEEDED
            return admitted.id
        finally:
            await db.close()

    request_id = asyncio.run(settle_without_record())
    assert _facts(pipeline) == {}
    pipeline.start_worker()  # nothing was published: only the sweeper knows
    wait_until(lambda: bool(_facts(pipeline)), timeout=60, what="the fact from the sweeper")
    assert _facts(pipeline) == {request_id: (0.0, 1, False)}
    wait_until(lambda: _promoted(repo) == c1, timeout=60, what="the promotion ref")
    assert pipeline.queue(QUEUE)["last_green_request_id"] == request_id
    assert "sweeper_republished what=record" in pipeline.full_logs()
