"""topics.yaml: the Kafka topics of the pipeline, loaded and validated (design §9).

`load_topics()` reads the file into frozen dataclasses and checks it against the wire
contract (every `TopicKey` and its `_dlq` declared, each key field present on its
payload, ...), reporting every problem at once in one `TopicsConfigError` that names the
file and the entry. Creating the topics on a broker is `streams.runtime.topic_admin`.

Each section is validated by a pydantic model (`streams.config.topic_sections`); then
every topic is its layers merged — ``defaults``, for a `_dlq` topic its stage's payload and
key field and ``dlq_defaults``, then its own entry — and checked as a whole.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from pydantic import ValidationError

from contract import PAYLOAD_TYPES, TopicKey, payload_type
from streams.config import settings as settings_mod
from streams.config.topic_sections import (
    FOREVER,
    TOPIC_CHARS,
    MergedEntry,
    TierEntry,
    TopicEntry,
    TopicLayer,
    TopLevel,
)
from streams.schema.durations import format_duration
from streams.schema.fields import Problems, Section, read_yaml

MAX_TOPIC_NAME_LENGTH = 249
S = TypeVar("S", bound="Section")


# --- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how far apart a failed message is retried.

    `max_attempts` counts deliveries, the first included; None means retry forever.
    Retry n (n >= 1) waits `backoff[n - 1]`; past the end the last delay repeats.
    For a `_dlq` topic, `max_attempts` bounds the attempts at a message that can never be
    reconciled before it is parked (transient failures are retried forever).
    """

    max_attempts: int | None
    backoff: tuple[timedelta, ...]

    @property
    def forever(self) -> bool:
        return self.max_attempts is None

    def exhausted(self, attempts: int) -> bool:
        """True when a message that failed `attempts` deliveries gets no more."""
        return self.max_attempts is not None and attempts >= self.max_attempts

    def backoff_after(self, attempts: int) -> timedelta:
        """The wait before the next delivery of a message that failed `attempts` times."""
        if attempts < 1:
            raise ValueError("attempts counts failed deliveries and starts at 1")
        return self.backoff[min(attempts, len(self.backoff)) - 1]

    def describe(self) -> str:
        tries = "forever" if self.max_attempts is None else f"{self.max_attempts} attempts"
        return f"{tries}, backoff {' '.join(format_duration(b) for b in self.backoff)}"


@dataclass(frozen=True)
class TopicSpec:
    """One pipeline topic: a stage's topic, or (`is_dead_letter`) its `_dlq` topic."""

    entry: str  # its key in topics.yaml: "process" or "process_dlq"
    topic_key: TopicKey  # the stage it belongs to
    is_dead_letter: bool  # True for `<key>_dlq`, the reconciler's input
    name: str
    full_name: str  # prefix + name: the Kafka topic
    partitions: int
    replication_factor: int
    payload: type[Message]
    key_field: str  # the payload field used as the Kafka key
    retry: RetryPolicy
    dlq: bool  # True: exhausted or non-retryable messages go to the `_dlq` topic
    config: Mapping[str, str] = field(default_factory=dict)
    park_after: int | None = None  # `_dlq` only: attempts at an irreconcilable message


@dataclass(frozen=True)
class DelayTier:
    """A delayed-redelivery topic: its consumer re-produces each message once it is due."""

    entry: str
    name: str
    full_name: str
    delay: timedelta
    partitions: int
    replication_factor: int
    config: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopicsConfig:
    path: Path
    prefix: str
    stages: Mapping[TopicKey, TopicSpec]
    dead_letters: Mapping[TopicKey, TopicSpec]
    delay_tiers: tuple[DelayTier, ...]  # shortest delay first

    def stage(self, key: TopicKey | str) -> TopicSpec:
        return self.stages[TopicKey(key)]

    def dead_letter(self, key: TopicKey | str) -> TopicSpec:
        """The `<key>_dlq` topic."""
        return self.dead_letters[TopicKey(key)]

    def dead_letter_for(self, spec: TopicSpec) -> TopicSpec | None:
        """Where `spec` sends exhausted or non-retryable messages; None if it never does."""
        return self.dead_letters[spec.topic_key] if spec.dlq else None

    def entry(self, entry: str) -> TopicSpec | DelayTier:
        """Look up by topics.yaml entry: "process", "process_dlq", "delay_5s"."""
        for topic in self.all_topics():
            if topic.entry == entry:
                return topic
        raise KeyError(entry)

    def by_name(self, full_name: str) -> TopicSpec | DelayTier:
        """Look up by full Kafka topic name (prefix included)."""
        for topic in self.all_topics():
            if topic.full_name == full_name:
                return topic
        raise KeyError(full_name)

    def all_topics(self) -> tuple[TopicSpec | DelayTier, ...]:
        """Every topic to create: stages, their `_dlq` topics, then the delay tiers."""
        return (*self.stages.values(), *self.dead_letters.values(), *self.delay_tiers)


class TopicsConfigError(ValueError):
    """topics.yaml is unreadable or invalid. `problems` lists each one, entry named."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  {problem}" for problem in problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n{lines}")


# --- loading --------------------------------------------------------------------------


def load_topics(path: Path | str | None = None, prefix: str | None = None) -> TopicsConfig:
    """Load and validate topics.yaml.

    `path` defaults to settings (STOVEPIPE_TOPICS_FILE, else the repo's topics.yaml).
    The name prefix is, first found: `prefix`, STOVEPIPE_TOPIC_PREFIX (even if empty),
    the file's `prefix`, settings.DEFAULT_TOPIC_PREFIX.
    Raises TopicsConfigError listing every problem found.
    """
    file = Path(path) if path is not None else settings_mod.load_settings().topics_file
    raw = read_yaml(file, TopicsConfigError)
    if not isinstance(raw, dict):
        raise TopicsConfigError(file, ["expected a mapping with 'topics' and 'delay_tiers'"])
    problems = Problems()
    try:
        TopLevel.model_validate(raw)
    except ValidationError as exc:
        problems.add_validation_error(exc, TopLevel)
    prefix = _prefix(raw, prefix, problems)

    defaults = _section(TopicLayer, raw.get("defaults"), "defaults", problems)
    dlq_defaults = _section(TopicLayer, raw.get("dlq_defaults"), "dlq_defaults", problems)
    topics_raw = _mapping(raw.get("topics"), "topics", problems)
    tiers_raw = _mapping(raw.get("delay_tiers"), "delay_tiers", problems)

    entries: dict[str, TopicEntry] = {}
    invalid: set[str] = set()  # reported already: not "missing" as well
    expected = [k.value for k in TopicKey] + [k.dlq for k in TopicKey]
    for entry, body in topics_raw.items():
        if TopicKey.of_dlq(str(entry)) is None and entry not in {k.value for k in TopicKey}:
            problems.add(f"topics.{entry}", f"unknown topic key; expected one of {expected}")
            continue
        section = _section(TopicEntry, body, f"topics.{entry}", problems)
        if section is None:
            invalid.add(str(entry))
        else:
            entries[str(entry)] = section

    stages: dict[TopicKey, TopicSpec] = {}
    dead_letters: dict[TopicKey, TopicSpec] = {}
    for entry, section in entries.items():
        dlq_key = TopicKey.of_dlq(entry)
        key = dlq_key or TopicKey(entry)
        where = f"topics.{entry}"
        layers: list[tuple[Section, str]] = [(defaults or TopicLayer(), "defaults")]
        if dlq_key is not None:
            # a dead-letter topic carries its stage's messages unchanged
            stage_entry = entries.get(key.value)
            if stage_entry is not None:
                inherited = TopicEntry.model_construct(
                    **{k: getattr(stage_entry, k) for k in ("payload", "key_field")
                       if k in stage_entry.model_fields_set})
                layers.append((inherited, f"topics.{key.value}"))
            layers.append((dlq_defaults or TopicLayer(), "dlq_defaults"))
        layers.append((section, where))
        spec = _topic_spec(entry, key, dlq_key is not None, MergedEntry(layers), prefix, problems)
        (dead_letters if dlq_key is not None else stages)[key] = spec

    for key in TopicKey:
        if key not in stages and key.value not in invalid:
            problems.add("topics", f"missing topic key {key.value!r}")
        if key not in dead_letters and key.dlq not in invalid:
            problems.add("topics", f"missing {key.dlq!r} (every stage needs its dead-letter "
                                   f"topic)")
        if key in stages and key in dead_letters:
            stage, dead = stages[key], dead_letters[key]
            if stage.key_field and dead.key_field and dead.key_field != stage.key_field:
                problems.add(f"topics.{dead.entry}.key_field",
                             f"must match {stage.entry}'s key_field {stage.key_field!r}: "
                             f"a _dlq topic keeps its stage's keys")

    tiers = _delay_tiers(tiers_raw, defaults or TopicLayer(), prefix, problems)
    _check_unique_names([*stages.values(), *dead_letters.values()], tiers, problems)
    if problems.items:
        raise TopicsConfigError(file, problems.items)
    return TopicsConfig(
        path=file,
        prefix=prefix,
        stages=MappingProxyType({k: stages[k] for k in TopicKey}),
        dead_letters=MappingProxyType({k: dead_letters[k] for k in TopicKey}),
        delay_tiers=tuple(tiers),
    )


def _prefix(raw: dict[str, Any], prefix: str | None, problems: Problems) -> str:
    if prefix is not None:
        where = "prefix argument"
    else:
        prefix = os.environ.get(settings_mod.ENV_TOPIC_PREFIX)
        where = settings_mod.ENV_TOPIC_PREFIX
        if prefix is None:
            prefix = raw.get("prefix", settings_mod.DEFAULT_TOPIC_PREFIX)
            where = "prefix"
    if not isinstance(prefix, str) or not TOPIC_CHARS.fullmatch(prefix):
        problems.add(where, f"must be letters, digits, '.', '_' and '-', got {prefix!r}")
        return ""
    return prefix


def _section(model: type[S], raw: Any, where: str, problems: Problems) -> S | None:
    try:
        return model.model_validate({} if raw is None else raw)
    except ValidationError as exc:
        problems.add_validation_error(exc, model, where)
        return None


def _mapping(raw: Any, where: str, problems: Problems) -> dict[Any, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add(where, f"expected a mapping, got {type(raw).__name__}")
        return {}
    return raw


def _topic_spec(entry: str, key: TopicKey, dead_letter: bool, merged: MergedEntry, prefix: str,
                problems: Problems) -> TopicSpec:
    owner = merged.owner
    name = merged.get("name", entry)
    full = prefix + name
    if len(full) > MAX_TOPIC_NAME_LENGTH or full in (".", ".."):
        problems.add(merged.where("name"), f"{full!r} is not a valid Kafka topic name")
    payload = _payload(merged, key, problems)
    retry = _retry(merged, problems)
    dlq = merged.get("dlq", not dead_letter)
    if dead_letter and dlq:
        problems.add(merged.where("dlq"), "a _dlq topic must not dead-letter itself: "
                                          "set dlq: false")
    if dead_letter and not retry.forever:
        problems.add(owner, "a _dlq topic's reconciler must retry forever: "
                            "set retry.max_attempts: forever")
    elif not dlq and not retry.forever:
        problems.add(owner, "with dlq: false, exhausted messages would be lost: "
                            "set retry.max_attempts: forever or dlq: true")
    park_after = merged.get("retry.park_after")
    if park_after is not None and not dead_letter:
        problems.add(merged.where("retry.park_after"), "only a _dlq topic parks messages; "
                                                       "a stage dead-letters them")
    return TopicSpec(
        entry=entry,
        topic_key=key,
        is_dead_letter=dead_letter,
        name=name,
        full_name=full,
        partitions=merged.required("partitions", problems, " (set it here or in defaults)")
        or 1,
        replication_factor=merged.required("replication_factor", problems,
                                           " (set it here or in defaults)") or 1,
        payload=payload,
        key_field=_key_field(merged, payload, problems),
        retry=retry,
        dlq=dlq,
        config=MappingProxyType(dict(merged.config)),
        park_after=park_after if dead_letter else None,
    )


def _retry(merged: MergedEntry, problems: Problems) -> RetryPolicy:
    attempts = merged.required("retry.max_attempts", problems,
                               " (set it here or in defaults)")
    backoff = merged.required("retry.backoff", problems, " (set it here or in defaults)")
    return RetryPolicy(None if attempts in (None, FOREVER) else int(attempts),
                       tuple(backoff or ()) or (timedelta(seconds=1),))


def _payload(merged: MergedEntry, key: TopicKey, problems: Problems) -> type[Message]:
    bound = payload_type(key)
    declared_name = merged.get("payload")
    if declared_name is None:
        return bound
    known = {cls.DESCRIPTOR.name: cls for cls in PAYLOAD_TYPES}
    known.update({cls.DESCRIPTOR.full_name: cls for cls in PAYLOAD_TYPES})
    declared = known.get(declared_name)
    if declared is None:
        problems.add(merged.where("payload"),
                     f"{declared_name!r} is not a contract message; expected one of "
                     f"{sorted(cls.DESCRIPTOR.name for cls in PAYLOAD_TYPES)}")
    elif declared is not bound:
        problems.add(merged.where("payload"),
                     f"topic key {key.value!r} carries {bound.DESCRIPTOR.name} (its "
                     f"topic_keys option), not {declared_name}")
    return bound


def _key_field(merged: MergedEntry, payload: type[Message], problems: Problems) -> str:
    name = merged.required("key_field", problems,
                           " (the payload field used as the Kafka key)")
    if name is None:
        return ""
    fields = payload.DESCRIPTOR.fields_by_name
    found = fields.get(name)
    if found is None:
        problems.add(merged.where("key_field"),
                     f"{name!r} is not a field of {payload.DESCRIPTOR.name}; its fields are "
                     f"{sorted(fields)}")
        return ""
    if found.type != FieldDescriptor.TYPE_STRING:
        problems.add(merged.where("key_field"),
                     f"{payload.DESCRIPTOR.name}.{name} is not a string field")
    return str(name)


def _delay_tiers(tiers_raw: dict[Any, Any], defaults: TopicLayer, prefix: str,
                 problems: Problems) -> list[DelayTier]:
    tiers: list[DelayTier] = []
    for entry, body in tiers_raw.items():
        where = f"delay_tiers.{entry}"
        section = _section(TierEntry, body, where, problems)
        if section is None:
            continue
        merged = MergedEntry([(defaults, "defaults"), (section, where)])
        name = merged.get("name", str(entry))
        tiers.append(DelayTier(
            entry=str(entry),
            name=name,
            full_name=prefix + name,
            delay=merged.required("delay", problems, ", e.g. delay: 5s")
            or timedelta(seconds=1),
            partitions=merged.required("partitions", problems,
                                       " (set it here or in defaults)") or 1,
            replication_factor=merged.required("replication_factor", problems,
                                               " (set it here or in defaults)") or 1,
            config=MappingProxyType(dict(merged.config)),
        ))
    if not tiers_raw:
        problems.add("delay_tiers", "declare at least one delay tier, e.g. delay_1s: {delay: 1s}")
    tiers.sort(key=lambda t: t.delay)
    for shorter, longer in itertools.pairwise(tiers):
        if shorter.delay == longer.delay:
            problems.add(f"delay_tiers.{longer.entry}",
                         f"same delay as {shorter.entry} ({format_duration(longer.delay)})")
    return tiers


def _check_unique_names(topics: list[TopicSpec], tiers: list[DelayTier],
                        problems: Problems) -> None:
    seen: dict[str, str] = {}
    declared: list[tuple[str, TopicSpec | DelayTier]] = [
        *((f"topics.{t.entry}", t) for t in topics),
        *((f"delay_tiers.{t.entry}", t) for t in tiers),
    ]
    for where, topic in declared:
        if topic.full_name in seen:
            problems.add(where, f"topic name {topic.full_name!r} is also used by "
                                f"{seen[topic.full_name]}")
        seen.setdefault(topic.full_name, where)
