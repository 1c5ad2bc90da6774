"""The HTTP surface's one error type: what a handler raises to answer other than success."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than success, with its status, a message for the caller and any
    headers it needs (a 401 says how to authenticate: a bearer token by default).
    ``close``: close the connection once the answer is sent, rather than read (and
    discard) the rest of the request's body first as aiohttp does for a while — for a
    sender too slow to be worth waiting for."""

    def __init__(self, status: int, message: str,
                 headers: dict[str, str] | None = None, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.close = close
