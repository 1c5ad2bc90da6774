"""The `stovepipe` command: one Click group; each area adds its subcommands here."""

from __future__ import annotations

import click

from store.cli import db_group
from streams.commands import (
    fact_command,
    ingest_command,
    queue_command,
    request_command,
    worker_command,
)
from streams.demo import demo_command
from streams.devstack.cli import dev_group
from streams.operator_cli import dlq_group, parked_group, replay_command
from streams.poller import poll_command
from streams.topics_cli import topics_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Stovepipe: at which commit is this branch green?"""


for _command in (dev_group, db_group, topics_group, worker_command, ingest_command,
                 request_command, queue_command, fact_command, replay_command, dlq_group,
                 parked_group, poll_command, demo_command):
    main.add_command(_command)


if __name__ == "__main__":
    main()
