"""Issue 25, item 5: an upgrade without downtime from release 3cbbf76 (the `main` this
release takes over from), on the real broker and database, under traffic.

The old release's code (from the git history) migrates a schema of its own and runs two
workers; heads keep being pushed and ingested, some passing, some failing, some slow.
Then the rolling switch, as a platform team does it: this release's `db migrate` runs
while the old workers work (expand-only: they must not notice), a new worker joins, an
old one leaves, another new one joins, the last old one leaves. Nothing may be lost,
nothing green that a build did not find green, no Request failed by the switch (every
Request ends as its head says), and every queue's newest head is validated.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import threading
from io import BytesIO
from pathlib import Path

import pytest
import yaml

from streams.config.settings import REPO_ROOT
from tests.pipeline_support import Pipeline
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

PREVIOUS = "3cbbf76"  # the release this one upgrades from
QUEUES = 6


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree, from this repository's history."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar",
                              PREVIOUS], capture_output=True, check=False)
    assert archive.returncode == 0, (
        f"release {PREVIOUS} is not in this clone's history (a shallow clone?): "
        f"{archive.stderr.decode(errors='replace')}")
    tree = tmp_path_factory.mktemp(f"release-{PREVIOUS}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _old_cli(tree: Path, env: dict[str, str], *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "streams.cli", *args], cwd=tree,
                          env={**env, "PYTHONPATH": str(tree)}, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{PREVIOUS}: stovepipe {' '.join(args)}: {done.stderr}"


def _old_topics_file(tree: Path, pipeline: Pipeline) -> Path:
    """The previous release's topics.yaml, reduced as this one's tests reduce theirs
    (tests.runtime_support.write_test_topics): the same topic names and partitions."""
    raw = yaml.safe_load((tree / "topics.yaml").read_text())
    mine = yaml.safe_load(pipeline.topics_file.read_text())
    for section in ("defaults", "dlq_defaults"):
        raw[section]["partitions"] = mine[section]["partitions"]
        raw[section]["retry"] = mine[section]["retry"]
    raw["delay_tiers"] = mine["delay_tiers"]
    path = pipeline.root / f"topics-{PREVIOUS}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class _Traffic:
    """Heads pushed and ingested through the topic, round after round, until stopped:
    a third fail, a third run a second."""

    def __init__(self, pipeline: Pipeline, refs: dict[str, str]) -> None:
        self.pipeline, self.refs = pipeline, refs
        self.pushed: dict[str, str] = {}
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        from tests.pipeline_support import produce_ingests
        try:
            while not self._stop.is_set():
                for i, (queue, ref) in enumerate(self.refs.items()):
                    kind = ("", "-fail", "-slow1")[(self.rounds + i) % 3]
                    sha = f"{queue}-r{self.rounds}{kind}"
                    self.pipeline.repo.push(ref, sha)
                    self.pushed[queue] = sha
                produce_ingests(self.pipeline.bootstrap, self.pipeline.topics,
                                list(self.refs))
                self.rounds += 1
                self._stop.wait(1.5)  # the traffic's pace, not a wait for a condition
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> _Traffic:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        assert self.error is None, self.error

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_a_rolling_upgrade_from_the_previous_release_under_traffic(
        previous_release: Path, schema_dsn: str, kafka_bootstrap: str,
        topic_prefix: str, tmp_path: Path) -> None:
    pipeline = Pipeline(bootstrap=kafka_bootstrap, dsn=schema_dsn, prefix=topic_prefix,
                        root=tmp_path)
    try:
        env = pipeline.env
        _old_cli(previous_release, env, "db", "migrate")  # the old schema: up to 0010
        refs = {f"u{i}": pipeline.add_queue(f"u{i}", max_concurrent=1 + i % 2)
                for i in range(QUEUES)}
        old_topics = {"STOVEPIPE_TOPICS_FILE": str(_old_topics_file(previous_release,
                                                                    pipeline))}
        old = [pipeline.start_worker(code=previous_release, env=old_topics)
               for _ in range(2)]
        with _Traffic(pipeline, refs) as traffic:
            wait_until(lambda: traffic.rounds >= 3 and len(pipeline.states()) >= QUEUES,
                       timeout=120, what="the old release working under traffic")
            # the switch: migrate under the old workers, then replace them one by one
            pipeline.cli("db", "migrate")
            wait_until(lambda: traffic.rounds >= 5, timeout=120, what="traffic after the "
                       "migration")
            new = [pipeline.start_worker()]
            pipeline.stop_worker(old.pop(0))
            wait_until(lambda: traffic.rounds >= 7, timeout=120, what="traffic")
            new.append(pipeline.start_worker())
            pipeline.stop_worker(old.pop(0))
            wait_until(lambda: traffic.rounds >= 10, timeout=180, what="traffic after the "
                       "switch")
            traffic.stop()
        pushed = dict(traffic.pushed)

        def newest_heads_in() -> bool:
            rows = pipeline.query("SELECT q.name, r.uri FROM queue q JOIN request r"
                                  " ON r.queue = q.name AND r.id = q.latest_request_id")
            latest = {queue: uri.rsplit("/", 1)[1] for queue, uri in rows}
            return all(latest.get(q) == sha for q, sha in pushed.items())

        wait_until(newest_heads_in, timeout=180, what="every queue's newest head ingested",
                   interval=0.5)
        pipeline.wait_quiet(timeout=240)
        assert pipeline.exact_outcome_problems() == []
        assert pipeline.invariant_violations(strict_bookmark=True) == []
        # no Request failed by the switch: a failure is only ever a red verdict of a
        # head that fails
        unvalidated = pipeline.query("SELECT id, reason FROM request WHERE state = 'failed'"
                                     " AND verdict IS NULL")
        assert unvalidated == []
        assert pipeline.dead_letters() == 0
        # both releases did the work: the previous one never records a build's start,
        # this one does
        [(by_old, by_new)] = pipeline.query(
            "SELECT count(*) FILTER (WHERE started_at IS NULL),"
            " count(*) FILTER (WHERE started_at IS NOT NULL) FROM build")
        assert by_old > 0 and by_new > 0, (by_old, by_new)
        # the newest head of every queue ended as its head says
        states = dict(pipeline.query("SELECT r.uri, r.state FROM queue q JOIN request r"
                                     " ON r.queue = q.name AND r.id = q.latest_request_id"))
        for queue, sha in pushed.items():
            uri = next(u for u in states if u.endswith(f"/{sha}"))
            assert states[uri] == ("failed" if "-fail" in sha else "succeeded"), (queue, sha)
    finally:
        pipeline.close()
