"""Wait on a condition with a deadline: no sleep-and-hope in tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(condition: Callable[[], bool], *, timeout: float, what: str,
               interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def wait_until_async(condition: Callable[[], Awaitable[bool]], *, within: float,
                           what: str, interval: float = 0.05) -> None:
    """`wait_until` inside an event loop, for a condition that must be awaited (at most
    ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        if await condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
