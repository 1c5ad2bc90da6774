"""The sweeper: nothing may depend on a message that was never sent (design §6, liveness).

Every worker runs a sweep every few seconds; one at a time across workers (a database
advisory lock), so the sweep is done once per interval whoever does it. It re-publishes,
from three indexed queries over live rows only (never a scan of history):

- an ``accepted`` Request whose gate loop has not been seen for longer than its queue's
  delays allow — its ProcessRequest was never sent (an ingest during a broker outage, a
  process killed between the commit and the publish), or its loop was lost;
- a ``processing`` Request without a build row long after its admission — its
  BuildRequest was never sent;
- a Build not yet terminal whose poll loop has not been seen — including the builds of
  Requests that ended without them, which buildsignal then cancels at their runner;
- a Request settled with a verdict whose fact was not recorded (its `record` message was
  lost, or dead-lettered while a reconciler could not finish it) — to record;

and advances a culprit search that nothing moved for `culprits.STALLED_AFTER` seconds
(its probe's `record` was lost, or a reconciler ended the probe), or that waits only for
a commit whose probe could not validate to be due again (its ``wake_at``: an outage
stalled it, and this resumes it).

A loop waiting out a dependency's outage says when it will be back (its row is "seen"
until then), so it is not taken for lost while it waits.

A re-published message carries no loop token, so it takes the loop over
(`streams.stages.loops`): were the old loop still alive after all, it ends on its next
turn, and nothing runs twice. Why a sweeper and no transactional outbox: an outbox would
cover only the first case and cost two writes for every Request on the hot path; the poll
loops and the orphaned builds need the sweep anyway, and a sweep costs a few indexed
queries per interval, whatever the traffic.

Bound: a loop is seen at least every `loops.HEARTBEAT` plus its hold delay, so a Request
whose message was lost is re-published within its queue's longest delay + HEARTBEAT +
`GRACE` + the sweep interval.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from contract import BuildRequest, BuildSignal, ProcessRequest, Record, TopicKey
from store import project_of
from streams.config.queues import QueueConfig, UnknownQueue
from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages import culprits, loops, pins, project_pins
from streams.stages.deps import Deps
from streams.stages.kit import seconds

log = logging.getLogger("stovepipe.sweeper")

LOCK = "sweeper"
GRACE = 5.0  # seconds of slack beyond a loop's longest silence
BATCH = 500  # rows of each kind per sweep: a backlog is worked off over several sweeps
RECORD_AGAIN = 300.0  # seconds before an unrecorded verdict is re-sent to record again
# seconds between two settlings of the pinned queues' refs (each asks the repository)
SETTLE_PINS_EVERY = 30.0
_settled_at = [-SETTLE_PINS_EVERY]


@dataclass
class SweepReport:
    ran: bool  # False: another worker holds the sweep
    processes: list[str] = field(default_factory=list)  # request ids re-published
    builds: list[str] = field(default_factory=list)  # request ids whose build was re-sent
    polls: list[str] = field(default_factory=list)  # build ids whose poll loop was revived
    records: list[str] = field(default_factory=list)  # request ids whose fact was missing
    searches: list[str] = field(default_factory=list)  # culprit searches advanced (red ids)
    promotions: list[str] = field(default_factory=list)  # queues whose pinned ref was settled

    @property
    def total(self) -> int:
        return (len(self.processes) + len(self.builds) + len(self.polls) + len(self.records)
                + len(self.searches))


def unseen_after(config: QueueConfig) -> float:
    """How long a live loop of this queue may go unseen: its longest hold, one heartbeat,
    and a grace."""
    longest = max(seconds(config.gate_delay), seconds(config.poll_delay_queued),
                  seconds(config.poll_delay_running))
    return longest + loops.HEARTBEAT + GRACE


async def sweep(deps: Deps, publish: Publisher) -> SweepReport:
    async with deps.db.try_exclusive(LOCK) as mine:
        if not mine:
            return SweepReport(ran=False)
        report = SweepReport(ran=True)
        floor = min((unseen_after(deps.queues.get(q)) for q in deps.queues.names()),
                    default=loops.HEARTBEAT + GRACE)

        for request in await deps.db.requests.list_unseen_accepted(floor, BATCH):
            if _overdue(deps, request.queue, request.loop_age):
                await publish(TopicKey.PROCESS,
                              ProcessRequest(id=request.id, queue_name=request.queue,
                                             nonce=request.nonce))
                await deps.db.requests.touch_loop(request.queue, request.id)
                report.processes.append(request.id)

        for request in await deps.db.requests.list_processing_without_build(floor, BATCH):
            if _overdue(deps, request.queue, request.loop_age):
                await publish(TopicKey.BUILD,
                              BuildRequest(id=request.id, queue_name=request.queue,
                                           nonce=request.nonce, attempt=request.attempt,
                                           project=project_of(request.queue)))
                await deps.db.requests.touch_loop(request.queue, request.id)
                report.builds.append(request.id)

        for build, _ in await deps.db.builds.list_unseen_live(floor, BATCH):
            if _overdue(deps, build.queue, build.loop_age):
                await publish(TopicKey.BUILDSIGNAL,
                              BuildSignal(id=build.id, queue_name=build.queue))
                await deps.db.builds.touch_loop(build.queue, build.id)
                report.polls.append(build.id)

        # a settled verdict whose fact was never written (its `record` lost or
        # dead-lettered): record is idempotent, so publishing it again is safe
        for request in await deps.db.requests.list_unrecorded(floor, BATCH):
            await publish(TopicKey.RECORD, Record(id=request.id, queue_name=request.queue,
                                                  nonce=request.nonce))
            # not again before RECORD_AGAIN: a record that keeps failing (an invariant)
            # is parked by its reconciler, and must not be re-sent every sweep
            await deps.db.requests.touch_loop(request.queue, request.id, quiet=RECORD_AGAIN)
            report.records.append(request.id)

        # a culprit search nothing moved for a while: the record that would have advanced
        # it was lost, or its probe was failed by a reconciler; or one whose commit is due
        # to be probed again after an outage (advancing is idempotent)
        for search in await deps.db.culprit_searches.due_to_advance(
                culprits.STALLED_AFTER, BATCH):
            after = await culprits.advance(deps, publish, search.queue, search.red_request_id)
            if (after.state, after.probes, after.lo, after.hi) != (
                    search.state, search.probes, search.lo, search.hi):
                report.searches.append(search.red_request_id)

    if report.ran and time.monotonic() - _settled_at[0] >= SETTLE_PINS_EVERY:
        # after the sweep's lock is released: git answers without a connection held
        _settled_at[0] = time.monotonic()
        report.promotions = [*await pins.settle_pinned(deps),
                             *await project_pins.settle_pinned_projects(deps)]

    for what, ids in (("process", report.processes), ("build", report.builds),
                      ("buildsignal", report.polls), ("record", report.records),
                      ("culprit_search", report.searches),
                      ("promotion", report.promotions)):
        if ids:
            metrics.SWEPT.labels(what=what).inc(len(ids))
            log.warning("sweeper_republished what=%s count=%d first=%s", what, len(ids),
                        ids[0])
    return report


def _overdue(deps: Deps, queue: str, unseen_for: float) -> bool:
    try:
        return unseen_for >= unseen_after(deps.queue_config(queue))
    except UnknownQueue:
        # no longer configured: nothing could process it; an operator's business
        log.warning("sweeper_unknown_queue queue=%s", queue)
        return False
