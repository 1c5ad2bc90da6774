"""Rate budgets: every call to a hosted API draws from a budget per credential (issues 17
and 23).

A provider limits requests per credential — Buildkite 200 a minute per organization (all
its users and tools together), GitHub 5,000 an hour per token, and of those at most about
500 an hour that create content — and Stovepipe must not spend all of it: people and
other tools use the same credential. A `Budget` is this deployment's share of one
credential's limit, spread evenly over the live worker processes.

**Turns.** A call takes its turn when it asks (a token bucket that may go below zero:
the turns given away are paid for at the rate of the moment), so callers are served first
come, first served, a caller knows at once how long it will wait, and at most
`BURST_SECONDS` of the rate are spent at once. Nothing is dropped: a short budget spreads
the calls out (and the poll loops lengthen their period to what the budget allows,
`Budget.poll_period`).

**Workers.** Each worker spends ``per_minute / W``, W being the live worker processes
(`share_among`: the worker counts them from their heartbeats every tend,
`streams.stages.budgets`); a budget made after a count uses the last count. A worker that
has not counted yet (`start_counting` until its first count) spends as if
`UNCOUNTED_WORKERS` shared it. A process that is no worker (a command, a test) counts as
one.

**Pauses.** A rate-limit answer (a 429, GitHub's secondary-limit 403) pauses the whole
credential until the provider's reset or ``Retry-After`` (`pause`): a call asked on it
meanwhile is not made but refused at once with `CredentialPaused`, which its caller waits
out as any unavailability — polls, triggers and statuses alike. A worker tells the others
about the pauses it learned at its next tend (`pauses_to_share`, `pause_from_elsewhere`).

**Long waits are announced.** A caller about to wait `ANNOUNCE_AFTER` seconds or more for
its turn first tells the listener its task set with `on_long_wait` (a poll or trigger
loop tells the sweeper when it will be back, so it is not taken for lost).

Budgets are shared by every runner and notifier of the worker that uses the same
credential (`budget_for`): the key names the provider, the API and the credential (a
token's hash, never the token; an organization for Buildkite), so two queues on one
organization draw from one budget.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar

log = logging.getLogger("stovepipe.budget")

BURST_SECONDS = 10.0  # a budget lets at most this many seconds of its rate go at once
# a poll loop's period leaves this much of the budget for triggers, cancels and the
# per-build calls a batched poll could not answer
POLL_SHARE = 0.8
# a worker that has not counted the live workers yet spends as if this many shared each
# budget: a rolling restart or a scale-out never spends more than the share meanwhile
UNCOUNTED_WORKERS = 10
ANNOUNCE_AFTER = 1.0  # seconds: a wait for a turn at least this long is announced


class BudgetWait(Exception):
    """A call on ``key`` was not made: it could go only ``wait`` seconds from now."""

    def __init__(self, key: str, wait: float, message: str) -> None:
        super().__init__(message)
        self.key, self.wait = key, wait


class CredentialPaused(BudgetWait):
    """The credential answered a rate limit; it is left alone for ``wait`` seconds."""

    def __init__(self, key: str, wait: float) -> None:
        super().__init__(key, wait, f"not sent: the credential is paused for another "
                                    f"{wait:.0f}s after a rate-limit answer")


class TurnTooFar(BudgetWait):
    """The call's turn is further away than its caller would wait."""

    def __init__(self, key: str, wait: float) -> None:
        super().__init__(key, wait, f"not sent yet: its turn in the budget is {wait:.0f}s "
                                    f"away")


@dataclass
class Budget:
    key: str
    per_minute: float  # the deployment's share of the credential's limit
    workers: int | None = None  # None: the live workers counted (`workers_sharing`)
    credential: str = ""  # the credential a pause is about ("": ``key``)
    spent: int = 0  # calls this worker made on it (for the benchmarks and tests)
    # calls that may go now (a token bucket refilled at this worker's rate, at most
    # `capacity`); below 0, turns already given away: a new call waits until they are
    # paid for at the rate of the moment, so a share that grows (a worker counted) serves
    # the calls waiting sooner. None: full, on first use
    _tokens: float | None = field(default=None, repr=False)
    _updated: float = field(default=0.0, repr=False)

    @property
    def sharing(self) -> int:
        return max(1, self.workers if self.workers is not None else workers_sharing())

    @property
    def per_second(self) -> float:
        """This worker's rate."""
        return self.per_minute / 60.0 / self.sharing

    @property
    def capacity(self) -> float:
        """Calls that may go at once after the budget was idle."""
        return max(1.0, self.per_second * BURST_SECONDS)

    def paused_for(self, now: float | None = None) -> float:
        """Seconds the credential stays paused (0: not paused)."""
        until = _PAUSED.get(self.credential or self.key)
        if until is None:
            return 0.0
        return max(0.0, until - (time.monotonic() if now is None else now))

    def _refill(self, now: float) -> float:
        if self._tokens is None:
            self._tokens = self.capacity
        elif now > self._updated:
            self._tokens = min(self.capacity,
                               self._tokens + (now - self._updated) * self.per_second)
        self._updated = max(self._updated, now)
        return self._tokens

    def turn_in(self, now: float) -> float:
        """Seconds from ``now`` until a call asked now could go (nothing reserved)."""
        return max(0.0, 1.0 - self._refill(now)) / self.per_second

    def check(self, now: float, max_wait: float | None) -> float:
        """The wait of a call asked ``now``; raises `CredentialPaused`, or `TurnTooFar`
        when it is longer than ``max_wait``."""
        paused = self.paused_for(now)
        if paused > 0:
            raise CredentialPaused(self.key, paused)
        wait = self.turn_in(now)
        if max_wait is not None and wait > max_wait:
            raise TurnTooFar(self.key, wait)
        return wait

    def reserve(self, now: float) -> None:
        """Take the next turn (after `check`)."""
        self._tokens = self._refill(now) - 1.0
        self.spent += 1

    async def acquire(self, *, max_wait: float | None = None) -> None:
        """Wait for this call's turn (see `take_turns`)."""
        await take_turns((self,), max_wait=max_wait)

    def poll_period(self, loops: int, floor: float) -> float:
        """Seconds between two polls of each of ``loops`` poll loops on this budget (one
        call each, e.g. one batched list per pipeline), so that together they spend at
        most `POLL_SHARE` of this worker's rate; never less than ``floor``."""
        if loops <= 0:
            return floor
        return max(floor, loops / (self.per_second * POLL_SHARE))


async def take_turns(budgets: tuple[Budget, ...], *, max_wait: float | None = None) -> None:
    """Wait for one call's turn in each of ``budgets`` (a call GitHub counts twice: in
    the token's limit and in its content limit). Every turn is checked before any is
    taken, so a call that is refused (`BudgetWait`) spends none; a pause that begins
    while the call waits refuses it too."""
    now = time.monotonic()
    wait = max((b.check(now, max_wait) for b in budgets), default=0.0)
    for budget in budgets:
        budget.reserve(now)
    if wait >= ANNOUNCE_AFTER:
        await announce_wait(wait)
    remaining = now + wait - time.monotonic()
    if remaining > 0:
        await asyncio.sleep(remaining)
    for budget in budgets:
        paused = budget.paused_for()
        if paused > 0:
            raise CredentialPaused(budget.key, paused)


# --- the worker's budgets ---------------------------------------------------------------

_BUDGETS: dict[str, Budget] = {}
_counted: int | None = 1  # the last count of live workers; None: not counted yet
_PAUSED: dict[str, float] = {}  # credential -> monotonic end of its pause
_UNSHARED: set[str] = set()  # pauses learned here that the other workers were not told


def budget_key(provider: str, api_url: str, credential: str) -> str:
    """A budget's key: the provider, the API and the credential's identity (a hash: a
    token never appears in a key, a log or an error)."""
    digest = hashlib.sha256(credential.encode()).hexdigest()[:16]
    return f"{provider}:{api_url.rstrip('/')}:{digest}"


def budget_for(key: str, per_minute: float, *, credential: str = "") -> Budget:
    """The worker's budget for ``key`` (made on first use with ``per_minute``; a later
    caller asking for a smaller share lowers it: the strictest configuration wins).
    ``credential``: the key whose pauses hold this budget too (a content budget: its
    token's)."""
    budget = _BUDGETS.get(key)
    if budget is None:
        budget = _BUDGETS[key] = Budget(key, per_minute, credential=credential)
    elif per_minute < budget.per_minute:
        budget.per_minute = per_minute
    return budget


def content_budget_for(credential: str, per_hour: float) -> Budget:
    """The budget of ``credential``'s calls that create content (GitHub counts them in a
    limit of their own, documented at about 500 an hour), paused with the credential."""
    return budget_for(f"{credential}|content", per_hour / 60.0, credential=credential)


def start_counting() -> None:
    """This process is a worker: until its first count it takes the conservative share
    (`UNCOUNTED_WORKERS`)."""
    global _counted
    _counted = None


def share_among(workers: int) -> None:
    """Every budget of this worker, made now or later, is shared by ``workers`` live
    workers (the last count)."""
    global _counted
    _counted = max(1, workers)


def workers_sharing() -> int:
    """The live workers a budget is divided among: the last count, or
    `UNCOUNTED_WORKERS` before a worker's first."""
    return _counted if _counted is not None else UNCOUNTED_WORKERS


def pause(credential: str, seconds: float) -> None:
    """The provider answered a rate limit on ``credential`` (a budget's key): no call on
    it for ``seconds`` from now, on this worker at once and on the others once told."""
    if _pause(credential, seconds):
        _UNSHARED.add(credential)
        log.warning("credential_paused credential=%s seconds=%.0f", credential, seconds)


def pause_from_elsewhere(credential: str, seconds: float) -> None:
    """Another worker paused ``credential`` for ``seconds`` from now."""
    _pause(credential, seconds)


def _pause(credential: str, seconds: float) -> bool:
    if seconds <= 0:
        return False
    until = time.monotonic() + seconds
    if until <= _PAUSED.get(credential, float("-inf")):
        return False
    _PAUSED[credential] = until
    return True


def pauses_to_share() -> dict[str, float]:
    """The pauses learned here that the other workers were not told yet, as seconds
    still to go (`mark_shared` once they are told)."""
    now = time.monotonic()
    return {key: _PAUSED[key] - now for key in _UNSHARED if _PAUSED[key] > now}


def mark_shared(credentials: Iterable[str]) -> None:
    _UNSHARED.difference_update(credentials)


def in_use() -> bool:
    """Whether this process has made any budget (called a hosted API) yet."""
    return bool(_BUDGETS)


def forget_all() -> None:
    """Every budget, count and pause of this process forgotten (tests and benchmarks
    that play several deployments in one process)."""
    global _counted
    _BUDGETS.clear()
    _PAUSED.clear()
    _UNSHARED.clear()
    _counted = 1


# --- announcing long waits --------------------------------------------------------------

T = TypeVar("T")
WaitListener = Callable[[float], Awaitable[None]]
_LISTENER: ContextVar[WaitListener | None] = ContextVar("budget_wait_listener",
                                                        default=None)


@contextmanager
def on_long_wait(listener: WaitListener) -> Iterator[None]:
    """Within this block, a call of this task that is about to wait `ANNOUNCE_AFTER`
    seconds or more for its turn first awaits ``listener(seconds)``."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


async def announcing(listener: WaitListener, call: Awaitable[T]) -> T:
    """``await call`` within `on_long_wait(listener)`."""
    with on_long_wait(listener):
        return await call


def current_listener() -> WaitListener | None:
    return _LISTENER.get()


async def announce_wait(seconds: float) -> None:
    """Tell this task's listener (if any) that it waits ``seconds`` for a turn."""
    listener = _LISTENER.get()
    if listener is not None and seconds >= ANNOUNCE_AFTER:
        await listener(seconds)
