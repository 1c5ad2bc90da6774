"""A repository reached by a credentialed URL (``http://user:secret@host/repo.git``): the
pipeline validates and promotes through it, and the secret appears in no URI, fact, log
line, API answer, dashboard, metric, Kafka message or build environment. Rotating the
credential changes no URI: the facts of before still answer, and the next build is
incremental from the last green commit (design §8)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.git_http import GitHttpServer, bare_repository
from tests.pipeline_support import Pipeline
from tests.stack_support import free_ports
from tests.waiting import wait_until

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

SECRET = "s3cr3t-Pa55"
ROTATED = "n3w-Pa55-after-rotation"
QUEUE = "mono/main"


def _git(work: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid",
                           "-C", str(work), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(work: Path, name: str) -> str:
    (work / "app.txt").write_text(f"{name}\n")
    _git(work, "add", "app.txt")
    _git(work, "commit", "-q", "-m", name)
    _git(work, "push", "-q", "origin", "HEAD:main")
    return _git(work, "rev-parse", "HEAD")


def _promoted(work: Path, bare: Path) -> str | None:
    out = _git(work, "ls-remote", str(bare), "verified-main").split()
    return out[0] if out else None


def _configure(pipeline: Pipeline, url: str, env_dir: Path) -> None:
    pipeline.add_raw_queue(QUEUE, {
        "source_control": {"kind": "git", "repository": url, "ref": "main",
                           "promotion_ref": "verified-main",
                           "cache_dir": str(pipeline.root / "git-cache")},
        "build_runner": {"kind": "command", "work_dir": str(pipeline.root / "builds"),
                         # the build's environment is kept, to be searched for the secret
                         "command": f'env | grep ^STOVEPIPE_ > "{env_dir}/$STOVEPIPE_BUILD_ID"'
                                    f" && test -f app.txt"},
        "gate_delay": "200ms", "poll_delay_queued": "200ms", "poll_delay_running": "200ms",
    })


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as answer:
        return answer.read().decode("utf-8", "replace")


def _kafka_text(pipeline: Pipeline) -> str:
    """Every key, value and header of every topic of the deployment."""
    consumer = Consumer({"bootstrap.servers": pipeline.bootstrap,
                         "group.id": f"search-{uuid.uuid4()}", "enable.auto.commit": False})
    texts = []
    try:
        metadata = consumer.list_topics(timeout=10)
        for topic in [t for t in metadata.topics if t.startswith(pipeline.prefix)]:
            for p in metadata.topics[topic].partitions:
                tp = TopicPartition(topic, p)
                low, high = consumer.get_watermark_offsets(tp, timeout=10)
                if high <= low:
                    continue
                consumer.assign([TopicPartition(topic, p, low)])
                read = 0
                while read < high - low:
                    for message in consumer.consume(100, timeout=5):
                        if message.error():
                            continue
                        read += 1
                        texts.append(repr((message.key(), message.value(),
                                           message.headers())))
    finally:
        consumer.close()
    return "\n".join(texts)


def test_a_credentialed_url_shows_its_secret_nowhere_and_rotating_it_changes_no_uri(
        pipeline: Pipeline, tmp_path: Path) -> None:
    served, work, env_dir = tmp_path / "served", tmp_path / "work", tmp_path / "envs"
    served.mkdir()
    env_dir.mkdir()
    bare = bare_repository(served, "mono.git", work)
    c1 = _commit(work, "c1")
    server = GitHttpServer(served, "builder", SECRET)
    with server.running():
        _configure(pipeline, server.url("mono.git"), env_dir)
        port = free_ports(1)[0]
        pipeline.start_worker(web_port=port)
        first = pipeline.ingest(QUEUE)
        pipeline.wait_quiet(timeout=120)
        assert pipeline.states() == {first: "succeeded"}
        wait_until(lambda: _promoted(work, bare) == c1, timeout=60, what="c1 promoted")
        assert server.requests > 0  # it really went through the password

        wait_until(lambda: _get(port, "/health").find('"ok"') >= 0, timeout=60,
                   what="the API")
        q = quote(QUEUE, safe="")
        [(uri,)] = pipeline.query("SELECT uri FROM request")
        seen = {
            "uri": uri,
            "database": json.dumps(pipeline.dump(), default=str),
            "api": "\n".join(_get(port, path) for path in (
                "/api/queues", f"/api/queues/{q}", f"/api/queues/{q}/requests",
                f"/api/requests/{quote(first, safe='')}",
                f"/api/facts?queue={q}&uri={quote(uri, safe='')}", "/api/dlq")),
            "dashboard": _get(port, "/") + _get(port, "/dashboard/dashboard.js"),
            "metrics": _get(port, "/metrics"),
            "cli": "\n".join(pipeline.cli(*args, check=False).stdout + pipeline.cli(
                *args, check=False).stderr for args in (
                ("request", first, "--json"), ("queue", QUEUE, "--json"),
                ("fact", QUEUE, uri, "--json"))),
            "logs": pipeline.full_logs(),
            "kafka": _kafka_text(pipeline),
            "build environment": "\n".join(p.read_text() for p in env_dir.iterdir()),
        }
        assert uri == f"git+http://127.0.0.1:{server.port}/mono.git#main@{c1}"
        for where, text in seen.items():
            assert text, f"nothing read from {where}"
            assert SECRET not in text, f"the secret shows in the {where}"
            assert "builder" not in text or where == "logs", f"the user shows in {where}"

        # rotate the credential: the server takes only the new one, the queue uses it
        server.password = ROTATED
        pipeline.stop_workers()
        _configure(pipeline, server.url("mono.git"), env_dir)
        pipeline.start_worker()
        c2 = _commit(work, "c2")
        second = pipeline.ingest(QUEUE)
        pipeline.wait_quiet(timeout=120)
        shown = pipeline.request(second)["request"]
        assert shown["state"] == "succeeded"
        assert shown["build_strategy"] == "incremental" and shown["base_uri"] == uri
        assert shown["uri"] == uri.replace(c1, c2)  # the same repository in the URI
        assert pipeline.cli("fact", QUEUE, uri).returncode == 0  # the old fact answers
        wait_until(lambda: _promoted(work, bare) == c2, timeout=60, what="c2 promoted")
        assert ROTATED not in pipeline.full_logs() + json.dumps(pipeline.dump(), default=str)
