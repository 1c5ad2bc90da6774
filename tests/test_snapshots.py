"""Batched polls' snapshot (streams.extensions.buildrunner.snapshots): one list call per
pipeline per period, whether the call answers or fails — an outage of the provider is
asked about once per period per pipeline, not once per build."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from streams.extensions.buildrunner.snapshots import Snapshot


class Down(Exception):
    pass


def test_a_failed_list_stands_for_every_loop_until_the_next_period() -> None:
    calls: list[str | None] = []
    answer: dict[str, Any] = {"fail": True}

    async def list_builds(since: str | None) -> tuple[Mapping[str, Any], bool]:
        calls.append(since)
        await asyncio.sleep(0.01)
        if answer["fail"]:
            raise Down("503")
        return {"b1": {"state": "passed"}}, True

    async def run() -> None:
        snapshot = Snapshot(list_builds)
        snapshot.plan(0.6)
        # six loops at once: one call, six failures
        results = await asyncio.gather(*(snapshot.lookup(f"b{n}") for n in range(6)),
                                       return_exceptions=True)
        assert len(calls) == 1 and all(isinstance(r, Down) for r in results)
        # loops coming back within the period get the same answer without a call
        for n in range(6):
            with pytest.raises(Down):
                await snapshot.lookup(f"b{n}")
        assert len(calls) == 1
        # the next period asks again; the provider is back
        answer["fail"] = False
        await asyncio.sleep(0.6)
        assert await snapshot.lookup("b1") == {"state": "passed"}
        assert await snapshot.lookup("b2") is None  # not listed: ask for it alone
        assert len(calls) == 2

    asyncio.run(run())


def test_a_cancelled_list_is_no_answer() -> None:
    calls = 0

    async def list_builds(since: str | None) -> tuple[Mapping[str, Any], bool]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(10)
        return {"b1": {"state": "running"}}, True

    async def run() -> None:
        snapshot = Snapshot(list_builds)
        snapshot.plan(5.0)
        first = asyncio.create_task(snapshot.lookup("b1"))
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(snapshot.lookup("b1"))
        await asyncio.sleep(0.05)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await waiter is None  # went on without an answer: asks for it alone
        assert await snapshot.lookup("b1") == {"state": "running"}  # asked again
        assert calls == 2

    asyncio.run(run())
