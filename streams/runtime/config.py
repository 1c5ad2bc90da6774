"""WorkerConfig from topics.yaml: the runtime's view of the topic registry (no Faust here:
the CLI reads it too)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from streams.config.kafka_security import KafkaSecurity
from streams.config.settings import DEFAULT_MAX_IN_FLIGHT
from streams.config.topics import RetryPolicy, TopicsConfig, TopicSpec
from streams.runtime import timings
from streams.runtime.kafka import TopicRoute
from streams.runtime.policy import Retry
from streams.runtime.stage import Route


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker consumes and publishes to (from topics.yaml), and its knobs."""

    app_id: str
    bootstrap: str
    topics: dict[str, TopicRoute]  # by topic key: every stage and every topic published to
    routes: dict[str, Route]  # by topic key of each consumed stage
    delay_tiers: dict[str, float]  # tier topic name -> delay in seconds
    web_port: int | None = None
    commit_interval: float = 0.5
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # messages under way per stage at once
    security: KafkaSecurity = field(default_factory=KafkaSecurity)  # TLS, SASL of its clients
    # static membership: the same id for the same worker across restarts (timings, 6.)
    group_instance_id: str | None = None
    session_timeout: float = timings.SESSION_TIMEOUT  # seconds


def retry_of(policy: RetryPolicy, park_after: int | None = None) -> Retry:
    backoff = tuple(d.total_seconds() for d in policy.backoff)
    if park_after is None:
        return Retry(max_attempts=policy.max_attempts, backoff=backoff)
    return Retry(max_attempts=policy.max_attempts, backoff=backoff, park_after=park_after)


def worker_config(topics: TopicsConfig, *, app_id: str, bootstrap: str,
                  consumed: Iterable[str], web_port: int | None = None,
                  max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                  security: KafkaSecurity | None = None, group_instance_id: str | None = None,
                  session_timeout: float = timings.SESSION_TIMEOUT) -> WorkerConfig:
    """The config of a worker consuming the topic entries ``consumed`` (e.g. ``process``,
    ``process_dlq``); it may publish to every stage topic. Its Kafka clients connect with
    ``security``, else with what the environment asks for; with a ``group_instance_id``
    its consumers are static members of their groups."""
    specs: list[TopicSpec] = [*topics.stages.values(), *topics.dead_letters.values()]
    routes = {}
    for entry in consumed:
        spec = topics.entry(entry)
        if not isinstance(spec, TopicSpec):
            raise ValueError(f"{entry!r} is a delay tier, not a stage topic")
        dlq = topics.dead_letter_for(spec) if spec.dlq else None
        routes[entry] = Route(topic=spec.full_name, retry=retry_of(spec.retry, spec.park_after),
                              dlq_topic=dlq.full_name if dlq else None)
    return WorkerConfig(
        app_id=app_id,
        bootstrap=bootstrap,
        topics={s.entry: TopicRoute(s.full_name, s.partitions, s.key_field) for s in specs},
        routes=routes,
        delay_tiers={t.full_name: t.delay.total_seconds() for t in topics.delay_tiers},
        web_port=web_port,
        max_in_flight=max_in_flight,
        security=security or KafkaSecurity.from_env(),
        group_instance_id=group_instance_id or None,
        session_timeout=session_timeout,
    )


def topic_routes(topics: TopicsConfig) -> dict[str, TopicRoute]:
    """Every stage topic by its key, as a publisher needs it."""
    return {s.entry: TopicRoute(s.full_name, s.partitions, s.key_field)
            for s in topics.stages.values()}
