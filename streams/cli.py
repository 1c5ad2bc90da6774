"""The `stovepipe` command: one Click group; each area adds its subcommands here."""

from __future__ import annotations

import click

from store.cli import db_group
from streams.devstack.cli import dev_group
from streams.topics_cli import topics_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Stovepipe: at which commit is this branch green?"""


main.add_command(dev_group)
main.add_command(db_group)
main.add_command(topics_group)
