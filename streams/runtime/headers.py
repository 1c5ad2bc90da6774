"""Header names the runtime reads and writes. Kafka headers are (str, bytes) pairs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ATTEMPT = "stovepipe-attempt"  # handler calls that already failed for this message
DUE_MS = "stovepipe-due-ms"  # epoch ms before which a delayed message must not arrive
TARGET = "stovepipe-target"  # topic a delayed message goes back to
# set by the delay scheduler on a held message it hands back to its stage: when it was
# due (epoch ms), so the stage can tell how late the hold arrived
WAS_DUE_MS = "stovepipe-was-due-ms"
# where a retried message was first delivered ("<partition>:<offset>"): a retry is the
# same delivery tried again, a hold is a new turn (streams.stages.loops)
ORIGIN = "stovepipe-origin"
# a message waiting out a dependency's outage: how many waits in a row, and since when
# (epoch ms, the first waiting worker's clock); a hold removes both
WAITS = "stovepipe-waits"
WAITING_SINCE_MS = "stovepipe-waiting-since-ms"

DLQ_SOURCE_TOPIC = "dlq-source-topic"
DLQ_SOURCE_PARTITION = "dlq-source-partition"
DLQ_SOURCE_OFFSET = "dlq-source-offset"
DLQ_ATTEMPTS = "dlq-attempts"
DLQ_ERROR_CLASS = "dlq-error-class"
DLQ_ERROR_MESSAGE = "dlq-error-message"
DLQ_TIME = "dlq-time"

RUNTIME_HEADERS = frozenset({ATTEMPT, DUE_MS, TARGET})

Headers = list[tuple[str, bytes]]


def get(headers: Iterable[tuple[str, bytes]] | None, name: str) -> bytes | None:
    """The last value of ``name`` (a redelivery appends; the newest wins)."""
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return found


def get_int(headers: Iterable[tuple[str, bytes]] | None, name: str, default: int = 0) -> int:
    raw = get(headers, name)
    if raw is None:
        return default
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return default


def replace(headers: Sequence[tuple[str, bytes]] | None,
            values: dict[str, str | int]) -> Headers:
    """``headers`` without the entries named in ``values``, then those values."""
    kept = [(k, v) for k, v in headers or () if k not in values]
    return kept + [(k, str(v).encode()) for k, v in values.items()]


def without_runtime(headers: Sequence[tuple[str, bytes]] | None) -> Headers:
    return [(k, v) for k, v in headers or () if k not in (DUE_MS, TARGET, WAS_DUE_MS)]


def remove(headers: Sequence[tuple[str, bytes]] | None, name: str) -> Headers:
    return [(k, v) for k, v in headers or () if k != name]
