"""`stovepipe poll` as a user runs it: a subprocess against the real broker and database,
with the fake repository's file standing in for the branches being pushed to."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from streams.config.settings import REPO_ROOT
from tests.pipeline_support import STOVEPIPE, Pipeline

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

LINE = re.compile(r"^\S+Z (?P<queue>\S+) -> (?P<request>\S+) \((?P<kind>new|same)\)$")


@pytest.fixture
def pipeline(kafka_bootstrap: str, migrated_dsn: str, topic_prefix: str,
             tmp_path: Path) -> Pipeline:
    return Pipeline(bootstrap=kafka_bootstrap, dsn=migrated_dsn, prefix=topic_prefix,
                    root=tmp_path)


class Poll:
    """A running `stovepipe poll`, its output read line by line as it comes."""

    def __init__(self, pipeline: Pipeline, *args: str) -> None:
        self.proc = subprocess.Popen([*STOVEPIPE, "poll", *args], env=pipeline.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO_ROOT)
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.seen: list[tuple[str, str]] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [threading.Thread(target=self._read, args=(name, stream), daemon=True)
                         for name, stream in (("out", self.proc.stdout),
                                              ("err", self.proc.stderr))]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put((name, line.rstrip("\n")))

    def expect(self, pattern: str, *, stream: str = "out", timeout: float = 60) -> str:
        """The next line of ``stream`` matching ``pattern``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {stream} line matching {pattern!r} within "
                                     f"{timeout:.0f}s; saw {self.seen}")
            try:
                item = self.lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise AssertionError(f"poll exited {self.proc.returncode} before "
                                         f"printing {pattern!r}; saw {self.seen}") from None
                continue
            self.seen.append(item)
            if item[0] == stream and re.search(pattern, item[1]):
                return item[1]

    def stop(self, signum: int) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        """Kill it if still running; then its pipes are drained and closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for reader in self._readers:
            reader.join(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def polls() -> Iterator[list[Poll]]:
    started: list[Poll] = []
    yield started
    for poll in started:
        poll.close()


def _ingests(stdout: str) -> dict[str, tuple[str, str]]:
    found = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        assert match, f"unexpected output line {line!r}"
        found[match["queue"]] = (match["request"], match["kind"])
    return found


def test_once_ingests_every_queue_and_reports_the_failing_one(pipeline: Pipeline) -> None:
    main = pipeline.add_queue("team/main")
    web = pipeline.add_queue("web/app")
    pipeline.add_queue("broken", ref="no-such-branch")
    pipeline.repo.push(main, "m1")
    pipeline.repo.push(web, "w1")

    first = pipeline.cli("poll", "--once", check=False)
    assert first.returncode == 1, first.stderr  # one queue failed
    assert _ingests(first.stdout) == {"team/main": ("request/team/main/1", "new"),
                                      "web/app": ("request/web/app/1", "new")}
    assert re.search(r"broken: error: UnknownRef: .*no ref 'no-such-branch'", first.stderr)
    assert "Traceback" not in first.stderr

    again = pipeline.cli("poll", "--once", "team/main", "web/app", check=False)
    assert again.returncode == 0, again.stderr
    assert _ingests(again.stdout) == {"team/main": ("request/team/main/1", "same"),
                                      "web/app": ("request/web/app/1", "same")}
    assert pipeline.states() == {"request/team/main/1": "accepted",
                                 "request/web/app/1": "accepted"}


def test_polls_on_a_period_and_stops_on_sigterm(pipeline: Pipeline,
                                                 polls: list[Poll]) -> None:
    ref = pipeline.add_queue("team/main")
    pipeline.add_queue("other")  # not named: not polled
    pipeline.repo.push(ref, "a1")
    poll = Poll(pipeline, "--every", "500ms", "team/main")
    polls.append(poll)
    poll.expect(r"poll: 1 queue\(s\), every 500ms", stream="err")
    poll.expect(r" team/main -> request/team/main/1 \(new\)$")
    poll.expect(r" team/main -> request/team/main/1 \(same\)$")  # the next round
    pipeline.repo.push(ref, "a2")
    poll.expect(r" team/main -> request/team/main/2 \(new\)$")
    poll.expect(r" team/main -> request/team/main/2 \(same\)$")
    assert poll.stop(signal.SIGTERM) == 0
    poll.expect(r"SIGTERM, stopping", stream="err", timeout=5)
    assert sorted(pipeline.states()) == ["request/team/main/1", "request/team/main/2"]
    assert all("other" not in line for _, line in poll.seen)


def test_sigint_stops_a_poller_between_rounds(pipeline: Pipeline,
                                              polls: list[Poll]) -> None:
    ref = pipeline.add_queue("team/main")
    pipeline.repo.push(ref, "a1")
    poll = Poll(pipeline, "--every", "1h")
    polls.append(poll)
    poll.expect(r" team/main -> request/team/main/1 \(new\)$")
    started = time.monotonic()
    assert poll.stop(signal.SIGINT) == 0
    assert time.monotonic() - started < 10  # not the rest of the hour
    poll.expect(r"SIGINT, stopping", stream="err", timeout=5)


def test_user_errors_are_one_line_messages(pipeline: Pipeline) -> None:
    pipeline.add_queue("team/main")
    unknown = pipeline.cli("poll", "--once", "nope", check=False)
    assert unknown.returncode == 1
    assert "unknown queue 'nope'" in unknown.stderr and "Traceback" not in unknown.stderr
    invalid = pipeline.cli("poll", "--once", "bad name", check=False)
    assert invalid.returncode == 1 and "invalid queue name" in invalid.stderr
    period = pipeline.cli("poll", "--every", "soon", check=False)
    assert period.returncode == 2 and "--every" in period.stderr
