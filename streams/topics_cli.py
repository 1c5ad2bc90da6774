import click


@click.group("topics")
def topics_group() -> None:
    """Create and verify the Kafka topics named in topics.yaml."""
