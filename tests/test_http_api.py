"""The worker's HTTP API over real HTTP: a real `stovepipe worker` process, the real
broker and database, and urllib as the client."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import streams
from tests.waiting import wait_until
from tests.web_support import TOKEN, WebPipeline, assert_error

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.slow]

def _uri(ref: str, sha: str) -> str:
    return f"fake://r/{ref}/{sha}"


def test_ingest_and_read_back_over_http(web: WebPipeline) -> None:
    ref = web.add_queue("team/main")
    web.add_queue("idle")
    web.repo.push(ref, "a1")
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()

    health = web.get("/health")
    assert health.body == {"status": "ok", "runtime": "started", "database": "ok",
                           "version": streams.__version__}

    first = web.post("/api/queues/team/main/ingest")
    assert (first.status, first.body) == (201, {"queue": "team/main", "new": True,
                                                "request_id": "request/team/main/1"})
    again = web.post("/api/queues/team%2Fmain/ingest")  # the same head, name encoded
    assert (again.status, again.body["request_id"], again.body["new"]) == (
        200, "request/team/main/1", False)
    web.wait_quiet()

    shown = web.get("/api/requests/request/team/main/1")
    assert shown.status == 200
    assert shown.body["request"]["state"] == "succeeded"
    assert shown.body["request"]["uri"] == _uri(ref, "a1")
    assert [(b["attempt"], b["status"], b["verdict"]) for b in shown.body["builds"]] == [
        (1, "succeeded", "green")]
    assert (shown.body["request"]["kind"], shown.body["request"]["attempt"],
            shown.body["request"]["verdict"]) == ("head", 1, "green")
    assert shown.body["fact"]["degree"] == 0
    assert shown.body["commit_fact"] == shown.body["fact"]  # its own fact answers
    assert shown.body["newest_for_commit"]["id"] == "request/team/main/1"
    assert shown.body["green"] is True
    assert web.get("/api/requests/" + quote("request/team/main/1", safe="")).body == shown.body

    web.repo.push(ref, "b2-fail")
    assert web.post("/api/queues/team/main/ingest").body["request_id"] == "request/team/main/2"
    web.wait_quiet()

    queue = web.get("/api/queues/team/main")
    assert queue.status == 200
    assert queue.body["name"] == "team/main"
    assert queue.body["ingested"] is True
    assert queue.body["max_concurrent"] == 1
    assert queue.body["in_flight"] == 0
    assert queue.body["last_green_uri"] == _uri(ref, "a1")
    assert queue.body["last_green_request_id"] == "request/team/main/1"
    assert queue.body["latest_request"]["id"] == "request/team/main/2"
    assert queue.body["latest_request"]["state"] == "failed"
    assert queue.body["promotion_ref"]["name"] == f"{ref}-verified-main"
    # the same answer by the encoded name (but for the health figures' running durations)
    again = web.get("/api/queues/team%2Fmain").body
    assert {k: v for k, v in again.items() if k != "health"} == {
        k: v for k, v in queue.body.items() if k != "health"}
    assert (queue.body["culprit"], queue.body["search"]) == (None, None)  # backfill is off
    assert queue.body["health"]["time_to_signal"]["facts"] == 2

    idle = web.get("/api/queues/idle").body
    assert (idle["ingested"], idle["latest_request"], idle["last_green_uri"]) == (
        False, None, None)
    listed = web.get("/api/queues").body["queues"]
    assert sorted(q["name"] for q in listed) == ["idle", "team/main"]

    green = web.get("/api/facts?" + urlencode({"queue": "team/main", "uri": _uri(ref, "a1")}))
    assert (green.status, green.body["green"], green.body["fact"]["request_id"],
            green.body["known"]) == (200, True, "request/team/main/1", True)
    red = web.get("/api/facts?" + urlencode({"queue": "team/main",
                                            "uri": _uri(ref, "b2-fail")}))
    assert (red.status, red.body["green"], red.body["fact"]["degree"], red.body["known"]) == (
        200, False, 1, True)
    unknown = web.get("/api/facts?" + urlencode({"queue": "team/main", "uri": "fake://r/x/y"}))
    assert (unknown.status, unknown.body["green"], unknown.body["fact"],
            unknown.body["known"], unknown.body["uri"]) == (200, False, None, False,
                                                            "fake://r/x/y")
    assert "has no commit y" in unknown.body["reason"]

    # newest first by ingest order: past 9, text order would put /10 after /9
    for n in range(3, 13):
        web.repo.push(ref, f"c{n}")
        assert web.post("/api/queues/team/main/ingest").status == 201
    recent = web.get("/api/queues/team/main/requests?limit=100")
    assert recent.status == 200
    ids = [r["request"]["id"] for r in recent.body["requests"]]
    assert ids == [f"request/team/main/{n}" for n in range(12, 0, -1)]
    by_id = {r["request"]["id"]: r for r in recent.body["requests"]}
    assert by_id["request/team/main/1"]["green"] is True
    assert by_id["request/team/main/2"]["fact"]["degree"] == 1
    top = web.get("/api/queues/team%2Fmain/requests?limit=2").body["requests"]
    assert [r["request"]["id"] for r in top] == ["request/team/main/12", "request/team/main/11"]
    assert len(web.get("/api/queues/team/main/requests").body["requests"]) == 12
    assert web.get("/api/queues/idle/requests").body == {"queue": "idle", "requests": []}

    metrics = web.get("/metrics")
    assert metrics.status == 200 and "stovepipe_deliveries_total" in metrics.text
    web.wait_quiet()


def test_bad_input_is_a_json_error_never_a_traceback(web: WebPipeline) -> None:
    web.add_queue("team/main")  # its ref does not exist: ingesting it is a config error
    web.repo.push("another-branch", "x1")
    web.start_web_worker()  # no token: POST is open
    web.wait_healthy()
    invalid = "invalid queue name"
    assert_error(web.get("/api/queues/bad%20name"), 400, invalid, "' '")
    assert_error(web.get("/api/queues/a//b"), 400, invalid, "'//'")
    assert_error(web.get("/api/queues/" + "q" * 201), 400, invalid, "201 characters")
    assert_error(web.post("/api/queues/-dash/ingest", token=None), 400, invalid)
    assert_error(web.get("/api/queues/bad%20name/requests"), 400, invalid)
    assert_error(web.get("/api/facts?queue=bad%20name&uri=x"), 400, invalid)

    assert_error(web.get("/api/queues/nope/main"), 404, "unknown queue 'nope/main'",
                 "team/main")
    assert_error(web.post("/api/queues/nope/ingest", token=None), 404, "unknown queue")
    assert_error(web.get("/api/queues/nope/requests"), 404, "unknown queue")
    assert_error(web.post("/api/queues/team/main/ingest", token=None), 422, "has no ref")

    assert_error(web.get("/api/requests/garbage"), 400, "not a request id")
    assert_error(web.get("/api/requests/request/team/main/x"), 400, "not a request id")
    assert_error(web.get("/api/requests/request/bad%20q/1"), 400, invalid)
    assert_error(web.get("/api/requests/request/team/main/7"), 404, "request/team/main/7")

    assert_error(web.get("/api/queues/team/main/requests?limit=0"), 400, "'limit'")
    assert_error(web.get("/api/queues/team/main/requests?limit=x"), 400, "'limit'")
    assert_error(web.get("/api/queues/team/main/requests?limit=101"), 400, "'limit'")
    assert_error(web.get("/api/facts?queue=team/main"), 400, "'uri'")
    assert_error(web.get("/api/facts?uri=x"), 400, "'queue'")
    assert_error(web.get("/api/nothing/here"), 404, "no such endpoint", "GET /api/facts")
    assert_error(web.call("DELETE", "/api/queues"), 405)

    unknown_queue = web.get("/api/facts?queue=nope&uri=x")  # a gate never gets a 404
    assert (unknown_queue.status, unknown_queue.body["green"]) == (200, False)
    assert unknown_queue.body["known"] is False
    assert "unknown queue" in unknown_queue.body["note"]
    assert "unknown queue" in unknown_queue.body["reason"]

    retry = "/api/queues/team/main/retry"
    assert_error(web.post(retry, token=None), 404, "no head yet")  # never ingested
    assert_error(web.post_json(retry, b"{", token=None), 400, "not JSON")
    assert_error(web.post_json(retry, b"\xff", token=None), 400, "not JSON")
    assert_error(web.post_json(retry, [1], token=None), 400, '{"commit"')
    assert_error(web.post_json(retry, {"sha": "x1"}, token=None), 400, '{"commit"')
    assert_error(web.post_json(retry, {"commit": 5}, token=None), 400, "'commit'")
    assert_error(web.post_json(retry, {"commit": " "}, token=None), 400, "'commit'")
    assert_error(web.post_json(retry, b"x" * 5000, token=None), 413, "at most")
    assert_error(web.post_json(retry, {"commit": "a b"}, token=None), 400, "not a fake sha")
    assert_error(web.post_json(retry, {"commit": "x1"}, token=None), 404, "never ingested")
    assert_error(web.post_json(retry, {"commit": "zz"}, token=None), 404, "no commit 'zz'")
    assert_error(web.post("/api/queues/nope/retry", token=None), 404, "unknown queue")
    assert_error(web.post("/api/queues/bad%20name/retry", token=None), 400, invalid)


def test_an_api_token_guards_writes_only(web: WebPipeline) -> None:
    ref = web.add_queue("team/main")
    web.repo.push(ref, "a1")
    web.start_web_worker("--api-token", TOKEN)
    web.wait_healthy()
    missing = web.post("/api/queues/team/main/ingest", token=None)
    assert_error(missing, 401, "Authorization: Bearer")
    assert missing.headers.get("WWW-Authenticate") == "Bearer"
    assert_error(web.post("/api/queues/team/main/ingest", token="wrong"), 401, "wrong")
    assert_error(web.post("/api/queues/nope/ingest", token=None), 401)  # auth comes first
    assert web.states() == {}
    assert web.post("/api/queues/team/main/ingest").status == 201
    assert web.get("/api/queues/team/main").status == 200  # reads stay open
    assert web.get("/api/requests/request/team/main/1").status == 200
    retry = "/api/queues/team/main/retry"
    assert_error(web.post(retry, token=None), 401, "Authorization: Bearer")
    assert_error(web.post_json(retry, {"commit": "a1"}, token="wrong"), 401, "wrong")
    assert set(web.states()) == {"request/team/main/1"}  # nothing validated again


def test_validating_a_commit_again_over_http(web: WebPipeline) -> None:
    ref = web.add_queue("team/main")
    web.repo.push(ref, "a1")
    web.start_web_worker(env={"STOVEPIPE_API_TOKEN": TOKEN})
    web.wait_healthy()
    retry = "/api/queues/team/main/retry"
    assert web.post("/api/queues/team/main/ingest").status == 201  # request 1: green
    web.wait_quiet()
    web.repo.push(ref, "b1", "b2-fail")  # b1 is never a head
    assert web.post("/api/queues/team/main/ingest").status == 201  # request 2: red
    web.wait_quiet()

    refused = web.post_json(retry, {"commit": "a1"})
    assert refused.status == 409, refused.text
    assert set(refused.body) == {"error", "fact"}
    assert "is green" in refused.body["error"]
    assert refused.body["fact"]["request_id"] == "request/team/main/1"
    assert_error(web.post_json(retry, {"commit": "b1"}), 404, "never ingested")
    assert_error(web.post_json(retry, {"commit": "0ff"}), 404, "no commit")

    again = web.post(retry)  # no body: the queue's newest head, b2-fail
    assert (again.status, again.body) == (201, {
        "queue": "team/main", "uri": _uri(ref, "b2-fail"), "request_id":
        "request/team/main/2.2", "new": True, "previous_id": "request/team/main/2"})
    web.wait_terminal(["request/team/main/2.2"])
    wait_until(lambda: bool(web.query("SELECT 1 FROM validation_fact WHERE request_id = %s",
                                      "request/team/main/2.2")),
               timeout=60, what="the fact of request/team/main/2.2")

    shown = web.get("/api/requests/request/team/main/2.2").body
    assert (shown["request"]["kind"], shown["request"]["state"], shown["request"]["verdict"],
            shown["request"]["attempt"]) == ("retry", "failed", "red", 1)
    assert [(b["attempt"], b["verdict"]) for b in shown["builds"]] == [(1, "red")]
    assert shown["fact"]["request_id"] == shown["commit_fact"]["request_id"] == \
        "request/team/main/2.2"
    assert shown["green"] is False
    first = web.get("/api/requests/request/team/main/2").body  # its own red fact stays
    assert (first["fact"]["request_id"], first["fact"]["degree"]) == ("request/team/main/2", 1)
    assert first["commit_fact"]["request_id"] == "request/team/main/2.2"
    assert first["newest_for_commit"]["id"] == "request/team/main/2.2"
    recent = web.get("/api/queues/team/main/requests").body["requests"]
    assert [(r["request"]["id"], (r["fact"] or {}).get("request_id")) for r in recent] == [
        ("request/team/main/2.2", "request/team/main/2.2"),
        ("request/team/main/2", "request/team/main/2"),
        ("request/team/main/1", "request/team/main/1")]

    # a commit being validated now is not validated twice
    web.repo.push(ref, "c3-latchC")
    assert web.post("/api/queues/team/main/ingest").body["request_id"] == "request/team/main/3"
    wait_until(lambda: web.states().get("request/team/main/3") == "processing", timeout=60,
               what="request/team/main/3 to be building")
    same = web.post_json(retry, {"commit": _uri(ref, "c3-latchC")})
    assert (same.status, same.body["request_id"], same.body["new"],
            same.body["previous_id"]) == (200, "request/team/main/3", False,
                                          "request/team/main/3")
    web.release("C")
    web.wait_quiet()
    assert web.post_json(retry, {"commit": "c3"}).status == 409
    assert web.states()["request/team/main/3"] == "succeeded"
    assert len(web.states()) == 4


class TcpProxy:
    """Forwards a local port to PostgreSQL; `cut()` drops every connection and refuses
    new ones until `restore()`: the database is down as far as the worker can tell."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.down = False
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.down = True
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def restore(self) -> None:
        self.down = False

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_database_down_is_503_and_health_recovers(web: WebPipeline) -> None:
    ref = web.add_queue("team/main")
    web.repo.push(ref, "a1")
    params = conninfo_to_dict(web.dsn)
    proxy = TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    try:
        proxied = make_conninfo(web.dsn, host="127.0.0.1", port=str(proxy.port))
        web.start_web_worker(env={"STOVEPIPE_POSTGRES_DSN": proxied})
        web.wait_healthy()
        assert web.post("/api/queues/team/main/ingest").status == 201

        proxy.cut()
        health = web.get("/health")
        assert health.status == 503, health.text
        assert health.body["status"] == "unavailable"
        assert health.body["runtime"] == "started"
        assert health.body["database"] != "ok"
        # each read gives up after its deadline (5 s) rather than waiting for the pool
        assert_error(web.get("/api/requests/request/team/main/1"), 503, "try again")
        assert_error(web.get("/api/queues/team/main/requests"), 503, "try again")

        proxy.restore()
        web.wait_healthy(timeout=60)
        assert web.get("/api/requests/request/team/main/1").status == 200
    finally:
        web.stop_workers()
        proxy.close()


def test_an_explicit_web_port_in_use_is_refused_clearly(web: WebPipeline) -> None:
    web.add_queue("team/main")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = web.cli("worker", "--web-port", str(port), check=False)
    assert result.returncode == 1
    assert f"port {port} is in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_dead_letter_depth_counts_what_the_group_has_not_committed(
        kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    import asyncio

    from confluent_kafka import Consumer, Producer, TopicPartition

    from streams.web.queries import DeadLetterDepths
    from tests.runtime_support import create_topics, write_test_topics

    topics = create_topics(kafka_bootstrap, write_test_topics(tmp_path / "topics.yaml"),
                           topic_prefix)
    process_dlq = topics.dead_letter("process").full_name
    record_dlq = topics.dead_letter("record").full_name
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(5):
        producer.produce(process_dlq, key=b"k", value=b"v%d" % n, partition=0)
    producer.produce(record_dlq, key=b"k", value=b"v", partition=1)
    assert producer.flush(30) == 0
    group = f"{topic_prefix}group"
    depths = DeadLetterDepths(bootstrap=kafka_bootstrap, group=group, ttl=0,
                              topics={"process": process_dlq, "record": record_dlq})

    report = asyncio.run(depths.report())
    assert report.error is None
    assert {t.stage: t.depth for t in report.topics} == {"process": 5, "record": 1}
    assert report.total == 6

    committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group,
                          "enable.auto.commit": False})
    try:
        committer.commit(offsets=[TopicPartition(process_dlq, 0, 3)], asynchronous=False)
    finally:
        committer.close()
    assert {t.stage: t.depth for t in asyncio.run(depths.report()).topics} == {
        "process": 2, "record": 1}

    broken = DeadLetterDepths(bootstrap=kafka_bootstrap, group=group, ttl=0, timeout=2,
                              topics={"process": f"{topic_prefix}no-such-topic"})
    report = asyncio.run(broken.report())
    assert report.error is not None and report.topics == []
