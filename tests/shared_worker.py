"""One pipeline worker per test module, shared by the tests that need no worker of their own.

A deployment of its own (the `pipeline` fixture) costs a test a cold worker process
(Python, Faust, a consumer group to join and leave), 19 topics and a schema: seconds each
time. Most end-to-end tests only need *a* running worker and queues nobody else touches.
They take a `Lane` (the `lane` fixture) of their module's `SharedPipeline`: one worker
process, one topic set, one consumer group and one schema for the whole module.

A worker reads queues.yaml once, when it starts, so a lane's queues are declared on its
test (`lane_queue`, `lane_raw_queue`), and the module's worker starts with the queues of
every lane test selected in the module. What a lane has of its own:

- its queues, named ``<lane>/<name>`` (`Lane.name`), so its Requests, builds, facts and
  dead letters are its own;
- its fake repository file (`Lane.repo`) and its fake build runner's state directory
  (`Lane.cancel_dir`: latches, cancels, CI outages), and a directory (`Lane.root`) for
  anything else it builds (a git repository, say);
- its checks: `Pipeline.scope` is its queues, so `states`, `wait_quiet`,
  `invariant_violations`, `exact_outcome_problems`, `dead_letters` and `parked` look at
  its queues' rows and messages only, and `logs` at the worker's lines about them.

Raw SQL is the test's own business: a lane test names its queues in every query.

A lane may not start, stop or kill workers. Keep a deployment of its own for a test that
kills, restarts or adds workers, runs one with other options or environment, changes
what every queue shares (consumer offsets, the database beyond its queues' rows, a
service's outage), or counts what the whole pipeline did.

The shared worker is stopped once the module's last lane test is done, so it does not
run beside the module's tests with workers of their own (the session's check that no
test leaves a process behind notes it with the module's first lane test).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from streams.extensions.sourcecontrol.fake import FakeRepo
from tests.pipeline_support import Pipeline, fake_queue

LANE_QUEUE = "lane_queue"
MARKERS = (f"{LANE_QUEUE}(name, body=None, **knobs): a queue of the test's Lane of the "
           f"module's shared worker (tests/shared_worker.py)",)

RawBody = Callable[[Path], dict[str, Any]]  # a queues.yaml entry, given the lane's root

_DECLARE = ("a lane's queues are declared on its test (lane_queue, lane_raw_queue): the "
            "shared worker read queues.yaml when it started")
_OWN_WORKERS = ("a lane shares its module's worker: a test that starts, stops or kills "
                "workers takes the `pipeline` fixture")


def lane_queue(name: str, **knobs: Any) -> pytest.MarkDecorator:
    """Declare a queue ``name`` of the test's lane on the fake source control and build
    runner, with `Pipeline.add_queue`'s knobs (``poll_deadline="3s"``, ...)."""
    return pytest.mark.lane_queue(name, **knobs)


def lane_raw_queue(name: str, body: RawBody) -> pytest.MarkDecorator:
    """Declare a queue ``name`` of the test's lane as written in queues.yaml:
    ``body(root)``, where ``root`` is the lane's directory (`Lane.root`), in which the
    test makes what the body names (a git repository, say) before it ingests."""
    return pytest.mark.lane_queue(name, body=body)


@dataclass
class _Declared:
    lane: str
    root: Path
    queues: dict[str, tuple[str | None, dict[str, Any]]] = field(default_factory=dict)


class SharedPipeline(Pipeline):
    """The module's deployment: its topics, schema, consumer group and one worker, started
    with the queues of every lane of ``items`` (the module's tests that take a lane)."""

    def __init__(self, *, bootstrap: str, dsn: str, prefix: str, root: Path,
                 items: list[pytest.Item]) -> None:
        super().__init__(bootstrap=bootstrap, dsn=dsn, prefix=prefix, root=root)
        self.declared: dict[str, _Declared] = {}
        for n, item in enumerate(items, 1):
            declared = _Declared(lane=f"l{n}", root=root / f"lane-{n}")
            (declared.root / "cancelled").mkdir(parents=True)
            for mark in reversed(list(item.iter_markers(LANE_QUEUE))):  # top to bottom
                local, = mark.args
                real = f"{declared.lane}/{local}"
                assert local not in declared.queues, f"{item.nodeid}: {local} twice"
                body = mark.kwargs.get("body")
                if body is not None:
                    declared.queues[local] = (None, body(declared.root))
                else:
                    declared.queues[local] = fake_queue(
                        real, repo_file=declared.root / "repo.json",
                        state_dir=declared.root / "cancelled", **mark.kwargs)
                self.add_raw_queue(real, declared.queues[local][1])
            self.declared[item.nodeid] = declared
        self._to_run = set(self.declared)

    def lane(self, nodeid: str) -> Lane:
        return Lane(self, self.declared[nodeid])

    def lane_done(self, nodeid: str) -> None:
        """Stop the worker once every lane test of the module has run."""
        self._to_run.discard(nodeid)
        if not self._to_run:
            self.stop_workers()


class Lane(Pipeline):
    """One test's share of a `SharedPipeline`: the `Pipeline` API over its own queues."""

    def __init__(self, shared: SharedPipeline, declared: _Declared) -> None:
        # not Pipeline.__init__: the deployment exists; this is a view of it
        self.shared = shared
        self.id = declared.lane
        self.bootstrap, self.dsn, self.prefix = shared.bootstrap, shared.dsn, shared.prefix
        self.root = declared.root
        self.repo_file = self.root / "repo.json"
        self.cancel_dir = self.root / "cancelled"
        self.repo = FakeRepo(self.repo_file)
        self.topics_file, self.topics = shared.topics_file, shared.topics
        self.queues_file = shared.queues_file
        self._refs = {local: ref for local, (ref, _) in declared.queues.items()}
        self.queues = {self.name(local): body for local, (_, body) in declared.queues.items()}
        self.scope = self.names = tuple(self.queues)
        self.app_id, self.sweep_interval = shared.app_id, shared.sweep_interval
        self.workers = shared.workers  # the same list: wait_terminal watches the worker
        self._log = shared.root / "worker-1.log"  # the one worker a SharedPipeline starts
        self._log_start = self._log.stat().st_size if self._log.exists() else 0

    def name(self, local: str) -> str:
        """The real name of the lane's queue ``local`` (as declared on the test)."""
        return f"{self.id}/{local}"

    def ref(self, local: str) -> str:
        """The fake repository ref the lane's queue ``local`` follows."""
        ref = self._refs[local]
        assert ref is not None, f"{local} is a raw queue: its body says what it follows"
        return ref

    @property
    def env(self) -> dict[str, str]:
        return self.shared.env  # the CLI sees what the worker sees

    def add_queue(self, name: str, **knobs: Any) -> str:
        raise AssertionError(_DECLARE)

    def add_raw_queue(self, name: str, body: dict[str, Any]) -> None:
        raise AssertionError(_DECLARE)

    def start_worker(self, **options: Any) -> Any:
        raise AssertionError(_OWN_WORKERS)

    def kill_worker(self, proc: Any) -> None:
        raise AssertionError(_OWN_WORKERS)

    def stop_workers(self) -> None:
        raise AssertionError(_OWN_WORKERS)

    def _lines(self) -> Iterator[str]:
        """The shared worker's log lines since this lane began that name one of its
        queues, Requests or builds."""
        ids = [rid for (rid,) in self.query("SELECT id FROM build WHERE queue = ANY(%s)",
                                            list(self.names))]
        if not self._log.exists() or not (self.names or ids):
            return
        mentions = re.compile("|".join(re.escape(s) for s in (*self.names, *ids)))
        with self._log.open("rb") as log:
            log.seek(self._log_start)
            for raw in log:
                line = raw.decode(errors="replace")
                if mentions.search(line):
                    yield line

    def logs(self) -> str:
        return "".join(self._lines())[-8000:]

    def full_logs(self) -> str:
        return "".join(self._lines())


def lane_items(session: pytest.Session, module: Any) -> list[pytest.Item]:
    """The selected tests of ``module`` that take a lane, in the order they run."""
    return [item for item in session.items
            if getattr(item, "module", None) is module
            and "lane" in getattr(item, "fixturenames", ())]
