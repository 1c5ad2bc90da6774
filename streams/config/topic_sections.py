"""The sections of topics.yaml as pydantic models, and how an entry's layers merge.

`TopicLayer` validates ``defaults`` and ``dlq_defaults``, `TopicEntry` each entry of
``topics``, `TierEntry` each entry of ``delay_tiers``. `MergedEntry` is one topic's layers
merged (later wins; ``retry`` and ``config`` key by key), each value remembering the YAML
path it came from, so a problem found after merging still names the line to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

from streams.schema.durations import parse_duration
from streams.schema.fields import Duration, Flag, PositiveInt, Problems, Section

TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]*")

FOREVER = "forever"


def _attempts(value: object) -> int | str:
    if value == FOREVER:
        return FOREVER
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer or 'forever', got {value!r}")
    return value


def _backoff_list(value: object) -> object:
    if not isinstance(value, list) or not value:
        raise ValueError(f"expected a non-empty list of durations such as [1s, 5s, 30s, 2m], "
                         f"got {value!r}")
    return value


def _not_decreasing(delays: list[timedelta]) -> list[timedelta]:
    if delays != sorted(delays):
        raise ValueError("delays must not decrease")
    return delays


def _topic_name(value: object) -> str:
    if not isinstance(value, str) or not value or not TOPIC_CHARS.fullmatch(value):
        raise ValueError(f"must be a non-empty topic name of letters, digits, '.', '_' and "
                         f"'-', got {value!r}")
    return value


def _config_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"expected a string or number, got {value!r}")


def _topic_configs(values: dict[str, str]) -> dict[str, str]:
    """Kafka's own topic configs; one whose name ends in ``.ms`` (``retention.ms``,
    ``segment.ms``) may be written as a duration (``7d``, ``1h``): it is stored in
    milliseconds, as Kafka reads it. ``-1`` (no limit) and plain numbers stay."""
    out = {}
    for name, value in values.items():
        if name.endswith(".ms") and not value.lstrip("-").isdigit():
            try:
                value = str(round(parse_duration(value).total_seconds() * 1000))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc} (or milliseconds, or -1 for no limit)") \
                    from None
        out[name] = value
    return out


Attempts = Annotated[int | str, BeforeValidator(_attempts)]
Backoff = Annotated[list[Duration], BeforeValidator(_backoff_list),
                    AfterValidator(_not_decreasing)]
TopicName = Annotated[str, BeforeValidator(_topic_name)]
ConfigValue = Annotated[str, BeforeValidator(_config_value)]
TopicConfigs = Annotated[dict[str, ConfigValue], AfterValidator(_topic_configs)]


class RetryLayer(Section):
    max_attempts: Attempts | None = None
    backoff: Backoff | None = None
    park_after: PositiveInt | None = None


class TopicLayer(Section):
    """What ``defaults`` and ``dlq_defaults`` may set for every topic."""

    partitions: PositiveInt | None = None
    replication_factor: PositiveInt | None = None
    retry: RetryLayer | None = None
    config: TopicConfigs | None = None


class TopicEntry(TopicLayer):
    """One entry of ``topics``."""

    name: TopicName | None = None
    payload: str | None = None
    key_field: str | None = None
    dlq: Flag | None = None


class TierEntry(Section):
    """One entry of ``delay_tiers``."""

    name: TopicName | None = None
    delay: Duration | None = None
    partitions: PositiveInt | None = None
    replication_factor: PositiveInt | None = None
    config: TopicConfigs | None = None


class TopLevel(Section):
    prefix: Any = None
    defaults: Any = None
    dlq_defaults: Any = None
    topics: Any = None
    delay_tiers: Any = None


@dataclass(frozen=True)
class LayerValue:
    value: Any
    where: str  # the YAML path it came from


class MergedEntry:
    """An entry's layers merged, later wins; ``retry`` and ``config`` key by key."""

    def __init__(self, layers: list[tuple[Section, str]]) -> None:
        self.owner = layers[-1][1]
        self.values: dict[str, LayerValue] = {}
        self.config: dict[str, str] = {}
        for layer, where in layers:
            for key in layer.model_fields_set:
                value = getattr(layer, key)
                if value is None:
                    continue
                if isinstance(value, RetryLayer):
                    for sub in value.model_fields_set:
                        if getattr(value, sub) is not None:
                            self.values[f"retry.{sub}"] = LayerValue(getattr(value, sub),
                                                                 f"{where}.retry.{sub}")
                elif key == "config":
                    self.config.update(value)
                else:
                    self.values[key] = LayerValue(value, f"{where}.{key}")

    def get(self, key: str, default: Any = None) -> Any:
        found = self.values.get(key)
        return default if found is None else found.value

    def where(self, key: str) -> str:
        found = self.values.get(key)
        return found.where if found is not None else f"{self.owner}.{key}"

    def required(self, key: str, problems: Problems, hint: str = "") -> Any:
        if key not in self.values:
            problems.add(self.owner, f"missing {key!r}{hint}")
        return self.get(key)
