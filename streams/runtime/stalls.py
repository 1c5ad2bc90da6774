"""Partitions whose fetched messages were never delivered are read again (design §10).

A message the consumer fetched reaches the stage's lanes, runs, is acknowledged, and its
offset is committed. With nothing of a partition held in the lanes, the consumer's fetch
position therefore equals the partition's committed offset within one commit interval.
A position that stays past the committed offset, while the partition holds nothing, means
fetched messages were dropped on their way to the lanes: Faust throws a fetched batch
away when a rebalance starts or ends under it, and a rare interleaving leaves the
partition's position after the thrown-away messages (seen once in a full test run: the
last five ingests of one partition waited for the next rebalance). Nothing else would
deliver them until then, so the partition's queues would silently stop being validated.

`StallWatch` finds such partitions: two looks one check apart (`CHECK_INTERVAL`), in one
group generation, both saw the partition hold nothing in the lanes while its position was
past its committed offset, and neither had moved; a look while any stage's lanes are full
(back-pressure: fetched messages legitimately wait outside the lanes) counts for nothing.
The worker then seeks the partition back to its committed offset and says so loudly. A
message delivered in the meantime is delivered once more (stages are idempotent); one
state is acted on only once, so a partition whose log start passed an offset never
committed (retention) is not sought back again and again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from streams.runtime import metrics

log = logging.getLogger("stovepipe.stalls")

CHECK_INTERVAL = 10.0  # seconds between two looks; > the commit interval (design §10)
POSITION_TIMEOUT = 5.0  # seconds for the consumer to say where a partition is


@dataclass(frozen=True)
class PartitionLook:
    """What one check saw of a partition."""

    position: int | None  # the next offset the consumer fetches (None: unknown)
    committed: int | None  # the group's committed offset (None: nothing committed)
    held: bool  # an event of it is in a stage's lanes

    @property
    def behind(self) -> bool:
        """Fetched past what was committed, with nothing of it under way."""
        return (not self.held and self.position is not None
                and self.position > (self.committed or 0))


class StallWatch:
    """Remembers the previous look at each partition (see the module docstring)."""

    def __init__(self) -> None:
        self._previous: dict[Any, PartitionLook] = {}
        self._generation: int | None = None
        self._acted: dict[Any, PartitionLook] = {}

    def stalled(self, looks: Mapping[Any, PartitionLook], *, generation: int,
                busy: bool) -> list[Any]:
        """The partitions to read again from their committed offset, given this check's
        ``looks`` in group ``generation``; ``busy`` when a stage's lanes were full."""
        previous, self._previous = self._previous, ({} if busy else dict(looks))
        if generation != self._generation:
            self._generation = generation
            self._acted.clear()
            return []
        if busy:
            return []
        found = [tp for tp, look in looks.items()
                 if look.behind and previous.get(tp) == look and self._acted.get(tp) != look]
        for tp in found:
            self._acted[tp] = looks[tp]
        return found

    def forget(self) -> None:
        """A rebalance is under way: the next look starts afresh."""
        self._previous.clear()


async def positions(consumer: Any, partitions: Iterable[Any]) -> dict[Any, int | None]:
    """The aiokafka ``consumer``'s fetch position of each partition (on its own thread);
    None for a partition it no longer has or cannot place in time."""
    from aiokafka import TopicPartition

    found: dict[Any, int | None] = {}
    for tp in partitions:
        try:
            found[tp] = await asyncio.wait_for(
                consumer.position(TopicPartition(tp.topic, tp.partition)), POSITION_TIMEOUT)
        except Exception:  # noqa: BLE001 - revoked meanwhile, or resetting: no look this time
            found[tp] = None
    return found


async def reread_stalled(app: Any, lanes: Collection[Any], topics: Collection[str],
                         watch: StallWatch) -> list[Any]:
    """One check of the Faust ``app``'s partitions of ``topics``; seeks the stalled ones
    back to their committed offsets and returns them."""
    consumer = app.consumer
    if app.rebalancing or not consumer.flow_active:
        watch.forget()
        return []
    generation = app.consumer_generation_id
    assigned = [tp for tp in consumer.assignment() if tp.topic in topics]
    held = {tp for stage_lanes in lanes for tp in stage_lanes.partitions_held()}
    busy = any(stage_lanes.full for stage_lanes in lanes)
    thread = consumer._thread
    at = await thread.call_thread(positions, thread._ensure_consumer(), assigned)
    if app.rebalancing or app.consumer_generation_id != generation:
        watch.forget()
        return []
    looks = {tp: PartitionLook(at.get(tp), consumer._committed_offset.get(tp), tp in held)
             for tp in assigned}
    stalled = watch.stalled(looks, generation=generation, busy=busy)
    for tp in stalled:
        look = looks[tp]
        metrics.PARTITIONS_REREAD.labels(topic=tp.topic).inc()
        log.warning("partition_stalled topic=%s partition=%d position=%s committed=%s: "
                    "fetched messages never reached a handler; reading it again from its "
                    "committed offset", tp.topic, tp.partition, look.position, look.committed)
        await consumer.seek(tp, look.committed or 0)
    return stalled
