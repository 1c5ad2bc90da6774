"""The dev-stack Kafka broker: Apache Kafka from Maven Central, single node, KRaft.

Layout under `<settings.home>`:

    cache/kafka-<ver>/pom.xml, libs/*.jar, .complete   jars, fetched once by Maven
    dev/kafka/server.properties, log4j2.properties     written on every start
    dev/kafka/data/                                    log.dirs (formatted once)
    dev/kafka/logs/server.log, kafka.out               broker log, JVM stdout/stderr
    dev/kafka/kafka.pid                                pid of the running broker

`stovepipe dev up --secure` adds two listeners beside the PLAINTEXT one (which the broker's
own traffic keeps using): SASL_SSL (SCRAM-SHA-512, SCRAM-SHA-256 and PLAIN for the user
`stovepipe`, OAUTHBEARER with unsigned tokens) and SSL that requires a client certificate,
both with certificates of the dev CA (`streams.devstack.tls`). SCRAM credentials are
written through the admin API on every secure start, so a broker formatted before works.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import string
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from streams.config.kafka_access import check_librdkafka_access
from streams.config.kafka_security import (
    KafkaAccessError,
    KafkaSecurity,
    KafkaSecurityError,
)
from streams.config.settings import ENV_KAFKA_BOOTSTRAP, Settings

from . import env
from .common import (
    DevStackError,
    Echo,
    ServiceStatus,
    ServiceUp,
    log_hint,
    pid_alive,
    port_answers,
    port_free,
    port_taken_message,
    process_cmdline,
    read_pid,
    tail,
    terminate,
    write_text_atomic,
)
from .kafka_install import (
    LABEL,
    check_java,
    ensure_libs,
    find_java,
    resource_text,
)
from .kafka_secure import (
    PLAINTEXT,
    SecureListeners,
    ensure_scram_user,
    sasl_ssl_security,
    wanted_secure_listeners,
)
from .tls import KAFKA_USER, DevSecrets

JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)
# The storage tool runs for a second: a small heap and no C2 compiler start it faster.
TOOL_JVM_OPTIONS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
MAIN_CLASS = "kafka.Kafka"
STORAGE_TOOL = "kafka.tools.StorageTool"



# librdkafka logs every refused connection; a probe must stay silent.
_SILENT = logging.getLogger("streams.devstack.kafka.probe")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


@dataclass(frozen=True)
class KafkaPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "server.properties"

    @property
    def log4j(self) -> Path:
        return self.root / "log4j2.properties"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def server_log(self) -> Path:
        return self.logs / "server.log"

    @property
    def stdout_log(self) -> Path:
        return self.logs / "kafka.out"

    @property
    def pid(self) -> Path:
        return self.root / "kafka.pid"


def kafka_paths(settings: Settings) -> KafkaPaths:
    return KafkaPaths(settings.home / "dev" / "kafka")


def local_bootstrap() -> str:
    return f"127.0.0.1:{env.kafka_port()}"


def _java_args(libs: Path, paths: KafkaPaths) -> list[str]:
    """The JVM arguments every Kafka command of the stack shares (logging, class path)."""
    return [
        f"-Dlog4j2.configurationFile={paths.log4j}",
        f"-Dkafka.logs.dir={paths.logs}",
        "-cp",
        f"{libs}/*",
    ]


# --- configuration and storage ---------------------------------------------------------


def write_config(paths: KafkaPaths, kafka_port: int, controller_port: int,
                 secure: tuple[SecureListeners, DevSecrets] | None = None) -> None:
    for directory in (paths.root, paths.data, paths.logs):
        directory.mkdir(parents=True, exist_ok=True)
    listeners = ""
    if secure is not None:
        ports = secure[0]
        listeners = (f",SASL_SSL://127.0.0.1:{ports.sasl_ssl_port}"
                     f",SSL://127.0.0.1:{ports.ssl_port}")
    config = string.Template(resource_text("kafka-server.properties")).substitute(
        kafka_port=kafka_port, controller_port=controller_port, data_dir=paths.data,
        secure_listeners=listeners,
    )
    if secure is not None:
        ports, secrets = secure
        config += string.Template(resource_text("kafka-secure.properties")).substitute(
            sasl_ssl_port=ports.sasl_ssl_port, ssl_port=ports.ssl_port,
            secrets_dir=secrets.root, keystore=secrets.kafka_keystore, ca=secrets.ca,
            user=KAFKA_USER, password=secrets.kafka_password())
    write_text_atomic(paths.config, config)
    paths.config.chmod(0o600)  # the PLAIN user's password
    write_text_atomic(paths.log4j, resource_text("kafka-log4j2.properties"))


def _listener_ports(paths: KafkaPaths) -> dict[str, int]:
    """Listener name → port of the `listeners=` line of the broker's server.properties."""
    try:
        text = paths.config.read_text()
    except OSError:
        return {}
    line = re.search(r"^listeners=(.*)$", text, re.M)
    found = re.findall(r"([A-Z_]+)://[^:,]+:(\d+)", line.group(1) if line else "")
    return {name: int(port) for name, port in found}


def configured_ports(paths: KafkaPaths) -> tuple[int, int] | None:
    """(broker port, controller port) in the broker's current server.properties."""
    ports = _listener_ports(paths)
    if "PLAINTEXT" not in ports or "CONTROLLER" not in ports:
        return None
    return ports["PLAINTEXT"], ports["CONTROLLER"]


def configured_secure_listeners(paths: KafkaPaths) -> SecureListeners | None:
    """The secure listeners in the broker's current server.properties, if it has them."""
    ports = _listener_ports(paths)
    if "SASL_SSL" not in ports or "SSL" not in ports:
        return None
    return SecureListeners(ports["SASL_SSL"], ports["SSL"])


def _storage_tool(java: str, libs: Path, paths: KafkaPaths, *args: str) -> str:
    cmd = [java, *TOOL_JVM_OPTIONS, *_java_args(libs, paths), STORAGE_TOOL, *args]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, check=False,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise DevStackError(f"`{STORAGE_TOOL} {args[0]}` did not finish in 120 s.") from None
    if out.returncode != 0:
        raise DevStackError(
            f"Formatting the Kafka storage failed: `{STORAGE_TOOL} {' '.join(args)}` "
            f"exited with {out.returncode}:\n{(out.stdout + out.stderr).strip()}"
        )
    return out.stdout


def ensure_formatted(java: str, libs: Path, paths: KafkaPaths, echo: Echo) -> None:
    """Format the data dir (static quorum, so no --standalone) unless it already is."""
    if (paths.data / "meta.properties").is_file():
        return
    echo(f"{LABEL}: formatting storage in {paths.data} ...")
    # No meta.properties: never formatted (or an interrupted format) - nothing to keep.
    shutil.rmtree(paths.data, ignore_errors=True)
    paths.data.mkdir(parents=True)
    lines = _storage_tool(java, libs, paths, "random-uuid").split()
    if not lines:
        raise DevStackError(f"`{STORAGE_TOOL} random-uuid` printed nothing.")
    _storage_tool(java, libs, paths, "format", "-t", lines[-1], "-c", str(paths.config))


# --- process ---------------------------------------------------------------------------


def running_pid(paths: KafkaPaths) -> int | None:
    """The pid of the broker the pid file names, if that broker still runs."""
    pid = read_pid(paths.pid)
    if pid is None or not pid_alive(pid):
        return None
    cmdline = process_cmdline(pid)
    if cmdline is not None and (MAIN_CLASS not in cmdline or str(paths.config) not in cmdline):
        return None  # the pid was reused by another process
    return pid


def _child_exit_code(pid: int) -> int | None:
    """The exit code of our own child `pid` if it has exited, else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None if pid_alive(pid) else -1
    if done != pid:
        return None
    return os.waitstatus_to_exitcode(status)


def _spawn(cmd: list[str], paths: KafkaPaths) -> int:
    """Start `cmd` detached: own session, stdin from /dev/null, output to kafka.out."""
    out = paths.stdout_log
    if out.exists() and out.stat().st_size:
        out.replace(out.with_name(out.name + ".1"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(out), flags, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    # posix_spawn leaves no Popen object behind to warn about a still-running child; the
    # shell only changes directory (thread-safe, unlike os.chdir) and execs the JVM in place.
    argv = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', str(paths.root), *cmd]
    return os.posix_spawn(argv[0], argv, dict(os.environ), file_actions=actions, setsid=True)


def _some_server_accepts(bootstrap: str, timeout: float) -> bool:
    """False only when no `host:port` of `bootstrap` accepts a TCP connection."""
    for entry in bootstrap.split(","):
        host, _, port = entry.strip().rpartition("://")[2].rpartition(":")
        if not host or not port.isdigit():
            return True  # a form we do not parse: let the client judge
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                return True
        except OSError:
            continue
    return False


def probe(bootstrap: str, timeout: float = 5.0,
          security: KafkaSecurity | None = None) -> tuple[bool, str]:
    """Ask the broker for its metadata as a client with `security` (else the security the
    environment asks for): (answers, detail)."""
    try:
        security = security or KafkaSecurity.from_env()
    except KafkaSecurityError as exc:
        return False, str(exc)
    if not _some_server_accepts(bootstrap, min(timeout, 2.0)):
        return False, "does not answer (no bootstrap server accepts connections)"
    try:
        metadata = check_librdkafka_access(bootstrap, security, timeout=timeout)
    except KafkaAccessError as exc:
        return False, str(exc)
    except TimeoutError as exc:
        return False, f"does not answer ({exc})"
    if not metadata.brokers:
        return False, "answers, but reports no brokers"
    topics = sum(1 for name in metadata.topics if not name.startswith("__"))
    return True, f"{len(metadata.brokers)} broker(s), {topics} topic(s)"


def _logs_hint(paths: KafkaPaths) -> str:
    hint = log_hint(paths.server_log, 20)
    jvm_out = tail(paths.stdout_log, 15)
    if jvm_out:
        hint += f"\nJVM output ({paths.stdout_log}):\n{jvm_out}"
    return hint


def _wait_ready(bootstrap: str, port: int, pid: int, paths: KafkaPaths, own_child: bool) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        code = _child_exit_code(pid) if own_child else (None if pid_alive(pid) else -1)
        if code is not None:
            paths.pid.unlink(missing_ok=True)
            how = f" with exit code {code}" if code >= 0 else ""
            raise DevStackError(
                f"The Kafka broker (pid {pid}) exited{how} while starting. {_logs_hint(paths)}"
            )
        remaining = deadline - time.monotonic()
        if port_answers(port) and probe(bootstrap, timeout=max(1.0, min(5.0, remaining)),
                                        security=PLAINTEXT)[0]:
            return
        if time.monotonic() >= deadline:
            raise DevStackError(
                f"The Kafka broker (pid {pid}) did not answer on {bootstrap} within "
                f"{START_TIMEOUT:.0f} s; it may still be starting (`stovepipe dev down` stops "
                f"it). {_logs_hint(paths)}"
            )
        time.sleep(0.2)


def ensure_kafka(settings: Settings, echo: Echo, secrets: DevSecrets | None = None
                 ) -> ServiceUp:
    """Reuse the running dev broker or start one; return once it answers. With `secrets`
    (`dev up --secure`), once its secure listeners accept the dev user too."""
    if settings.kafka_from_env:
        return ServiceUp("kafka", LABEL, settings.kafka_bootstrap, "external")
    paths = kafka_paths(settings)
    port, controller_port = env.kafka_port(), env.kafka_controller_port()
    secure = wanted_secure_listeners() if secrets is not None else None
    bootstrap = f"127.0.0.1:{port}"
    pid = running_pid(paths)
    if pid is not None:
        ports = configured_ports(paths)
        if ports is not None and ports != (port, controller_port):
            raise DevStackError(
                f"The dev-stack Kafka broker (pid {pid}) runs on ports {ports[0]}/{ports[1]}, "
                f"not {port}/{controller_port}. Run `stovepipe dev down`, then "
                "`stovepipe dev up` again."
            )
        running_secure = configured_secure_listeners(paths)
        if secure is not None and running_secure != secure:
            how = ("without secure listeners" if running_secure is None else
                   f"with secure listeners on ports {running_secure.sasl_ssl_port}/"
                   f"{running_secure.ssl_port}, not {secure.sasl_ssl_port}/{secure.ssl_port}")
            raise DevStackError(
                f"The dev-stack Kafka broker (pid {pid}) runs {how}. Run `stovepipe dev "
                f"down`, then `stovepipe dev up --secure`.")
        _wait_ready(bootstrap, port, pid, paths, own_child=False)
        action = "reused"
    else:
        wanted = [(port, "the Kafka broker", env.ENV_DEV_KAFKA_PORT),
                  (controller_port, "the Kafka controller", env.ENV_DEV_KAFKA_CONTROLLER_PORT)]
        if secure is not None:
            wanted += [(secure.sasl_ssl_port, "the Kafka SASL_SSL listener",
                        env.ENV_DEV_KAFKA_SASL_SSL_PORT),
                       (secure.ssl_port, "the Kafka SSL listener", env.ENV_DEV_KAFKA_SSL_PORT)]
        for wanted_port, what, env_name in wanted:
            if not port_free(wanted_port):
                raise DevStackError(port_taken_message(wanted_port, what, env_name))
        java = find_java()
        check_java(java)
        libs = ensure_libs(settings, echo)
        write_config(paths, port, controller_port,
                     (secure, secrets) if secure is not None and secrets is not None else None)
        ensure_formatted(java, libs, paths, echo)
        cmd = [java, *JVM_OPTIONS, *_java_args(libs, paths), MAIN_CLASS, str(paths.config)]
        echo(f"{LABEL}: starting the broker on {bootstrap} ...")
        pid = _spawn(cmd, paths)
        write_text_atomic(paths.pid, f"{pid}\n")
        _wait_ready(bootstrap, port, pid, paths, own_child=True)
        action = "started"
    listeners: tuple[tuple[str, str], ...] = ()
    running_secure = configured_secure_listeners(paths)
    if secrets is not None and running_secure is not None:
        ensure_scram_user(bootstrap, secrets)
        _wait_secure_ready(running_secure, secrets, pid, paths)
        listeners = (("SASL_SSL", running_secure.sasl_ssl_bootstrap),
                     ("SSL", running_secure.ssl_bootstrap))
    return ServiceUp("kafka", LABEL, bootstrap, action, pid, paths.server_log, paths.data,
                     listeners)


def _wait_secure_ready(listeners: SecureListeners, secrets: DevSecrets, pid: int,
                       paths: KafkaPaths) -> None:
    """Until the SASL_SSL listener accepts the dev user (new SCRAM credentials reach the
    listener through the metadata log, a moment after they are written)."""
    deadline = time.monotonic() + START_TIMEOUT
    security = sasl_ssl_security(secrets)
    while True:
        ok, detail = probe(listeners.sasl_ssl_bootstrap, timeout=5.0, security=security)
        if ok:
            return
        if time.monotonic() >= deadline or not pid_alive(pid):
            raise DevStackError(
                f"The dev broker's SASL_SSL listener {listeners.sasl_ssl_bootstrap} did not "
                f"accept {KAFKA_USER!r} within {START_TIMEOUT:.0f} s: {detail}. "
                f"{_logs_hint(paths)}")
        time.sleep(0.2)


def stop_kafka(settings: Settings) -> str:
    """Stop the broker the pid file names; say what happened."""
    paths = kafka_paths(settings)
    if read_pid(paths.pid) is None:
        if settings.kafka_from_env:
            return f"uses {ENV_KAFKA_BOOTSTRAP}={settings.kafka_bootstrap}; nothing to stop"
        return "not running"
    pid = running_pid(paths)
    if pid is None:
        paths.pid.unlink(missing_ok=True)
        return "not running (removed a stale pid file)"
    started = time.monotonic()
    killed = terminate(pid, STOP_TIMEOUT)
    paths.pid.unlink(missing_ok=True)
    how = f"killed after {STOP_TIMEOUT:.0f} s" if killed else "stopped"
    return f"{how} (pid {pid}) in {time.monotonic() - started:.1f} s"


def kafka_status(settings: Settings) -> ServiceStatus:
    if settings.kafka_from_env:
        ok, detail = probe(settings.kafka_bootstrap)
        return ServiceStatus(
            "kafka", LABEL, settings.kafka_bootstrap, ok, "external",
            f"from {ENV_KAFKA_BOOTSTRAP}; {detail}",
        )
    paths = kafka_paths(settings)
    port = env.kafka_port()
    bootstrap = f"127.0.0.1:{port}"
    pid = running_pid(paths)
    if pid is None:
        detail = "not running"
        if not port_free(port):
            detail += f"; port {port} is taken by another process"
        return ServiceStatus("kafka", LABEL, bootstrap, False, "stopped", detail,
                             log=paths.server_log)
    ports = configured_ports(paths)
    if ports is not None and ports[0] != port:
        return ServiceStatus(
            "kafka", LABEL, bootstrap, False, "unhealthy",
            f"runs on port {ports[0]}, not {port}", pid, paths.server_log,
        )
    ok, detail = probe(bootstrap, security=PLAINTEXT)
    secure = configured_secure_listeners(paths)
    if ok and secure is not None:
        detail += f"; secure listeners: {secure.describe()}"
    return ServiceStatus("kafka", LABEL, bootstrap, ok, "running" if ok else "unhealthy",
                         detail, pid, paths.server_log)
