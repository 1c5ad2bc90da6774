"""Bounded history (issue 25, item 6; design §12): a round of pruning, run by `stovepipe
prune` and by the workers on a timer (`apply_retention`, one worker at a time).

A round takes its cutoff on the database's clock (now - ``older_than``) and deletes, in
batches of at most `BATCH` rows, each its own short transaction (store.retention):

1. per family of queues (a queue and its projects' scopes): the culprit searches that no
   longer stay, then — the queue's before its projects' — the Requests older than the
   cutoff that nothing keeps (`retention_rules.why_kept`), each with its fact, project
   answers, plan, builds, command builds and ingest mapping;
2. per queue, its greenness history before the bound `retention_rules` gives (never
   inside the share-of-time-red window, `gauges.RED_WINDOW`);
3. the other tables, each walked on an index and deleted by its rule: sent
   notifications, parked messages, closed pins, webhook deliveries (never younger than the
   webhooks' own week), commit descriptions nothing names.

Pacing: one batch (about `BATCH` rows) at a time on the worker's (or the command's) pool,
and after each batch the round rests in proportion to the time it was busy, so that it
works `Pace.duty_cycle` of its time (`retention.duty_cycle`, `--duty-cycle`): the stages
share the database and (in a worker) the event loop with it: a round that never rests
moved ingest → fact p50 by +43 % on 2 cores, one at 0.25 left it where it was idle
(bench/prune_bench.py, docs/benchmarks.md). A worker holds the round's lock on a
connection of its own, so the stages keep their whole pool. A round stops once it
deleted ``max_rows`` rows (its last batches shrink to fit, give or take a Request's
rows); the rest waits for the next round. A batch that meets a lock (or a pin being
taken) is skipped, never waited for, and found again by the next round.

Invariant: what a round deletes is older than its cutoff and named by nothing that stays;
a dry run counts what the same round would delete.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from store import Database, Request, split_scope
from store.retention import WALKED_TABLES, Family, RetentionStore
from store.webhook_deliveries import KEEP_DELIVERIES
from streams.config.retention import DEFAULT_BATCH_ROWS
from streams.runtime import metrics
from streams.runtime.stage import Publisher
from streams.stages import retention_rules as rules
from streams.stages.deps import Deps
from streams.stages.gauges import RED_WINDOW
from streams.stages.retention_rules import Keep, Policy

log = logging.getLogger("stovepipe.retention")

LOCK = "retention"  # one round at a time, across workers and `stovepipe prune`
BATCH = DEFAULT_BATCH_ROWS  # rows a batch deletes (about): a table's, or Requests' with theirs
# a Request goes with its ingest mapping and usually a build, a fact and a notification:
# a batch of Requests is BATCH // ROWS_PER_REQUEST of them
ROWS_PER_REQUEST = 5
REQUEST_TABLES = ("request", "validation_fact", "project_answer", "request_plan", "build",
                  "command_build", "request_uri")
TABLES = (*REQUEST_TABLES, "culprit_search", "greenness_change", *WALKED_TABLES)


# a batch that seemed long because the process was suspended must not rest for hours
MAX_REST = 60.0


def rest_after(busy: float, duty_cycle: float) -> float:
    """Seconds to rest after ``busy`` seconds of work so that work is ``duty_cycle`` of the
    time (1: never rest)."""
    if duty_cycle >= 1 or busy <= 0:
        return 0.0
    return min(MAX_REST, busy * (1 / duty_cycle - 1))


@dataclass(frozen=True)
class Pace:
    duty_cycle: float = 1.0  # share of the round's time spent in batches, in (0, 1]
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


@dataclass
class PruneReport:
    cutoff: datetime
    dry_run: bool
    deleted: Counter[str] = field(default_factory=Counter)  # by table (dry: would be)
    kept: Counter[Keep] = field(default_factory=Counter)  # old Requests kept, by why
    skipped: int = 0  # batches skipped for a lock; the next round finds them again
    batches: int = 0
    finished: bool = True  # False: stopped at max_rows, more is past retention
    seconds: float = 0.0
    rested: float = 0.0  # of `seconds`, resting between batches (`Pace`)

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


async def prune(db: Database, policy: Policy, *, dry_run: bool = False,
                max_rows: int | None = None, batch: int = BATCH,
                cutoff: datetime | None = None, pace: Pace = Pace()) -> PruneReport:
    """One round: delete (or with ``dry_run`` count) what is older than ``cutoff``
    (default: the database's now - ``policy.older_than``) and kept by nothing, at
    ``pace``."""
    started = pace.clock()
    now = await db.retention.now()
    round_ = _Round(db.retention, policy, cutoff or now - policy.older_than, now,
                    dry_run=dry_run, max_rows=None if dry_run else max_rows, batch=batch,
                    pace=pace)
    await round_.run()
    round_.report.seconds = pace.clock() - started
    return round_.report


class _Round:
    def __init__(self, store: RetentionStore, policy: Policy, cutoff: datetime,
                 now: datetime, *, dry_run: bool, max_rows: int | None, batch: int,
                 pace: Pace) -> None:
        self.store, self.policy, self.cutoff, self.now = store, policy, cutoff, now
        self.dry_run, self.max_rows, self.batch, self.pace = dry_run, max_rows, batch, pace
        self.busy_since = pace.clock()
        self.report = PruneReport(cutoff=cutoff, dry_run=dry_run)
        # a dry run deletes nothing, so the answers of the queue's Requests it would
        # delete still name their sources: those Requests are remembered per family
        self.doomed_parents: set[str] = set()

    @property
    def full(self) -> bool:
        if self.max_rows is not None and self.report.total >= self.max_rows:
            self.report.finished = False
            return True
        return False

    def _room(self) -> int:
        """Rows the next batch may delete: `batch`, or what is left of ``max_rows``."""
        if self.max_rows is None:
            return self.batch
        return max(1, min(self.batch, self.max_rows - self.report.total))

    async def _counted(self, counts: Mapping[str, int] | None) -> None:
        """A batch done (None: skipped); then the stages' turn: a rest in proportion to
        the work since the last one (a dry run's reads count as work too)."""
        self.report.batches += 1
        if counts is None:
            self.report.skipped += 1
        else:
            self.report.deleted.update(counts)
        rest = rest_after(self.pace.clock() - self.busy_since, self.pace.duty_cycle)
        await self.pace.sleep(rest)
        self.report.rested += rest
        self.busy_since = self.pace.clock()

    async def run(self) -> None:
        families = await self.store.families()
        plans = await self.store.open_plans()
        for family in families:
            if self.full:
                return
            await self._family(family, plans)
        greenness_cutoff = rules.greenness_cutoff(self.cutoff, self.now,
                                                  timedelta(seconds=RED_WINDOW))
        for queue in (q for family in families for q in family.members):
            if self.full:
                return
            await self._greenness(queue, greenness_cutoff)
        for table in WALKED_TABLES:
            if self.full:
                return
            await self._walk(table)

    async def _family(self, family: Family, plans: dict[str, tuple[str, ...]]) -> None:
        holdings = await self.store.holdings(
            family, keep_newest=self.policy.keep_newest,
            open_plans=[p for q in family.members for p in plans.get(q, ())])
        for queue in family.members:
            gone = [s.red_request_id for s in holdings.searches
                    if s.queue == queue and not rules.search_stays(s, self.cutoff)]
            for chunk in _chunks(gone, self._room()):
                await self._counted(_one("culprit_search", await self.store.delete_searches(
                    queue, chunk, self.cutoff, dry_run=self.dry_run)))
        held = rules.protected(holdings, self.cutoff)
        self.doomed_parents.clear()
        for queue in family.members:
            await self._requests(family, queue, held)

    async def _requests(self, family: Family, queue: str, held: rules.Protected) -> None:
        rank: Sequence[int] | None = None
        while not self.full:
            limit = max(1, self._room() // ROWS_PER_REQUEST)
            rows = await self.store.requests_after(queue, rank, limit)
            if not rows:
                return
            rank = rows[-1][1]
            requests: list[Request] = []
            for request, _ in rows:
                if rules.walk_ends(request, self.cutoff):
                    break
                requests.append(request)
            ended = len(requests) < len(rows) or len(rows) < limit
            answered = await self._answered(queue, requests)
            doomed = []
            for request in requests:
                why = rules.why_kept(request, self.cutoff, held, answered)
                if why is None:
                    doomed.append(request.id)
                elif why is not Keep.RECENT and request.created_at < self.cutoff:
                    self.report.kept[why] += 1
            if doomed:
                await self._counted(await self.store.delete_requests(
                    family, queue, doomed, self.cutoff, dry_run=self.dry_run))
                if self.dry_run and family.scopes and queue == family.queue:
                    self.doomed_parents.update(doomed)
            if ended:
                return

    async def _answered(self, queue: str, requests: Sequence[Request]) -> set[str]:
        if split_scope(queue)[1] is None or not requests:
            return set()
        pairs = await self.store.answered(queue, [r.id for r in requests])
        return {source for source, parent in pairs if parent not in self.doomed_parents}

    async def _greenness(self, queue: str, cutoff: datetime) -> None:
        before = rules.greenness_delete_before(*await self.store.greenness_bounds(queue,
                                                                                  cutoff))
        while before is not None and not self.full:
            limit = self._room()
            deleted = await self.store.delete_greenness(queue, before, limit,
                                                        dry_run=self.dry_run)
            await self._counted(_one("greenness_change", deleted))
            if self.dry_run or deleted is None or deleted < limit:
                return

    async def _walk(self, table: str) -> None:
        cutoff = self.cutoff
        if table == "webhook_delivery":
            cutoff = min(cutoff, self.now - timedelta(seconds=KEEP_DELIVERIES))
        after: tuple[Any, ...] | None = None
        while not self.full:
            limit = self._room()
            rows = await self.store.walk(table, after, cutoff, limit)
            if not rows:
                return
            after = rows[-1].key
            past = []
            for row in rows:
                if row.at >= cutoff:  # the walk's order is (about) time: nothing older left
                    break
                past.append(row)
            doomed = [row.key for row in past if row.doomed]
            if doomed:
                await self._counted(_one(table, await self.store.delete_walked(
                    table, doomed, cutoff, dry_run=self.dry_run)))
            if len(past) < len(rows) or len(rows) < limit:
                return


def _one(table: str, deleted: int | None) -> dict[str, int] | None:
    return None if deleted is None else {table: deleted}


def _chunks(items: Sequence[str], size: int) -> list[list[str]]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


# --- the workers' rounds ----------------------------------------------------------------


async def apply_retention(deps: Deps, publish: Publisher) -> None:
    """The workers' timer: when retention is on, a round once per ``retention.every``
    (whichever worker comes first; one at a time), and every worker's gauges refreshed
    from the newest round."""
    config = deps.queues.retention
    if config is None:
        return
    store = deps.db.retention
    async with deps.db.try_exclusive(LOCK, dedicated=True) as mine:
        if mine and await store.claim_round(config.every.total_seconds()) is not None:
            policy = Policy(config.older_than, config.keep_newest)
            pace = Pace(config.duty_cycle)
            report = await prune(deps.db, policy, max_rows=config.max_rows, pace=pace,
                                 batch=config.batch_rows)
            left: Counter[str] = Counter()
            if not report.finished:
                left = (await prune(deps.db, policy, dry_run=True, cutoff=report.cutoff,
                                    pace=pace, batch=config.batch_rows)).deleted
            await store.finish_round(report.cutoff, _by_table(report.deleted),
                                     _by_table(left))
            for table, count in report.deleted.items():
                metrics.PRUNED_ROWS.labels(table=table).inc(count)
            log.info("retention_round deleted=%d left=%d skipped=%d seconds=%.1f "
                     "rested=%.1f cutoff=%s", report.total, sum(left.values()),
                     report.skipped, report.seconds, report.rested,
                     report.cutoff.isoformat(timespec="seconds"))
    await refresh_gauges(store)


async def refresh_gauges(store: RetentionStore) -> None:
    """stovepipe_rows_past_retention from the newest finished round (one row read)."""
    last = await store.last_round()
    if last is None or last["finished_at"] is None:
        return
    for table in TABLES:
        metrics.ROWS_PAST_RETENTION.labels(table=table).set(
            int(last["past_retention"].get(table, 0)))
    metrics.RETENTION_ROUND_FINISHED.set(last["finished_at"].timestamp())


def _by_table(counts: Counter[str]) -> dict[str, int]:
    return {table: int(counts.get(table, 0)) for table in TABLES}
