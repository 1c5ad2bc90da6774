"""`python -m streams.cli …` runs the `stovepipe` command."""

from streams.cli import main

main()
