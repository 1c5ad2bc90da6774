"""Issue 25, item 2 on the real broker: static consumer-group membership (KIP-345). A
worker given STOVEPIPE_CONSUMER_GROUP_INSTANCE_ID (on Kubernetes: its pod's name) and
stopped as a deployment stops it (SIGTERM) does not leave its group; started again under
the same id within the session timeout, it takes its own partitions back and the other
member is not rebalanced at all (its partition assignments stay counted as they were) —
in the stage group and in the delay tiers' group. The pipeline then still validates a
commit."""

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


def test_a_worker_restarted_under_its_instance_id_rejoins_without_a_rebalance(
        pipeline: Pipeline) -> None:
    ref = pipeline.add_queue("q")
    delay_group = f"{pipeline.app_id}-delay"
    ports = [free_port(), free_port()]
    envs = [{ENV_CONSUMER_GROUP_INSTANCE_ID: f"stovepipe-{n}",
             ENV_SESSION_TIMEOUT: SESSION_TIMEOUT} for n in range(2)]

    pipeline.start_worker(web_port=ports[0], env=envs[0])
    wait_until(lambda: _stable_with(pipeline.bootstrap, pipeline.app_id, 1)
               and (_assignments(ports[0]) or 0) >= 1,
               timeout=120, what="the first worker to hold every partition", interval=0.5)
    second = pipeline.start_worker(web_port=ports[1], env=envs[1])
    wait_until(lambda: _stable_with(pipeline.bootstrap, pipeline.app_id, 2)
               and _stable_with(pipeline.bootstrap, delay_group, 2)
               and (_assignments(ports[0]) or 0) >= 2 and (_assignments(ports[1]) or 0) >= 1,
               timeout=120, what="both workers to hold partitions", interval=0.5)
    first_assignments = _assignments(ports[0])
    before = _members(pipeline.bootstrap, pipeline.app_id)
    delay_before = _members(pipeline.bootstrap, delay_group)

    pipeline.stop_worker(second)  # SIGTERM: a rolling restart's stop
    pipeline.start_worker(web_port=ports[1], env=envs[1])
    wait_until(lambda: (_assignments(ports[1]) or 0) >= 1
               and _stable_with(pipeline.bootstrap, pipeline.app_id, 2),
               timeout=120, what="the restarted worker to take its partitions back",
               interval=0.5)

    # the pipeline runs across both members (and any rebalance would have been counted)
    pipeline.repo.push(ref, "c1")
    request_id = pipeline.ingest("q")
    pipeline.wait_quiet()
    assert pipeline.states() == {request_id: "succeeded"}
    assert pipeline.exact_outcome_problems() == []

    assert _assignments(ports[0]) == first_assignments, \
        "the other worker was rebalanced by the restart"
    # each member under its own id in both groups, holding what it held before the restart
    assert before is not None and set(before) == {"stovepipe-0", "stovepipe-1"}, before
    assert _members(pipeline.bootstrap, pipeline.app_id) == before
    assert delay_before is not None and set(delay_before) == set(before), delay_before
    assert _members(pipeline.bootstrap, delay_group) == delay_before
