"""The `stovepipe` command: one Click group; each module here adds a command group.

    worker    run the stages (worker.py)       ingest, poll   ingest heads (ingest.py)
    request, queue, fact   read state (show.py) topics, db     set up Kafka / PostgreSQL
    replay, dlq, parked    recover (replay.py, dlq.py, parked.py; kafka.py is shared)
    dev, demo              the local stack and the demo (dev.py, demo.py)
"""

from __future__ import annotations

import logging

import click

from streams.cli.db import db_group
from streams.cli.demo import demo_command
from streams.cli.dev import dev_group
from streams.cli.dlq import dlq_group
from streams.cli.ingest import ingest_command, poll_command
from streams.cli.parked import parked_group
from streams.cli.replay import replay_command
from streams.cli.show import fact_command, queue_command, request_command
from streams.cli.topics import topics_group
from streams.cli.worker import worker_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Stovepipe: at which commit is this branch green?"""
    # The clients' own warnings (a connection pool retrying, librdkafka reconnecting)
    # would reach the terminal through logging's last resort; a command reports its
    # failure in one line of its own instead. The worker configures logging itself.
    for name in ("psycopg", "aiokafka", "kafka"):
        logging.getLogger(name).addHandler(logging.NullHandler())


for _command in (dev_group, db_group, topics_group, worker_command, ingest_command,
                 request_command, queue_command, fact_command, replay_command, dlq_group,
                 parked_group, poll_command, demo_command):
    main.add_command(_command)
