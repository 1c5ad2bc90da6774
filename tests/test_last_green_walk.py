"""`last-green` over projects on a real PostgreSQL (issue 24, Deliver 5 and 7): the merge
walk of `store.project_answers.LAST_GREEN` finds exactly the newest Request at which every
listed project has a green answer — checked against every Request's answers for random
histories (green, red, no answer; heads and commits validated again), and said to be cut
short, never wrong, when green answers alternate past its step limit."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store import Database, request_order
from store.project_answers import LastGreen

pytestmark = pytest.mark.postgres

PROJECTS = ("api", "web", "docs", "ops")
# per Request: its validation (1: a head; 2: the commit validated again) and each
# project's answer: green, red, or none (its build could not validate)
cells = st.sampled_from([0.0, 1.0, None])
histories = st.lists(
    st.tuples(st.booleans(), st.fixed_dictionaries({p: cells for p in PROJECTS})),
    min_size=0, max_size=14)


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as run:
        yield run


def _write(dsn: str, queue: str,
           history: list[tuple[bool, dict[str, float | None]]]) -> list[str]:
    """The Requests of ``history`` (oldest first) and their answers; their ids."""
    ids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n, (again, answers) in enumerate(history, start=1):
            uri = f"git+/srv/mono#main@{n:040x}"
            ids.append(f"request/{queue}/{n}")
            if again:  # the commit validated again: a Request that sorts above it
                ids.append(f"request/{queue}/{n}.2")
            for request_id in ids[-2 if again else -1:]:
                conn.execute("INSERT INTO request (queue, id, uri, state, verdict)"
                             " VALUES (%s, %s, %s, 'succeeded', 'green')",
                             (queue, request_id, uri))
            for project, degree in answers.items():
                if degree is None:
                    continue
                conn.execute(
                    "INSERT INTO project_answer (queue, request_id, project, uri, degree,"
                    " inherited, source_request_id, source_uri)"
                    " VALUES (%s, %s, %s, %s, %s, false, %s, %s)",
                    (queue, ids[-1], project, uri, degree,
                     ids[-1].replace(queue, f"{queue}#{project}"), uri))
    return ids


def _expected(history: list[tuple[bool, dict[str, float | None]]], queue: str,
              projects: tuple[str, ...]) -> str | None:
    """The newest Request whose answers are green for every project, by brute force."""
    found = None
    for n, (again, answers) in enumerate(history, start=1):
        if all(answers[p] == 0.0 for p in projects):
            found = f"request/{queue}/{n}" + (".2" if again else "")
    return found


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories, chosen=st.lists(st.sampled_from(PROJECTS), min_size=1,
                                          max_size=4, unique=True))
def test_the_walk_finds_the_newest_request_green_for_every_project(
        migrated_dsn: str, runner: asyncio.Runner,
        history: list[tuple[bool, dict[str, float | None]]], chosen: list[str]) -> None:
    queue = f"mono/{uuid.uuid4().hex[:10]}"
    _write(migrated_dsn, queue, history)
    projects = tuple(chosen)

    async def walk() -> LastGreen:
        async with await Database.open(migrated_dsn, max_size=1) as db:
            return await db.project_answers.last_green(queue, projects)

    found = runner.run(walk())
    expected = _expected(history, queue, projects)
    assert found.complete
    assert found.request_id == expected
    if expected is None:
        assert (found.uri, found.answers) == (None, {})
    else:
        assert set(found.answers) == set(projects)
        assert {a.request_id for a in found.answers.values()} == {expected}
        assert all(a.degree == 0 for a in found.answers.values())


def test_alternating_greens_past_the_step_limit_are_cut_short_not_wrong(
        migrated_dsn: str, runner: asyncio.Runner) -> None:
    """api green at odd Requests, web at even ones, both green only at the first: the walk
    needs a step per Request; with fewer it says it could not tell."""
    queue = "mono/alternating"
    history = [(False, {"api": 0.0, "web": 0.0, "docs": 0.0, "ops": 0.0})] + [
        (False, {"api": float(n % 2 == 0), "web": float(n % 2), "docs": 0.0, "ops": 0.0})
        for n in range(2, 41)]
    _write(migrated_dsn, queue, history)

    async def walks() -> tuple[LastGreen, LastGreen]:
        async with await Database.open(migrated_dsn, max_size=1) as db:
            return (await db.project_answers.last_green(queue, ("api", "web"), max_steps=10),
                    await db.project_answers.last_green(queue, ("api", "web"), max_steps=60))

    short, enough = runner.run(walks())
    assert (short.request_id, short.complete, short.steps) == (None, False, 10)
    assert (enough.request_id, enough.complete) == (f"request/{queue}/1", True)
    assert request_order(enough.request_id) == (1, 0, 1)
