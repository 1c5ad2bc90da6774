"""`stovepipe topics`: list, create and verify the Kafka topics named in topics.yaml.

Exit codes: 0 all topics as declared; 1 bad topics.yaml, broker unreachable, or a topic
the broker refused to create; 2 a topic missing (verify) or differing from topics.yaml.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import click

from streams.cli.kafka import (
    broker_options,
    fail_when_nothing_listens,
    fail_when_refused,
    kafka_security_or_fail,
    load_topics_or_fail,
    topics_options,
)
from streams.config import settings as settings_mod
from streams.config.topics import DelayTier
from streams.runtime.topic_admin import (
    TopicsAdminError,
    TopicsReport,
    TopicState,
    admin_conf_for,
    ensure_topics,
)
from streams.schema.durations import format_duration

EXIT_DRIFT = 2


def _report(ctx: click.Context, report: TopicsReport) -> None:
    width = max((len(s.name) for s in report), default=0)
    for status in report:
        label = status.state.value if status.ok else status.state.value.upper()
        detail = status.detail
        if status.state is TopicState.MISMATCH:
            detail += "; left unchanged"
        click.echo(f"{label:<9} {status.name:<{width}}  {detail}",
                   err=not status.ok)
    counts = {state: len(report.with_state(state)) for state in TopicState}
    summary = ", ".join(f"{n} {state.value}" for state, n in counts.items() if n)
    click.echo(f"{len(report.statuses)} topics: {summary}")
    if counts[TopicState.FAILED]:
        raise click.ClickException(f"{counts[TopicState.FAILED]} topic(s) could not be created")
    drift = counts[TopicState.MISMATCH] + counts[TopicState.MISSING]
    if drift:
        hint = ("existing topics are never altered: fix topics.yaml, or repartition "
                "deliberately once the topic is drained")
        if counts[TopicState.MISSING]:
            hint = "run `stovepipe topics create` to create missing topics"
        elif any("partitions:" not in s.detail for s in report.with_state(TopicState.MISMATCH)):
            hint = ("existing topics are never altered: change a config deliberately "
                    "(kafka-configs --alter) and topics.yaml with it, or fix topics.yaml")
        click.echo(f"Error: {drift} topic(s) differ from topics.yaml; {hint}", err=True)
        ctx.exit(EXIT_DRIFT)


def _run(ctx: click.Context, topics_file: Path | None, prefix: str | None, bootstrap: str | None,
         timeout: float, *, create: bool) -> None:
    config = load_topics_or_fail(topics_file, prefix)
    bootstrap = bootstrap or settings_mod.load_settings().kafka_bootstrap
    security = kafka_security_or_fail()
    fail_when_nothing_listens(bootstrap, timeout)
    fail_when_refused(bootstrap, security, timeout)
    try:
        report = ensure_topics(admin_conf_for(bootstrap, security), config, create=create,
                               timeout=timeout)
    except TopicsAdminError as exc:
        raise click.ClickException(str(exc)) from None
    _report(ctx, report)


def _retention(config: Mapping[str, str]) -> str:
    """retention.ms as a duration: "-" for the broker's default, "forever" for -1."""
    value = config.get("retention.ms")
    if value is None:
        return "-"
    if value.startswith("-"):
        return "forever"
    return format_duration(timedelta(milliseconds=int(value)))


@click.group("topics")
def topics_group() -> None:
    """Create and verify the Kafka topics named in topics.yaml."""


@topics_group.command("create")
@topics_options
@broker_options
@click.pass_context
def create_command(ctx: click.Context, topics_file: Path | None, prefix: str | None,
                   bootstrap: str | None, timeout: float) -> None:
    """Create the topics that are missing. Safe to re-run.

    Existing topics are never altered: one whose partition count or replication factor
    differs from topics.yaml is reported and the command exits 2.
    """
    _run(ctx, topics_file, prefix, bootstrap, timeout, create=True)


@topics_group.command("verify")
@topics_options
@broker_options
@click.pass_context
def verify_command(ctx: click.Context, topics_file: Path | None, prefix: str | None,
                   bootstrap: str | None, timeout: float) -> None:
    """Check every topic exists as declared; change nothing. Exits 2 on any difference."""
    _run(ctx, topics_file, prefix, bootstrap, timeout, create=False)


@topics_group.command("list")
@topics_options
def list_command(topics_file: Path | None, prefix: str | None) -> None:
    """Show the topics topics.yaml declares, with their full Kafka names (no broker)."""
    config = load_topics_or_fail(topics_file, prefix)
    click.echo(f"# {config.path} (prefix {config.prefix!r})")
    rows = [("ENTRY", "TOPIC", "PARTS", "RF", "RETENTION", "KEY FIELD", "PAYLOAD",
             "ON FAILURE")]
    for topic in config.all_topics():
        if isinstance(topic, DelayTier):
            rows.append((topic.entry, topic.full_name, str(topic.partitions),
                         str(topic.replication_factor), _retention(topic.config), "-", "-",
                         f"delay tier: redeliver after {format_duration(topic.delay)}"))
            continue
        target = config.dead_letter_for(topic)
        failure = topic.retry.describe() + (f", then {target.full_name}" if target else "")
        rows.append((topic.entry, topic.full_name, str(topic.partitions),
                     str(topic.replication_factor), _retention(topic.config),
                     topic.key_field, topic.payload.DESCRIPTOR.name, failure))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, row[-1]]))
