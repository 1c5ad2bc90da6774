import click


@click.group("db")
def db_group() -> None:
    """Manage the PostgreSQL schema."""
