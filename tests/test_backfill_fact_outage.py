"""Issue 23, item 5: a culprit search's green probe gets its fact while the repository
cannot say whether the probe descends from the bookmark; the bookmark moves once it can
(design §5, record) — on a real worker, broker and database, with the fake source
control made unreachable exactly while the probe's verdict is recorded.
"""

from __future__ import annotations

import pytest

from tests.shared_worker import Lane, lane_queue
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]


@lane_queue("q", backfill={"mode": "bisect", "max_builds": 4})
def test_a_green_probe_is_recorded_while_git_is_down_and_takes_the_bookmark_after(
        lane: Lane) -> None:
    queue, ref = lane.name("q"), lane.ref("q")
    lane.repo.push(ref, "c0")
    green = lane.ingest(queue)
    lane.wait_quiet(timeout=120)
    assert lane.queue(queue)["last_green_request_id"] == green

    # one push of two: c1 passes (held by a latch), c2 breaks the build
    lane.repo.push(ref, "c1-latchP", "c2-fail")
    red = lane.ingest(queue)
    lane.wait_terminal([red], timeout=120)
    assert lane.request(red)["request"]["verdict"] == "red"

    def probe() -> str | None:
        rows = lane.query("SELECT r.id FROM request r JOIN build b"
                          " ON b.queue = r.queue AND b.request_id = r.id"
                          " WHERE r.queue = %s AND r.kind = 'backfill'"
                          " AND b.status = 'running'", queue)
        return rows[0][0] if rows else None

    wait_until(lambda: probe() is not None, timeout=120, what="the probe of c1 to build")
    probe_id = probe()
    assert probe_id is not None
    lane.repo.set_reachable(False)
    try:
        lane.release("P")
        wait_until(lambda: lane.request(probe_id)["fact"] is not None, timeout=60,
                   what="the probe's fact while the repository is down")
        assert lane.request(probe_id)["fact"]["degree"] == 0
        # the bookmark waits for the ancestry answer
        assert lane.queue(queue)["last_green_request_id"] == green
    finally:
        lane.repo.set_reachable(True)
    wait_until(lambda: lane.queue(queue)["last_green_request_id"] == probe_id, timeout=120,
               what="the bookmark to move to the probe once the repository answers")
    lane.wait_quiet(timeout=120)
    assert lane.dead_letters() == 0
    assert lane.invariant_violations(strict_bookmark=False) == []
