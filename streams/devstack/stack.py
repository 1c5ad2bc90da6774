"""The local stack as a whole: start both services side by side, stop them, check them."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click

from streams.config.settings import Settings, load_settings

from .common import DevStackError, Echo, ServiceStatus, ServiceUp, file_lock, quiet_echo
from .kafka import ensure_kafka, kafka_status, stop_kafka
from .postgres import ensure_postgres, postgres_status, stop_postgres
from .tls import DevSecrets, ensure_secrets


@dataclass(frozen=True)
class Stack:
    """The endpoints of a stack that answers, and what `ensure_up` did for each service."""

    kafka_bootstrap: str
    postgres_dsn: str
    kafka: ServiceUp
    postgres: ServiceUp
    elapsed: float  # seconds `ensure_up` took
    secrets: DevSecrets | None = None  # `ensure_up(secure=True)`: the CA, passwords, ...


def _lock_path(settings: Settings) -> Path:
    return settings.home / "dev" / ".lock"


def _result(future: Future[ServiceUp], label: str, errors: list[str]) -> ServiceUp | None:
    try:
        return future.result()
    except DevStackError as exc:
        errors.append(exc.message)
    except OSError as exc:
        errors.append(f"{label}: {exc}")
    return None


def ensure_up(settings: Settings | None = None, quiet: bool = False,
              secure: bool = False) -> Stack:
    """Start what is not running yet (Kafka and PostgreSQL in parallel); reuse the rest.
    With `secure`, the broker's SASL_SSL and mutual-TLS listeners and PostgreSQL's TLS
    too (`streams.devstack.tls`).

    Returns once both answer. Services given by STOVEPIPE_KAFKA_BOOTSTRAP /
    STOVEPIPE_POSTGRES_DSN are used as they are. Raises `DevStackError` (a
    `click.ClickException`) with a message naming the problem and the log to read.
    """
    settings = settings or load_settings()
    echo: Echo = quiet_echo if quiet else click.echo
    started = time.monotonic()
    errors: list[str] = []
    secrets = None
    try:
        with file_lock(_lock_path(settings)), ThreadPoolExecutor(2, "devstack") as pool:
            secrets = ensure_secrets(settings) if secure else None
            kafka_future = pool.submit(ensure_kafka, settings, echo, secrets)
            postgres_future = pool.submit(ensure_postgres, settings, echo, secrets)
            kafka = _result(kafka_future, "Kafka", errors)
            postgres = _result(postgres_future, "PostgreSQL", errors)
    except OSError as exc:  # e.g. STOVEPIPE_HOME not writable
        raise DevStackError(str(exc)) from exc
    if errors or kafka is None or postgres is None:
        raise DevStackError("\n\n".join(errors))
    return Stack(kafka.endpoint, postgres.endpoint, kafka, postgres, time.monotonic() - started,
                 secrets)


def stop_stack(settings: Settings | None = None) -> dict[str, str]:
    """Stop the services this home's `ensure_up` started (found by their pid files).

    Returns what happened per service ("kafka", "postgres"); fine when nothing runs.
    """
    settings = settings or load_settings()
    try:
        with file_lock(_lock_path(settings)):
            return {"kafka": stop_kafka(settings), "postgres": stop_postgres(settings)}
    except OSError as exc:  # e.g. a process of another user
        raise DevStackError(str(exc)) from exc


def stack_status(settings: Settings | None = None) -> list[ServiceStatus]:
    """The health of each service (external endpoints are probed too)."""
    settings = settings or load_settings()
    try:
        return [kafka_status(settings), postgres_status(settings)]
    except OSError as exc:
        raise DevStackError(str(exc)) from exc
