"""The fake BuildRunner: every behaviour, its timing, statelessness, shared cancellation."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from store.entities import BuildStatus
from streams.extensions.buildrunner import BuildReport, BuildRunner, BuildRunnerError
from streams.extensions.buildrunner.fake import (
    CANCELLED_FILE,
    LATCH_POLL,
    Behaviour,
    FakeBuild,
    FakeBuildRunner,
)
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent


def head(sha: str) -> str:
    return f"fake://demo/main/{sha}"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def trigger(runner: FakeBuildRunner, sha: str, base: str | None = None) -> str:
    return asyncio.run(runner.trigger(base, head(sha), {"request_id": "request/q/1"}))


def status(runner: FakeBuildRunner, build_id: str) -> BuildStatus:
    return asyncio.run(runner.status(build_id)).status


def test_satisfies_the_protocol() -> None:
    runner: BuildRunner = FakeBuildRunner()
    assert runner is not None


def test_default_succeeds_from_the_first_poll() -> None:
    runner = FakeBuildRunner()
    build_id = trigger(runner, "c1", base=head("c0"))
    report = asyncio.run(runner.status(build_id))
    assert report == BuildReport(BuildStatus.SUCCEEDED, {
        "runner": "fake", "head_uri": head("c1"), "base_uri": head("c0")},
        started_at=report.started_at)
    assert report.started_at is not None
    assert asyncio.run(runner.status(trigger(runner, "c2"))).metadata["base_uri"] == ""


def test_fail() -> None:
    runner = FakeBuildRunner()
    assert status(runner, trigger(runner, "c7-fail")) is BuildStatus.FAILED


def test_any_uri_works_the_sha_is_its_last_segment() -> None:
    runner = FakeBuildRunner()
    build_id = asyncio.run(runner.trigger(None, "git://host/repo/ref/main/abc-fail", {}))
    assert status(runner, build_id) is BuildStatus.FAILED
    assert Behaviour.of("no-slash-fail").fail
    assert Behaviour.of("git://x/failing") == Behaviour()  # tokens match whole


def test_two_triggers_of_one_commit_are_two_builds() -> None:
    runner = FakeBuildRunner()
    first, second = trigger(runner, "c1"), trigger(runner, "c1")
    assert first != second
    assert first.startswith("fake-")


def test_behaviours_are_read_from_tokens() -> None:
    assert Behaviour.of(head("c7-queued2-slow3-fail")) == Behaviour(fail=True, queued=2,
                                                                     slow=3)
    assert Behaviour.of(head("x-slow0.25")).slow == 0.25
    assert Behaviour.of(head("x-hang")).finishes_after() == float("inf")
    assert Behaviour.of(head("slow-queued-failx")) == Behaviour()  # no N, no effect


def test_slow_runs_for_n_seconds_then_ends() -> None:
    clock = Clock()
    runner = FakeBuildRunner(clock=clock)
    build_id = trigger(runner, "c1-slow3-fail")
    assert status(runner, build_id) is BuildStatus.RUNNING
    clock.now += 2.9
    assert status(runner, build_id) is BuildStatus.RUNNING
    clock.now += 0.1
    assert status(runner, build_id) is BuildStatus.FAILED


def test_queued_then_slow() -> None:
    clock = Clock()
    runner = FakeBuildRunner(clock=clock)
    build_id = trigger(runner, "c1-queued2-slow3")
    seen = []
    for _ in range(7):
        seen.append(status(runner, build_id))
        clock.now += 1
    assert seen == [BuildStatus.ACCEPTED] * 2 + [BuildStatus.RUNNING] * 3 + [
        BuildStatus.SUCCEEDED] * 2


def test_a_queued_build_says_what_it_waits_for_and_a_started_one_when_it_started() -> None:
    """Issue 23, item 1: the start is the trigger plus the time queued, not the trigger."""
    clock = Clock()
    runner = FakeBuildRunner(clock=clock)
    triggered = clock.now
    build_id = trigger(runner, "c1-queued2-slow3")
    queued = asyncio.run(runner.status(build_id))
    assert queued.status is BuildStatus.ACCEPTED and queued.waiting == "queued for an agent"
    assert queued.started_at is None and not queued.running_now
    clock.now += 2.5
    running = asyncio.run(runner.status(build_id))
    assert running.running_now and running.waiting == ""
    assert running.started_at is not None
    assert running.started_at.timestamp() == pytest.approx(triggered + 2)


def test_queued_alone_goes_straight_to_the_outcome() -> None:
    clock = Clock()
    runner = FakeBuildRunner(clock=clock)
    build_id = trigger(runner, "c1-queued1-fail")
    assert status(runner, build_id) is BuildStatus.ACCEPTED
    clock.now += 1
    assert status(runner, build_id) is BuildStatus.FAILED


def test_hang_runs_forever() -> None:
    clock = Clock()
    runner = FakeBuildRunner(clock=clock)
    build_id = trigger(runner, "c1-queued1-hang")
    assert status(runner, build_id) is BuildStatus.ACCEPTED
    clock.now += 1
    assert status(runner, build_id) is BuildStatus.RUNNING
    clock.now += 10**9
    assert status(runner, build_id) is BuildStatus.RUNNING


def test_timing_on_the_real_clock() -> None:
    runner = FakeBuildRunner()
    started = time.time()
    build_id = trigger(runner, "c1-queued0.3-slow0.4")
    assert status(runner, build_id) is BuildStatus.ACCEPTED
    wait_until(lambda: status(runner, build_id) is BuildStatus.RUNNING, timeout=5,
               what="running", interval=0.02)
    assert time.time() - started >= 0.3
    wait_until(lambda: status(runner, build_id) is BuildStatus.SUCCEEDED, timeout=5,
               what="succeeded", interval=0.02)
    assert time.time() - started >= 0.7


@pytest.mark.parametrize(("sha", "retryable"), [("c1-triggererror", False),
                                                ("c1-triggerretry", True)])
def test_trigger_errors(sha: str, retryable: bool) -> None:
    with pytest.raises(BuildRunnerError, match="trigger of fake://demo/main/c1") as info:
        trigger(FakeBuildRunner(), sha)
    assert info.value.retryable is retryable


@pytest.mark.parametrize(("sha", "retryable"), [("c1-statuserror", False),
                                                ("c1-statusretry", True)])
def test_status_errors(sha: str, retryable: bool) -> None:
    runner = FakeBuildRunner()
    build_id = trigger(runner, sha)
    with pytest.raises(BuildRunnerError, match="status of fake-") as info:
        status(runner, build_id)
    assert info.value.retryable is retryable


def test_any_runner_instance_can_poll_any_build(tmp_path: Path) -> None:
    clock = Clock()
    build_id = trigger(FakeBuildRunner(clock=clock), "c1-slow5")
    other = FakeBuildRunner(tmp_path, clock=clock)  # nothing shared with the first
    assert status(other, build_id) is BuildStatus.RUNNING
    clock.now += 5
    assert status(other, build_id) is BuildStatus.SUCCEEDED


def test_another_process_polls_a_build(tmp_path: Path) -> None:
    build_id = trigger(FakeBuildRunner(), "c1-fail")
    script = textwrap.dedent(f"""
        import asyncio
        from streams.extensions.buildrunner.fake import FakeBuildRunner
        print(asyncio.run(FakeBuildRunner().status({build_id!r})).status.value)
    """)
    done = subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=ROOT,
                          capture_output=True, text=True)
    assert done.stdout.strip() == "failed"


@pytest.mark.parametrize("build_id", [
    "", "fake-", "nope", "fake-abc", "fake-!!!-0123456789abcdef",
    "fake-e30-0123456789abcdef",  # {} : no fields
    "fake-eyJoZWFkIjoxLCJiYXNlIjpudWxsLCJ0IjoxfQ-0123456789abcdef",  # head is a number
    "fake-eyJoZWFkIjoieCIsImJhc2UiOm51bGwsInQiOjF9-XYZ",  # bad nonce
    "fake-eyJoZWFkIjoieCIsImJhc2UiOm51bGwsInQiOnRydWV9-0123456789abcdef",  # t is a bool
])
def test_malformed_build_ids_are_named_and_not_retried(build_id: str, tmp_path: Path) -> None:
    runner = FakeBuildRunner(tmp_path)
    for call in (runner.status, runner.cancel):
        with pytest.raises(BuildRunnerError) as info:
            asyncio.run(call(build_id))
        assert not info.value.retryable
        assert repr(build_id) in str(info.value)


def test_a_well_formed_id_round_trips() -> None:
    build = FakeBuild(head("c1"), None, 1.5, "0123456789abcdef")
    assert FakeBuild.parse(build.build_id()) == build
    assert FakeBuild.parse("fake-eyJoZWFkIjoieCIsImJhc2UiOm51bGwsInQiOjF9-0123456789abcdef") \
        == FakeBuild("x", None, 1.0, "0123456789abcdef")


def test_cancel_without_a_state_dir_does_nothing() -> None:
    runner = FakeBuildRunner()
    build_id = trigger(runner, "c1-hang")
    asyncio.run(runner.cancel(build_id))
    assert status(runner, build_id) is BuildStatus.RUNNING


def test_cancel_is_seen_by_other_instances_sharing_the_state_dir(tmp_path: Path) -> None:
    clock = Clock()
    canceller = FakeBuildRunner(tmp_path / "builds", clock=clock)
    poller = FakeBuildRunner(tmp_path / "builds", clock=clock)
    hung, slow, other = (trigger(canceller, s) for s in ("c1-hang", "c2-slow5", "c3-slow5"))
    asyncio.run(canceller.cancel(hung))
    asyncio.run(canceller.cancel(slow))
    asyncio.run(canceller.cancel(slow))  # idempotent
    assert status(poller, hung) is BuildStatus.CANCELLED
    assert status(poller, slow) is BuildStatus.CANCELLED
    assert status(poller, other) is BuildStatus.RUNNING
    clock.now += 10  # the behaviour would have finished it by now: it was stopped first
    assert status(poller, slow) is BuildStatus.CANCELLED
    assert status(poller, other) is BuildStatus.SUCCEEDED
    assert len((tmp_path / "builds" / CANCELLED_FILE).read_text().splitlines()) == 2
    # a runner without the state dir does not know about cancellations
    assert status(FakeBuildRunner(clock=clock), slow) is BuildStatus.SUCCEEDED


def test_cancel_while_queued(tmp_path: Path) -> None:
    clock = Clock()
    runner = FakeBuildRunner(tmp_path, clock=clock)
    build_id = trigger(runner, "c1-queued5")
    clock.now += 1
    asyncio.run(runner.cancel(build_id))
    assert status(runner, build_id) is BuildStatus.CANCELLED


def test_a_finished_build_stays_as_it_ended(tmp_path: Path) -> None:
    clock = Clock()
    runner = FakeBuildRunner(tmp_path, clock=clock)
    done, failed, slow = (trigger(runner, s) for s in ("c1", "c2-fail", "c3-slow2"))
    clock.now += 2
    for build_id in (done, failed, slow):
        asyncio.run(runner.cancel(build_id))
    assert status(runner, done) is BuildStatus.SUCCEEDED
    assert status(runner, failed) is BuildStatus.FAILED
    assert status(runner, slow) is BuildStatus.SUCCEEDED


def test_a_cancel_from_another_process(tmp_path: Path) -> None:
    runner = FakeBuildRunner(tmp_path)
    build_id = trigger(runner, "c1-hang")
    script = textwrap.dedent(f"""
        import asyncio
        from streams.extensions.buildrunner.fake import FakeBuildRunner
        asyncio.run(FakeBuildRunner({str(tmp_path)!r}).cancel({build_id!r}))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd=ROOT)
    assert status(runner, build_id) is BuildStatus.CANCELLED


def test_a_trigger_latch_holds_the_trigger_call_until_released(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = FakeBuildRunner(tmp_path)
    latch = tmp_path / "latches" / "T"
    looks: list[Path] = []
    real_exists = Path.exists

    def counting_exists(path: Path, *args: object, **kwargs: object) -> bool:
        if path == latch:
            looks.append(path)
        return real_exists(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "exists", counting_exists)

    async def main() -> str:
        call = asyncio.create_task(runner.trigger(None, head("c1-triggerlatchT"), {}))
        deadline = time.monotonic() + 30
        while len(looks) < 5:  # the call has looked for the latch, and found none, 5 times
            assert time.monotonic() < deadline, "the trigger call never looked for its latch"
            assert not call.done()
            await asyncio.sleep(LATCH_POLL)
        assert not call.done()
        (tmp_path / "latches").mkdir()
        (tmp_path / "latches" / "T").touch()
        return await asyncio.wait_for(call, 30)

    build_id = asyncio.run(main())
    assert status(runner, build_id) is BuildStatus.SUCCEEDED
    assert Behaviour.of(head("c1-triggerlatchT")).trigger_latch == "T"
    assert Behaviour.of(head("c1-triggerlatchT")).latch == ""
