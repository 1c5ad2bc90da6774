"""Dropping duplicate poll loops of a build never ends the loop that polled."""

from __future__ import annotations

import pytest

from streams.stages import deps as deps_mod
from streams.stages.deps import PollLoops


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(deps_mod.time, "monotonic", lambda: now[0])
    return now


def test_a_second_loop_within_the_hold_is_a_duplicate(clock: list[float]) -> None:
    loops = PollLoops()
    assert not loops.is_duplicate("b1")  # never polled
    loops.polled("b1", hold=2.0)
    clock[0] += 0.1
    assert loops.is_duplicate("b1")  # a duplicate loop right after the poll
    clock[0] += 1.5
    assert loops.is_duplicate("b1")
    assert not loops.is_duplicate("b2")  # other builds are unaffected


def test_the_loop_itself_returns_after_its_hold_and_polls(clock: list[float]) -> None:
    loops = PollLoops()
    loops.polled("b1", hold=2.0)
    clock[0] += 2.0  # holds are never early
    assert not loops.is_duplicate("b1")


def test_memory_is_bounded() -> None:
    loops = PollLoops()
    for i in range(PollLoops.LIMIT + 10):
        loops.polled(f"b{i}", hold=1.0)
    assert not loops.is_duplicate("b0")  # the oldest were forgotten
    assert loops.is_duplicate(f"b{PollLoops.LIMIT + 9}")
