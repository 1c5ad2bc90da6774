"""One slow queue never delays another (design §10), on the real broker and database with
a real worker: a hosted CI hanging on one queue's trigger call leaves every other queue
validated, and the hanging queue still ends exactly as its head says once the call
returns. The hang is a latch the test releases (``triggerlatch`` in the fake runner)."""

from __future__ import annotations

import pytest

from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

OTHERS = 6


def test_a_queue_whose_ci_hangs_delays_no_other_queue(pipeline: Pipeline) -> None:
    slow_ref = pipeline.add_queue("slow")
    refs = {f"q{i}": pipeline.add_queue(f"q{i}") for i in range(OTHERS)}
    pipeline.start_worker()

    pipeline.repo.push(slow_ref, "s1-triggerlatchHANG")
    slow = pipeline.ingest("slow")
    wait_until(lambda: pipeline.states()[slow] == "processing", timeout=60,
               what="the slow queue's Request admitted (its trigger now hangs)")
    others = {}
    for queue, ref in refs.items():
        pipeline.repo.push(ref, f"{queue}-c1")
        others[queue] = pipeline.ingest(queue)
    # every other queue is validated while the slow queue's trigger call still hangs
    pipeline.wait_terminal(list(others.values()), timeout=120)
    assert {q: pipeline.states()[rid] for q, rid in others.items()} == {
        q: "succeeded" for q in others}
    assert pipeline.states()[slow] == "processing"
    assert pipeline.query("SELECT count(*) FROM build WHERE request_id = %s", slow) == [(0,)]

    pipeline.release("HANG")
    pipeline.wait_terminal([slow], timeout=120)
    assert pipeline.states()[slow] == "succeeded"
    assert pipeline.exact_outcome_problems() == []
    assert pipeline.invariant_violations(strict_bookmark=True) == []
