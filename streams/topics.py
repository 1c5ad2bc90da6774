"""topics.yaml: the Kafka topics of the pipeline, loaded, validated, and created.

`load_topics()` reads the file into frozen dataclasses and checks it against the wire
contract (every `TopicKey` and its `_dlq` declared, each key field present on its
payload, ...), reporting every problem at once in one `TopicsConfigError` that names the
file and the entry. `ensure_topics()` creates missing topics and reports, never changes,
existing ones that differ from the file. The CLI (`stovepipe topics`) is a thin shell
over these functions; the devstack and the tests call them directly.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from contract import PAYLOAD_TYPES, TopicKey, payload_type
from streams import settings as settings_mod
from streams.yamlconfig import Problems as _Problems
from streams.yamlconfig import Value as _Value
from streams.yamlconfig import check_fields as _check_fields
from streams.yamlconfig import mapping as _mapping
from streams.yamlconfig import read_yaml

DEFAULT_ADMIN_TIMEOUT = 10.0
MAX_TOPIC_NAME_LENGTH = 249
_TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]*")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

# librdkafka's own log lines (e.g. one per failed connect) go here rather than straight to
# stderr; an application that configures logging sees them, a CLI user sees our message.
_kafka_log = logging.getLogger(__name__ + ".kafka")
_kafka_log.addHandler(logging.NullHandler())

# --- durations ------------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """Parse "250ms", "1s", "2m", "1h", "1m30s" into a timedelta. Raises ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"expected a duration such as 1s or 2m, got {text!r}")
    stripped = text.strip()
    parts = list(_DURATION_PART.finditer(stripped))
    if not parts or "".join(p.group(0) for p in parts) != stripped:
        raise ValueError(f"expected a duration such as 250ms, 1s, 2m or 1h, got {text!r}")
    seconds = sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
    return timedelta(seconds=seconds)


def format_duration(delta: timedelta) -> str:
    """The shortest of "2m", "1m30s", "250ms" that `parse_duration` reads back."""
    ms = round(delta.total_seconds() * 1000)
    if ms == 0:
        return "0s"
    out = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        count, ms = divmod(ms, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out)


# --- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how far apart a failed message is retried.

    `max_attempts` counts deliveries, the first included; None means retry forever.
    Retry n (n >= 1) waits `backoff[n - 1]`; past the end the last delay repeats.
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

_SHARED_FIELDS = {"partitions", "replication_factor", "retry", "config"}
_TOPIC_FIELDS = _SHARED_FIELDS | {"name", "payload", "key_field", "dlq"}
_TIER_FIELDS = {"name", "delay", "partitions", "replication_factor", "config"}
_TOP_FIELDS = {"prefix", "defaults", "dlq_defaults", "topics", "delay_tiers"}
_RETRY_FIELDS = {"max_attempts", "backoff"}


def _layer(layers: list[tuple[dict[str, Any], str]]) -> dict[str, _Value]:
    """Merge entry layers, later wins; `retry` and `config` merge key by key."""
    merged: dict[str, _Value] = {}
    for raw, where in layers:
        for key, value in raw.items():
            if key in ("retry", "config") and isinstance(value, dict):
                for sub, sub_value in value.items():
                    merged[f"{key}.{sub}"] = _Value(sub_value, f"{where}.{key}.{sub}")
                merged.setdefault(key, _Value({}, f"{where}.{key}"))
            else:
                merged[key] = _Value(value, f"{where}.{key}")
    return merged


def _positive_int(merged: dict[str, _Value], key: str, owner: str,
                  problems: _Problems) -> int:
    got = merged.get(key)
    if got is None:
        problems.add(owner, f"missing {key!r} (set it here or in defaults)")
        return 1
    if isinstance(got.value, bool) or not isinstance(got.value, int) or got.value < 1:
        problems.add(got.where, f"must be a positive integer, got {got.value!r}")
        return 1
    return got.value


def _duration(value: _Value, problems: _Problems) -> timedelta:
    try:
        delta = parse_duration(value.value)
    except ValueError as exc:
        problems.add(value.where, str(exc))
        return timedelta(seconds=1)
    if delta <= timedelta(0):
        problems.add(value.where, f"must be longer than zero, got {value.value!r}")
    return delta


def _retry(merged: dict[str, _Value], owner: str, problems: _Problems) -> RetryPolicy:
    if "retry" in merged and not isinstance(merged["retry"].value, dict):
        problems.add(merged["retry"].where, "expected a mapping with max_attempts and backoff")
    for key, value in merged.items():
        if key.startswith("retry.") and key.removeprefix("retry.") not in _RETRY_FIELDS:
            problems.add(value.where, f"unknown field; expected one of {sorted(_RETRY_FIELDS)}")
    attempts = merged.get("retry.max_attempts")
    max_attempts: int | None = 1
    if attempts is None:
        problems.add(owner, "missing retry.max_attempts (set it here or in defaults)")
    elif attempts.value == "forever":
        max_attempts = None
    elif isinstance(attempts.value, bool) or not isinstance(attempts.value, int) \
            or attempts.value < 1:
        problems.add(attempts.where, f"must be a positive integer or 'forever', "
                                     f"got {attempts.value!r}")
    else:
        max_attempts = attempts.value
    raw_backoff = merged.get("retry.backoff")
    backoff: list[timedelta] = []
    if raw_backoff is None:
        problems.add(owner, "missing retry.backoff (set it here or in defaults)")
    elif not isinstance(raw_backoff.value, list) or not raw_backoff.value:
        problems.add(raw_backoff.where, f"expected a non-empty list of durations such as "
                                        f"[1s, 5s, 30s, 2m], got {raw_backoff.value!r}")
    else:
        for i, item in enumerate(raw_backoff.value):
            backoff.append(_duration(_Value(item, f"{raw_backoff.where}[{i}]"), problems))
        if backoff != sorted(backoff):
            problems.add(raw_backoff.where, "delays must not decrease")
    return RetryPolicy(max_attempts, tuple(backoff) or (timedelta(seconds=1),))


def _config(merged: dict[str, _Value], problems: _Problems) -> Mapping[str, str]:
    out: dict[str, str] = {}
    if "config" in merged and not isinstance(merged["config"].value, dict):
        problems.add(merged["config"].where, "expected a mapping of Kafka topic configs")
    for key, value in merged.items():
        if not key.startswith("config."):
            continue
        if isinstance(value.value, bool):
            out[key.removeprefix("config.")] = str(value.value).lower()
        elif isinstance(value.value, str | int | float):
            out[key.removeprefix("config.")] = str(value.value)
        else:
            problems.add(value.where, f"expected a string or number, got {value.value!r}")
    return MappingProxyType(out)


def _name(merged: dict[str, _Value], entry: str, prefix: str, owner: str,
          problems: _Problems) -> tuple[str, str]:
    got = merged.get("name", _Value(entry, f"{owner}.name"))
    name = got.value
    if not isinstance(name, str) or not name or not _TOPIC_CHARS.fullmatch(name):
        problems.add(got.where, f"must be a non-empty topic name of letters, digits, '.', "
                                f"'_' and '-', got {name!r}")
        return entry, prefix + entry
    full = prefix + name
    if len(full) > MAX_TOPIC_NAME_LENGTH or full in (".", ".."):
        problems.add(got.where, f"{full!r} is not a valid Kafka topic name")
    return name, full


def _payload(merged: dict[str, _Value], key: TopicKey, owner: str,
             problems: _Problems) -> type[Message]:
    bound = payload_type(key)
    got = merged.get("payload")
    if got is None:
        return bound
    known = {cls.DESCRIPTOR.name: cls for cls in PAYLOAD_TYPES}
    known.update({cls.DESCRIPTOR.full_name: cls for cls in PAYLOAD_TYPES})
    declared = known.get(got.value) if isinstance(got.value, str) else None
    if declared is None:
        problems.add(got.where, f"{got.value!r} is not a contract message; expected one of "
                                f"{sorted(cls.DESCRIPTOR.name for cls in PAYLOAD_TYPES)}")
    elif declared is not bound:
        problems.add(got.where, f"topic key {key.value!r} carries {bound.DESCRIPTOR.name} "
                                f"(its topic_keys option), not {got.value}")
    return bound


def _key_field(merged: dict[str, _Value], payload: type[Message], owner: str,
               problems: _Problems) -> str:
    got = merged.get("key_field")
    if got is None:
        problems.add(owner, "missing 'key_field' (the payload field used as the Kafka key)")
        return ""
    fields = payload.DESCRIPTOR.fields_by_name
    field_desc = fields.get(got.value) if isinstance(got.value, str) else None
    if field_desc is None:
        problems.add(got.where, f"{got.value!r} is not a field of {payload.DESCRIPTOR.name}; "
                                f"its fields are {sorted(fields)}")
        return ""
    if field_desc.type != FieldDescriptor.TYPE_STRING:
        problems.add(got.where, f"{payload.DESCRIPTOR.name}.{got.value} is not a string field")
    return str(got.value)


def _topic_spec(entry: str, key: TopicKey, dead_letter: bool, layers: list[tuple[dict, str]],
                prefix: str, problems: _Problems) -> TopicSpec:
    owner = layers[-1][1]
    merged = _layer(layers)
    name, full = _name(merged, entry, prefix, owner, problems)
    payload = _payload(merged, key, owner, problems)
    retry = _retry(merged, owner, problems)
    dlq_value = merged.get("dlq", _Value(not dead_letter, f"{owner}.dlq"))
    dlq = dlq_value.value
    if not isinstance(dlq, bool):
        problems.add(dlq_value.where, f"must be true or false, got {dlq!r}")
        dlq = not dead_letter
    elif dead_letter and dlq:
        problems.add(dlq_value.where, "a _dlq topic must not dead-letter itself: set dlq: false")
    if dead_letter and not retry.forever:
        problems.add(owner, "a _dlq topic's reconciler must retry forever: "
                            "set retry.max_attempts: forever")
    elif not dlq and not retry.forever:
        problems.add(owner, "with dlq: false, exhausted messages would be lost: "
                            "set retry.max_attempts: forever or dlq: true")
    return TopicSpec(
        entry=entry,
        topic_key=key,
        is_dead_letter=dead_letter,
        name=name,
        full_name=full,
        partitions=_positive_int(merged, "partitions", owner, problems),
        replication_factor=_positive_int(merged, "replication_factor", owner, problems),
        payload=payload,
        key_field=_key_field(merged, payload, owner, problems),
        retry=retry,
        dlq=dlq,
        config=_config(merged, problems),
    )


def _delay_tier(entry: str, layers: list[tuple[dict, str]], prefix: str,
                problems: _Problems) -> DelayTier:
    owner = layers[-1][1]
    merged = _layer(layers)
    name, full = _name(merged, entry, prefix, owner, problems)
    delay = merged.get("delay")
    if delay is None:
        problems.add(owner, "missing 'delay', e.g. delay: 5s")
    return DelayTier(
        entry=entry,
        name=name,
        full_name=full,
        delay=_duration(delay, problems) if delay else timedelta(seconds=1),
        partitions=_positive_int(merged, "partitions", owner, problems),
        replication_factor=_positive_int(merged, "replication_factor", owner, problems),
        config=_config(merged, problems),
    )


def _read_yaml(path: Path) -> Any:
    return read_yaml(path, TopicsConfigError)


def load_topics(path: Path | str | None = None, prefix: str | None = None) -> TopicsConfig:
    """Load and validate topics.yaml.

    `path` defaults to settings (STOVEPIPE_TOPICS_FILE, else the repo's topics.yaml).
    The name prefix is, first found: `prefix`, STOVEPIPE_TOPIC_PREFIX (even if empty),
    the file's `prefix`, settings.DEFAULT_TOPIC_PREFIX.
    Raises TopicsConfigError listing every problem found.
    """
    file = Path(path) if path is not None else settings_mod.load_settings().topics_file
    raw = _read_yaml(file)
    problems = _Problems()
    if not isinstance(raw, dict):
        raise TopicsConfigError(file, ["expected a mapping with 'topics' and 'delay_tiers'"])
    _check_fields(raw, _TOP_FIELDS, "(top level)", problems)

    if prefix is None:
        prefix = os.environ.get(settings_mod.ENV_TOPIC_PREFIX)
        where = settings_mod.ENV_TOPIC_PREFIX
        if prefix is None:
            prefix = raw.get("prefix", settings_mod.DEFAULT_TOPIC_PREFIX)
            where = "prefix"
    else:
        where = "prefix argument"
    if not isinstance(prefix, str) or not _TOPIC_CHARS.fullmatch(prefix):
        problems.add(where, f"must be letters, digits, '.', '_' and '-', got {prefix!r}")
        prefix = ""

    defaults = _mapping(raw.get("defaults"), "defaults", problems)
    _check_fields(defaults, _SHARED_FIELDS, "defaults", problems)
    dlq_defaults = _mapping(raw.get("dlq_defaults"), "dlq_defaults", problems)
    _check_fields(dlq_defaults, _SHARED_FIELDS, "dlq_defaults", problems)
    topics_raw = _mapping(raw.get("topics"), "topics", problems)
    tiers_raw = _mapping(raw.get("delay_tiers"), "delay_tiers", problems)

    stages: dict[TopicKey, TopicSpec] = {}
    dead_letters: dict[TopicKey, TopicSpec] = {}
    expected = [k.value for k in TopicKey] + [k.dlq for k in TopicKey]
    for entry, body in topics_raw.items():
        where = f"topics.{entry}"
        key = TopicKey.of_dlq(str(entry))
        dead_letter = key is not None
        if key is None and entry in {k.value for k in TopicKey}:
            key = TopicKey(entry)
        if key is None:
            problems.add(where, f"unknown topic key; expected one of {expected}")
            continue
        entry_raw = _mapping(body, where, problems)
        _check_fields(entry_raw, _TOPIC_FIELDS, where, problems)
        layers = [(defaults, "defaults")]
        if dead_letter:
            # A dead-letter topic carries its stage's messages unchanged.
            stage_raw = topics_raw.get(key.value)
            if isinstance(stage_raw, dict):
                inherited = {k: stage_raw[k] for k in ("payload", "key_field") if k in stage_raw}
                layers.append((inherited, f"topics.{key.value}"))
            layers.append((dlq_defaults, "dlq_defaults"))
        layers.append((entry_raw, where))
        spec = _topic_spec(str(entry), key, dead_letter, layers, prefix, problems)
        (dead_letters if dead_letter else stages)[key] = spec

    for key in TopicKey:
        if key not in stages:
            problems.add("topics", f"missing topic key {key.value!r}")
        if key not in dead_letters:
            problems.add("topics", f"missing {key.dlq!r} (every stage needs its dead-letter "
                                   f"topic)")
        if key in stages and key in dead_letters:
            stage, dead = stages[key], dead_letters[key]
            if stage.key_field and dead.key_field and dead.key_field != stage.key_field:
                problems.add(f"topics.{dead.entry}.key_field",
                             f"must match {stage.entry}'s key_field {stage.key_field!r}: "
                             f"a _dlq topic keeps its stage's keys")

    tiers: list[DelayTier] = []
    for entry, body in tiers_raw.items():
        where = f"delay_tiers.{entry}"
        entry_raw = _mapping(body, where, problems)
        _check_fields(entry_raw, _TIER_FIELDS, where, problems)
        tiers.append(_delay_tier(str(entry), [(defaults, "defaults"), (entry_raw, where)],
                                 prefix, problems))
    if not tiers:
        problems.add("delay_tiers", "declare at least one delay tier, e.g. delay_1s: {delay: 1s}")
    tiers.sort(key=lambda t: t.delay)
    for shorter, longer in itertools.pairwise(tiers):
        if shorter.delay == longer.delay:
            problems.add(f"delay_tiers.{longer.entry}",
                         f"same delay as {shorter.entry} ({format_duration(longer.delay)})")

    seen: dict[str, str] = {}
    declared: list[tuple[str, TopicSpec | DelayTier]] = [
        *((f"topics.{t.entry}", t) for t in (*stages.values(), *dead_letters.values())),
        *((f"delay_tiers.{t.entry}", t) for t in tiers),
    ]
    for where, topic in declared:
        if topic.full_name in seen:
            problems.add(where, f"topic name {topic.full_name!r} is also used by "
                                f"{seen[topic.full_name]}")
        seen.setdefault(topic.full_name, where)

    if problems.items:
        raise TopicsConfigError(file, problems.items)
    return TopicsConfig(
        path=file,
        prefix=prefix,
        stages=MappingProxyType({k: stages[k] for k in TopicKey}),
        dead_letters=MappingProxyType({k: dead_letters[k] for k in TopicKey}),
        delay_tiers=tuple(tiers),
    )


# --- creating and verifying on the broker ---------------------------------------------


class TopicState(StrEnum):
    CREATED = "created"
    EXISTS = "exists"  # present and matching topics.yaml
    MISMATCH = "mismatch"  # present, differs from topics.yaml; left unchanged
    MISSING = "missing"  # absent (verify only)
    FAILED = "failed"  # the broker refused to create it


@dataclass(frozen=True)
class TopicStatus:
    topic: TopicSpec | DelayTier
    state: TopicState
    detail: str = ""

    @property
    def name(self) -> str:
        return self.topic.full_name

    @property
    def ok(self) -> bool:
        """The topic exists as topics.yaml says."""
        return self.state in (TopicState.CREATED, TopicState.EXISTS)


@dataclass(frozen=True)
class TopicsReport:
    statuses: tuple[TopicStatus, ...]

    def __iter__(self) -> Iterator[TopicStatus]:
        return iter(self.statuses)

    def with_state(self, state: TopicState) -> tuple[TopicStatus, ...]:
        return tuple(s for s in self.statuses if s.state is state)

    @property
    def ok(self) -> bool:
        """Every topic exists as topics.yaml says."""
        return all(s.ok for s in self.statuses)


class TopicsAdminError(RuntimeError):
    """The broker could not be reached or did not answer in time."""


def _reason(exc: BaseException) -> str:
    from confluent_kafka import KafkaError

    err = exc.args[0] if exc.args else exc
    return err.str() if isinstance(err, KafkaError) else str(err)


def _admin(admin_conf: Mapping[str, Any]) -> Any:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    conf = {"logger": _kafka_log, **admin_conf}
    try:
        return AdminClient(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        raise TopicsAdminError(f"bad Kafka admin configuration: {_reason(exc)}") from None


def _describe(admin: Any, bootstrap: str, timeout: float) -> dict[str, tuple[int, int]]:
    """Topic name → (partitions, replication factor) for every topic on the cluster."""
    from confluent_kafka import KafkaException

    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicsAdminError(
            f"no answer from Kafka at {bootstrap} within {timeout:g}s ({_reason(exc)}); "
            f"is the broker running? (`stovepipe dev up` starts a local one)"
        ) from None
    out = {}
    for name, topic in metadata.topics.items():
        if topic.error is not None:
            continue
        replicas = max((len(p.replicas) for p in topic.partitions.values()), default=0)
        out[name] = (len(topic.partitions), replicas)
    return out


def _await_visible(admin: Any, bootstrap: str, names: list[str],
                   timeout: float) -> dict[str, tuple[int, int]]:
    """`_describe`, polled until every one of `names` is listed or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        existing = _describe(admin, bootstrap, timeout)
        if all(n in existing for n in names) or time.monotonic() >= deadline:
            return existing
        time.sleep(0.1)


def _compare(topic: TopicSpec | DelayTier, actual: tuple[int, int]) -> TopicStatus:
    partitions, replicas = actual
    drift = []
    if partitions != topic.partitions:
        drift.append(f"partitions: topics.yaml says {topic.partitions}, broker has {partitions}")
    if replicas != topic.replication_factor:
        drift.append(f"replication factor: topics.yaml says {topic.replication_factor}, "
                     f"broker has {replicas}")
    if drift:
        return TopicStatus(topic, TopicState.MISMATCH, "; ".join(drift))
    return TopicStatus(topic, TopicState.EXISTS, f"{partitions} partitions")


def ensure_topics(
    admin_conf: Mapping[str, Any],
    config: TopicsConfig,
    *,
    create: bool = True,
    timeout: float = DEFAULT_ADMIN_TIMEOUT,
    topics: Iterable[TopicSpec | DelayTier] | None = None,
) -> TopicsReport:
    """Create the missing topics of `config` (all, or just `topics`) and report on each.

    Idempotent. An existing topic is never altered: one whose partition count or
    replication factor differs from topics.yaml is reported as MISMATCH. With
    `create=False` nothing is created and absent topics are MISSING. Every admin call is
    bounded by `timeout` seconds; no answer raises TopicsAdminError.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    bootstrap = str(admin_conf.get("bootstrap.servers", "?"))
    admin = _admin(admin_conf)
    wanted = tuple(topics) if topics is not None else config.all_topics()
    existing = _describe(admin, bootstrap, timeout)

    statuses: dict[str, TopicStatus] = {}
    to_create = []
    for topic in wanted:
        if topic.full_name in existing:
            statuses[topic.full_name] = _compare(topic, existing[topic.full_name])
        elif create:
            to_create.append(topic)
        else:
            statuses[topic.full_name] = TopicStatus(topic, TopicState.MISSING, "not on broker")

    if to_create:
        futures = admin.create_topics(
            [NewTopic(t.full_name, num_partitions=t.partitions,
                      replication_factor=t.replication_factor, config=dict(t.config))
             for t in to_create],
            operation_timeout=timeout,
            request_timeout=timeout,
        )
        created, raced = [], []
        for topic in to_create:
            try:
                futures[topic.full_name].result(timeout=timeout + 5)
            except KafkaException as exc:
                err = exc.args[0]
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    raced.append(topic)  # created by someone else since we listed: check it
                    continue
                statuses[topic.full_name] = TopicStatus(topic, TopicState.FAILED, _reason(exc))
            except TimeoutError:
                statuses[topic.full_name] = TopicStatus(
                    topic, TopicState.FAILED, f"no answer within {timeout:g}s")
            else:
                created.append(topic)
        # The controller acknowledges a creation before every broker's metadata shows the
        # topic; wait (bounded) so that "created" means a consumer can use it now.
        visible = _await_visible(admin, bootstrap, [t.full_name for t in created + raced],
                                 timeout)
        for topic in created:
            detail = f"{topic.partitions} partitions, replication {topic.replication_factor}"
            if topic.full_name not in visible:
                detail += f" (not yet in the broker's metadata after {timeout:g}s)"
            statuses[topic.full_name] = TopicStatus(topic, TopicState.CREATED, detail)
        for topic in raced:
            actual = visible.get(topic.full_name)
            statuses[topic.full_name] = _compare(topic, actual) if actual else TopicStatus(
                topic, TopicState.FAILED,
                f"the broker says it exists but did not list it within {timeout:g}s")
    return TopicsReport(tuple(statuses[t.full_name] for t in wanted))


def admin_conf_for(bootstrap: str) -> dict[str, Any]:
    """A minimal AdminClient configuration for `bootstrap`."""
    return {"bootstrap.servers": bootstrap}
