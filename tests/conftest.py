"""Session-scoped real services and per-test isolation.

The broker and database are chosen in this order:
1. ``STOVEPIPE_KAFKA_BOOTSTRAP`` / ``STOVEPIPE_POSTGRES_DSN`` when set;
2. testcontainers, when a Docker engine answers;
3. the local stack (``stovepipe dev up``), started on demand.

Every test gets its own topic-name prefix and its own PostgreSQL schema, so tests can
run in any order and never see each other's data. The exception is by design: the tests
of a module that take a `lane` share one worker, topic set and schema
(`tests.shared_worker`), each with queues of its own and checks that see only those.

No test may leave a process behind. ``PYTEST_STOVEPIPE_SESSION=<uuid>`` is exported before
anything starts, so every process the tests start carries it in its environment (unless
a test hands it a bare environment of its own; those are still found as descendants of
pytest while their parents live). After each test's teardown, the processes started
since the session began that are still alive — descendants of this pytest process, or
carrying this session's marker — are noted with the test that started them (module
fixtures' processes, such as a throwaway stack, are noted with the first test of their
module and are gone once the module's teardown ran). At the end of the session, any of
them still alive after a short grace fails the session: each is named with its test,
then stopped. The shared local stack (`stovepipe dev up`'s Kafka and PostgreSQL, found by
their pid files, with their children) outlives the session by design and is exempt.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from streams.config import settings as settings_mod

if TYPE_CHECKING:
    from tests.pipeline_support import Pipeline
    from tests.shared_worker import Lane, SharedPipeline
    from tests.web_support import WebPipeline

# not STOVEPIPE_*: the command runner hands builds the environment without those
SESSION_ENV = "PYTEST_STOVEPIPE_SESSION"
# exported at import, before any fixture or test starts a process: all of them inherit it
os.environ[SESSION_ENV] = uuid.uuid4().hex
LEFTOVER_GRACE = 15.0  # seconds the session's last processes get to finish stopping
# modules taking minutes, longest first (test-artifacts/module-seconds.txt of a fresh
# clone's `make test`: test_faults 546 s, test_dependency_outages 386, test_hosted_budget
# 329, test_buildkite_runner 199, test_pipeline_e2e 165, test_notify_pipeline 163)
LONGEST_MODULES = ("test_faults.py", "test_dependency_outages.py", "test_hosted_budget.py",
                   "test_buildkite_runner.py", "test_pipeline_e2e.py",
                   "test_notify_pipeline.py", "test_culprits_e2e.py", "test_pin_outcomes.py",
                   "test_liveness.py", "test_demo.py", "test_secure_kafka.py",
                   "test_retention_e2e.py", "test_credentials.py", "test_project_pins.py",
                   "test_restore_replay.py")


# --- no test leaves a process behind ---------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    start: int  # clock ticks after boot: with the pid, it names one process
    state: str

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.start


def _processes() -> dict[int, _Proc]:
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()
        found[int(name)] = _Proc(int(name), int(fields[1]), int(fields[19]), fields[0])
    return found


def _marked(pid: int, mark: bytes) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(raw.decode(errors="replace").split("\0")).strip()[:200] or "?"


@functools.cache
def _shared_stack_pid_files() -> tuple[Path, ...]:
    from streams.devstack.kafka import kafka_paths
    from streams.devstack.postgres import pg_paths

    settings = settings_mod.load_settings()
    return kafka_paths(settings).pid, pg_paths(settings).pid


def _shared_stack_pids() -> set[int]:
    """The local stack's Kafka broker and PostgreSQL postmaster, by their pid files."""
    pids = set()
    for pid_file in _shared_stack_pid_files():
        try:
            first = pid_file.read_text().split("\n", 1)[0].strip()
        except OSError:
            continue
        if first.isdigit():
            pids.add(int(first))
    return pids


class _Leftovers:
    """The processes the tests started, and which test started each (module docstring)."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.mark = f"{SESSION_ENV}={os.environ[SESSION_ENV]}".encode()
        self.before = {p.key for p in _processes().values()}  # not the tests' doing
        self.started_by: dict[tuple[int, int], tuple[str, str]] = {}
        self.found: list[str] = []

    def _ours(self, procs: dict[int, _Proc]) -> list[_Proc]:
        exempt = _shared_stack_pids()
        ours = []
        for proc in procs.values():
            if proc.key in self.before or proc.pid == self.me or proc.state == "Z":
                continue
            ancestors = self._ancestors(proc, procs)
            if exempt & {proc.pid, *ancestors}:
                continue
            if self.me in ancestors or _marked(proc.pid, self.mark):
                ours.append(proc)
        return ours

    @staticmethod
    def _ancestors(proc: _Proc, procs: dict[int, _Proc]) -> list[int]:
        chain, seen = [], {proc.pid}
        parent = procs.get(proc.ppid)
        while parent is not None and parent.pid not in seen:
            chain.append(parent.pid)
            seen.add(parent.pid)
            parent = procs.get(parent.ppid)
        return chain

    def after(self, nodeid: str) -> None:
        """Note the processes still alive after ``nodeid``'s teardown that no earlier test
        started."""
        for proc in self._ours(_processes()):
            if proc.key not in self.started_by:
                self.started_by[proc.key] = (nodeid, _command_line(proc.pid))

    def at_end(self) -> list[str]:
        """What is still alive once every fixture is torn down (after `LEFTOVER_GRACE`
        for processes still stopping), one line each; those processes are then stopped."""
        deadline = time.monotonic() + LEFTOVER_GRACE
        while True:
            alive = self._ours(_processes())
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        lines = []
        for proc in alive:
            test, command = self.started_by.get(
                proc.key, ("the session's own teardown", _command_line(proc.pid)))
            lines.append(f"{test}: pid {proc.pid}: {command}")
        now = _processes()
        for proc in alive:  # the report is made: do not leave them running either
            if proc.pid in now and now[proc.pid].start == proc.start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGKILL)
        return sorted(lines)


_LEFTOVERS = _Leftovers()


def pytest_configure(config: pytest.Config) -> None:
    from tests.shared_worker import MARKERS

    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    try:
        return (yield)
    finally:  # setup, call and teardown of the item are over
        _LEFTOVERS.after(item.nodeid)


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this pytest only hands tests to xdist workers (``make test`` runs several)."""
    return config.pluginmanager.hasplugin("dsession") and not hasattr(config, "workerinput")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _xdist_controller(session.config):
        # each pytest that ran tests looks for what they left; a worker reports it to the
        # controller (`pytest_testnodedown`), which fails the session for it
        found = _LEFTOVERS.at_end()
        _LEFTOVERS.found.extend(found)
        if hasattr(session.config, "workeroutput"):
            session.config.workeroutput["leftovers"] = found
    if _LEFTOVERS.found:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _write_module_seconds(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    _LEFTOVERS.found.extend(getattr(node, "workeroutput", {}).get("leftovers", []))


_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each module's time, setup and teardown included (in a parallel run the controller
    sees every worker's reports): written by `pytest_sessionfinish` for rebalancing
    `LONGEST_MODULES`."""
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def _write_module_seconds(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not _MODULE_SECONDS:
        return
    out = Path(config.rootpath) / "test-artifacts" / "module-seconds.txt"
    with contextlib.suppress(OSError):
        out.parent.mkdir(exist_ok=True)
        out.write_text("".join(f"{seconds:8.1f}  {module}\n" for module, seconds in
                               sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first, so the workers of a parallel run finish together (the
    order is the same in every worker, as xdist requires); the rest keep theirs."""
    rank = {name: n for n, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFTOVERS.found:
        terminalreporter.write_sep("=", "processes left behind by tests", red=True,
                                   bold=True)
        for line in _LEFTOVERS.found:
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            f"{len(_LEFTOVERS.found)} process(es) started by the tests above were still "
            f"alive {LEFTOVER_GRACE:g} s after the session ended (now killed): the session "
            f"fails. Stop what a test starts in its own teardown.")


def _docker_answers() -> bool:
    """True when a Docker engine answers its ping (a client binary alone is not enough)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host.removeprefix("unix://")
            if not os.path.exists(path):
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(2)
            sock.connect(path)
        elif host.startswith("tcp://"):
            hostname, _, port = host.removeprefix("tcp://").partition(":")
            sock = socket.create_connection((hostname, int(port or 2375)), timeout=2)
        else:
            return False
        with sock:
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(1024)
    except (OSError, ValueError):
        return False


class _Services:
    def __init__(self) -> None:
        self.kafka_bootstrap: str | None = os.environ.get(settings_mod.ENV_KAFKA_BOOTSTRAP) or None
        self.postgres_dsn: str | None = os.environ.get(settings_mod.ENV_POSTGRES_DSN) or None
        self._containers: list[object] = []
        self._resolved = False

    def resolve(self) -> None:
        if self._resolved:
            return
        self._resolved = True
        if self.kafka_bootstrap and self.postgres_dsn:
            return
        if os.environ.get("STOVEPIPE_TESTS_NO_DOCKER") != "1" and _docker_answers():
            self._start_containers()
            return
        from streams.devstack import ensure_up

        stack = ensure_up(settings_mod.load_settings(), quiet=True)
        self.kafka_bootstrap = self.kafka_bootstrap or stack.kafka_bootstrap
        self.postgres_dsn = self.postgres_dsn or stack.postgres_dsn

    def _start_containers(self) -> None:
        if not self.kafka_bootstrap:
            from testcontainers.kafka import KafkaContainer

            kafka = KafkaContainer("apache/kafka:4.1.1").with_kraft()
            kafka.start()
            self._containers.append(kafka)
            self.kafka_bootstrap = kafka.get_bootstrap_server()
        if not self.postgres_dsn:
            from testcontainers.postgres import PostgresContainer

            pg = PostgresContainer("postgres:15", username="stovepipe", password="stovepipe",
                                   dbname="stovepipe", driver=None)
            pg.start()
            self._containers.append(pg)
            self.postgres_dsn = pg.get_connection_url()

    def stop(self) -> None:
        for container in reversed(self._containers):
            container.stop()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def services() -> Iterator[_Services]:
    svc = _Services()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(services: _Services) -> str:
    services.resolve()
    assert services.kafka_bootstrap
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def postgres_dsn(services: _Services) -> str:
    services.resolve()
    assert services.postgres_dsn
    return services.postgres_dsn


@pytest.fixture
def topic_prefix(services: _Services) -> Iterator[str]:
    """A prefix no other test uses, so each test has its own topics; they are deleted
    afterwards so a long-lived local broker does not pile up partitions."""
    with _own_topic_prefix(services) as prefix:
        yield prefix


@contextlib.contextmanager
def _own_topic_prefix(services: _Services) -> Iterator[str]:
    prefix = f"t{uuid.uuid4().hex[:10]}."
    try:
        yield prefix
    finally:
        if services.kafka_bootstrap and services._resolved:
            _delete_topics(services.kafka_bootstrap, prefix)


def _delete_topics(bootstrap: str, prefix: str) -> None:
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(prefix)]
    if names:
        for fut in admin.delete_topics(names, operation_timeout=30).values():
            try:
                fut.result(timeout=30)
            except KafkaException as exc:  # the test deleted it already
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise


@pytest.fixture
def schema_dsn(postgres_dsn: str) -> Iterator[str]:
    """A DSN whose search_path is a fresh, empty schema dropped after the test."""
    with _own_schema(postgres_dsn) as dsn:
        yield dsn


@contextlib.contextmanager
def _own_schema(postgres_dsn: str) -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield make_conninfo(postgres_dsn, options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def migrated_dsn(schema_dsn: str) -> str:
    """`schema_dsn` with every migration applied."""
    from store.migrations import migrate

    migrate(schema_dsn)
    return schema_dsn


@pytest.fixture
def pipeline(kafka_bootstrap: str, migrated_dsn: str, topic_prefix: str,
             tmp_path: Path) -> Iterator[Pipeline]:
    """A pipeline of its own (topics, schema, queues, fake repository), workers stopped
    at the end: `tests.pipeline_support.Pipeline`."""
    # deferred: only the end-to-end tests need it, and it pulls in the CLI's settings
    from tests.pipeline_support import Pipeline

    p = Pipeline(bootstrap=kafka_bootstrap, dsn=migrated_dsn, prefix=topic_prefix,
                 root=tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def web(kafka_bootstrap: str, migrated_dsn: str, topic_prefix: str,
        tmp_path: Path) -> Iterator[WebPipeline]:
    """`pipeline` whose workers serve HTTP: `tests.web_support.WebPipeline`."""
    from tests.web_support import WebPipeline

    p = WebPipeline(bootstrap=kafka_bootstrap, dsn=migrated_dsn, prefix=topic_prefix,
                    root=tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def shared_pipeline(request: pytest.FixtureRequest, services: _Services,
                    kafka_bootstrap: str, postgres_dsn: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPipeline]:
    """The module's one worker (topics, schema, consumer group) for its `lane` tests,
    started with every lane's queues and stopped after the module's last test."""
    from store.migrations import migrate
    from tests.shared_worker import SharedPipeline, lane_items

    with _own_schema(postgres_dsn) as dsn, _own_topic_prefix(services) as prefix:
        migrate(dsn)
        shared = SharedPipeline(bootstrap=kafka_bootstrap, dsn=dsn, prefix=prefix,
                                root=tmp_path_factory.mktemp("shared"),
                                items=lane_items(request.session, request.module))
        try:
            shared.start_worker()
            yield shared
        finally:
            shared.close()


@pytest.fixture
def lane(shared_pipeline: SharedPipeline, request: pytest.FixtureRequest) -> Iterator[Lane]:
    """This test's queues on the module's shared worker: `tests.shared_worker.Lane`."""
    yield shared_pipeline.lane(request.node.nodeid)
    shared_pipeline.lane_done(request.node.nodeid)
