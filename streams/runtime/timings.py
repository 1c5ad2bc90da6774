"""The timing constants a worker depends on, and how they must relate (issue 17).

The group's own (defined here, used by `streams.runtime.worker`):

| constant            | value | meaning                                                  |
|---------------------|-------|----------------------------------------------------------|
| HEARTBEAT_INTERVAL  | 1 s   | a member's heartbeat to the group coordinator            |
| SESSION_TIMEOUT     | 10 s  | a silent member is evicted: a killed worker's partitions  |
|                     |       | move after this                                           |
| REBALANCE_TIMEOUT   | 60 s  | how long the group waits for every member to rejoin       |
| REVOKE_DEADLINE     | 10 s  | how long a member stops its revoked partitions' messages  |
| OUTAGE_MAX_BACKOFF  | 5 s   | the longest pause of a handler retried in place (the      |
|                     |       | broker or the database away)                              |

Relations (tests/test_timings.py checks each against the constants where they live):

1. HEARTBEAT_INTERVAL * 3 <= SESSION_TIMEOUT: three heartbeats lost before an eviction.
2. REVOKE_DEADLINE < REBALANCE_TIMEOUT: a member rejoins in time, however long its handlers
   would have waited — a rebalance does not wait for handlers (stream_wait_empty off): it
   cancels the revoked partitions' messages, which are delivered again to their new owner.
   Every wait *inside* a handler is cancellable: the in-place outage retry
   (OUTAGE_MAX_BACKOFF), a pooled connection (store: acquire_timeout 30 s), a git command
   (gitrepo: 60 s local, 300 s remote; killed when cancelled), an HTTP call to a CI or a
   notifier (10 s). A dependency's outage is waited out *between* deliveries (`Wait`,
   through the delay topics, capped at `streams.stages.kit.WAIT_CAP` = 60 s), so it holds
   no handler at all.
3. The sweeper takes a loop for lost after its queue's longest delay + `loops.HEARTBEAT`
   (5 s) + `sweeper.GRACE` (5 s); a loop waiting out an outage says when it will be back.
4. Hosts: `pipeline.TEND_INTERVAL` (2 s) * 3 <= `store.worker_hosts.HEARTBEAT_GAP` (6 s);
   HEARTBEAT_GAP + 2 * TEND_INTERVAL <= `worker_hosts.MIN_HOST_TIMEOUT` (10 s) <= every
   command runner's host_timeout: a database outage shorter than the gap leaves every
   build's heartbeat younger than host_timeout, and a longer one restarts every host's
   evidence (`store.worker_hosts`).
5. Leases outlive the work they cover or are renewed: an ingest lease (`ingest.LEASE`,
   30 s) is renewed every third of it while git runs; a notification's lease
   (`notify.LEASE`, 60 s) exceeds one post's timeout (10 s), and a round posts a channel's
   notices one at a time for at most `notify.ROUND_LIMIT` (30 s), to which the last post
   adds at most its wait for a turn (`github_status.TURN_WAIT`, 5 s) and its timeout:
   ROUND_LIMIT + TURN_WAIT + 10 s < LEASE.
6. Budgets (`streams.stages.budgets`): a worker process heartbeats and counts the live
   ones every tend (2 s); a process is live for `budgets.LIVE_WITHIN` (12 s, two
   heartbeat gaps) after its last heartbeat, so a live one is never missed; a worker uses
   its count from its second tend on, so workers started together count each other. A
   pause one worker learned reaches the others within two tends. A loop waiting for its
   turn in a budget `budget.ANNOUNCE_AFTER` (1 s) or longer marks its row seen until its
   turn, so the sweeper (relation 3) never takes it for lost.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL = 1.0
SESSION_TIMEOUT = 10.0
REBALANCE_TIMEOUT = 60.0
REVOKE_DEADLINE = 10.0
OUTAGE_FIRST_BACKOFF = 0.5
OUTAGE_MAX_BACKOFF = 5.0
