import click


@click.group("dev")
def dev_group() -> None:
    """Start, stop and check the local Kafka + PostgreSQL stack."""
