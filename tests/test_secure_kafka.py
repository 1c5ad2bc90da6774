"""Stovepipe against a broker that wants TLS and SASL, and a database that wants TLS.

One throwaway stack for the module (`stovepipe dev up --secure`: a broker of its own with
a SASL_SSL listener — SCRAM-SHA-512, SCRAM-SHA-256, PLAIN, OAUTHBEARER — and a listener
that requires a client certificate; PostgreSQL with a certificate of the same dev CA). On
it: the whole pipeline (the CLI's `db migrate`, `topics create|verify`, `ingest`, `fact`,
`dlq list`; a real worker process) over SCRAM-SHA-512, PLAIN and mutual TLS, with the
database reached through `sslmode=verify-full`; a wrong password, which the worker and
the CLI report within seconds, naming authentication; OAUTHBEARER through an OpenID
Connect token endpoint for both Kafka clients; a database whose certificate the given
root does not vouch for, refused with a message naming TLS.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from contract import TopicKey
from streams.config import kafka_access
from streams.config import kafka_security as ks
from streams.config.settings import ENV_KAFKA_BOOTSTRAP, REPO_ROOT
from streams.devstack.postgres import verify_full_dsn
from tests.pipeline_support import STOVEPIPE, Pipeline
from tests.stack_support import ThrowawayStack, describe_run, dev
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.postgres]

REFUSED_WITHIN = 30.0  # seconds; a wrong password is reported long before this
WAYS = ("SCRAM-SHA-512", "PLAIN", "mTLS")


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawayStack]:
    stack = ThrowawayStack(tmp_path_factory.mktemp("secure"), secure=True)
    try:
        stack.up()
        yield stack
    finally:
        stack.teardown()


def client_env(stack: ThrowawayStack, way: str, **changes: str) -> dict[str, str]:
    """The variables a deployment sets to reach the stack's broker `way`."""
    secrets = stack.secrets
    if way == "mTLS":
        env = {ENV_KAFKA_BOOTSTRAP: stack.ssl_bootstrap, ks.ENV_SECURITY_PROTOCOL: "SSL",
               ks.ENV_SSL_CA_LOCATION: str(secrets.ca),
               ks.ENV_SSL_CERTIFICATE_LOCATION: str(secrets.client_cert),
               ks.ENV_SSL_KEY_LOCATION: str(secrets.client_key),
               ks.ENV_SSL_KEY_PASSWORD: secrets.client_key_password()}
    else:
        env = {ENV_KAFKA_BOOTSTRAP: stack.sasl_ssl_bootstrap,
               ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: way,
               ks.ENV_SASL_USERNAME: "stovepipe", ks.ENV_SASL_PASSWORD: secrets.kafka_password(),
               ks.ENV_SSL_CA_LOCATION: str(secrets.ca)}
    return {**env, **changes}


@contextlib.contextmanager
def tls_schema(stack: ThrowawayStack) -> Iterator[str]:
    """A fresh schema of the stack's database, as a verify-full DSN."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(stack.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield make_conninfo(verify_full_dsn(stack.postgres_port, stack.secrets),
                            options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(stack.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@contextlib.contextmanager
def secure_pipeline(stack: ThrowawayStack, way: str, root: Path,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[Pipeline]:
    """A pipeline whose every process (and this test's own clients) reaches the broker
    `way` and the database through verify-full."""
    env = client_env(stack, way)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with tls_schema(stack) as dsn:
        pipeline = Pipeline(bootstrap=env[ENV_KAFKA_BOOTSTRAP], dsn=dsn,
                            prefix=f"sec-{uuid.uuid4().hex[:6]}.", root=root)
        try:
            yield pipeline
        finally:
            pipeline.close()


def _timed(pipeline: Pipeline, *args: str, **env: str
           ) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    out = subprocess.run([*STOVEPIPE, *args], env={**pipeline.env, **env}, capture_output=True,
                         text=True, timeout=120, cwd=REPO_ROOT)
    return out, time.monotonic() - started


@pytest.mark.parametrize("way", WAYS)
def test_the_whole_pipeline_over_a_secure_listener(secure: ThrowawayStack, way: str,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with secure_pipeline(secure, way, tmp_path, monkeypatch) as p:
        migrated = p.cli("db", "migrate")  # the store over sslmode=verify-full
        assert "Traceback" not in migrated.stderr
        # the CLI's admin client creates and verifies topics over the listener
        other = f"{p.prefix}cli."
        created = p.cli("topics", "create", "--prefix", other)
        assert created.stdout.count("created ") == len(p.topics.all_topics()), created.stdout
        assert p.cli("topics", "verify", "--prefix", other).returncode == 0

        ref = p.add_queue("team/main")
        p.repo.push(ref, "a1")
        p.start_worker()
        rid = p.ingest("team/main")  # aiokafka's producer, from the CLI
        assert rid == "request/team/main/1"
        p.wait_quiet()
        assert p.request(rid)["request"]["state"] == "succeeded"
        assert p.cli("fact", "team/main", f"fake://r/{ref}/a1").returncode == 0

        # a dead letter produced by this test's confluent-kafka producer, read back by
        # the CLI's reader
        from confluent_kafka import Producer

        from streams.runtime.kafka import producer_conf
        dlq = p.topics.dead_letter(TopicKey.PROCESS).full_name
        producer = Producer(producer_conf(p.bootstrap))
        producer.produce(dlq, key=b"team/main", value=b"not a payload")
        assert producer.flush(30) == 0
        del producer  # its connections close now, not when the broker is long gone
        listed = json.loads(p.cli("dlq", "list", "process", "--json").stdout)
        assert (listed["topic"], listed["total"]) == (dlq, 1)


def test_a_wrong_password_is_named_within_seconds(secure: ThrowawayStack, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the worker nor a command waits on a broker that refuses the password: each
    stops within seconds with one line naming authentication and the variables."""
    with secure_pipeline(secure, "SCRAM-SHA-512", tmp_path, monkeypatch) as p:
        p.cli("db", "migrate")
        p.add_queue("team/main")
        wrong = {ks.ENV_SASL_PASSWORD: "not-the-password"}

        started = time.monotonic()
        worker = p.start_worker(env=wrong)
        wait_until(lambda: worker.poll() is not None, timeout=REFUSED_WITHIN,
                   what="the worker to give up")
        worker_took = time.monotonic() - started
        log = p.logs()
        assert worker.returncode == 1, log
        assert "refused authentication as SCRAM-SHA-512 user 'stovepipe'" in log, log
        assert ks.ENV_SASL_PASSWORD in log and "Traceback" not in log, log

        took = {"worker": worker_took}
        for args in (("ingest", "team/main"), ("topics", "verify"),
                     ("dlq", "list", "process")):
            out, took[args[0]] = _timed(p, *args, **wrong)
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            assert out.returncode == 1, describe_run(out)
            assert len(lines) == 1 and "refused authentication" in lines[0], describe_run(out)
            assert ks.ENV_SASL_PASSWORD in lines[0], lines
        print("wrong password reported after " + ", ".join(
            f"{what} {seconds:.1f} s" for what, seconds in took.items()))
        assert max(took.values()) < REFUSED_WITHIN, took


def test_a_client_without_certificate_is_named(secure: ThrowawayStack, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with secure_pipeline(secure, "mTLS", tmp_path, monkeypatch) as p:
        out, _ = _timed(p, "topics", "verify", **{ks.ENV_SSL_CERTIFICATE_LOCATION: "",
                                                  ks.ENV_SSL_KEY_LOCATION: "",
                                                  ks.ENV_SSL_KEY_PASSWORD: ""})
        assert out.returncode == 1, describe_run(out)
        assert "TLS with Kafka" in out.stderr, describe_run(out)
        assert ks.ENV_SSL_CERTIFICATE_LOCATION in out.stderr, describe_run(out)


def test_the_database_refuses_a_root_it_cannot_vouch_for(secure: ThrowawayStack,
                                                         tmp_path: Path) -> None:
    other_ca = tmp_path / "other-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(tmp_path / "other-ca.key"), "-out", str(other_ca), "-days", "2",
                    "-subj", "/CN=Another CA"], check=True, capture_output=True, timeout=60)
    good = verify_full_dsn(secure.postgres_port, secure.secrets)
    with psycopg.connect(good, connect_timeout=10) as conn:
        row = conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone()
        assert row == (True,)
    wrong = good.replace(str(secure.secrets.ca), str(other_ca))
    env = dict(secure.env, STOVEPIPE_POSTGRES_DSN=wrong)
    out = subprocess.run([*STOVEPIPE, "db", "status"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 1, describe_run(out)
    assert "TLS with PostgreSQL" in out.stderr, describe_run(out)
    assert "certificate verify failed" in out.stderr and "sslrootcert" in out.stderr


def test_dev_status_checks_the_secure_listener(secure: ThrowawayStack) -> None:
    again = dev(secure.env, "up", "--secure")  # reuses both; PostgreSQL's TLS is reloaded
    assert again.returncode == 0, describe_run(again)
    assert again.stdout.count("already running") == 2, describe_run(again)
    assert f"export {ks.ENV_SECURITY_PROTOCOL}=SASL_SSL" in again.stdout, describe_run(again)
    with psycopg.connect(verify_full_dsn(secure.postgres_port, secure.secrets),
                         connect_timeout=10) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    healthy = dev({**secure.env, **client_env(secure, "SCRAM-SHA-512")}, "status")
    assert healthy.returncode == 0, describe_run(healthy)
    refused = dev({**secure.env, **client_env(secure, "SCRAM-SHA-512",
                                              **{ks.ENV_SASL_PASSWORD: "wrong"})}, "status")
    assert refused.returncode == 1, describe_run(refused)
    assert "refused authentication" in refused.stdout, describe_run(refused)


# --- OAUTHBEARER ---------------------------------------------------------------------------


class _TokenEndpoint(BaseHTTPRequestHandler):
    """An OpenID Connect token endpoint for one client: unsigned JWTs, which the dev
    broker's OAUTHBEARER listener accepts."""

    client = ("stovepipe-worker", "s3cret")
    grants: list[str] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()
        basic = self.headers.get("Authorization", "").removeprefix("Basic ")
        user, _, password = base64.b64decode(basic).decode().partition(":")
        self.grants.append(body)
        if (user, password) != self.client:
            self.send_response(401)
            self.end_headers()
            return
        now = int(time.time())
        token = ".".join([_b64({"alg": "none"}),
                          _b64({"sub": user, "iat": now, "exp": now + 600}), ""])
        answer = json.dumps({"access_token": token, "token_type": "bearer",
                             "expires_in": 600}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


@pytest.fixture
def token_endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/token"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_oauthbearer_through_oidc_for_both_clients(secure: ThrowawayStack,
                                                   token_endpoint: str) -> None:
    """One message from aiokafka to librdkafka, both signed in with a token of the same
    OIDC endpoint; a wrong client secret is named by each."""
    from aiokafka import AIOKafkaProducer
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    def oauth(secret: str) -> ks.KafkaSecurity:
        return ks.KafkaSecurity.from_env({
            ks.ENV_SECURITY_PROTOCOL: "SASL_SSL", ks.ENV_SASL_MECHANISM: "OAUTHBEARER",
            ks.ENV_SSL_CA_LOCATION: str(secure.secrets.ca),
            ks.ENV_OAUTHBEARER_CLIENT_ID: "stovepipe-worker",
            ks.ENV_OAUTHBEARER_CLIENT_SECRET: secret,
            ks.ENV_OAUTHBEARER_TOKEN_ENDPOINT_URL: token_endpoint,
            ks.ENV_OAUTHBEARER_SCOPE: "kafka"})

    security, bootstrap = oauth("s3cret"), secure.sasl_ssl_bootstrap
    topic = f"oauth-{uuid.uuid4().hex[:8]}"
    admin = AdminClient(ks.librdkafka_conf(bootstrap, security))
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)

    async def produce() -> None:
        producer = AIOKafkaProducer(**ks.aiokafka_conf(bootstrap, security))
        await producer.start()
        try:
            await producer.send_and_wait(topic, b"over OAUTHBEARER", key=b"k")
        finally:
            await producer.stop()

    asyncio.run(produce())
    consumer = Consumer(ks.librdkafka_conf(bootstrap, security, **{
        "group.id": f"oauth-{uuid.uuid4().hex}", "enable.auto.commit": False}))
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        message = None
        deadline = time.monotonic() + 30
        while message is None and time.monotonic() < deadline:
            message = consumer.poll(0.5)
        assert message is not None and message.error() is None
        assert message.value() == b"over OAUTHBEARER"
    finally:
        consumer.close()
        admin.delete_topics([topic])[topic].result(timeout=30)
        del admin  # its connections close now, not at the next garbage collection
    assert "grant_type=client_credentials&scope=kafka" in _TokenEndpoint.grants

    wrong = oauth("not-the-secret")
    with pytest.raises(ks.KafkaAccessError, match="refused authentication as OAUTHBEARER"):
        kafka_access.check_librdkafka_access(bootstrap, wrong, timeout=REFUSED_WITHIN)
    with pytest.raises(ks.KafkaAccessError, match="HTTP 401"):
        asyncio.run(kafka_access.check_aiokafka_access(bootstrap, wrong, connect_within=10))
