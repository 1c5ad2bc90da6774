"""queues.yaml's ``retention`` section: whether the workers prune old history, and how
(issue 25, item 6; `streams.stages.retention`).

    retention:
      older_than: 180d   # history older than this goes (at least 1d), except what is kept
      keep_newest: 100   # facts kept per queue and per project, however old
      every: 1h          # a round this often, by one worker at a time
      max_rows: 100000   # rows one round deletes at most; the rest waits for the next
      duty_cycle: 0.25   # share of a round's time spent deleting; it rests the rest
      batch_rows: 1000   # rows one batch (one statement, one transaction) deletes, about

Off when the section is absent, null or ``off``; ``on`` (or ``{}``) takes every default.
`stovepipe prune` works either way, and takes ``keep_newest`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, ValidationError

from streams.schema.durations import format_duration
from streams.schema.fields import Duration, PositiveFloat, PositiveInt, Problems, Section

MIN_OLDER_THAN = timedelta(days=1)
DEFAULT_OLDER_THAN = timedelta(days=180)
DEFAULT_KEEP_NEWEST = 100
DEFAULT_EVERY = timedelta(hours=1)
DEFAULT_MAX_ROWS = 100_000
# a quarter of the time: ingest → fact p50 unmoved beside a round on 2 cores, p99 1.29x
# idle (1.33x and p50 +43 % without rest; bench/prune_bench.py, docs/benchmarks.md)
DEFAULT_DUTY_CYCLE = 0.25
DEFAULT_BATCH_ROWS = 1000


def check_older_than(value: timedelta) -> timedelta:
    """Retention shorter than a day would delete Requests whose messages may still be in
    Kafka (a replay would then find them gone), and facts a person looked at this
    morning."""
    if value < MIN_OLDER_THAN:
        raise ValueError(f"must be at least {format_duration(MIN_OLDER_THAN)} (1 day), "
                         f"got {format_duration(value)}")
    return value


OlderThan = Annotated[Duration, AfterValidator(check_older_than)]


def check_duty_cycle(value: float) -> float:
    """A share of time: above 0 (a round that never works never ends), at most 1."""
    if not 0 < value <= 1:
        raise ValueError(f"must be a share of time above 0 and at most 1 (e.g. 0.25), "
                         f"got {value!r}")
    return value


DutyCycle = Annotated[PositiveFloat, AfterValidator(check_duty_cycle)]


class RetentionFields(Section):
    older_than: OlderThan = DEFAULT_OLDER_THAN
    keep_newest: PositiveInt = DEFAULT_KEEP_NEWEST
    every: Duration = DEFAULT_EVERY
    max_rows: PositiveInt = DEFAULT_MAX_ROWS
    duty_cycle: DutyCycle = DEFAULT_DUTY_CYCLE
    batch_rows: PositiveInt = DEFAULT_BATCH_ROWS


@dataclass(frozen=True)
class RetentionConfig:
    older_than: timedelta = DEFAULT_OLDER_THAN
    keep_newest: int = DEFAULT_KEEP_NEWEST
    every: timedelta = DEFAULT_EVERY
    max_rows: int = DEFAULT_MAX_ROWS
    duty_cycle: float = DEFAULT_DUTY_CYCLE
    batch_rows: int = DEFAULT_BATCH_ROWS


def load_retention(raw: Any, problems: Problems) -> RetentionConfig | None:
    """The ``retention`` section; None when retention is off. Its problems are added to
    ``problems`` under ``retention``."""
    if raw is None or raw is False or raw == "off":
        return None
    if raw is True or raw == "on":
        raw = {}
    try:
        fields = RetentionFields.model_validate(raw)
    except ValidationError as exc:
        problems.add_validation_error(exc, RetentionFields, "retention")
        return None
    return RetentionConfig(older_than=fields.older_than, keep_newest=fields.keep_newest,
                           every=fields.every, max_rows=fields.max_rows,
                           duty_cycle=fields.duty_cycle, batch_rows=fields.batch_rows)
