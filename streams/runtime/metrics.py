"""Prometheus metrics of the delivery runtime: every outcome of every stage is counted."""

from __future__ import annotations

from typing import Literal

from prometheus_client import Counter, Gauge, Histogram, Info

from streams import __version__

OutcomeLabel = Literal["ack", "hold", "wait", "retry", "dead_letter", "parked",
                       "undecodable"]

DELIVERIES = Counter(
    "stovepipe_deliveries_total",
    "Messages a stage finished, by what the runtime did with them.",
    ["stage", "outcome"],
)
HANDLE_SECONDS = Histogram(
    "stovepipe_handle_seconds",
    "Time in a stage's handler, decode to outcome.",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
DELIVERY_SECONDS = Histogram(
    "stovepipe_delivery_seconds",
    "Time from receiving a message to its source offset being safe to commit.",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PRODUCE_FAILURES = Counter(
    "stovepipe_produce_failures_total",
    "Produce attempts the broker did not acknowledge (each one is retried).",
    ["topic"],
)
HOLD_LATENESS = Histogram(
    "stovepipe_hold_lateness_seconds",
    "How late a held message reached its stage's handler: handler start minus due time.",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
IN_FLIGHT = Gauge(
    "stovepipe_in_flight",
    "Messages of a stage under way in this worker (started or waiting for their key).",
    ["stage"],
)
DELAY_HELD = Gauge(
    "stovepipe_delay_held_messages",
    "Messages this worker holds in its delay tiers, fetched and not yet re-produced.",
)
DELAY_LATENESS = Histogram(
    "stovepipe_delay_lateness_seconds",
    "How late a delayed message reached its target, after its due time.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
DELAY_DROPPED = Counter(
    "stovepipe_delay_dropped_total",
    "Messages in a delay tier without a target header (not produced by Stovepipe).",
)
OUTAGE_RETRIES = Counter(
    "stovepipe_outage_retries_total",
    "Handler calls made again in place because the broker or the database was away.",
    ["stage"],
)
BACKPRESSURE_RETRIES = Counter(
    "stovepipe_backpressure_retries_total",
    "Handler calls made again in place because no pooled database connection came free "
    "in time (the worker busy, the database answering).",
    ["stage"],
)
DEPENDENCY_WAITS = Counter(
    "stovepipe_dependency_waits_total",
    "Messages brought back later because a build runner, a source control or another "
    "dependency was unavailable (no attempt spent).",
    ["stage"],
)
AGENT_RESTARTS = Counter(
    "stovepipe_agent_restarts_total",
    "A stage's agent crashed on a bug outside the runtime's error handling and was restarted"
    " (its uncommitted messages delivered again after a rebalance).",
    ["stage"],
)
PARTITION_ASSIGNMENTS = Counter(
    "stovepipe_partition_assignments_total",
    "Times the consumer group handed this worker its partitions: its first join and every "
    "rebalance since (a static member restarted within the session timeout causes none).",
)
PARKED = Counter(
    "stovepipe_parked_total",
    "Reconciler messages that can never be processed, parked in PostgreSQL.",
    ["stage"],
)


def count(stage: str, outcome: OutcomeLabel) -> None:
    DELIVERIES.labels(stage=stage, outcome=outcome).inc()
ATTEMPTS_ENDED = Counter(
    "stovepipe_attempts_total",
    "Attempts (builds) of Requests that ended, by how: green, red, unvalidated (could not "
    "validate the commit: no verdict), cancelled.",
    ["queue", "outcome"],
)
PROJECTS_PLANNED = Counter(
    "stovepipe_projects_planned_total",
    "Projects planned for Requests of queues with projects, by how: built (affected: a "
    "build of the project) or inherited (unaffected: its nearest validated ancestor's "
    "answer).",
    ["queue", "how"],
)
AFFECTED_DIFFS = Counter(
    "stovepipe_affected_diffs_total",
    "Diffs the analyze stage asked the source control for: one from the previous planned "
    "head in a chain of heads, else one per distinct base (nearest validated ancestor) of "
    "the head's projects; never one per project or commit.",
    ["queue"],
)
BACKSTOP_MISSES = Counter(
    "stovepipe_backstop_misses_total",
    "Projects a backstop found red although the path rules (or the affected command) said "
    "they were unaffected: the rules miss a dependency.",
    ["queue", "project"],
)
REQUESTS_SETTLED = Counter(
    "stovepipe_requests_settled_total",
    "Requests that ended after admission, by outcome: green, red (a red fact), unvalidated "
    "(failed without a verdict: no fact, no red alert), cancelled.",
    ["queue", "outcome"],
)
FLAKY = Counter(
    "stovepipe_flaky_total",
    "Requests green on a re-run of a red build (retry.red): flakes.",
    ["queue"],
)
STALE_MESSAGES = Counter(
    "stovepipe_stale_messages_total",
    "Messages about an earlier Request with the same id (a restored database), ignored.",
    ["stage"],
)
PROMOTION_SKIPPED = Counter(
    "stovepipe_promotion_skipped_total",
    "Promotions not done because the commit is no longer on the ref (force-push).",
    ["queue"],
)
SWEPT = Counter(
    "stovepipe_sweeper_republished_total",
    "Messages the sweeper published again: a loop unseen for too long, or never started.",
    ["what"],
)
RECONCILED = Counter(
    "stovepipe_reconciled_total",
    "Requests a reconciler drove to failed.",
    ["stage"],
)
NOTIFICATIONS = Counter(
    "stovepipe_notifications_total",
    "Commit statuses and alerts by channel and what became of one delivery attempt: "
    "sent, retried (will be tried again), given_up (a permanent refusal).",
    ["channel", "outcome"],
)
BOOKMARK_AGE = Gauge(
    "stovepipe_bookmark_age_seconds",
    "Seconds since the queue's bookmarked last green commit got its green fact (no sample "
    "before the queue's first green).",
    ["queue"],
)
COMMITS_SINCE_GREEN = Gauge(
    "stovepipe_commits_since_green",
    "Heads ingested after the queue's bookmarked last green commit (its Requests newer "
    "than the bookmark's): branch moves seen, not git commits.",
    ["queue"],
)
PROJECT_GREEN = Gauge(
    "stovepipe_project_green",
    "1 while the project of a queue with projects is green, 0 while it is red: its newest "
    "build's verdict, as its alerts judge it (no sample before its first verdict).",
    ["queue", "project"],
)
PROJECT_RED_STREAK = Gauge(
    "stovepipe_project_red_streak_seconds",
    "Seconds since the project went red; 0 while it is green (no sample before its first "
    "verdict).",
    ["queue", "project"],
)
PROJECT_HEADS_SINCE_GREEN = Gauge(
    "stovepipe_project_commits_since_green",
    "Heads of the queue ingested after the project's last green answer (built or "
    "inherited): branch moves seen, not git commits; every head when it was never green.",
    ["queue", "project"],
)
PROJECT_BOOKMARK_AGE = Gauge(
    "stovepipe_project_bookmark_age_seconds",
    "Seconds since the project's last green answer (built or inherited) was recorded (no "
    "sample before its first).",
    ["queue", "project"],
)
CULPRIT_SEARCHES = Counter(
    "stovepipe_culprit_searches_total",
    "Culprit searches opened and ended, by state: bisecting (opened), found, fixed (the "
    "branch went green first), budget_spent, inconclusive, no_range.",
    ["queue", "state"],
)
BACKFILL_PROBES = Counter(
    "stovepipe_backfill_requests_total",
    "Backfill Requests started by culprit searches (commits validated to find a culprit).",
    ["queue"],
)
CULPRIT_FAILURES = Counter(
    "stovepipe_culprit_search_failures_total",
    "Culprit searches that could not be opened or advanced after a verdict (logged; the "
    "sweeper advances a search left bisecting).",
    ["queue"],
)
PERIODIC_ROUNDS = Counter(
    "stovepipe_periodic_rounds_total",
    "Rounds of a worker's timed tasks (sweeper, notify, gauges), by how they ended.",
    ["task", "outcome"],
)
TIME_TO_SIGNAL = Gauge(
    "stovepipe_time_to_signal_seconds",
    "Ingest to fact of the queue's heads and commits validated again whose facts were "
    "recorded in the last 24 h, at the quantile 0.5 or 0.9 (no sample without such facts).",
    ["queue", "quantile"],
)
RED_SHARE = Gauge(
    "stovepipe_red_time_ratio",
    "Share of the last 7 days the queue was red (its newest verdict), of the time its "
    "greenness was known (no sample before its first verdict).",
    ["queue"],
)
RED_STREAK = Gauge(
    "stovepipe_red_streak_seconds",
    "Seconds since the queue's current red streak began; 0 while it is green.",
    ["queue"],
)
BOOKMARK_LAG_COMMITS = Gauge(
    "stovepipe_bookmark_lag_commits",
    "First-parent git commits from the bookmarked last green commit to the newest head "
    "(counted up to 1000: a larger lag shows as 1000; no sample when unknown).",
    ["queue"],
)
BOOKMARK_LAG_SECONDS = Gauge(
    "stovepipe_bookmark_lag_seconds",
    "Seconds since the first head ingested after the bookmarked one; 0 when the bookmark "
    "is the newest head.",
    ["queue"],
)
FLAKES = Gauge(
    "stovepipe_flakes",
    "Facts green on a re-run of a red build (retry.red), recorded in the last 24 h "
    "(window=24h) and ever (window=total).",
    ["queue", "window"],
)
ROWS_PAST_RETENTION = Gauge(
    "stovepipe_rows_past_retention",
    "Rows older than the retention that retention may delete and its last round left "
    "(over its max_rows): 0 once it has caught up; no sample while retention is off.",
    ["table"],
)
PRUNED_ROWS = Counter(
    "stovepipe_pruned_rows_total",
    "Rows retention deleted in this worker's rounds, by table.",
    ["table"],
)
RETENTION_ROUND_FINISHED = Gauge(
    "stovepipe_retention_round_finished_timestamp_seconds",
    "When the newest retention round (of any worker) finished, Unix time.",
)

BUILD = Info("stovepipe_build", "The Stovepipe release this process runs.")
BUILD.info({"version": __version__})
