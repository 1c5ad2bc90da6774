"""The pipeline with HTTP: workers that serve the API on a port of their own, and a small
urllib client for it (shared by the API, dashboard, gate and webhook tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from streams.config.settings import REPO_ROOT
from tests.pipeline_support import STOVEPIPE, Pipeline
from tests.waiting import wait_until

TOKEN = "s3cret-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]
    text: str


class WebPipeline(Pipeline):
    """A Pipeline whose workers serve HTTP on a port of their own."""

    port: int | None = None

    def start_web_worker(self, *extra: str, env: dict[str, str] | None = None,
                         port: int | None = None) -> subprocess.Popen[bytes]:
        self.port = port or free_port()
        self._log_index += 1
        with open(self.root / f"worker-{self._log_index}.log", "wb") as log:
            proc = subprocess.Popen(
                [*STOVEPIPE, "worker", "--loglevel", "info", "--web-port", str(self.port),
                 *extra],
                env={**self.env, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                cwd=REPO_ROOT)
        self.workers.append(proc)
        return proc

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def call(self, method: str, path: str, *, token: str | None = None,
             timeout: float = 30, data: bytes | None = None) -> Reply:
        if data is None and method == "POST":
            data = b""
        request = urllib.request.Request(self.url(path), method=method, data=data)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, raw, headers = response.status, response.read(), response.headers
        except urllib.error.HTTPError as err:
            status, raw, headers = err.code, err.read(), err.headers
        text = raw.decode()
        body = json.loads(text) if "json" in headers.get("Content-Type", "") else None
        return Reply(status, body, dict(headers), text)

    def get(self, path: str) -> Reply:
        return self.call("GET", path)

    def post(self, path: str, token: str | None = TOKEN) -> Reply:
        return self.call("POST", path, token=token)

    def post_json(self, path: str, body: Any, token: str | None = TOKEN) -> Reply:
        """POST ``body`` as JSON (bytes are sent as they are, to send malformed ones)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.call("POST", path, token=token, data=data)

    def wait_healthy(self, timeout: float = 90) -> None:
        def healthy() -> bool:
            assert self.workers[-1].poll() is None, self.logs()
            try:
                return self.get("/health").status == 200
            except OSError:
                return False

        wait_until(healthy, timeout=timeout, what="the worker's /health to answer 200",
                   interval=0.2)


def assert_error(reply: Reply, status: int, *fragments: str) -> None:
    """A JSON error with a message, never a traceback."""
    assert reply.status == status, (reply.status, reply.text)
    assert reply.body is not None, f"not JSON: {reply.text!r}"
    assert set(reply.body) == {"error"}, reply.body
    for fragment in fragments:
        assert fragment in reply.body["error"], reply.body["error"]
    assert "Traceback" not in reply.text


@dataclass
class SlowAnswer:
    """What one slow sender got: the answer's status, headers and body (None: no answer),
    and when (seconds after its headers were sent) the answer came and the worker closed
    the connection."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""
    answered_after: float | None = None
    closed_after: float | None = None
    sent: int = 0  # body bytes sent

    @property
    def body(self) -> Any:
        return json.loads(self.text) if "json" in self.headers.get("content-type", "") \
            else None


class SlowSenders:
    """``count`` POSTs to ``path``, each on a connection of its own, declaring ``declared``
    body bytes and sending ``chunk`` of them every ``every`` seconds (0: none at all),
    whatever the worker answers, until the worker closes the connection or `stop`. Runs
    its own event loop in a thread; `answers` fill in as they come."""

    def __init__(self, port: int, path: str, headers: dict[str, str], *, count: int,
                 declared: int, chunk: int = 1024, every: float = 0.25) -> None:
        self.head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     f"Content-Length: {declared}\r\n"
                     + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                     + "\r\n").encode()
        self.port, self.count, self.chunk, self.every = port, count, chunk, every
        self.answers = [SlowAnswer() for _ in range(count)]
        self.connected = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._all()), daemon=True)

    def start(self) -> SlowSenders:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive(), "the slow senders did not stop"

    def statuses(self) -> list[int | None]:
        return [a.status for a in self.answers]

    async def _all(self) -> None:
        await asyncio.gather(*(self._one(a) for a in self.answers))

    async def _one(self, answer: SlowAnswer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(self.head)
        await writer.drain()
        self.connected += 1
        started = time.monotonic()
        received = bytearray()

        async def read_until_closed() -> None:
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    if answer.answered_after is None:
                        answer.answered_after = time.monotonic() - started
                    received.extend(chunk)
                    _read_answer(bytes(received), answer)
            answer.closed_after = time.monotonic() - started

        reading = asyncio.create_task(read_until_closed())
        try:
            while not reading.done() and not self._stop.is_set():
                if self.chunk:
                    try:
                        writer.write(b" " * self.chunk)
                        await writer.drain()
                        answer.sent += self.chunk
                    except ConnectionError:
                        pass  # closed by the worker: the reader sees it too
                # the pace of a slow sender, not a wait for a condition
                await asyncio.wait({reading}, timeout=self.every)
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            writer.close()


def _read_answer(received: bytes, answer: SlowAnswer) -> None:
    head, complete, text = received.partition(b"\r\n\r\n")
    if not complete:
        return
    lines = head.decode("latin-1").split("\r\n")
    answer.headers = {k.strip().lower(): v.strip() for k, _, v in
                      (line.partition(":") for line in lines[1:])}
    answer.text = text.decode(errors="replace")
    answer.status = int(lines[0].split(" ")[1])


def raw_answer(port: int, request: bytes, timeout: float = 30) -> bytes:
    """Send ``request`` as it is and read the answer until the server closes the
    connection (or has sent a head and ``timeout`` passes)."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        with contextlib.suppress(TimeoutError, ConnectionError):
            while chunk := sock.recv(65536):
                received.extend(chunk)
    return bytes(received)
