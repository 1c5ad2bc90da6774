"""Reading a partition's offsets while its leader moves or is not elected yet — a topic
created a moment ago on a busy broker answers NOT_LEADER_FOR_PARTITION — asks again
instead of calling the broker unreachable (`stovepipe dlq`, the API's dead-letter depth)."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from streams.runtime.topic_admin import WATERMARK_ATTEMPTS, read_watermarks


class FlakyLeader:
    """A consumer whose first ``failures`` watermark reads answer ``code``."""

    def __init__(self, failures: int, code: int) -> None:
        self.failures, self.code, self.calls = failures, code, 0

    def get_watermark_offsets(self, tp: object, timeout: float) -> tuple[int, int]:
        self.calls += 1
        if self.calls <= self.failures:
            raise KafkaException(KafkaError(self.code))
        return 3, 7


def test_a_moving_leader_is_asked_again() -> None:
    consumer = FlakyLeader(2, KafkaError.NOT_LEADER_FOR_PARTITION)
    assert read_watermarks(consumer, "t", 1, timeout=1.0) == (3, 7)
    assert consumer.calls == 3


def test_a_leader_that_never_settles_is_an_error_after_a_few_tries() -> None:
    consumer = FlakyLeader(99, KafkaError.LEADER_NOT_AVAILABLE)
    with pytest.raises(KafkaException):
        read_watermarks(consumer, "t", 0, timeout=1.0)
    assert consumer.calls == WATERMARK_ATTEMPTS


def test_any_other_error_is_not_asked_again() -> None:
    consumer = FlakyLeader(1, KafkaError.TOPIC_AUTHORIZATION_FAILED)
    with pytest.raises(KafkaException):
        read_watermarks(consumer, "t", 0, timeout=1.0)
    assert consumer.calls == 1


@pytest.mark.kafka
def test_every_partition_of_a_topic_created_a_moment_ago(kafka_bootstrap: str) -> None:
    topic = f"watermarks-{uuid.uuid4().hex[:12]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=6, replication_factor=1)])[
        topic].result(timeout=30)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap,
                         "group.id": f"watermarks-{uuid.uuid4().hex}"})
    try:
        assert [read_watermarks(consumer, topic, p, timeout=5.0) for p in range(6)] == [
            (0, 0)] * 6
    finally:
        consumer.close()
        admin.delete_topics([topic])[topic].result(timeout=30)
