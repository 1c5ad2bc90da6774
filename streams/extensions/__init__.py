"""Extensions: the contracts the stages call and their implementations (design §8).

- `sourcecontrol/`: how a queue's repository is seen (head, ancestry, promotion);
- `buildrunner/`: how a queue's builds run (trigger, status, cancel).

Each package has a ``contract`` module, one module per kind, and a registry of kinds in
its ``__init__``: the union of the kinds' spec classes, which queues.yaml's ``kind`` picks
from. A new kind is one module (its spec, a pydantic dataclass with a ``kind`` literal and a
``build`` method, and its implementation) plus one line in that union.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from store import Database


@dataclass(frozen=True)
class ExtensionContext:
    """Where an extension of one queue lives, handed to a spec's ``build``."""

    queue: str
    home: Path  # $STOVEPIPE_HOME: caches and work directories default to below it
    git_cache: Path  # where the queue's remote repositories are cached (shared by kinds)
    repository: str | None = None  # the queue's repository, when its source control has one
    # the worker's database, for extensions whose state every host must see (None: a
    # caller without one, e.g. a configuration check; such an extension refuses to work)
    database: Database | None = None
    host: str = ""  # this worker's host id (`STOVEPIPE_HOST_ID`, else hostname and home)
