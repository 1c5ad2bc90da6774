"""The timing relations a worker depends on (streams/runtime/timings.py), checked against
the constants where each lives: a change to one that breaks a relation fails here."""

from __future__ import annotations

from store.database import Database
from store.worker_hosts import HEARTBEAT_GAP, MIN_HOST_TIMEOUT
from streams.extensions import budget
from streams.extensions.buildrunner.command import DEFAULT_HOST_TIMEOUT
from streams.extensions.notify.github_status import TURN_WAIT
from streams.extensions.notify.http import DEFAULT_TIMEOUT as POST_TIMEOUT
from streams.extensions.sourcecontrol.gitrepo import DEFAULT_REMOTE_TIMEOUT
from streams.runtime import timings
from streams.stages import budgets, ingest, loops, notify, sweeper
from streams.stages.kit import WAIT_CAP
from streams.stages.pipeline import TEND_INTERVAL


def test_the_group_evicts_a_member_only_after_three_lost_heartbeats() -> None:
    assert timings.HEARTBEAT_INTERVAL * 3 <= timings.SESSION_TIMEOUT


def test_a_member_stops_its_revoked_work_well_within_the_rebalance_timeout() -> None:
    assert timings.REVOKE_DEADLINE < timings.REBALANCE_TIMEOUT
    # the waits a handler may be inside when a rebalance comes are cancelled, not awaited:
    # each is cancellable, so none of them needs to fit in the rebalance timeout — but the
    # in-place retry's pause does, so a revoked handler notices promptly
    assert timings.OUTAGE_MAX_BACKOFF < timings.REVOKE_DEADLINE
    assert DEFAULT_REMOTE_TIMEOUT > timings.REBALANCE_TIMEOUT  # why cancelling is needed


def test_a_dependency_is_waited_out_between_deliveries_with_a_bounded_pause() -> None:
    assert WAIT_CAP <= timings.REBALANCE_TIMEOUT


def test_a_database_outage_never_makes_a_host_look_dead() -> None:
    assert TEND_INTERVAL * 3 <= HEARTBEAT_GAP
    assert HEARTBEAT_GAP + 2 * TEND_INTERVAL <= MIN_HOST_TIMEOUT <= DEFAULT_HOST_TIMEOUT


def test_leases_outlive_or_are_renewed_during_the_work_they_cover() -> None:
    assert ingest.RENEW_EVERY * 3 <= ingest.LEASE
    assert notify.LEASE > POST_TIMEOUT


def test_a_notice_round_ends_well_inside_its_lease() -> None:
    assert notify.ROUND_LIMIT + TURN_WAIT + POST_TIMEOUT < notify.LEASE


def test_workers_count_each_other_from_heartbeats_they_cannot_miss() -> None:
    assert budgets.LIVE_WITHIN >= 2 * TEND_INTERVAL + HEARTBEAT_GAP
    # a wait announced to the sweeper is shorter than the silence it tolerates anyway
    assert budget.ANNOUNCE_AFTER < loops.HEARTBEAT + sweeper.GRACE


def test_the_sweeper_waits_for_a_loop_longer_than_its_heartbeat() -> None:
    assert sweeper.GRACE > 0 and loops.HEARTBEAT > 0
    assert Database.open.__kwdefaults__["acquire_timeout"] < timings.REBALANCE_TIMEOUT
