"""`stovepipe dev up | down | status` with real processes, on a throwaway second stack.

The stack under test has its own `STOVEPIPE_HOME` (a temporary directory) and free ports,
so it never touches the default stack (19092/15432) other people use. The broker jars are
copied from the default cache when it has them (no Maven run); a `mvn` wrapper on PATH
records every Maven invocation, so the tests can assert that a cached start runs none.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from streams.config import settings as settings_mod
from streams.devstack import ENV_DEV_KAFKA_PORT
from streams.devstack.common import pid_alive
from tests.stack_support import ThrowawayStack, base_env, describe_run, dev, free_ports


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThrowawayStack]:
    throwaway = ThrowawayStack(tmp_path_factory.mktemp("devstack"))
    try:
        yield throwaway
    finally:
        throwaway.teardown()


@pytest.mark.slow
def test_up_twice_status_down_and_cached_restart(stack: ThrowawayStack) -> None:
    first = dev(stack.env, "up")
    assert first.returncode == 0, describe_run(first)
    assert f"started, bootstrap {stack.bootstrap}" in first.stdout, describe_run(first)
    assert f"started, dsn {stack.dsn}" in first.stdout, describe_run(first)
    assert "server.log" in first.stdout and "postgres.log" in first.stdout
    assert "Stack ready in" in first.stdout
    assert stack.mvn_call_count() == (0 if stack.cache_copied else 1)
    kafka_pid, postgres_pid = stack.kafka_pid(), stack.postgres_pid()
    assert kafka_pid and pid_alive(kafka_pid)
    assert postgres_pid and pid_alive(postgres_pid)

    # Both services really answer, with the configuration the stack promises.
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": stack.bootstrap})
    assert admin.list_topics(timeout=10).brokers
    resource = ConfigResource(ConfigResource.Type.BROKER, "1")
    config = admin.describe_configs([resource])[resource].result(timeout=10)
    assert config["auto.create.topics.enable"].value == "false"
    with psycopg.connect(stack.dsn, connect_timeout=5) as conn:
        assert conn.execute("SELECT current_user, current_database()").fetchone() == (
            "stovepipe", "stovepipe")

    # Idempotent: the second call reuses both processes and is quick.
    started = time.monotonic()
    second = dev(stack.env, "up")
    assert second.returncode == 0, describe_run(second)
    assert time.monotonic() - started < 10
    assert second.stdout.count("already running") == 2, describe_run(second)
    assert (stack.kafka_pid(), stack.postgres_pid()) == (kafka_pid, postgres_pid)

    status = dev(stack.env, "status")
    assert status.returncode == 0, describe_run(status)
    assert status.stdout.count("healthy") == 2 and "UNHEALTHY" not in status.stdout

    down = dev(stack.env, "down")
    assert down.returncode == 0, describe_run(down)
    assert down.stdout.count("stopped (pid") == 2, describe_run(down)
    assert not pid_alive(kafka_pid) and not pid_alive(postgres_pid)

    after = dev(stack.env, "status")
    assert after.returncode == 1, describe_run(after)
    assert after.stdout.count("not running") == 2, describe_run(after)

    again = dev(stack.env, "down")
    assert again.returncode == 0, describe_run(again)
    assert again.stdout.count("not running") == 2, describe_run(again)

    # Restart from the cache: no Maven, storage not formatted again.
    calls = stack.mvn_call_count()
    restart = dev(stack.env, "up")
    assert restart.returncode == 0, describe_run(restart)
    assert stack.mvn_call_count() == calls
    assert "Maven" not in restart.stdout and "formatting" not in restart.stdout
    assert "initdb" not in restart.stdout
    assert restart.stdout.count("started,") == 2, describe_run(restart)


@pytest.mark.slow
def test_endpoints_from_the_environment_start_nothing(
    stack: ThrowawayStack, tmp_path: Path
) -> None:
    assert dev(stack.env, "up").returncode == 0
    ports = free_ports(3)
    env = base_env(tmp_path / "home", ports)
    env[settings_mod.ENV_KAFKA_BOOTSTRAP] = stack.bootstrap
    env[settings_mod.ENV_POSTGRES_DSN] = stack.dsn

    up = dev(env, "up")
    assert up.returncode == 0, describe_run(up)
    assert f"using {stack.bootstrap} from {settings_mod.ENV_KAFKA_BOOTSTRAP}" in up.stdout
    assert f"using {stack.dsn} from {settings_mod.ENV_POSTGRES_DSN}" in up.stdout
    assert "started," not in up.stdout
    assert not (tmp_path / "home" / "dev" / "kafka").exists()
    assert not any(_listening(port) for port in ports)

    status = dev(env, "status")
    assert status.returncode == 0, describe_run(status)
    assert status.stdout.count("healthy") == 2, describe_run(status)

    env[settings_mod.ENV_KAFKA_BOOTSTRAP] = f"127.0.0.1:{ports[0]}"  # nothing listens
    dead = dev(env, "status")
    assert dead.returncode == 1, describe_run(dead)
    assert "UNHEALTHY" in dead.stdout

    down = dev(env, "down")
    assert down.returncode == 0, describe_run(down)
    assert pid_alive(stack.kafka_pid() or 0), "down must not stop an external broker"


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_port_taken_is_a_clear_error(tmp_path: Path) -> None:
    env = base_env(tmp_path / "home", free_ports(3))
    env[settings_mod.ENV_POSTGRES_DSN] = "postgresql://nobody@127.0.0.1:1/none"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(env[ENV_DEV_KAFKA_PORT])))
        squatter.listen()
        out = dev(env, "up")
    assert out.returncode == 1, describe_run(out)
    assert f"Port {env[ENV_DEV_KAFKA_PORT]} on 127.0.0.1" in out.stderr
    assert ENV_DEV_KAFKA_PORT in out.stderr


def test_down_ignores_a_stale_pid_file(tmp_path: Path) -> None:
    env = base_env(tmp_path / "home", free_ports(3))
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        pid_file = tmp_path / "home" / "dev" / "kafka" / "kafka.pid"
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(f"{bystander.pid}\n")
        out = dev(env, "down")
        assert out.returncode == 0, describe_run(out)
        assert "stale pid file" in out.stdout
        assert bystander.poll() is None, "down killed a process it did not start"
        assert not pid_file.exists()
    finally:
        bystander.kill()
        bystander.wait()
