"""The dev-stack PostgreSQL: the machine's own server binaries, a private data directory.

Layout (`<root>` is `<settings.home>/dev/postgres`, or, when running as root, a directory
under /var/lib/stovepipe-dev that the unprivileged `postgres` user can reach):

    <root>/data/            the cluster (initdb once); data/postmaster.pid is the pid file
    <root>/run/             unix socket directory
    <root>/postgres.log     server log
    <root>/tls/             with `dev up --secure`: the server certificate and key of the
                            dev CA (`streams.devstack.tls`), owned by the server's user

With `--secure` the server also speaks TLS (`ssl = on`), so a DSN with
`sslmode=verify-full&sslrootcert=<home>/dev/secure/ca.pem` connects (`verify_full_dsn`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from streams.config.settings import ENV_POSTGRES_DSN, Settings

from . import env
from .common import (
    DevStackError,
    Echo,
    ServiceStatus,
    ServiceUp,
    log_hint,
    pid_alive,
    port_free,
    port_taken_message,
    process_cmdline,
    wait_until,
    write_text_atomic,
)
from .tls import DevSecrets

DB_USER = "stovepipe"
DB_NAME = "stovepipe"
SUPERUSER = "postgres"
RUN_AS_USER = "postgres"
ROOT_STATE_DIR = Path("/var/lib/stovepipe-dev")
DEB_LIB_DIR = Path("/usr/lib/postgresql")
START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
INCLUDE_FILE = "stovepipe-dev.conf"
_TOOLS = ("initdb", "pg_ctl", "postgres")
_INSTALL = "apt-get update && apt-get install -y postgresql"


@dataclass(frozen=True)
class PgPaths:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    @property
    def pid(self) -> Path:
        return self.data / "postmaster.pid"

    @property
    def tls(self) -> Path:
        return self.root / "tls"


def postgres_root(settings: Settings) -> Path:
    """Where the dev-stack cluster of this `settings.home` lives."""
    if os.geteuid() != 0:
        return settings.home / "dev" / "postgres"
    # As root the server runs as `postgres`, which cannot enter /root (mode 700).
    home = settings.home.expanduser().resolve()
    if home == (Path.home() / ".stovepipe").resolve():
        return ROOT_STATE_DIR / "postgres"
    return ROOT_STATE_DIR / f"postgres-{hashlib.sha256(str(home).encode()).hexdigest()[:12]}"


def pg_paths(settings: Settings) -> PgPaths:
    return PgPaths(postgres_root(settings))


def local_dsn(port: int) -> str:
    return f"postgresql://{DB_USER}@127.0.0.1:{port}/{DB_NAME}"


def verify_full_dsn(port: int, secrets: DevSecrets) -> str:
    """The dev database over TLS, its certificate checked against the dev CA and host."""
    return f"{local_dsn(port)}?sslmode=verify-full&sslrootcert={secrets.ca}"


# --- binaries and user -----------------------------------------------------------------


@dataclass(frozen=True)
class PgBinaries:
    bindir: Path
    major: int

    def tool(self, name: str) -> str:
        return str(self.bindir / name)


def _major_of(bindir: Path) -> int | None:
    try:
        out = subprocess.run([str(bindir / "pg_ctl"), "--version"], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", out)
    return int(match.group(1)) if match else None


def find_binaries(want_major: int | None = None) -> PgBinaries:
    """The newest server binaries in PATH or /usr/lib/postgresql/*/bin (or `want_major`)."""
    candidates = sorted(DEB_LIB_DIR.glob("*/bin"))
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    found: dict[Path, int] = {}
    for bindir in candidates:
        bindir = bindir.resolve()
        if bindir in found or not all(os.access(bindir / t, os.X_OK) for t in _TOOLS):
            continue
        major = _major_of(bindir)
        if major is not None:
            found[bindir] = major
    if not found:
        raise DevStackError(
            "PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found in PATH "
            f"or {DEB_LIB_DIR}/*/bin. Install them: {_INSTALL} "
            f"(or set {ENV_POSTGRES_DSN} to use a database you already have)."
        )
    if want_major is not None:
        matching = [b for b, m in found.items() if m == want_major]
        if not matching:
            have = ", ".join(str(m) for m in sorted(set(found.values())))
            raise DevStackError(
                f"The dev-stack data directory was created by PostgreSQL {want_major}, but "
                f"only PostgreSQL {have} is installed. Install {want_major} "
                f"(apt-get install -y postgresql-{want_major}) or remove the data directory "
                "(its data is lost) and run `stovepipe dev up` again."
            )
        return PgBinaries(matching[0], want_major)
    bindir, major = max(found.items(), key=lambda item: item[1])
    return PgBinaries(bindir, major)


@dataclass(frozen=True)
class RunAs:
    uid: int
    gid: int
    name: str
    home: str


def run_as() -> RunAs | None:
    """The unprivileged user PostgreSQL runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(RUN_AS_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            raise DevStackError(
                f"PostgreSQL refuses to run as root and there is no `{RUN_AS_USER}` user "
                f"to run it as (nor `useradd` to create one). Create that user, or run "
                "`stovepipe dev up` as an ordinary user."
            ) from None
        subprocess.run(
            [useradd, "--system", "--user-group", "--no-create-home",
             "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", RUN_AS_USER],
            capture_output=True, check=False,
        )
        try:
            entry = pwd.getpwnam(RUN_AS_USER)
        except KeyError:
            raise DevStackError(f"Could not create the system user `{RUN_AS_USER}`.") from None
    return RunAs(entry.pw_uid, entry.pw_gid, entry.pw_name, entry.pw_dir)


def _run(cmd: list[str], user: RunAs | None, cwd: Path,
         timeout: float) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    extra: dict[str, Any] = {}
    if user is not None:
        extra = {"user": user.uid, "group": user.gid, "extra_groups": []}
        environ.update(USER=user.name, LOGNAME=user.name, HOME=str(cwd))
    try:
        return subprocess.run(
            cmd, cwd=cwd, env=environ, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=timeout, check=False, start_new_session=True, **extra,
        )
    except subprocess.TimeoutExpired:
        raise DevStackError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s.") from None


def _own(path: Path, user: RunAs | None, mode: int = 0o700) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if user is not None:
        os.chown(path, user.uid, user.gid)
    path.chmod(mode)


# --- cluster ---------------------------------------------------------------------------


def _data_major(paths: PgPaths) -> int | None:
    try:
        return int((paths.data / "PG_VERSION").read_text().strip().split(".")[0])
    except (OSError, ValueError):
        return None


def running_postmaster(paths: PgPaths) -> tuple[int, int | None] | None:
    """(pid, port) of the postmaster whose postmaster.pid is in our data dir, if it runs."""
    try:
        lines = paths.pid.read_text().splitlines()
    except OSError:
        return None
    if not lines or not lines[0].strip().isdigit():
        return None
    pid = int(lines[0])
    if not pid_alive(pid):
        return None
    cmdline = process_cmdline(pid)
    if cmdline is not None and not (
        cmdline and Path(cmdline[0]).name in ("postgres", "postmaster")
    ):
        return None  # the pid was reused by another process
    port = int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None
    return pid, port


def _initdb(binaries: PgBinaries, paths: PgPaths, user: RunAs | None, echo: Echo) -> None:
    if paths.data.exists():
        shutil.rmtree(paths.data)  # no PG_VERSION: an interrupted initdb, nothing to keep
    echo(f"PostgreSQL {binaries.major}: initdb {paths.data} ...")
    out = _run([binaries.tool("initdb"), "-D", str(paths.data), "-U", SUPERUSER, "-A", "trust",
                "-E", "UTF8", "--no-locale", "--no-sync"], user, paths.root, timeout=120)
    if out.returncode != 0:
        raise DevStackError(
            f"initdb failed (exit {out.returncode}):\n{(out.stdout + out.stderr).strip()}"
        )
    with (paths.data / "postgresql.conf").open("a") as conf:
        conf.write(f"\n# Settings of `stovepipe dev up`, rewritten on every start.\n"
                   f"include_if_exists = '{INCLUDE_FILE}'\n")


def _write_settings(paths: PgPaths, port: int, user: RunAs | None,
                    secrets: DevSecrets | None = None) -> None:
    target = paths.data / INCLUDE_FILE
    tls = ""
    if secrets is not None:
        cert, key = _install_server_certificate(paths, user, secrets)
        tls = f"ssl = on\nssl_cert_file = '{cert}'\nssl_key_file = '{key}'\n"
    write_text_atomic(target, (
        "# Written by `stovepipe dev up` on every start; edits are lost.\n"
        "listen_addresses = '127.0.0.1'\n"
        f"port = {port}\n"
        f"unix_socket_directories = '{paths.run}'\n"
        "max_connections = 200\n"
        + tls
    ))
    if user is not None:
        os.chown(target, user.uid, user.gid)


def _install_server_certificate(paths: PgPaths, user: RunAs | None,
                                secrets: DevSecrets) -> tuple[Path, Path]:
    """The dev CA's server certificate and key where the server's user may read them
    (PostgreSQL refuses a key that others may read)."""
    _own(paths.tls, user)
    copies = []
    for source in (secrets.server_cert, secrets.server_key):
        target = paths.tls / source.name
        shutil.copyfile(source, target)
        if user is not None:
            os.chown(target, user.uid, user.gid)
        target.chmod(0o600)
        copies.append(target)
    return copies[0], copies[1]


def _connect(conninfo: str, timeout: float = 3.0) -> Any:

    return psycopg.connect(conninfo, connect_timeout=max(1, int(timeout)), autocommit=True)


def _ensure_role_and_db(port: int) -> None:

    with _connect(f"host=127.0.0.1 port={port} user={SUPERUSER} dbname=postgres") as conn:
        if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DB_USER,)).fetchone():
            conn.execute(sql.SQL("CREATE ROLE {} WITH LOGIN SUPERUSER").format(
                sql.Identifier(DB_USER)))
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                            (DB_NAME,)).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(DB_NAME), sql.Identifier(DB_USER)))


def probe(dsn: str, timeout: float = 5.0) -> tuple[bool, str]:
    """Connect and run a query: (answers, detail)."""

    try:
        with _connect(dsn, timeout) as conn:
            row = conn.execute("SELECT 1, current_setting('server_version')").fetchone()
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return False, f"does not answer ({reason})"
    return True, f"PostgreSQL {row[1]}" if row else "answers"


def _wait_ready(dsn: str, port: int, pid: int, paths: PgPaths) -> None:
    """Wait until the server accepts connections, with the role and database in place."""

    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if not pid_alive(pid):
            raise DevStackError(f"PostgreSQL (pid {pid}) exited while starting. "
                                f"{log_hint(paths.log)}")
        try:
            _ensure_role_and_db(port)
        except psycopg.Error as exc:
            last = str(exc).strip()
        else:
            ok, last = probe(dsn, timeout=max(1.0, deadline - time.monotonic()))
            if ok:
                return
        if time.monotonic() >= deadline:
            raise DevStackError(
                f"PostgreSQL (pid {pid}) did not answer on {dsn} within {START_TIMEOUT:.0f} s "
                f"({last}). {log_hint(paths.log)}"
            )
        time.sleep(0.2)


def ensure_postgres(settings: Settings, echo: Echo, secrets: DevSecrets | None = None
                    ) -> ServiceUp:
    """Reuse the running dev database or start one; return once it answers. With
    `secrets` (`dev up --secure`), once it answers a `verify_full_dsn` too."""
    if settings.postgres_from_env:
        return ServiceUp("postgres", "PostgreSQL", settings.postgres_dsn, "external")
    paths = pg_paths(settings)
    port = env.postgres_port()
    dsn = local_dsn(port)
    major = _data_major(paths)
    label = f"PostgreSQL {major}" if major else "PostgreSQL"
    running = running_postmaster(paths)
    if running is not None:
        pid, running_port = running
        if running_port is not None and running_port != port:
            raise DevStackError(
                f"The dev-stack PostgreSQL (pid {pid}) runs on port {running_port}, not {port}. "
                "Run `stovepipe dev down`, then `stovepipe dev up` again."
            )
        _wait_ready(dsn, port, pid, paths)
        if secrets is not None:
            _write_settings(paths, port, run_as(), secrets)
            os.kill(pid, signal.SIGHUP)  # TLS settings take effect on a reload
            _wait_ready(verify_full_dsn(port, secrets), port, pid, paths)
        return ServiceUp("postgres", label, dsn, "reused", pid, paths.log, paths.data,
                         _tls_listeners(port, secrets))

    if not port_free(port):
        raise DevStackError(port_taken_message(port, "PostgreSQL", env.ENV_DEV_POSTGRES_PORT))
    binaries = find_binaries(major)
    label = f"PostgreSQL {binaries.major}"
    user = run_as()
    if user is not None:
        ROOT_STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    _own(paths.root, user)
    _own(paths.run, user)
    if major is None:
        _initdb(binaries, paths, user, echo)
    _write_settings(paths, port, user, secrets)
    echo(f"{label}: starting the server on 127.0.0.1:{port} ...")
    out = _run([binaries.tool("pg_ctl"), "start", "-D", str(paths.data), "-l", str(paths.log),
                "-w", "-t", str(int(START_TIMEOUT))], user, paths.root, START_TIMEOUT + 10)
    running = running_postmaster(paths)
    if out.returncode != 0 or running is None:
        raise DevStackError(
            f"PostgreSQL did not start (pg_ctl exit {out.returncode}: "
            f"{(out.stdout + out.stderr).strip()}). {log_hint(paths.log)}"
        )
    _wait_ready(dsn, port, running[0], paths)
    if secrets is not None:
        _wait_ready(verify_full_dsn(port, secrets), port, running[0], paths)
    return ServiceUp("postgres", label, dsn, "started", running[0], paths.log, paths.data,
                     _tls_listeners(port, secrets))


def _tls_listeners(port: int, secrets: DevSecrets | None) -> tuple[tuple[str, str], ...]:
    return () if secrets is None else (("verify-full", verify_full_dsn(port, secrets)),)


def stop_postgres(settings: Settings) -> str:
    """Fast-shut-down the postmaster named by our data dir's postmaster.pid."""
    paths = pg_paths(settings)
    running = running_postmaster(paths)
    if running is None:
        if settings.postgres_from_env:
            return f"uses {ENV_POSTGRES_DSN}; nothing to stop"
        return "not running"
    pid = running[0]
    started = time.monotonic()
    # SIGINT is PostgreSQL's "fast" shutdown (what `pg_ctl stop -m fast` sends).
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGINT)
    if wait_until(lambda: not pid_alive(pid), STOP_TIMEOUT):
        return f"stopped (pid {pid}) in {time.monotonic() - started:.1f} s"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGQUIT)  # "immediate" shutdown
    wait_until(lambda: not pid_alive(pid), 10)
    return f"shut down immediately after {STOP_TIMEOUT:.0f} s (pid {pid})"


def postgres_status(settings: Settings) -> ServiceStatus:
    if settings.postgres_from_env:
        ok, detail = probe(settings.postgres_dsn)
        return ServiceStatus("postgres", "PostgreSQL", settings.postgres_dsn, ok, "external",
                             f"from {ENV_POSTGRES_DSN}; {detail}")
    paths = pg_paths(settings)
    port = env.postgres_port()
    dsn = local_dsn(port)
    major = _data_major(paths)
    label = f"PostgreSQL {major}" if major else "PostgreSQL"
    running = running_postmaster(paths)
    if running is None:
        detail = "not running"
        if not port_free(port):
            detail += f"; port {port} is taken by another process"
        return ServiceStatus("postgres", label, dsn, False, "stopped", detail, log=paths.log)
    pid, running_port = running
    if running_port is not None and running_port != port:
        return ServiceStatus("postgres", label, dsn, False, "unhealthy",
                             f"runs on port {running_port}, not {port}", pid, paths.log)
    ok, detail = probe(dsn)
    return ServiceStatus("postgres", label, dsn, ok, "running" if ok else "unhealthy",
                         detail, pid, paths.log)
