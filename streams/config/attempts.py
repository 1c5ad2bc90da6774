"""A queue's ``retry`` and ``backfill`` sections (design §4 "Attempts", §5 "backfill"):
how often an attempt of a Request is tried again, and how the culprit of a red verdict is
searched for among the commits never built. Part of `streams.config.queues`."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic.dataclasses import dataclass as spec_dataclass

from streams.schema.fields import SPEC, Count, Duration, PositiveInt


@spec_dataclass(frozen=True, config=SPEC)
class RetrySpec:
    """A queue's ``retry`` section: how often an attempt of a Request is tried again
    before the Request settles (design §4, "Attempts")."""

    # attempts that could not validate (host lost, never started, dependency down past
    # its deadline) tried again, after `backoff` doubling per retry
    unvalidated: Count = 2
    # red builds run again on the same commit before the verdict (flake detection)
    red: Count = 0
    backoff: Duration = timedelta(seconds=30)


BACKFILL_MODES = ("bisect", "off")


def backfill_shorthand(value: Any) -> Any:
    """``backfill: bisect`` / ``backfill: off`` (YAML reads a bare off as false) stand for
    ``{mode: ...}``."""
    if isinstance(value, bool):
        value = "bisect" if value else "off"
    if isinstance(value, str):
        return {"mode": value}
    if isinstance(value, dict) and isinstance(value.get("mode"), bool):
        return {**value, "mode": "bisect" if value["mode"] else "off"}
    return value


def _backfill_mode(value: object) -> str:
    if value not in BACKFILL_MODES:
        raise ValueError(f"expected one of {', '.join(BACKFILL_MODES)}, got {value!r}")
    assert isinstance(value, str)
    return value


@spec_dataclass(frozen=True, config=SPEC)
class BackfillSpec:
    """A queue's ``backfill`` section: finding the culprit of a red verdict among the
    commits that were never built (design §5, "backfill"). ``bisect`` validates some of
    them by bisection, with spare capacity only; ``off`` (the default: it spends builds
    on the queue's runner) never does."""

    mode: Annotated[str, BeforeValidator(_backfill_mode)] = "off"
    # builds that ran (gave a verdict) one search may spend, re-runs under retry.red
    # included; a probe starts only while 1 + retry.red more builds fit
    max_builds: PositiveInt = 10
    # backfill builds of the queue at once, besides its max_concurrent heads
    max_concurrent: PositiveInt = 1
    # commits a search lists at most (a longer red range is searched in its newest part)
    max_commits: PositiveInt = 1000
    # a commit whose probe could not validate it is probed again after `probe_backoff`,
    # doubling each time (at most PROBE_BACKOFF_CAP), and passed by after this many
    # probes of it could not validate it
    unvalidated_probes: PositiveInt = 5
    probe_backoff: Duration = timedelta(minutes=5)

    @property
    def enabled(self) -> bool:
        return self.mode == "bisect"
