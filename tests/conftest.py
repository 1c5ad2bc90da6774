"""Session-scoped real services and per-test isolation.

The broker and database are chosen in this order:
1. ``STOVEPIPE_KAFKA_BOOTSTRAP`` / ``STOVEPIPE_POSTGRES_DSN`` when set;
2. testcontainers, when a Docker engine answers;
3. the local stack (``stovepipe dev up``), started on demand.

Every test gets its own topic-name prefix and its own PostgreSQL schema, so tests can
run in any order and never see each other's data.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from streams.config import settings as settings_mod

if TYPE_CHECKING:
    from tests.pipeline_support import Pipeline
    from tests.web_support import WebPipeline


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
    prefix = f"t{uuid.uuid4().hex[:10]}."
    yield prefix
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
        p.stop_workers()


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
        p.stop_workers()
