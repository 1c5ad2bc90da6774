"""A project's answer at a commit on a real PostgreSQL (streams/web/project_answers.py,
issue 24 Deliver 5): the answer of the newest Request of the queue for the commit that has
one — built, or inherited and saying from where — else, for a commit only the project's
culprit search built, that probe's fact in the project's scope; else none (not green).
And the project's green answers walk by the queue's order, as the gate's search needs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from store import Database
from streams.web.project_answers import project_fact

pytestmark = pytest.mark.postgres

Q = "mono/main"
SCOPE = f"{Q}#api"


def _uri(n: int) -> str:
    return f"git+/srv/mono#main@{n:040x}"


def _fill(dsn: str) -> None:
    """Heads 1 (api built green), 2 (api inherits green from 1), 4 (api built red) and 4.2
    (the commit validated again: api inherits red from 4); commit 3 lies between heads
    and was built only by api's culprit search (`request/mono/main#api/2~1`, green)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        def request(queue: str, request_id: str, uri: str, kind: str = "head") -> None:
            conn.execute("INSERT INTO request (queue, id, uri, kind, state, verdict)"
                         " VALUES (%s, %s, %s, %s, 'succeeded', 'green')",
                         (queue, request_id, uri, kind))

        def answer(request_id: str, n: int, degree: float, source: int,
                   source_id: str) -> None:
            conn.execute(
                "INSERT INTO project_answer (queue, request_id, project, uri, degree,"
                " inherited, source_request_id, source_uri)"
                " VALUES (%s, %s, 'api', %s, %s, %s, %s, %s)",
                (Q, request_id, _uri(n), degree, source != n, source_id, _uri(source)))

        for n, request_id in ((1, f"request/{Q}/1"), (2, f"request/{Q}/2"),
                              (4, f"request/{Q}/4"), (4, f"request/{Q}/4.2")):
            request(Q, request_id, _uri(n), "retry" if "." in request_id else "head")
        for n in (1, 4):
            request(SCOPE, f"request/{SCOPE}/{n}", _uri(n))
            conn.execute("INSERT INTO validation_fact (queue, uri, project, degree,"
                         " request_id) VALUES (%s, %s, 'api', %s, %s)",
                         (SCOPE, _uri(n), 0.0 if n == 1 else 1.0, f"request/{SCOPE}/{n}"))
        request(SCOPE, f"request/{SCOPE}/2~1", _uri(3), "backfill")
        conn.execute("INSERT INTO validation_fact (queue, uri, project, degree, request_id)"
                     " VALUES (%s, %s, 'api', 0, %s)", (SCOPE, _uri(3), f"request/{SCOPE}/2~1"))
        answer(f"request/{Q}/1", 1, 0.0, 1, f"request/{SCOPE}/1")
        answer(f"request/{Q}/2", 2, 0.0, 1, f"request/{SCOPE}/1")
        answer(f"request/{Q}/4", 4, 1.0, 4, f"request/{SCOPE}/4")
        answer(f"request/{Q}/4.2", 4, 1.0, 4, f"request/{SCOPE}/4")


def test_a_commits_answer_for_a_project(migrated_dsn: str) -> None:
    _fill(migrated_dsn)

    async def read() -> dict[str, Any]:
        async with await Database.open(migrated_dsn, max_size=1) as db:
            deps: Any = SimpleNamespace(db=db)
            return {
                "built": await project_fact(deps, Q, "api", _uri(1)),
                "inherited": await project_fact(deps, Q, "api", _uri(2)),
                "probed": await project_fact(deps, Q, "api", _uri(3)),
                "again": await project_fact(deps, Q, "api", _uri(4)),
                "never": await project_fact(deps, Q, "api", _uri(5)),
                "older": await db.project_answers.green_older_than(Q, "api", (4, 0, 1), 10),
                "newer": await db.project_answers.green_newer_than(Q, "api", (1, 0, 1), 10),
            }

    found = asyncio.run(read())
    built, inherited, probed = found["built"], found["inherited"], found["probed"]
    assert (built.unaffected, built.inherited_from, built.request_id,
            built.source_request_id, built.is_green) == (
        False, None, f"request/{Q}/1", f"request/{SCOPE}/1", True)
    assert (inherited.unaffected, inherited.inherited_from, inherited.inherited_from_uri,
            inherited.source_request_id) == (True, f"{1:040x}", _uri(1), f"request/{SCOPE}/1")
    assert (probed.unaffected, probed.request_id, probed.is_green, probed.uri) == (
        False, f"request/{SCOPE}/2~1", True, _uri(3))
    # the commit validated again: its newest Request's answer
    assert (found["again"].request_id, found["again"].degree) == (f"request/{Q}/4.2", 1.0)
    assert found["never"] is None
    assert [a.request_id for a in found["older"]] == [f"request/{Q}/2", f"request/{Q}/1"]
    assert [a.request_id for a in found["newer"]] == [f"request/{Q}/2"]
