"""A git server over smart HTTP that wants a password: `git http-backend` (from git itself)
behind a small threaded HTTP server doing basic authentication. For tests of repositories
reached by a credentialed URL (``http://user:secret@127.0.0.1:PORT/repo.git``)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit


def _backend() -> str:
    found = subprocess.run(["git", "--exec-path"], capture_output=True, text=True,
                           check=True).stdout.strip()
    path = Path(found) / "git-http-backend"
    assert path.exists(), f"no git-http-backend in {found}"
    return str(path)


class GitHttpServer:
    """Serves every repository under ``root`` to whoever presents ``user``:``password``;
    change ``password`` to rotate the credential. ``requests`` counts what it answered."""

    def __init__(self, root: Path, user: str, password: str) -> None:
        self.root, self.user, self.password = root, user, password
        self.requests = 0
        self.refused = 0
        self.delay = 0.0  # seconds each answer is held back: a slow git host
        self.down = False  # answer every request 503: the git host's outage
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._serve()

            def do_POST(self) -> None:
                self._serve()

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                if server.delay:
                    time.sleep(server.delay)  # this request's own thread
                if server.down:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                expected = base64.b64encode(
                    f"{server.user}:{server.password}".encode()).decode()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""  # read even if refused
                if self.headers.get("Authorization") != f"Basic {expected}":
                    server.refused += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="git"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                server.requests += 1
                parts = urlsplit(self.path)
                env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(server.root),
                       "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": parts.path,
                       "QUERY_STRING": parts.query, "REQUEST_METHOD": self.command,
                       "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                       "CONTENT_LENGTH": str(length), "REMOTE_USER": server.user,
                       "REMOTE_ADDR": "127.0.0.1",
                       "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "http.receivepack",
                       "GIT_CONFIG_VALUE_0": "true"}
                if self.headers.get("Content-Encoding"):
                    env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
                if self.headers.get("Git-Protocol"):
                    env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
                out = subprocess.run([_backend()], input=body, capture_output=True, env=env,
                                     check=False).stdout
                head, _, payload = out.partition(b"\r\n\r\n")
                status = 200
                headers = []
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "status":
                        status = int(value.strip().split()[0])
                    elif name:
                        headers.append((name, value.strip()))
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, repo: str, *, password: str | None = None) -> str:
        secret = self.password if password is None else password
        return f"http://{self.user}:{secret}@127.0.0.1:{self.port}/{repo}"

    @contextmanager
    def running(self) -> Iterator[GitHttpServer]:
        self._thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()


def bare_repository(root: Path, name: str, work: Path) -> Path:
    """A bare repository ``root/name`` with ``work`` a clone of it to commit in."""
    bare = root / name
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(bare), str(work)], check=True,
                   capture_output=True)
    return bare
