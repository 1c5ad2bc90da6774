"""What the pipeline's stages share: the database, the queue configuration and the
extensions it names. Built once per worker (or per CLI call)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from store import Database

if TYPE_CHECKING:
    from streams.queueconfig import Extensions, QueueConfig, QueuesConfig


@dataclass
class Deps:
    db: Database
    queues: QueuesConfig
    extensions: Extensions

    def queue_config(self, name: str) -> QueueConfig:
        """Raises UnknownQueue (a user error) for a queue the configuration lacks."""
        return self.queues.get(name)


class WrongQueue(ValueError):
    """A payload's queue_name disagrees with the stored entity: a malformed message."""


def check_queue_name(payload_queue: str, stored_queue: str, what: str) -> None:
    """`queue_name` may be empty on old payloads; when present it must match."""
    if payload_queue and payload_queue != stored_queue:
        raise WrongQueue(f"{what} belongs to queue {stored_queue!r}, "
                         f"but the message says {payload_queue!r}")
