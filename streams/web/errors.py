"""The HTTP surface's one error type: what a handler raises to answer other than success."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than success, with its status, a message for the caller and any
    headers it needs (a 401 says how to authenticate: a bearer token by default)."""

    def __init__(self, status: int, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
