"""Durations as users write them in topics.yaml, queues.yaml and on the command line:
``250ms``, ``1s``, ``2m``, ``1h``, ``7d``, or combined (``1m30s``)."""

from __future__ import annotations

import re
from datetime import timedelta

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: object) -> timedelta:
    """Parse "250ms", "1s", "2m", "1h", "7d", "1m30s" into a timedelta. Raises ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as 1s or 2m, got {text!r}")
    stripped = text.strip()
    parts = list(_DURATION_PART.finditer(stripped))
    if not parts or "".join(p.group(0) for p in parts) != stripped:
        raise ValueError(f"expected a duration such as 250ms, 1s, 2m, 1h or 7d, got {text!r}")
    seconds = sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
    return timedelta(seconds=seconds)


def format_duration(delta: timedelta) -> str:
    """The shortest of "2m", "1m30s", "250ms", "180d" that `parse_duration` reads back."""
    ms = round(delta.total_seconds() * 1000)
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000),
                       ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)
