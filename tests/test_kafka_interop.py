"""Broker and client versions work together: confluent-kafka ⇄ Faust (aiokafka)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from tests.waiting import wait_until


def _create_topics(bootstrap: str, names: list[str]) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(n, num_partitions=1, replication_factor=1)
                                   for n in names], operation_timeout=30)
    for fut in futures.values():
        fut.result(timeout=30)


def test_confluent_to_faust_and_back(kafka_bootstrap: str, topic_prefix: str,
                                     tmp_path: Path) -> None:
    source, sink = f"{topic_prefix}echo-in", f"{topic_prefix}echo-out"
    _create_topics(kafka_bootstrap, [source, sink])

    env = dict(os.environ, ECHO_BOOTSTRAP=kafka_bootstrap, ECHO_IN=source, ECHO_OUT=sink,
               ECHO_APP_ID=f"{topic_prefix}echo-{uuid.uuid4().hex[:6]}",
               ECHO_DATADIR=str(tmp_path / "faust"))
    worker = subprocess.Popen([sys.executable, "-m", "tests.apps.faust_echo"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic_prefix}reader",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        sent = [f"m{i}".encode() for i in range(20)]
        for i, value in enumerate(sent):
            producer.produce(source, key=f"k{i % 3}".encode(), value=value)
        assert producer.flush(30) == 0

        consumer.subscribe([sink])
        received: list[tuple[bytes | None, bytes | None, list]] = []

        def all_echoed() -> bool:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                received.append((msg.key(), msg.value(), msg.headers() or []))
            assert worker.poll() is None, "faust worker exited early"
            return len(received) >= len(sent)

        wait_until(all_echoed, timeout=90, what="Faust to echo every message")
        assert sorted(v for _, v, _ in received) == sorted(b"faust:" + v for v in sent)
        assert {k for k, _, _ in received} == {b"k0", b"k1", b"k2"}
        assert all(("via", b"faust") in h for _, _, h in received)
    finally:
        consumer.close()
        worker.terminate()
        try:
            out, _ = worker.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            out, _ = worker.communicate()
        if worker.returncode not in (0, -15):
            print(out.decode(errors="replace")[-4000:])

