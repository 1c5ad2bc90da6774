"""The pipeline with HTTP: workers that serve the API on a port of their own, and a small
urllib client for it (shared by the API, dashboard, gate and webhook tests)."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
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
