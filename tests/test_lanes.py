"""Lanes (streams/runtime/lanes.py): many events at once, one key at a time, acks in
order per partition, a bounded window — checked with Hypothesis over random keys,
partitions and handler timings, and with latches for the cases that matter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streams.runtime.lanes import Lanes


@dataclass
class Event:
    n: int
    key: str
    partition: int
    steps: int  # how many times the work yields to the loop
    gate: asyncio.Event | None = None


@dataclass
class Observed:
    running: set[str] = field(default_factory=set)
    started: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    acked: list[Event] = field(default_factory=list)
    most_at_once: int = 0
    now: int = 0
    overlaps: list[str] = field(default_factory=list)


def _lanes(observed: Observed, limit: int, fail: frozenset[int] = frozenset(),
           buffer: int | None = None) -> Lanes:
    async def work(event: Event) -> None:
        if event.key in observed.running:
            observed.overlaps.append(event.key)
        observed.running.add(event.key)
        observed.started.append(event.n)
        observed.now += 1
        observed.most_at_once = max(observed.most_at_once, observed.now)
        try:
            if event.gate is not None:
                await event.gate.wait()
            for _ in range(event.steps):
                await asyncio.sleep(0)
            if event.n in fail:
                raise RuntimeError(f"bug in {event.n}")
        finally:
            observed.now -= 1
            observed.running.discard(event.key)
        observed.finished.append(event.n)

    def ack(event: Event) -> None:
        assert event.n in observed.finished, f"acked {event.n} before it finished"
        observed.acked.append(event)

    return Lanes(work, limit=limit, key_of=lambda e: e.key, partition_of=lambda e: e.partition,
                 ack=ack, buffer=buffer)


async def _drain(lanes: Lanes) -> None:
    for _ in range(10_000):
        if not lanes.in_flight:
            return
        await asyncio.sleep(0)
    raise AssertionError("lanes never drained")


events_st = st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 3),
                               st.integers(0, 5)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(spec=events_st, limit=st.integers(1, 8), buffer=st.integers(1, 20))
def test_each_key_in_order_each_partition_acked_in_order(spec: list[tuple[str, int, int]],
                                                          limit: int, buffer: int) -> None:
    observed = Observed()
    events = [Event(n, key, partition, steps) for n, (key, partition, steps) in enumerate(spec)]

    async def main() -> None:
        lanes = _lanes(observed, limit, buffer=buffer)
        for event in events:
            await lanes.submit(event)
        await _drain(lanes)

    asyncio.run(main())
    assert observed.overlaps == []
    assert observed.most_at_once <= limit
    for key in "abcdef":
        mine = [e.n for e in events if e.key == key]
        assert [n for n in observed.started if n in mine] == mine
    # every event acked exactly once, and per partition in the order it arrived
    assert sorted(e.n for e in observed.acked) == [e.n for e in events]
    for partition in range(4):
        assert [e.n for e in observed.acked if e.partition == partition] == [
            e.n for e in events if e.partition == partition]


def test_a_slow_key_does_not_hold_up_other_keys_but_holds_its_partitions_acks() -> None:
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=10)
        gate = asyncio.Event()
        slow = Event(0, "slow", 0, 0, gate)
        await lanes.submit(slow)
        others = [Event(n, f"k{n}", n % 2, 1) for n in range(1, 7)]
        for event in others:
            await lanes.submit(event)
        for _ in range(50):
            await asyncio.sleep(0)
        assert set(observed.finished) == {e.n for e in others}  # not waiting for `slow`
        # partition 1 is all done; partition 0 waits behind the slow head
        assert [e.n for e in observed.acked] == [e.n for e in others if e.partition == 1]
        gate.set()
        await _drain(lanes)
        assert [e.n for e in observed.acked if e.partition == 0] == [0, 2, 4, 6]

    asyncio.run(main())


def test_a_full_buffer_makes_submit_wait() -> None:
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=2, buffer=3)
        gate = asyncio.Event()
        for n in range(3):
            await lanes.submit(Event(n, f"k{n}", 0, 0, gate))
        fourth = asyncio.create_task(lanes.submit(Event(3, "k3", 0, 0)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not fourth.done() and lanes.in_flight == 3 and lanes.running == 2
        gate.set()
        await asyncio.wait_for(fourth, 5)
        await _drain(lanes)
        assert [e.n for e in observed.acked] == [0, 1, 2, 3]

    asyncio.run(main())


def test_events_waiting_for_their_key_hold_no_slot() -> None:
    """One key fills the window: 15 slow events of one queue ahead, the window at 5. The
    other keys' events start at once (issue 17: they used to wait for the slow key's)."""
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=5)
        gate = asyncio.Event()
        busy = [Event(n, "busy", 0, 0, gate) for n in range(15)]
        for event in busy:
            await lanes.submit(event)
        others = [Event(n, f"k{n}", 1, 1) for n in range(15, 19)]
        for event in others:
            await lanes.submit(event)
        for _ in range(20):
            await asyncio.sleep(0)
        assert set(observed.finished) == {e.n for e in others}
        assert observed.started[:1] == [0] and lanes.running == 1  # one busy event runs
        gate.set()
        await _drain(lanes)
        assert [n for n in observed.finished if n < 15] == list(range(15))

    asyncio.run(main())


def test_a_key_with_a_backlog_delays_another_key_by_one_handler_at_most() -> None:
    """With one slot, a key with 100 events waiting and another key's event arriving after
    them: the other key's event runs as soon as the one event under way ends."""
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=1, buffer=1000)
        for n in range(100):
            await lanes.submit(Event(n, "backlog", 0, 1))
        await lanes.submit(Event(100, "other", 1, 1))
        await _drain(lanes)
        assert observed.started[:3] == [0, 100, 1]

    asyncio.run(main())


def test_a_failed_event_halts_its_partition_and_the_agent() -> None:
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=5, fail=frozenset({1}))
        for event in [Event(0, "a", 0, 0), Event(1, "b", 0, 0), Event(2, "c", 0, 2)]:
            await lanes.submit(event)
        await _drain(lanes)
        assert [e.n for e in observed.acked] == [0]  # never past the failed event
        with pytest.raises(RuntimeError, match="outside the runtime"):
            await lanes.submit(Event(3, "d", 1, 0))

    asyncio.run(main())


def test_close_cancels_what_is_under_way_without_acking_it() -> None:
    async def main() -> Any:
        observed = Observed()
        lanes = _lanes(observed, limit=5)
        gate = asyncio.Event()
        await lanes.submit(Event(0, "a", 0, 0))
        await lanes.submit(Event(1, "b", 0, 0, gate))
        for _ in range(10):
            await asyncio.sleep(0)
        await lanes.close()
        assert [e.n for e in observed.acked] == [0] and lanes.in_flight == 0

    asyncio.run(main())


def test_revoking_partitions_stops_their_events_and_acks_none_of_them() -> None:
    """A rebalance moves partition 0 away while one of its events runs (waiting out an
    outage, say) and two wait behind it: they stop at once and are never acknowledged;
    partition 1 goes on."""
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=5)
        stuck = asyncio.Event()  # never set: a handler waiting for ever
        gate = asyncio.Event()
        await lanes.submit(Event(0, "a", 0, 0, stuck))
        await lanes.submit(Event(1, "a", 0, 0))
        await lanes.submit(Event(2, "b", 1, 0, gate))
        await lanes.submit(Event(3, "a", 0, 0))
        for _ in range(10):
            await asyncio.sleep(0)
        assert await asyncio.wait_for(lanes.revoke({0}), 5) == 3
        assert lanes.in_flight == 1 and lanes.running == 1  # partition 1's event only
        gate.set()
        await _drain(lanes)
        assert [e.n for e in observed.acked] == [2]
        assert 1 not in observed.started and 3 not in observed.started
        await lanes.submit(Event(4, "a", 0, 0))  # assigned again: delivered again
        await _drain(lanes)
        assert [e.n for e in observed.acked] == [2, 4]

    asyncio.run(main())


def test_after_a_revoke_returns_no_event_of_the_revoked_partition_counts_as_held() -> None:
    """Five keys of partition 0 run (all waiting out an outage) when it is revoked: once
    `revoke` returns none of them is running or held any more, so the same keys, assigned
    again, start at once."""
    async def main() -> None:
        observed = Observed()
        lanes = _lanes(observed, limit=10)
        stuck = asyncio.Event()
        for n, key in enumerate("abcde"):
            await lanes.submit(Event(n, key, 0, 0, stuck))
        for _ in range(10):
            await asyncio.sleep(0)
        assert lanes.running == 5
        # awaited directly, as the worker does (wait_for would run it as a task of its
        # own, and the loop would tidy up before the assertion)
        assert await lanes.revoke({0}) == 5
        assert (lanes.running, lanes.in_flight) == (0, 0)
        for n, key in enumerate("abcde", start=10):
            await lanes.submit(Event(n, key, 0, 0))
        await _drain(lanes)
        assert [e.n for e in observed.acked] == [10, 11, 12, 13, 14]

    asyncio.run(main())
