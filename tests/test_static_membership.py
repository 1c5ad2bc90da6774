"""Issue 25, item 2 on the real broker: static consumer-group membership (KIP-345). A
worker given STOVEPIPE_CONSUMER_GROUP_INSTANCE_ID (on Kubernetes: its pod's name) and
stopped as a deployment stops it (SIGTERM) does not leave its group; started again under
the same id within the session timeout, it takes its own partitions back and the other
member is not rebalanced at all (its partition assignments stay counted as they were) —
in the stage group and in the delay tiers' group — whether it is a follower or the
group's leader, as in a rolling update. The pipeline validates a commit after each
restart."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient

from streams.config.settings import ENV_CONSUMER_GROUP_INSTANCE_ID, ENV_SESSION_TIMEOUT
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until
from tests.web_support import free_port

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

# well above a restart on a loaded machine, so the rejoin always falls within it
SESSION_TIMEOUT = "120"


def _assignments(port: int) -> int | None:
    """The worker's stovepipe_partition_assignments_total; None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    found = re.search(r"^stovepipe_partition_assignments_total (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def _members(bootstrap: str, group: str) -> dict[str, frozenset[tuple[str, int]]] | None:
    """Each member's partitions by its instance id (its member id when it has none),
    once the group is stable; else None."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        described: Any = admin.describe_consumer_groups([group])[group].result(timeout=10)
    except Exception:
        return None
    if str(described.state).rsplit(".", 1)[-1] != "STABLE":
        return None
    return {m.group_instance_id or m.member_id:
            frozenset((tp.topic, tp.partition) for tp in (m.assignment.topic_partitions or []))
            for m in described.members}


def _stable_with(bootstrap: str, group: str, members: int) -> bool:
    found = _members(bootstrap, group)
    return found is not None and len(found) == members and all(found.values())


def test_workers_restarted_under_their_instance_ids_rejoin_without_a_rebalance(
        pipeline: Pipeline) -> None:
    ref = pipeline.add_queue("q")
    delay_group = f"{pipeline.app_id}-delay"
    ports = [free_port(), free_port()]
    envs = [{ENV_CONSUMER_GROUP_INSTANCE_ID: f"stovepipe-{n}",
             ENV_SESSION_TIMEOUT: SESSION_TIMEOUT} for n in range(2)]

    workers = [pipeline.start_worker(web_port=ports[0], env=envs[0])]
    wait_until(lambda: _stable_with(pipeline.bootstrap, pipeline.app_id, 1)
               and (_assignments(ports[0]) or 0) >= 1,
               timeout=120, what="the first worker to hold every partition", interval=0.5)
    workers.append(pipeline.start_worker(web_port=ports[1], env=envs[1]))
    wait_until(lambda: _stable_with(pipeline.bootstrap, pipeline.app_id, 2)
               and _stable_with(pipeline.bootstrap, delay_group, 2)
               and (_assignments(ports[0]) or 0) >= 2 and (_assignments(ports[1]) or 0) >= 1,
               timeout=120, what="both workers to hold partitions", interval=0.5)
    before = _members(pipeline.bootstrap, pipeline.app_id)
    delay_before = _members(pipeline.bootstrap, delay_group)

    # as a StatefulSet rolls: the highest ordinal first, then stovepipe-0, which joined
    # first and leads the group
    for n, commit in ((1, "c1"), (0, "c2")):
        other = 1 - n
        other_assignments = _assignments(ports[other])
        pipeline.stop_worker(workers[n])  # SIGTERM, as Kubernetes stops a pod
        workers[n] = pipeline.start_worker(web_port=ports[n], env=envs[n])
        wait_until(lambda n=n: (_assignments(ports[n]) or 0) >= 1
                   and _stable_with(pipeline.bootstrap, pipeline.app_id, 2),
                   timeout=120, what=f"stovepipe-{n} to take its partitions back",
                   interval=0.5)
        # the pipeline runs across both (and a rebalance would have been counted by now)
        pipeline.repo.push(ref, commit)
        request_id = pipeline.ingest("q")
        pipeline.wait_quiet()
        assert pipeline.states()[request_id] == "succeeded"
        assert _assignments(ports[other]) == other_assignments, \
            f"restarting stovepipe-{n} rebalanced stovepipe-{other}"

    assert pipeline.exact_outcome_problems() == []
    # each member under its own id in both groups, holding what it held before
    assert before is not None and set(before) == {"stovepipe-0", "stovepipe-1"}, before
    assert _members(pipeline.bootstrap, pipeline.app_id) == before
    assert delay_before is not None and set(delay_before) == set(before), delay_before
    assert _members(pipeline.bootstrap, delay_group) == delay_before
