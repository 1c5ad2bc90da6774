"""Issue 16, items 2 to 5 and 8 on real git repositories and real command builds, with real
workers on the real broker and database: what a `failed` means, flaky builds re-run,
validating a commit again (explicitly, and by itself after an ingest), the bookmark and
the promotion ref never moving back, and a settled Request whose `record` was lost.

A build's verdict is chosen by a file outside the repository, per commit sha, so one
commit can be red and later green: ``red`` fails, ``once-red`` fails once then passes,
anything else (or nothing) passes; ``hang`` sleeps until the test kills it.

Each case takes a lane of the module's shared worker (`tests.shared_worker`), with its
own repository in the lane's directory; the lost `record` is set up before any worker
runs, so that case starts a worker of its own.
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
from tests.shared_worker import Lane, lane_raw_queue
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

QUEUE = "mono/main"


def _git(work: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-c", "init.defaultBranch=main", "-C", str(work), *args],
                          env=env, check=True, capture_output=True, text=True).stdout.strip()


class Repo:
    """A git repository whose commits' verdicts the test chooses, in ``root`` (made there
    the first time)."""

    def __init__(self, root: Path) -> None:
        self.work = root / "mono"
        self.verdicts = root / "verdicts"
        if not self.work.exists():
            self.work.mkdir()
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
                f'if [ "$v" = red-then-hang ]; then echo hang > {v}; exit 1; fi; '
                f'[ "$v" != red ]')


def _queue(repo: Repo, **knobs: Any) -> dict[str, Any]:
    """The queue's entry in queues.yaml."""
    return {
        "source_control": {"kind": "git", "repository": str(repo.work), "ref": "main",
                           "promotion_ref": "verified-main"},
        "build_runner": {"kind": "command", "command": repo.command},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
        "poll_deadline": "5m", **knobs}


def lane_repo_queue(**knobs: Any) -> pytest.MarkDecorator:
    """The test's lane has QUEUE on a Repo in the lane's directory."""
    return lane_raw_queue(QUEUE, lambda root: _queue(Repo(root), **knobs))


def _promoted(repo: Repo) -> str | None:
    try:
        return _git(repo.work, "rev-parse", "refs/heads/verified-main")
    except subprocess.CalledProcessError:
        return None


def _settle(pipeline: Pipeline, request_id: str) -> str:
    pipeline.wait_terminal([request_id], timeout=120)
    pipeline.wait_quiet(timeout=120)
    return pipeline.states()[request_id]


def _facts(pipeline: Pipeline, queue: str) -> dict[str, tuple[float, int, bool]]:
    return {r: (d, a, f) for r, d, a, f in pipeline.query(
        "SELECT request_id, degree, attempts, flaky FROM validation_fact WHERE queue = %s",
        queue)}


def _fact_exit(pipeline: Pipeline, queue: str, sha: str) -> tuple[int, dict[str, Any]]:
    done = pipeline.cli("fact", queue, sha, "--json", check=False)
    return done.returncode, json.loads(done.stdout)


@lane_repo_queue(retry={"red": 1})
def test_a_flaky_build_is_run_again_and_its_green_is_marked_flaky(lane: Lane) -> None:
    """retry.red: 1 — a build that fails once then passes: the Request succeeds on its
    second attempt with a green fact marked flaky (attempts 2); a build red twice is the
    red verdict, after two attempts."""
    repo, queue = Repo(lane.root), lane.name(QUEUE)
    repo.commit("c1", "once-red")
    first = lane.ingest(queue)
    assert _settle(lane, first) == "succeeded"
    assert _facts(lane, queue) == {first: (0.0, 2, True)}
    builds = lane.query("SELECT attempt, status, verdict FROM build WHERE queue = %s"
                        " ORDER BY attempt", queue)
    assert builds == [(1, "failed", "red"), (2, "succeeded", "green")]

    repo.commit("c2", "red")
    second = lane.ingest(queue)
    assert _settle(lane, second) == "failed"
    assert _facts(lane, queue)[second] == (1.0, 2, False)
    assert lane.query("SELECT verdict, red_reruns FROM request WHERE id = %s",
                      second) == [("red", 1)]
    assert lane.dead_letters() == 0


@lane_repo_queue(retry={"red": 1, "unvalidated": 0})
def test_a_red_verdict_stands_when_its_re_run_could_not_validate(lane: Lane) -> None:
    """Issue 23, item 5: retry.red 1 — the build fails (red), its re-run's process
    vanishes (no verdict): the Request ends red with a red fact of 2 attempts, not
    without a verdict (before: the red was dropped)."""
    repo, queue = Repo(lane.root), lane.name(QUEUE)
    repo.commit("c1", "red-then-hang")
    rid = lane.ingest(queue)

    def rerun() -> list[tuple[Any, ...]]:
        return lane.query("SELECT c.pgid FROM command_build c JOIN build b"
                          " ON b.queue = c.queue AND b.id = c.build_id"
                          " WHERE c.status = 'running' AND c.pgid IS NOT NULL"
                          " AND b.attempt = 2 AND c.queue = %s", queue)

    wait_until(lambda: bool(rerun()), timeout=120, what="the re-run to run")
    [(pgid,)] = rerun()
    os.killpg(pgid, signal.SIGKILL)
    assert _settle(lane, rid) == "failed"
    request = lane.request(rid)["request"]
    assert request["verdict"] == "red"
    assert "red on an earlier attempt" in request["reason"]
    assert "vanished" in request["reason"]
    assert _facts(lane, queue) == {rid: (1.0, 2, False)}
    assert lane.query("SELECT attempt, status, verdict FROM build WHERE queue = %s"
                      " ORDER BY attempt", queue) == [(1, "failed", "red"),
                                                      (2, "failed", None)]


@lane_repo_queue()
def test_a_failed_head_is_validated_again_on_request_and_its_new_verdict_answers(
        lane: Lane) -> None:
    repo, queue = Repo(lane.root), lane.name(QUEUE)
    c1 = repo.commit("c1", "red")
    first = lane.ingest(queue)
    assert _settle(lane, first) == "failed"
    assert _facts(lane, queue) == {first: (1.0, 1, False)}
    # an ingest of the same head after a red verdict validates nothing again
    assert lane.ingest(queue) == first

    repo.judge(c1, "green")  # the flake is fixed, or the infrastructure: ask again
    again = lane.cli("retry", queue).stdout.strip()
    assert again == f"{first}.2"
    assert _settle(lane, again) == "succeeded"
    # each Request keeps its own fact; the commit's answer is its newest Request's verdict
    assert _facts(lane, queue) == {first: (1.0, 1, False), again: (0.0, 1, False)}
    assert lane.request(first)["fact"]["degree"] == 1.0
    code, answer = _fact_exit(lane, queue, c1)
    assert code == 0 and answer["green"] and answer["fact"]["request_id"] == again
    assert lane.queue(queue)["last_green_request_id"] == again
    assert _promoted(repo) == c1

    # a green commit is never validated again
    refused = lane.cli("retry", queue, c1, check=False)
    assert refused.returncode == 4, refused.stderr
    assert "green" in refused.stderr
    assert lane.query("SELECT count(*) FROM request WHERE queue = %s", queue) == [(2,)]


@lane_repo_queue()
def test_validating_an_older_commit_again_moves_neither_the_bookmark_nor_the_ref_back(
        lane: Lane) -> None:
    repo, queue = Repo(lane.root), lane.name(QUEUE)
    c1 = repo.commit("c1", "red")
    first = lane.ingest(queue)
    assert _settle(lane, first) == "failed"
    c2 = repo.commit("c2")
    second = lane.ingest(queue)
    assert _settle(lane, second) == "succeeded"
    assert _promoted(repo) == c2

    repo.judge(c1, "green")
    again = lane.cli("retry", queue, c1[:10]).stdout.strip()
    assert again == f"{first}.2"
    assert _settle(lane, again) == "succeeded"
    # c1 is green now, and sorts where it was first ingested: before c2
    shown = lane.queue(queue)
    assert (shown["last_green_request_id"], shown["latest_request_id"]) == (second, second)
    assert _promoted(repo) == c2
    code, answer = _fact_exit(lane, queue, c1)
    assert code == 0 and answer["fact"]["request_id"] == again
    # it superseded nothing, and nothing superseded it
    assert lane.states() == {first: "failed", second: "succeeded", again: "succeeded"}
    assert lane.invariant_violations(strict_bookmark=False) == []


@lane_repo_queue(retry={"unvalidated": 1, "backoff": "200ms"})
def test_a_head_that_could_not_be_validated_is_validated_again_when_ingested(
        lane: Lane) -> None:
    """retry.unvalidated: 1 — a build whose process vanishes (killed behind our back),
    twice, gives no verdict: the Request fails without one (no fact, no red alert, its
    reason shown, an `error` commit status, its cause transient), and the next ingest of
    the same head validates it again."""
    repo, queue = Repo(lane.root), lane.name(QUEUE)
    c1 = repo.commit("c1", "hang")
    first = lane.ingest(queue)

    def running(attempt: int) -> list[tuple[Any, ...]]:
        return lane.query("SELECT c.pgid FROM command_build c JOIN build b"
                          " ON b.queue = c.queue AND b.id = c.build_id"
                          " WHERE c.status = 'running' AND c.pgid IS NOT NULL"
                          " AND b.attempt = %s AND c.queue = %s", attempt, queue)

    for attempt in (1, 2):
        wait_until(lambda a=attempt: bool(running(a)), timeout=120,  # type: ignore[misc]
                   what=f"attempt {attempt} to run")
        [(pgid,)] = running(attempt)
        os.killpg(pgid, signal.SIGKILL)
    lane.wait_terminal([first], timeout=120)
    assert lane.states() == {first: "failed"}
    request = lane.request(first)["request"]
    assert request["verdict"] is None and request["unvalidated_cause"] == "transient"
    assert request["reason"].startswith("could not be validated (2 attempts): its process "
                                        "vanished")
    wait_until(lambda: lane.query("SELECT recorded FROM request WHERE queue = %s", queue)
               == [(False,)], timeout=5, what="no record of a Request without a verdict")
    assert _facts(lane, queue) == {}
    code, answer = _fact_exit(lane, queue, c1)
    assert code == 3 and answer["fact"] is None

    repo.judge(c1, "green")
    again = lane.ingest(queue)  # the same head: validated again by itself
    assert again == f"{first}.2"
    assert _settle(lane, again) == "succeeded"
    assert lane.queue(queue)["latest_request_id"] == again
    assert _promoted(repo) == c1
    assert lane.ingest(queue) == again  # green: never again


def test_a_settled_request_whose_record_was_lost_gets_its_fact_from_the_sweeper(
        pipeline: Pipeline, tmp_path: Path) -> None:
    """A Request settled green whose `record` message was never delivered (it
    dead-lettered on its publish): the sweeper finds the verdict without a fact, and
    record writes it, moves the bookmark and the promotion ref."""

    repo = Repo(tmp_path)
    pipeline.add_raw_queue(QUEUE, _queue(repo))
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
    assert _facts(pipeline, QUEUE) == {}
    pipeline.start_worker()  # nothing was published: only the sweeper knows
    wait_until(lambda: bool(_facts(pipeline, QUEUE)), timeout=60,
               what="the fact from the sweeper")
    assert _facts(pipeline, QUEUE) == {request_id: (0.0, 1, False)}
    wait_until(lambda: _promoted(repo) == c1, timeout=60, what="the promotion ref")
    assert pipeline.queue(QUEUE)["last_green_request_id"] == request_id
    assert "sweeper_republished what=record" in pipeline.full_logs()
