"""The pipeline under test: real worker processes, the CLI, topics and a schema.

Tests act only through the `stovepipe` command, the Kafka topics and the database; the
fake source control's file stands in for the repository a developer pushes to.

A `Pipeline` is a deployment of its own and sees every queue of its schema. A view that
shares its deployment with other tests (`tests.shared_worker.Lane`) sets ``scope`` to its
own queues: then every check here (states, quiet, invariants, exact outcomes, dead
letters, parked messages) looks at those queues' rows and messages only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import yaml

from contract import MalformedPayload, unmarshal
from streams.config.settings import REPO_ROOT
from streams.config.topics import TopicsConfig
from streams.extensions.buildrunner.processes import PGID, START_TIME
from streams.extensions.sourcecontrol.fake import FakeRepo
from tests.runtime_support import create_topics, write_test_topics
from tests.waiting import wait_until

STOVEPIPE = [sys.executable, "-m", "streams.cli"]
TERMINAL = ("superseded", "succeeded", "failed", "cancelled")


def fake_queue(name: str, *, repo_file: Path, state_dir: Path, max_concurrent: int = 1,
               poll_deadline: str = "60s", promotion_ref: str | None = "verified-main",
               ref: str | None = None, source_latency: dict[str, str] | None = None,
               **extra: Any) -> tuple[str, dict[str, Any]]:
    """(ref, queues.yaml entry) of a queue on the fake source control and build runner,
    with short delays so a test runs in seconds."""
    ref = ref or f"{name}-main"
    return ref, {
        "source_control": {"kind": "fake", "path": str(repo_file), "repo": "r", "ref": ref,
                           **({"promotion_ref": f"{ref}-{promotion_ref}"}
                              if promotion_ref else {}),
                           **({"latency": source_latency} if source_latency else {})},
        "build_runner": {"kind": "fake", "state_dir": str(state_dir)},
        "max_concurrent": max_concurrent,
        "gate_delay": "200ms",
        "poll_delay_queued": "200ms",
        "poll_delay_running": "200ms",
        "poll_deadline": poll_deadline,
        **extra,
    }


class Pipeline:
    """One isolated Stovepipe deployment: its own topics, schema, queues and workers."""

    # the queues this object answers for: None, every queue of the schema (a deployment of
    # its own); a Lane of a shared worker (tests.shared_worker) sees only its own
    scope: tuple[str, ...] | None = None

    def __init__(self, *, bootstrap: str, dsn: str, prefix: str, root: Path) -> None:
        self.bootstrap, self.dsn, self.prefix, self.root = bootstrap, dsn, prefix, root
        self.repo_file = root / "repo.json"
        self.cancel_dir = root / "cancelled"
        self.cancel_dir.mkdir(exist_ok=True)
        self.repo = FakeRepo(self.repo_file)
        self.topics_file = write_test_topics(root / "topics.yaml")
        self.topics: TopicsConfig = create_topics(bootstrap, self.topics_file, prefix)
        self.queues_file = root / "queues.yaml"
        self.queues: dict[str, dict[str, Any]] = {}
        self.app_id = f"{prefix}stovepipe-{uuid.uuid4().hex[:6]}"
        self.workers: list[subprocess.Popen[bytes]] = []
        self._log_index = 0
        self.sweep_interval = 1.0

    # -- configuration -------------------------------------------------------------
    def add_queue(self, name: str, *, max_concurrent: int = 1, poll_deadline: str = "60s",
                  promotion_ref: str | None = "verified-main", ref: str | None = None,
                  source_latency: dict[str, str] | None = None, **extra: Any) -> str:
        ref, self.queues[name] = fake_queue(
            name, repo_file=self.repo_file, state_dir=self.cancel_dir,
            max_concurrent=max_concurrent, poll_deadline=poll_deadline,
            promotion_ref=promotion_ref, ref=ref, source_latency=source_latency, **extra)
        self.queues_file.write_text(yaml.safe_dump({"queues": self.queues}))
        return ref

    def add_raw_queue(self, name: str, body: dict[str, Any]) -> None:
        """A queue as written in queues.yaml, e.g. with a git source control."""
        self.queues[name] = body
        self.queues_file.write_text(yaml.safe_dump({"queues": self.queues}))

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, STOVEPIPE_KAFKA_BOOTSTRAP=self.bootstrap,
                    STOVEPIPE_POSTGRES_DSN=self.dsn, STOVEPIPE_TOPIC_PREFIX=self.prefix,
                    STOVEPIPE_TOPICS_FILE=str(self.topics_file),
                    STOVEPIPE_QUEUES_FILE=str(self.queues_file), STOVEPIPE_APP_ID=self.app_id,
                    STOVEPIPE_SWEEP_INTERVAL=str(self.sweep_interval),
                    STOVEPIPE_HOME=str(self.root / "home"))

    def release(self, latch: str) -> None:
        """Let every fake build whose head carries ``latch<latch>`` finish."""
        latches = self.cancel_dir / "latches"
        latches.mkdir(exist_ok=True)
        (latches / latch).touch()

    def set_ci_reachable(self, reachable: bool, *, retry_after: float | None = None) -> None:
        """An outage of the fake build runner's CI, for every worker: while unreachable,
        trigger, status and cancel fail retryably (asking for ``retry_after`` seconds)."""
        down = self.cancel_dir / "down"
        if reachable:
            down.unlink(missing_ok=True)
        else:
            down.write_text(f"{retry_after:g}" if retry_after is not None else "")

    def outage_calls(self) -> list[tuple[str, str, float]]:
        """(call, build id or trigger key, epoch s) of every call made to the fake CI
        while it was unreachable."""
        log = self.cancel_dir / "outage_calls.log"
        if not log.exists():
            return []
        calls = []
        for line in log.read_text().splitlines():
            call, subject, at = line.split(" ")
            calls.append((call, subject, float(at)))
        return calls

    def cancelled_builds(self) -> set[str]:
        """The build ids the fake runner was asked to cancel."""
        log = self.cancel_dir / "cancelled.log"
        return {line.split(" ")[0] for line in log.read_text().splitlines()} \
            if log.exists() else set()

    # -- processes -----------------------------------------------------------------
    def start_worker(self, *, wrapper: list[str] | None = None,
                     env: dict[str, str] | None = None,
                     web_port: int | None = None,
                     code: Path | None = None) -> subprocess.Popen[bytes]:
        """A worker process; ``wrapper`` runs it under another command (e.g. faketime).
        Without ``web_port`` it serves no HTTP: workers of one test would race for the
        default port. ``code``: the source tree it runs (another release's), else this
        one."""
        self._log_index += 1
        web = ["--web-port", str(web_port)] if web_port else ["--no-web"]
        with open(self.root / f"worker-{self._log_index}.log", "wb") as log:
            # a process group of its own: a wrapper (faketime forks the worker as its
            # child) and the worker under it are stopped, and killed, together
            proc = subprocess.Popen([*(wrapper or []), *STOVEPIPE, "worker", "--loglevel",
                                     "info", *web],
                                    env={**self.env, **(env or {}),
                                         **({"PYTHONPATH": str(code)} if code else {})},
                                    stdout=log, stderr=subprocess.STDOUT,
                                    cwd=code or REPO_ROOT, start_new_session=True)
        self.workers.append(proc)
        return proc

    def stop_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop one worker as a deployment does (SIGTERM, its process group), and wait."""
        family = _family(proc)
        _signal(family, signal.SIGTERM)
        if not _wait_gone(family, timeout=60):
            _signal(family, signal.SIGKILL)
            _wait_gone(family, timeout=30)
        proc.wait(timeout=30)

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the worker and whatever runs in its process group (a wrapper's child)."""
        family = _family(proc)
        _signal(family, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_gone(family, timeout=30)

    def stop_workers(self) -> None:
        """Stop every worker with SIGTERM — each with its process group, or, for a worker
        started in the test's own group, its descendants — and wait until all of them are
        gone (SIGKILL after 30 s): a wrapper's exit never leaves the worker it wrapped."""
        families = [_family(proc) for proc in self.workers]
        for family in families:
            _signal(family, signal.SIGTERM)
        for proc, family in zip(self.workers, families, strict=True):
            if not _wait_gone(family, timeout=30):
                _signal(family, signal.SIGKILL)
                _wait_gone(family, timeout=30)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def close(self) -> None:
        """The end of a test: its workers stopped, then the command builds they launched.
        Builds are detached from their worker by design (a restarted worker adopts them),
        so stopping the workers alone leaves them running."""
        self.stop_workers()
        for pgid_file in self.root.rglob(PGID):
            _stop_build_group(pgid_file.parent)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.root.glob("worker-*.log")))

    def full_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.root.glob("worker-*.log")))

    def log_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("worker-*.log"))

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*STOVEPIPE, *args], env=self.env, capture_output=True,
                                text=True, timeout=120, cwd=REPO_ROOT)
        if check and result.returncode != 0:
            raise AssertionError(f"stovepipe {' '.join(args)} exited {result.returncode}: "
                                 f"{result.stderr}")
        return result

    def ingest(self, queue: str) -> str:
        return self.cli("ingest", queue).stdout.strip()

    def request(self, request_id: str) -> dict[str, Any]:
        return json.loads(self.cli("request", request_id, "--json").stdout)

    def queue(self, name: str) -> dict[str, Any]:
        return json.loads(self.cli("queue", name, "--json").stdout)["queue"]

    # -- database ------------------------------------------------------------------
    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn) as conn:
            return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]

    def execute(self, sql: str, *params: Any) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql, params or None)  # type: ignore[arg-type]

    def _only(self, column: str = "queue") -> tuple[str, list[Any]]:
        """A condition keeping the rows of ``scope``'s queues, and its parameters."""
        if self.scope is None:
            return "TRUE", []
        return f"{column} = ANY(%s)", [list(self.scope)]

    def queue_latest(self, name: str) -> str | None:
        rows = self.query("SELECT latest_request_id FROM queue WHERE name = %s", name)
        return rows[0][0] if rows else None

    def states(self, queue: str | None = None) -> dict[str, str]:
        only, params = self._only()
        rows = self.query(f"SELECT id, state FROM request WHERE {only}" +
                          (" AND queue = %s" if queue else ""), *params,
                          *([queue] if queue else []))
        return dict(rows)  # type: ignore[arg-type]

    def wait_terminal(self, request_ids: list[str] | None = None, timeout: float = 90) -> None:
        def done() -> bool:
            for proc in self.workers[-1:]:
                assert proc.poll() is None, self.logs()
            states = self.states()
            wanted = request_ids if request_ids is not None else list(states)
            return bool(wanted) and all(states.get(r) in TERMINAL for r in wanted)

        wait_until(done, timeout=timeout, what="every Request terminal", interval=0.2)

    def wait_quiet(self, timeout: float = 90) -> None:
        """Every Request terminal, every settled build's fact recorded, and the bookmarks
        and promotion refs where those facts put them."""
        self.wait_terminal(timeout=timeout)

        def settled() -> bool:
            return not self.missing_facts() and \
                not self.invariant_violations(strict_bookmark=True)

        wait_until(settled, timeout=timeout, what="facts and bookmarks to settle",
                   interval=0.2)

    def missing_facts(self) -> list[str]:
        """Requests whose verdict a build gave (succeeded, or failed red) but whose fact
        record has not written yet: record runs after the Request turns terminal, so a test
        waits for these before it judges outcomes."""
        only, params = self._only("r.queue")
        return [rid for (rid,) in self.query(
            f"SELECT r.id FROM request r WHERE r.verdict IS NOT NULL AND {only}"
            " AND NOT EXISTS (SELECT 1 FROM validation_fact f"
            "                 WHERE f.queue = r.queue AND f.request_id = r.id)", *params)]

    def invariant_violations(self, *, strict_bookmark: bool = False) -> list[str]:
        """Design §4's invariants at a quiet point; [] when all hold."""
        from store import request_order

        problems: list[str] = []
        only, params = self._only()
        only_name, _ = self._only("name")
        queues = self.query("SELECT name, in_flight_count, last_green_uri, "
                            "last_green_request_id, backfill_in_flight FROM queue "
                            f"WHERE {only_name}", *params)
        processing: dict[str, int] = defaultdict(int)
        backfilling: dict[str, int] = defaultdict(int)
        for queue, kind in self.query(
                f"SELECT queue, kind FROM request WHERE state = 'processing' AND {only}",
                *params):
            if kind == "backfill":
                backfilling[queue] += 1
            else:
                processing[queue] += 1
        facts = {r: (q, u, d) for q, u, d, r in self.query(
            "SELECT queue, uri, degree, request_id FROM validation_fact"
            " WHERE project = queue_project(queue) "
            f"AND {only}", *params)}
        states = dict(self.query(f"SELECT id, state FROM request WHERE {only}", *params))
        greens_per_commit: dict[tuple[str, str], int] = defaultdict(int)
        for q, u, d in facts.values():
            greens_per_commit[(q, u)] += d == 0
        problems += [f"{q}: {u} has {n} green facts"
                     for (q, u), n in greens_per_commit.items() if n > 1]
        for name, in_flight, green_uri, green_id, backfill_in_flight in queues:
            if in_flight != processing[name]:
                problems.append(f"{name}: in_flight_count {in_flight} but "
                                f"{processing[name]} processing")
            if backfill_in_flight != backfilling[name]:
                problems.append(f"{name}: backfill_in_flight {backfill_in_flight} but "
                                f"{backfilling[name]} backfills processing")
            if green_id is not None:
                fact = facts.get(green_id)
                if fact is None or fact[2] != 0 or fact[1] != green_uri:
                    problems.append(f"{name}: bookmark {green_id} names no green fact")
            greens = [r for r, (q, _, d) in facts.items() if q == name and d == 0]
            if strict_bookmark and greens:
                newest = max(greens, key=request_order)
                if green_id != newest:
                    problems.append(f"{name}: bookmark {green_id}, newest green {newest}")
            sc = self.queues.get(name, {}).get("source_control", {})
            if strict_bookmark and sc.get("promotion_ref") and sc.get("kind") == "fake":
                promoted = self.repo.promoted(sc["promotion_ref"])
                expected = green_uri.rsplit("/", 1)[1] if green_uri else None
                if promoted != expected:
                    problems.append(f"{name}: promotion ref at {promoted}, bookmark at "
                                    f"{expected}")
        for rid, (q, uri, degree) in facts.items():
            if states.get(rid) not in ("succeeded", "failed"):
                problems.append(f"fact for {q} {uri} by {rid} in state {states.get(rid)}")
            if (degree == 0) != (states.get(rid) == "succeeded"):
                problems.append(f"fact degree {degree} but {rid} is {states.get(rid)}")
        return problems

    def exact_outcome_problems(self, *, dead_letters_allowed: bool = False) -> list[str]:
        """Every Request ended as its head says, however it got there: a crash or an
        outage may delay an outcome, never change it. Superseded only below its queue's
        latest; succeeded only for a head without `fail`, with a green fact; failed only
        for a head with `fail`, with a red fact (a Request failed by a reconciler has no
        fact); nothing dead-lettered and nothing parked."""
        problems = []
        only, params = self._only()
        only_name, _ = self._only("name")
        latest = dict(self.query(f"SELECT name, latest_request_id FROM queue WHERE {only_name}",
                                 *params))
        facts = {r: d for r, d in self.query(
            f"SELECT request_id, degree FROM validation_fact WHERE {only}", *params)}
        for queue, rid, uri, state in self.query(
                f"SELECT queue, id, uri, state FROM request WHERE {only}", *params):
            fails = "fail" in uri.rsplit("/", 1)[1].split("-")
            if state == "superseded":
                ok = rid != latest.get(queue)
            elif state == "succeeded":
                ok = not fails and facts.get(rid) == 0
            elif state == "failed":
                ok = fails and facts.get(rid) == 1
            else:
                ok = False
            if not ok:
                problems.append(f"{rid} ({uri}) ended {state} with fact {facts.get(rid)}")
        if dead_letters_allowed:  # garbage was sent: what it caused is checked by the caller
            return problems
        dead = self.dead_letters()
        if dead:
            problems.append(f"{dead} message(s) dead-lettered")
        parked = self.parked()
        if parked:
            problems.append(f"parked: {parked[:5]}")
        return problems

    def dead_letters(self) -> int:
        """Messages ever produced to the `_dlq` topics (with a ``scope``: those about its
        queues, and any that names no queue at all)."""
        names = [t.full_name for t in self.topics.dead_letters.values()]
        if self.scope is None:
            return topic_sizes(self.bootstrap, names)
        return sum(1 for topic, value in topic_messages(self.bootstrap, names)
                   if self._concerns(topic, value))

    def parked(self) -> list[tuple[str, str]]:
        """(topic, error) of every parked message (with a ``scope``: those about its
        queues, and any that names no queue at all)."""
        rows = self.query("SELECT topic, error, value FROM parked_message ORDER BY id")
        return [(topic, error) for topic, error, value in rows
                if self._concerns(topic, value)]

    def _concerns(self, topic: str, value: bytes | None) -> bool:
        """Whether a message of ``topic`` is about a queue in ``scope``; one that cannot be
        read, or names no queue, concerns every view (so that none overlooks it)."""
        if self.scope is None:
            return True
        specs = {t.full_name: t for t in (*self.topics.stages.values(),
                                          *self.topics.dead_letters.values())}
        spec = specs.get(topic)
        if spec is None or value is None:
            return True
        try:
            payload = unmarshal(bytes(value), spec.payload)
        except MalformedPayload:
            return True
        queue = getattr(payload, "queue_name", "") or getattr(payload, "queue", "")
        return not queue or queue in self.scope

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of the pipeline's tables: a deployment of its own only."""
        assert self.scope is None, "dump() is of a whole deployment, not of a Lane"
        tables = {"queue": "name", "request": "queue, id", "request_uri": "queue, uri",
                  "build": "queue, id", "validation_fact": "queue, uri, project",
                  "queue_counter": "queue", "parked_message": "id",
                  "command_build": "build_id", "request_plan": "queue, request_id",
                  "project_answer": "queue, request_id, project",
                  "project_state": "queue, project"}
        return {t: self.query(f"SELECT * FROM {t} ORDER BY {order}")
                for t, order in tables.items()}


def topic_sizes(bootstrap: str, topics: list[str]) -> int:
    """Messages ever written to ``topics`` (the sum of their partitions' end offsets)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"sizes-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=10)
        total = 0
        for topic in topics:
            for p in metadata.topics[topic].partitions:
                _, high = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                         timeout=10)
                total += high
        return total
    finally:
        consumer.close()


def topic_messages(bootstrap: str, topics: list[str]) -> list[tuple[str, bytes | None]]:
    """(topic, value) of every message of ``topics`` the broker still keeps."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=10)
        ends: dict[tuple[str, int], tuple[int, int]] = {}
        for topic in topics:
            for p in metadata.topics[topic].partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                           timeout=10)
                if high > low:
                    ends[(topic, p)] = (low, high)
        if not ends:
            return []
        consumer.assign([TopicPartition(t, p, low) for (t, p), (low, _) in ends.items()])
        found: list[tuple[str, bytes | None]] = []
        unread = {tp: high for tp, (_, high) in ends.items()}
        deadline = time.monotonic() + 30
        while unread:
            assert time.monotonic() < deadline, f"{sorted(unread)} not read within 30 s"
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            tp = (str(msg.topic()), int(msg.partition() or 0))
            found.append((tp[0], msg.value()))
            if int(msg.offset() or 0) + 1 >= unread.get(tp, 0):
                unread.pop(tp, None)
        return found
    finally:
        consumer.close()


def group_lag(bootstrap: str, group: str, topics: list[str]) -> int:
    """Messages of `topics` not yet committed by consumer group `group`."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(timeout=10)
        partitions = [TopicPartition(t, p) for t in topics
                      for p in metadata.topics[t].partitions]
        committed = consumer.committed(partitions, timeout=10)
        lag = 0
        for tp in committed:
            low, high = consumer.get_watermark_offsets(tp, timeout=10)
            position = tp.offset if tp.offset >= 0 else low
            lag += max(0, high - position)
        return lag
    finally:
        consumer.close()


def reset_group_to_beginning(bootstrap: str, group: str, topics: list[str]) -> None:
    """What `stovepipe replay --to-beginning` does, for a group with no live member."""
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    metadata = admin.list_topics(timeout=10)
    partitions = [TopicPartition(t, p, 0) for t in topics
                  for p in metadata.topics[t].partitions]
    futures = admin.alter_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group, partitions)])
    for fut in futures.values():
        result = fut.result(timeout=30)
        # Kafka answers per partition (e.g. a live member refuses the reset)
        failed = [tp for tp in result.topic_partitions if tp.error is not None]
        assert not failed, f"offset reset refused: {failed}"


def produce_ingests(bootstrap: str, topics: TopicsConfig, queues: list[str]) -> None:
    from confluent_kafka import Producer

    from contract import IngestRequest, marshal
    from streams.runtime.kafka import producer_conf

    producer = Producer(producer_conf(bootstrap))
    spec = topics.stage("ingest")
    for queue in queues:
        producer.produce(spec.full_name, key=queue.encode(),
                         value=marshal(IngestRequest(queue=queue)))
    assert producer.flush(30) == 0


# -- process groups ------------------------------------------------------------------------

Family = tuple[int | None, list[tuple[int, int]]]  # (process group, [(pid, start time)])


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, start time in clock ticks) of a process; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def _family(proc: subprocess.Popen[bytes]) -> Family:
    """The processes to stop with ``proc``: its process group when it leads one (a worker
    started by `Pipeline.start_worker`), and ``proc`` with its living descendants either
    way — found now, while their parents still live, since orphans lose their ancestry."""
    stats = {int(name): stat for name in os.listdir("/proc") if name.isdigit()
             and (stat := _stat(int(name))) is not None}
    own = stats.get(proc.pid)
    group = proc.pid if own is not None and own[2] == proc.pid else None
    members = {proc.pid} if own is not None else set()
    grew = True
    while grew:
        more = {pid for pid, (_, ppid, pgid, _) in stats.items()
                if pid not in members and (ppid in members or pgid == group)}
        members |= more
        grew = bool(more)
    return group, [(pid, stats[pid][3]) for pid in sorted(members)]


def _alive(family: Family) -> bool:
    group, members = family
    for pid, start in members:
        stat = _stat(pid)
        if stat is not None and stat[3] == start and stat[0] != "Z":
            return True
    if group is None:
        return False
    return any(stat is not None and stat[2] == group and stat[0] != "Z"
               for stat in (_stat(int(name)) for name in os.listdir("/proc")
                            if name.isdigit()))


def _signal(family: Family, sig: int) -> None:
    group, members = family
    if group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
    for pid, start in members:
        stat = _stat(pid)
        if stat is not None and stat[3] == start:  # the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _stop_build_group(state: Path) -> None:
    """SIGKILL the process group of the command build whose state directory is ``state``
    while any process of it lives (started no earlier than the build: not a reused id)."""
    try:
        pgid = int((state / PGID).read_text())
        started = int((state / START_TIME).read_text())
    except (OSError, ValueError):
        return
    members = [pid for name in os.listdir("/proc") if name.isdigit()
               and (stat := _stat(pid := int(name))) is not None
               and stat[2] == pgid and stat[3] >= started and stat[0] != "Z"]
    if members:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        _wait_gone((pgid, []), timeout=30)


def _wait_gone(family: Family, *, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(family):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
