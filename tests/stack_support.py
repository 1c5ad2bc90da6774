"""A throwaway second stack — Kafka and PostgreSQL of its own, on free ports, with its own
`STOVEPIPE_HOME` — for tests that start, stop or kill the services (test_devstack,
test_faults), or need the secure listeners of `dev up --secure` (test_secure_kafka), and
must never touch the shared stack other tests use. The broker jars are
copied from the default cache when it has them (no Maven run); a `mvn` wrapper on PATH
records every Maven invocation."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from streams.config import settings as settings_mod
from streams.devstack import (
    ENV_DEV_KAFKA_CONTROLLER_PORT,
    ENV_DEV_KAFKA_PORT,
    ENV_DEV_POSTGRES_PORT,
    KAFKA_VERSION,
    postgres_root,
)
from streams.devstack.common import pid_alive, read_pid
from streams.devstack.env import ENV_DEV_KAFKA_SASL_SSL_PORT, ENV_DEV_KAFKA_SSL_PORT
from streams.devstack.tls import DevSecrets

STOVEPIPE = Path(sys.executable).parent / "stovepipe"
CALL_TIMEOUT = 180


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def base_env(home: Path, ports: list[int], path_prefix: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in (settings_mod.ENV_KAFKA_BOOTSTRAP, settings_mod.ENV_POSTGRES_DSN)}
    env[settings_mod.ENV_HOME] = str(home)
    env[ENV_DEV_KAFKA_PORT], env[ENV_DEV_KAFKA_CONTROLLER_PORT], env[ENV_DEV_POSTGRES_PORT] = (
        str(port) for port in ports
    )
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env.get('PATH', '')}"
    return env


def dev(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(STOVEPIPE), "dev", *args], env=env, capture_output=True,
                         text=True, timeout=CALL_TIMEOUT, check=False)
    assert "Traceback" not in out.stderr, out.stderr
    return out


def describe_run(out: subprocess.CompletedProcess[str]) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout}--- stderr\n{out.stderr}"


class ThrowawayStack:
    """With ``secure``, `up` is `dev up --secure`: SASL_SSL and mutual-TLS listeners on
    ports of their own, PostgreSQL with TLS, certificates of the stack's own CA."""

    def __init__(self, root: Path, *, secure: bool = False) -> None:
        self.home = root / "home"
        self.secure = secure
        self.ports = free_ports(3)
        self.kafka_port, self.controller_port, self.postgres_port = self.ports
        self.sasl_ssl_port, self.ssl_port = free_ports(2)
        self.sasl_ssl_bootstrap = f"127.0.0.1:{self.sasl_ssl_port}"
        self.ssl_bootstrap = f"127.0.0.1:{self.ssl_port}"
        self.secrets = DevSecrets(self.home / "dev" / "secure")
        self.bootstrap = f"127.0.0.1:{self.kafka_port}"
        self.dsn = f"postgresql://stovepipe@127.0.0.1:{self.postgres_port}/stovepipe"
        self.mvn_calls = root / "mvn-calls"
        bindir = root / "bin"
        bindir.mkdir()
        real_mvn = shutil.which("mvn")
        wrapper = bindir / "mvn"
        wrapper.write_text(
            "#!/bin/sh\n"
            f"echo \"$*\" >> '{self.mvn_calls}'\n"
            + (f"exec '{real_mvn}' \"$@\"\n" if real_mvn else "exit 127\n")
        )
        wrapper.chmod(0o755)
        self.env = base_env(self.home, self.ports, bindir)
        self.env[ENV_DEV_KAFKA_SASL_SSL_PORT] = str(self.sasl_ssl_port)
        self.env[ENV_DEV_KAFKA_SSL_PORT] = str(self.ssl_port)
        self.settings = dataclasses.replace(settings_mod.load_settings(), home=self.home)
        self.cache_copied = self._reuse_default_cache()

    def _reuse_default_cache(self) -> bool:
        name = f"kafka-{KAFKA_VERSION}"
        default = Path.home() / ".stovepipe" / "cache" / name
        if not (default / ".complete").is_file() or not (default / "libs").is_dir():
            return False
        target = self.home / "cache" / name
        shutil.copytree(default / "libs", target / "libs")
        shutil.copy2(default / ".complete", target / ".complete")
        return True

    def mvn_call_count(self) -> int:
        try:
            return len(self.mvn_calls.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def kafka_pid(self) -> int | None:
        return read_pid(self.home / "dev" / "kafka" / "kafka.pid")

    def postgres_pid(self) -> int | None:
        return read_pid(postgres_root(self.settings) / "data" / "postmaster.pid")

    def up(self, deadline: float = 120.0) -> None:
        """`dev up` until both services answer: after a SIGKILL, PostgreSQL refuses to start
        while the killed postmaster's backends are still leaving."""
        started = time.monotonic()
        while True:
            out = dev(self.env, "up", *(["--secure"] if self.secure else []))
            if out.returncode == 0:
                return
            if time.monotonic() - started > deadline:
                raise AssertionError(describe_run(out))
            threading.Event().wait(1.0)  # the old backends go within a few seconds

    def kill_kafka(self) -> None:
        pid = self.kafka_pid()
        assert pid is not None and pid_alive(pid)
        os.kill(pid, signal.SIGKILL)

    def kill_postgres(self) -> None:
        pid = self.postgres_pid()
        assert pid is not None and pid_alive(pid)
        os.kill(pid, signal.SIGKILL)

    def teardown(self) -> None:
        try:
            dev(self.env, "down")
        finally:
            pid = self.kafka_pid()  # should be gone; never leave a broker behind
            if pid is not None and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(postgres_root(self.settings), ignore_errors=True)
