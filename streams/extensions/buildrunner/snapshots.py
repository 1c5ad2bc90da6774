"""Batched polls: one list call answers every running build of a pipeline (issue 17).

A hosted CI lets a client list a pipeline's (a workflow's) builds in one call — Buildkite
by creation time and state, GitHub Actions by creation date and status. Instead of asking
about each running build on every poll, a worker keeps per pipeline a `Snapshot`: what the
last list call said about each build, refreshed at most once per *period* (the pipeline's
poll period, what the credential's budget allows: `streams.extensions.budget`). A build's
poll takes its answer from a snapshot taken after the poll began its period, and asks for
the build alone only when the list did not name it (a build older than the list reaches,
or one created since).

Poll loops are steered to the snapshot's schedule (`Snapshot.wait_before_next`): each loop
holds until just after the pipeline's next refresh is due, so the first loop to arrive
refreshes it and the others share that call — one call per pipeline per period however
many builds run on it, and a build's end is seen within one period of the provider
reporting it. A list call that fails is an answer too: every loop of the pipeline gets
that failure until the next refresh is due, so a provider's outage is asked about once
per period per pipeline, not once per build.

A loop that waits for a refresh another loop started waits as long as that refresh's
call waits for its turn in the budget: it announces that wait as the refreshing loop does
(`budget.on_long_wait`), so neither is taken for lost while the budget spaces the calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streams.extensions import budget

MARGIN = 0.25  # seconds after a refresh is due that the loops come back
FORGET_AFTER = 3  # periods after its last poll that a build stops being listed for


@dataclass
class Snapshot:
    """One pipeline's builds, as its last list call answered."""

    # lists the pipeline's builds created at or after the given ISO time (None: the
    # newest), as {build key: what the provider said}, and says whether the list was
    # complete (a full page may have left older builds out)
    list_builds: Callable[[str | None], Awaitable[tuple[Mapping[str, Any], bool]]]
    taken_at: float = float("-inf")  # monotonic time of the last refresh's start
    period: float = 0.0  # seconds a list answers for (`plan`)
    builds: dict[str, Any] = field(default_factory=dict)
    complete: bool = False
    asked: dict[str, float] = field(default_factory=dict)  # build key -> last poll
    created: dict[str, str] = field(default_factory=dict)  # build key -> created time
    refreshes: int = 0
    _refreshing: asyncio.Future[None] | None = None
    _failure: BaseException | None = None  # what the last refresh raised, if it failed
    _turn_at: float = 0.0  # monotonic time the refresh under way gets its budget's turn

    async def lookup(self, key: str) -> Any | None:
        """What the provider said of build ``key`` in a list taken at most a period ago
        (refreshing the list when it is older); None when the list did not name it (then
        ask for the build alone)."""
        now = time.monotonic()
        self.asked[key] = now
        if self._refreshing is not None:
            await budget.announce_wait(self._turn_at - now)
            await asyncio.shield(self._refreshing)
        elif now - self.taken_at >= self.period - MARGIN:
            await self._refresh(now, max(self.period, MARGIN))
        elif self._failure is not None:
            # the last list failed less than a period ago: its answer stands for every
            # loop of the pipeline, so an outage costs one call per period, as health does
            raise self._failure
        return self.builds.get(key)

    def plan(self, period: float) -> float:
        """This pipeline is polled every ``period`` seconds: how long a poll loop holds
        before its next poll (until just after the next refresh is due)."""
        self.period = period
        return self.wait_before_next(period)

    def remember(self, key: str, build: Any, created_at: str | None) -> None:
        """A build asked for alone: keep what was said until the next list."""
        self.builds[key] = build
        if created_at:
            self.created[key] = created_at

    def wait_before_next(self, period: float) -> float:
        """Seconds until just after this pipeline's next refresh is due."""
        return max(0.0, self.taken_at + period - time.monotonic()) + MARGIN

    def active(self, within: float) -> bool:
        now = time.monotonic()
        return any(now - at <= within for at in self.asked.values())

    async def _refresh(self, now: float, period: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._refreshing = future
        try:
            for key in [k for k, at in self.asked.items() if now - at > FORGET_AFTER * period]:
                del self.asked[key]
                self.created.pop(key, None)
            wanted = [self.created[k] for k in self.asked if k in self.created]
            since = min(wanted) if wanted and len(wanted) == len(self.asked) else None
            self.taken_at = now
            self._turn_at = now
            outer = budget.current_listener()

            async def note_turn(wait: float) -> None:
                # set before any other task runs: the budget reserves the turn and calls
                # this without awaiting in between, so every loop that joins sees it
                self._turn_at = time.monotonic() + wait
                if outer is not None:
                    await outer(wait)

            with budget.on_long_wait(note_turn):
                builds, complete = await self.list_builds(since)
            self.builds, self.complete = dict(builds), complete
            for key, build in builds.items():
                created = build.get("created_at") if isinstance(build, dict) else None
                if isinstance(created, str):
                    self.created[key] = created
            self.refreshes += 1
            self._failure = None
            future.set_result(None)
        except asyncio.CancelledError:
            # not an answer: the next poll tries again; a loop waiting on this one goes
            # on with what the snapshot had (or asks for its build alone)
            self.taken_at = float("-inf")
            future.set_result(None)
            raise
        except BaseException as exc:
            self._failure = exc  # an answer: it stands until the next refresh is due
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters get it through the shield
            raise
        finally:
            self._refreshing = None


_SNAPSHOTS: dict[str, Snapshot] = {}


def snapshot_for(key: str, list_builds: Callable[[str | None],
                                                 Awaitable[tuple[Mapping[str, Any], bool]]]
                 ) -> Snapshot:
    """The worker's snapshot of the pipeline ``key`` (shared by every queue on it)."""
    snapshot = _SNAPSHOTS.get(key)
    if snapshot is None:
        snapshot = _SNAPSHOTS[key] = Snapshot(list_builds)
    return snapshot


def active_pipelines(prefix: str, within: float) -> int:
    """Pipelines (snapshot keys starting with ``prefix``: one credential's) polled within
    the last ``within`` seconds."""
    return sum(1 for key, s in _SNAPSHOTS.items() if key.startswith(prefix)
               and s.active(within))
