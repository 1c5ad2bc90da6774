"""Which chain of held messages is the loop (design §6, liveness).

A Request waiting at the gate and a Build being polled are each kept alive by a chain of
held messages: each turn ends by holding the message for the next turn. Chains can
multiply — every ingest of an unchanged head re-publishes its Request, a duplicate
BuildRequest re-publishes the poll loop, a worker killed after producing its hold but
before committing delivers the message again, the sweeper revives a loop it thinks lost —
and only one of them may go on. Which one is decided by the row, never by a clock or by a
worker's memory:

- the row holds a ``loop_token``, and each message carries the token of the loop it
  belongs to (``loop`` in the payload);
- a message whose token is not the row's belongs to a duplicate loop and ends;
- a message with no token is a fresh publication and takes the loop over;
- the loop takes a new token every `HEARTBEAT` seconds (by the database's clock), which
  also ends duplicates that share its old token, and marks the loop seen for the sweeper.

A new token is derived from the message that takes it (`message_token`): the same
message delivered again after a crash derives the same token, finds it already on the row
and goes on, so the last loop can never end by losing a race with itself.

A loop that will be silent longer than its delays — waiting out an outage, or for its turn
in a hosted API's rate budget (a trigger, a poll) — says when it will be back: its row is
marked seen until then (`request_back_after`, `build_back_after`), so the sweeper does not
take it for lost and start another.
"""

from __future__ import annotations

from enum import Enum

from store import Database
from streams.extensions.budget import WaitListener
from streams.runtime.stage import Incoming

HEARTBEAT = 5.0  # seconds between a live loop's new tokens, by the database's clock


class Turn(Enum):
    CONTINUE = "continue"  # this message is the loop: go on with the row's token
    CLAIM = "claim"  # this message is the loop and takes a new token now
    DUPLICATE = "duplicate"  # another loop owns the row: end without a next turn


def message_token(stage: str, message: Incoming) -> str:
    """The token a message takes a loop with: its stage and where its delivery began —
    the same on every delivery and every retry of that message, different for every
    other message (a hold is a new message, and a new turn)."""
    return f"{stage}@{message.origin}"


def next_turn(*, row_token: str, carried: str, mine: str, age: float,
              heartbeat: float = HEARTBEAT) -> Turn:
    """What a message carrying ``carried`` does with a row whose loop is ``row_token``,
    last seen ``age`` seconds ago; ``mine`` is the message's own `message_token`."""
    if row_token == mine:
        return Turn.CONTINUE  # this very message took the loop before (a redelivery)
    if not carried:
        return Turn.CLAIM  # a fresh publication takes over; the old chain ends next turn
    if carried != row_token:
        return Turn.DUPLICATE
    return Turn.CLAIM if age >= heartbeat else Turn.CONTINUE


def request_back_after(db: Database, queue: str, request_id: str) -> WaitListener:
    """What a Request's loop (its trigger) does when a rate budget makes it wait: its row
    is seen until the wait is over."""
    async def back_after(wait: float) -> None:
        await db.requests.touch_loop(queue, request_id, quiet=wait)
    return back_after


def build_back_after(db: Database, queue: str, build_id: str) -> WaitListener:
    """What a build's poll loop does when a rate budget makes it wait: its row is seen
    until the wait is over."""
    async def back_after(wait: float) -> None:
        await db.builds.touch_loop(queue, build_id, quiet=wait)
    return back_after
