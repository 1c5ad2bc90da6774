"""Helpers shared by the Kafka and PostgreSQL parts of the local stack."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

Echo = Callable[[str], None]


class DevStackError(click.ClickException):
    """A problem the user can fix; the CLI shows the message, never a traceback."""


def quiet_echo(_message: str) -> None:
    """An `Echo` that says nothing."""


@dataclass(frozen=True)
class ServiceStatus:
    """Health of one service of the stack, as `stovepipe dev status` shows it."""

    name: str  # "kafka" or "postgres"
    label: str  # "Kafka 4.1.2", "PostgreSQL 15"
    endpoint: str
    healthy: bool
    state: str  # "running", "stopped", "unhealthy" or "external"
    detail: str = ""
    pid: int | None = None
    log: Path | None = None


@dataclass(frozen=True)
class ServiceUp:
    """What `ensure_up` did for one service."""

    name: str  # "kafka" or "postgres"
    label: str  # "Kafka 4.1.2", "PostgreSQL 15"
    endpoint: str
    action: str  # "started", "reused" (already running) or "external" (from the environment)
    pid: int | None = None
    log: Path | None = None
    data_dir: Path | None = None
    listeners: tuple[tuple[str, str], ...] = ()  # (protocol, host:port) beyond the endpoint


# --- processes -------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True when `pid` is a live (not zombie) process."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        # Reap it if it is our own child that has exited (ensure_up in a long-lived process).
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # Field 3, after the parenthesised command name, is the state.
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def process_cmdline(pid: int) -> list[str] | None:
    """The command line of `pid`, or None when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().split()
    except OSError:
        return None
    if not text or not text[0].isdigit():
        return None
    return int(text[0])


def terminate(pid: int, timeout: float) -> bool:
    """SIGTERM `pid`, wait up to `timeout` s, then SIGKILL. True if it had to be killed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if wait_until(lambda: not pid_alive(pid), timeout):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10)
    return True


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


# --- ports -----------------------------------------------------------------------------


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (a server could bind it now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers themselves: a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def port_answers(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_taken_message(port: int, what: str, env_name: str) -> str:
    return (
        f"Port {port} on 127.0.0.1 (wanted for {what}) is taken by another process, "
        f"not by the stovepipe dev stack. Stop that process (see `ss -ltnp 'sport = :{port}'`) "
        f"or choose another port with {env_name}=<port>."
    )


# --- files -----------------------------------------------------------------------------


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a text file ('' when it is missing)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    text = data.decode(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in text)


def log_hint(path: Path, lines: int = 25) -> str:
    """'See <log>' followed by its last lines, for an error message."""
    last = tail(path, lines)
    if not last:
        return f"See {path} (empty or missing)."
    return f"See {path}; its last lines:\n{last}"


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (one `dev up`/`dev down` at a time per home)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
