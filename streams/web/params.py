"""Reading what an HTTP caller sent: query parameters and small JSON bodies. Every problem
is an `ApiError` (400, or 413 for a body too large) whose message says what to send."""

from __future__ import annotations

import json

from aiohttp import web

from streams.web.errors import ApiError

RETRY_BODY_LIMIT = 4096  # bytes: a retry names one commit
PIN_BODY_LIMIT = 8192  # bytes: a commit, who and why


def required_param(request: web.Request, name: str) -> str:
    value = request.query.get(name, "")
    if not value:
        raise ApiError(400, f"missing query parameter {name!r}, e.g. "
                            f"/api/facts?queue=monorepo/main&sha=<commit sha>")
    return value


def project_param(request: web.Request) -> str | None:
    """The project a gate asks about (``project=P``), or None for the whole repository."""
    given = request.query.getall("project", [])
    if not given:
        return None
    if len(given) > 1 or not given[0].strip():
        raise ApiError(400, "name one project with the query parameter 'project', e.g. "
                            "project=api (leave it out to ask about the whole repository)")
    return given[0].strip()


def format_param(request: web.Request) -> str:
    """``json`` (the default) or ``text`` (``format=text``: the bare sha)."""
    wanted = request.query.get("format", "json")
    if wanted not in ("json", "text"):
        raise ApiError(400, f"query parameter 'format' is 'json' (the default) or 'text' "
                            f"(the bare sha), got {wanted[:40]!r}")
    return wanted


def commit_param(request: web.Request) -> tuple[str, str]:
    """("sha", value) or ("uri", value): the commit a gate asks about, named exactly one
    way."""
    given = [(name, request.query[name]) for name in ("sha", "uri") if request.query.get(name)]
    if len(given) != 1:
        raise ApiError(400, "name the commit with exactly one of the query parameters "
                            "'sha' (a full sha or a unique prefix) and 'uri' (its commit URI)")
    return given[0]


async def retry_commit(request: web.Request) -> str | None:
    """The commit a retry names: `{"commit": C}`, or None (the queue's newest head) for
    no body, an empty one, or `{}`."""
    too_large = ApiError(413, f"a retry body is at most {RETRY_BODY_LIMIT} bytes")
    if request.content_length is not None and request.content_length > RETRY_BODY_LIMIT:
        raise too_large
    chunks: list[bytes] = []
    async for chunk in request.content.iter_chunked(RETRY_BODY_LIMIT):
        chunks.append(chunk)
        if sum(map(len, chunks)) > RETRY_BODY_LIMIT:
            raise too_large
    raw = b"".join(chunks)
    if not raw.strip():
        return None
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON ({exc}); send {{\"commit\": \"<sha, "
                            f"prefix or URI>\"}} or nothing") from None
    if not isinstance(body, dict) or set(body) - {"commit"}:
        raise ApiError(400, 'the body is {"commit": "<sha, prefix or URI>"} (or nothing: the '
                            "queue's newest head)")
    commit = body.get("commit")
    if commit is not None and (not isinstance(commit, str) or not commit.strip()):
        raise ApiError(400, "'commit' is a sha, a unique prefix of one, or a commit URI")
    return commit.strip() if commit is not None else None


def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise ApiError(400, f"query parameter {name!r} must be an integer from {low} to "
                            f"{high}, got {raw!r}")
    return int(raw)


async def pin_fields(request: web.Request, *, needs_commit: bool) -> dict[str, str]:
    """The fields of a pin (`{"commit": C, "reason": R, "by": B}`) or an unpin
    (`{"by": B}`), each with an optional `"project": P` (a project's own promotion ref):
    each a non-empty string."""
    wanted = {"commit", "reason", "by"} if needs_commit else {"by"}
    example = ('{"commit": "<sha, prefix or URI>", "reason": "<why>", "by": "<who>"'
               ', optionally "project": "<project>"}'
               if needs_commit else '{"by": "<who>", optionally "project": "<project>"}')
    if request.content_length is not None and request.content_length > PIN_BODY_LIMIT:
        raise ApiError(413, f"the body is at most {PIN_BODY_LIMIT} bytes")
    raw = await request.content.read(PIN_BODY_LIMIT + 1)
    if len(raw) > PIN_BODY_LIMIT:
        raise ApiError(413, f"the body is at most {PIN_BODY_LIMIT} bytes")
    try:
        body = json.loads(raw) if raw.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON ({exc}); send {example}") from None
    if not isinstance(body, dict) or not wanted <= set(body) <= wanted | {"project"} \
            or not all(
            isinstance(v, str) and v.strip() for v in body.values()):
        raise ApiError(400, f"the body is {example}, every field a non-empty string")
    return {k: v.strip() for k, v in body.items()}
