"""How the HTTP API answers: JSON bodies, and the one translation of a failure into an
HTTP answer (`error_response`): every error is `{"error": message}`, never a traceback."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from store import NotFound, StoreError
from streams.config.names import InvalidQueueName, UnknownQueue
from streams.extensions.sourcecontrol import (
    AmbiguousCommit,
    CommitNotFound,
    SourceControlError,
    UnknownRef,
)
from streams.runtime.classify import is_retryable
from streams.web import queries
from streams.web.errors import ApiError
from streams.web.project_answers import InvalidProjectName, UnknownProject

log = logging.getLogger("stovepipe.http")


def json_answer(body: Any, status: int = 200,
                headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(queries.jsonable(body), status=status, headers=headers,
                             dumps=lambda value: json.dumps(value, sort_keys=True))


def text_answer(text: str) -> web.Response:
    """A bare value as text/plain (a sha, for a script's ``$(curl …)``)."""
    return web.Response(text=f"{text}\n", content_type="text/plain", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def error_answer(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_answer({"error": message}, status=status, headers=headers)


def error_response(exc: Exception) -> web.Response:
    """The one translation of a failure into an HTTP answer."""
    if isinstance(exc, ApiError):
        headers = exc.headers
        if headers is None and exc.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return error_answer(exc.status, exc.message, headers)
    if isinstance(exc, InvalidQueueName):
        return error_answer(400, str(exc))
    if isinstance(exc, UnknownQueue | UnknownProject):
        return error_answer(404, str(exc))
    if isinstance(exc, InvalidProjectName):
        return error_answer(400, str(exc))
    if isinstance(exc, NotFound):
        return error_answer(404, str(exc))
    if isinstance(exc, CommitNotFound):
        return error_answer(404, str(exc))
    if isinstance(exc, AmbiguousCommit):
        return error_answer(400, str(exc))
    if isinstance(exc, UnknownRef):
        return error_answer(422, f"{exc} (fix the queue's source_control in the queue "
                           f"configuration)")
    if isinstance(exc, TimeoutError):
        return error_answer(503, "a dependency (database, Kafka or the repository) did not "
                           "answer in time; try again")
    if is_retryable(exc):
        return error_answer(503, f"temporarily unavailable, try again: {describe(exc)}")
    if isinstance(exc, SourceControlError):
        return error_answer(502, f"the repository refused: {exc}")
    if isinstance(exc, StoreError):
        return error_answer(500, f"the store refused: {exc}")
    log.error("http_internal_error error=%r", exc, exc_info=exc)
    return error_answer(500, "internal error; the worker's log has the details")


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
