"""`streams.runtime.stalls.StallWatch`: which partitions a worker reads again (pure logic;
the real broker's case is in tests/test_rebalance.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streams.runtime.stalls import PartitionLook, StallWatch

BEHIND = PartitionLook(position=12, committed=9, held=False)


def test_a_partition_behind_and_unchanged_for_two_looks_is_read_again_once() -> None:
    watch = StallWatch()
    assert watch.stalled({"p0": BEHIND}, generation=3, busy=False) == []
    assert watch.stalled({"p0": BEHIND}, generation=3, busy=False) == ["p0"]
    assert watch.stalled({"p0": BEHIND}, generation=3, busy=False) == []  # acted on once
    moved = PartitionLook(position=14, committed=12, held=False)
    assert watch.stalled({"p0": moved}, generation=3, busy=False) == []
    assert watch.stalled({"p0": moved}, generation=3, busy=False) == ["p0"]


def test_nothing_committed_yet_counts_from_the_start() -> None:
    watch = StallWatch()
    look = PartitionLook(position=2, committed=None, held=False)
    watch.stalled({"p0": look}, generation=1, busy=False)
    assert watch.stalled({"p0": look}, generation=1, busy=False) == ["p0"]


def test_a_partition_under_way_caught_up_or_moving_is_left_alone() -> None:
    for first, second in [
        (PartitionLook(12, 9, held=True), PartitionLook(12, 9, held=True)),
        (PartitionLook(12, 12, held=False), PartitionLook(12, 12, held=False)),
        (PartitionLook(None, 9, held=False), PartitionLook(None, 9, held=False)),
        (BEHIND, PartitionLook(12, 10, held=False)),
        (BEHIND, PartitionLook(13, 9, held=False)),
    ]:
        watch = StallWatch()
        watch.stalled({"p0": first}, generation=1, busy=False)
        assert watch.stalled({"p0": second}, generation=1, busy=False) == [], (first, second)


def test_a_rebalance_or_full_lanes_between_two_looks_restart_the_count() -> None:
    watch = StallWatch()
    watch.stalled({"p0": BEHIND}, generation=1, busy=False)
    assert watch.stalled({"p0": BEHIND}, generation=2, busy=False) == []
    watch.forget()
    assert watch.stalled({"p0": BEHIND}, generation=2, busy=False) == []
    assert watch.stalled({"p0": BEHIND}, generation=2, busy=True) == []
    assert watch.stalled({"p0": BEHIND}, generation=2, busy=False) == []
    assert watch.stalled({"p0": BEHIND}, generation=2, busy=False) == ["p0"]


looks = st.builds(PartitionLook, st.none() | st.integers(0, 5), st.none() | st.integers(0, 5),
                  st.booleans())


@given(st.lists(st.tuples(st.dictionaries(st.sampled_from("abc"), looks, max_size=3),
                          st.integers(1, 2), st.booleans()), max_size=12))
def test_only_a_behind_partition_seen_alike_twice_in_a_row_is_read_again(
        checks: list[tuple[dict[str, PartitionLook], int, bool]]) -> None:
    watch = StallWatch()
    previous: tuple[dict[str, PartitionLook], int, bool] | None = None
    for looks_now, generation, busy in checks:
        found = watch.stalled(looks_now, generation=generation, busy=busy)
        for tp in found:
            assert looks_now[tp].behind and not busy
            assert previous is not None and previous[1] == generation and not previous[2]
            assert previous[0].get(tp) == looks_now[tp]
        previous = (looks_now, generation, busy)
