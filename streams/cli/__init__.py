"""The `stovepipe` command: one Click group; each module here adds a command group.

    worker    run the stages (worker.py)       ingest, poll   ingest heads (ingest.py)
    request, queue, fact   read state (show.py) topics, db     set up Kafka / PostgreSQL
    last-green             the newest commit green for several projects (last_green.py)
    explain                the branch's story since its last green commit (explain.py)
    retry                  validate a commit again (retry.py)
    pin, unpin             hold the promotion ref during an incident (pin.py)
    replay, dlq, parked    recover (replay.py, dlq.py, parked.py; kafka.py is shared)
    prune                  delete history older than the retention (prune.py)
    dev, demo              the local stack and the demo (dev.py, demo.py)
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from typing import Any

import click

from streams import __version__
from streams.extensions import tracing

# Each command is imported only when it is run: a command that reads the database starts
# without loading Faust, the stages or the queues.yaml models.
COMMANDS: dict[str, str] = {
    "dev": "streams.cli.dev:dev_group",
    "db": "streams.cli.db:db_group",
    "topics": "streams.cli.topics:topics_group",
    "worker": "streams.cli.worker:worker_command",
    "ingest": "streams.cli.ingest:ingest_command",
    "request": "streams.cli.show:request_command",
    "queue": "streams.cli.show:queue_command",
    "fact": "streams.cli.show:fact_command",
    "last-green": "streams.cli.last_green:last_green_command",
    "explain": "streams.cli.explain:explain_command",
    "retry": "streams.cli.retry:retry_command",
    "pin": "streams.cli.pin:pin_command",
    "unpin": "streams.cli.pin:unpin_command",
    "replay": "streams.cli.replay:replay_command",
    "dlq": "streams.cli.dlq:dlq_group",
    "parked": "streams.cli.parked:parked_group",
    "prune": "streams.cli.prune:prune_command",
    "poll": "streams.cli.ingest:poll_command",
    "demo": "streams.cli.demo:demo_command",
}


class _LazyCommands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        command: Any = getattr(importlib.import_module(module), attr)
        return command  # type: ignore[no-any-return]


@click.group(cls=_LazyCommands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="stovepipe", message="%(prog)s %(version)s")
def main() -> None:
    """Stovepipe: at which commit is this branch green?"""
    # The clients' own warnings (a connection pool retrying, librdkafka reconnecting)
    # would reach the terminal through logging's last resort; a command reports its
    # failure in one line of its own instead. The worker configures logging itself.
    for name in ("psycopg", "aiokafka", "kafka"):
        logging.getLogger(name).addHandler(logging.NullHandler())
    # a trace per Request when the OTEL_* variables ask for one (a no-op otherwise); what
    # is buffered is exported as the command exits
    if tracing.setup(os.environ):
        atexit.register(tracing.shutdown)
