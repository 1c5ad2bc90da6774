"""`stovepipe dev up | down | status`: the local Kafka + PostgreSQL stack."""

from __future__ import annotations

import time

import click

from streams.config.settings import (
    ENV_KAFKA_BOOTSTRAP,
    ENV_POSTGRES_DSN,
    LOCAL_KAFKA_BOOTSTRAP,
    LOCAL_POSTGRES_DSN,
    load_settings,
)
from streams.devstack.common import ServiceUp
from streams.devstack.stack import ensure_up, stack_status, stop_stack

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
    if service.log is not None:
        lines.append(f"{'':<{_WIDTH}}log {service.log}")
    return lines


@click.group("dev")
def dev_group() -> None:
    """Start, stop and check the local Kafka + PostgreSQL stack."""


@dev_group.command("up")
def up() -> None:
    """Start the stack (or reuse what runs) and wait until it answers."""
    stack = ensure_up(load_settings())
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
