"""Shared pieces of the delivery-runtime tests: small topic sets and a worker process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import yaml
from confluent_kafka import Consumer, Producer

from contract import ProcessRequest, marshal
from streams.config.settings import REPO_ROOT
from streams.config.topics import TopicsConfig, load_topics
from streams.runtime.kafka import producer_conf
from streams.runtime.topic_admin import admin_conf_for, ensure_topics
from tests.apps.runtime_worker import SCHEMA_SQL


def write_test_topics(path: Path, *, partitions: int = 3, tiers: dict[str, str] | None = None,
                      backoff: list[str] | None = None, max_attempts: int = 3) -> Path:
    """topics.yaml with fewer partitions and short backoffs, so a test runs in seconds."""
    raw = yaml.safe_load((REPO_ROOT / "topics.yaml").read_text())
    raw["defaults"]["partitions"] = partitions
    raw["defaults"]["retry"] = {"max_attempts": max_attempts,
                                "backoff": backoff or ["100ms", "300ms"]}
    raw["dlq_defaults"]["partitions"] = 2
    raw["dlq_defaults"]["retry"] = {"max_attempts": "forever",
                                    "backoff": backoff or ["100ms", "300ms"]}
    tiers = tiers or {"delay_100ms": "100ms", "delay_1s": "1s", "delay_5s": "5s"}
    raw["delay_tiers"] = {k: {"name": k, "delay": v} for k, v in tiers.items()}
    path.write_text(yaml.safe_dump(raw))
    return path


def create_topics(bootstrap: str, path: Path, prefix: str) -> TopicsConfig:
    config = load_topics(path, prefix=prefix)
    report = ensure_topics(admin_conf_for(bootstrap), config)  # the environment's security
    assert report.ok, [s.detail for s in report if not s.ok]
    return config


class RuntimeWorker:
    """`tests.apps.runtime_worker` as a child process that can be killed and restarted."""

    def __init__(self, *, bootstrap: str, dsn: str, topics_file: Path, prefix: str,
                 log_dir: Path, app_id: str | None = None, name: str = "w1") -> None:
        self.env = dict(os.environ, RT_BOOTSTRAP=bootstrap, RT_DSN=dsn,
                        RT_TOPICS=str(topics_file), RT_PREFIX=prefix,
                        RT_APP_ID=app_id or f"{prefix}app-{uuid.uuid4().hex[:6]}",
                        RT_WORKER=name)
        self.name = name
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        with open(self.log_dir / f"worker-{self.name}-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.apps.runtime_worker"],
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final commit."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:]
                         for p in sorted(self.log_dir.glob("worker-*.log")))


def prepare_schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA_SQL)


def produce_process(bootstrap: str, config: TopicsConfig, ids: list[str],
                    queue: str = "q", raw: list[bytes] | None = None,
                    topic: str | None = None) -> None:
    """ProcessRequests (or raw bytes) on `process`, keyed by queue like the pipeline."""
    producer = Producer(producer_conf(bootstrap))
    target = topic or config.stage("process").full_name
    for ident in ids:
        producer.produce(target, key=queue.encode(),
                         value=marshal(ProcessRequest(id=ident, queue_name=queue)))
    for value in raw or []:
        producer.produce(target, key=queue.encode(), value=value)
    assert producer.flush(30) == 0


def sink_rows(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id, stage, attempt, deliveries, received_at FROM runtime_sink").fetchall()
    return {r[0]: {"stage": r[1], "attempt": r[2], "deliveries": r[3], "received_at": r[4]}
            for r in rows}


def read_all(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list[Any]:
    """Every message of `topic` from the beginning, once at least `expect` arrived."""
    import time

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(msg)
        # a little longer: more than expected would be a bug worth seeing
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            msg = consumer.poll(0.1)
            if msg is not None and msg.error() is None:
                out.append(msg)
    finally:
        consumer.close()
    return out
