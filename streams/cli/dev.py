"""`stovepipe dev up | down | status`: the local Kafka + PostgreSQL stack."""

from __future__ import annotations

import shlex
import time

import click

from streams.config import kafka_security as ks
from streams.config.settings import (
    ENV_KAFKA_BOOTSTRAP,
    ENV_POSTGRES_DSN,
    LOCAL_KAFKA_BOOTSTRAP,
    LOCAL_POSTGRES_DSN,
    load_settings,
)
from streams.devstack.common import ServiceUp
from streams.devstack.stack import Stack, ensure_up, stack_status, stop_stack
from streams.devstack.tls import KAFKA_USER

_ACTIONS = {"started": "started", "reused": "already running"}
_ENV_NAMES = {"kafka": ENV_KAFKA_BOOTSTRAP, "postgres": ENV_POSTGRES_DSN}
_WIDTH = 16


def _describe(service: ServiceUp) -> list[str]:
    head = f"{service.label + ':':<{_WIDTH}}"
    if service.action == "external":
        env_name = _ENV_NAMES[service.name]
        return [f"{head}using {service.endpoint} from {env_name} (nothing started)"]
    what = "bootstrap" if service.name == "kafka" else "dsn"
    lines = [f"{head}{_ACTIONS[service.action]}, {what} {service.endpoint} (pid {service.pid})"]
    for protocol, endpoint in service.listeners:
        lines.append(f"{'':<{_WIDTH}}{protocol} {endpoint}")
    if service.log is not None:
        lines.append(f"{'':<{_WIDTH}}log {service.log}")
    return lines


def _secure_exports(stack: Stack) -> list[str]:
    """The variables that point Stovepipe at the secure listeners (SCRAM-SHA-512)."""
    secrets = stack.secrets
    listeners = dict(stack.kafka.listeners)
    if secrets is None or "SASL_SSL" not in listeners:
        return []
    password_file = shlex.quote(str(secrets.kafka_password_file))
    lines = [f"export {ENV_KAFKA_BOOTSTRAP}={listeners['SASL_SSL']}",
             f"export {ks.ENV_SECURITY_PROTOCOL}=SASL_SSL",
             f"export {ks.ENV_SASL_MECHANISM}=SCRAM-SHA-512",
             f"export {ks.ENV_SASL_USERNAME}={KAFKA_USER}",
             f'export {ks.ENV_SASL_PASSWORD}="$(cat {password_file})"',
             f"export {ks.ENV_SSL_CA_LOCATION}={shlex.quote(str(secrets.ca))}"]
    tls_dsn = dict(stack.postgres.listeners).get("verify-full")
    if tls_dsn is not None:
        lines.append(f"export {ENV_POSTGRES_DSN}={shlex.quote(tls_dsn)}")
    return lines


@click.group("dev")
def dev_group() -> None:
    """Start, stop and check the local Kafka + PostgreSQL stack."""


@dev_group.command("up")
@click.option("--secure", is_flag=True,
              help="Also give the broker a SASL_SSL listener (SCRAM-SHA-512/256, PLAIN) and a "
                   "mutual-TLS listener, and PostgreSQL TLS, all with certificates of a local "
                   "CA made for the stack; prints the variables that use them.")
def up(secure: bool) -> None:
    """Start the stack (or reuse what runs) and wait until it answers."""
    stack = ensure_up(load_settings(), secure=secure)
    for service in (stack.kafka, stack.postgres):
        for line in _describe(service):
            click.echo(line)
    exports = []
    if stack.kafka.action != "external" and stack.kafka_bootstrap != LOCAL_KAFKA_BOOTSTRAP:
        exports.append(f"export {ENV_KAFKA_BOOTSTRAP}={stack.kafka_bootstrap}")
    if stack.postgres.action != "external" and stack.postgres_dsn != LOCAL_POSTGRES_DSN:
        exports.append(f"export {ENV_POSTGRES_DSN}={stack.postgres_dsn}")
    if exports:
        click.echo("Not the default ports; point stovepipe at this stack with:")
        for line in exports:
            click.echo(f"  {line}")
    secure_exports = _secure_exports(stack)
    if secure_exports:
        click.echo("Point stovepipe at the secure listeners with:")
        for line in secure_exports:
            click.echo(f"  {line}")
    click.echo(f"Stack ready in {stack.elapsed:.1f} s.")


@dev_group.command("down")
def down() -> None:
    """Stop what `stovepipe dev up` started (nothing else)."""
    started = time.monotonic()
    result = stop_stack(load_settings())
    click.echo(f"{'Kafka:':<{_WIDTH}}{result['kafka']}")
    click.echo(f"{'PostgreSQL:':<{_WIDTH}}{result['postgres']}")
    click.echo(f"Done in {time.monotonic() - started:.1f} s.")


@dev_group.command("status")
def status() -> None:
    """Show each service's health (exit status 1 when one is down)."""
    statuses = stack_status(load_settings())
    for service in statuses:
        health = "healthy" if service.healthy else "UNHEALTHY"
        pid = f"pid {service.pid}, " if service.pid else ""
        click.echo(f"{service.label + ':':<{_WIDTH}}{health:<10}{service.endpoint}  "
                   f"({pid}{service.state}: {service.detail})")
        if service.log is not None and service.state != "external":
            click.echo(f"{'':<{_WIDTH}}log {service.log}")
    if not all(service.healthy for service in statuses):
        raise click.exceptions.Exit(1)
