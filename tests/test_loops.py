"""Which chain of held messages is the loop (streams.stages.loops), as a pure function and
as a simulation of many chains racing over one row (Hypothesis): a duplicate chain ends,
the last chain never does, and nothing depends on any clock but the row's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from streams.stages.loops import HEARTBEAT, Turn, next_turn

tokens = st.sampled_from(["", "a", "b", "c"])
ages = st.floats(min_value=0, max_value=3 * HEARTBEAT, allow_nan=False)


@given(row=tokens, carried=tokens, age=ages)
def test_a_message_that_took_the_loop_before_goes_on(row: str, carried: str,
                                                     age: float) -> None:
    assert next_turn(row_token=row, carried=carried, mine=row, age=age) is Turn.CONTINUE


@given(row=tokens, age=ages)
def test_a_fresh_publication_takes_the_loop_over(row: str, age: float) -> None:
    assert next_turn(row_token=row, carried="", mine="m", age=age) is Turn.CLAIM


@given(row=tokens, carried=tokens.filter(bool), age=ages)
def test_a_message_of_another_loop_ends(row: str, carried: str, age: float) -> None:
    turn = next_turn(row_token=row, carried=carried, mine="m", age=age)
    assert (turn is Turn.DUPLICATE) == (carried != row)


@given(carried=tokens.filter(bool), age=ages)
def test_the_loop_takes_a_new_token_once_a_heartbeat(carried: str, age: float) -> None:
    turn = next_turn(row_token=carried, carried=carried, mine="m", age=age)
    assert turn is (Turn.CLAIM if age >= HEARTBEAT else Turn.CONTINUE)


# --- many chains over one row --------------------------------------------------------------


@dataclass
class Message:
    token: str  # the loop token it carries
    origin: int  # its delivery's coordinates: a redelivery keeps them


@dataclass
class World:
    """A row and the messages in flight for it. Each delivery runs `next_turn` and, unless
    the message's chain ends, holds it: the next turn is a new message (new origin)
    carrying the row's token. ``age`` is the row's clock: seconds since the loop was last
    seen; it never reads a worker's clock."""

    row: str = ""
    age: float = 0.0
    flight: list[Message] = field(default_factory=list)
    origins: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def mine(self, message: Message) -> str:
        return f"tok{message.origin}"

    def publish_fresh(self) -> None:
        self.flight.append(Message("", next(self.origins)))

    def deliver(self, index: int, *, crash_before_hold: bool = False) -> None:
        message = self.flight.pop(index)
        turn = next_turn(row_token=self.row, carried=message.token, mine=self.mine(message),
                         age=self.age)
        if turn is Turn.DUPLICATE:
            return
        if turn is Turn.CLAIM:
            self.row, self.age = self.mine(message), 0.0
        if crash_before_hold:
            # the worker died after its writes, before its hold was acknowledged: the same
            # message is delivered again (same coordinates), with the token it carried
            self.flight.append(message)
            return
        self.flight.append(Message(self.row, next(self.origins)))

    def live_chains(self) -> list[Message]:
        """Messages that would go on if delivered now."""
        return [m for m in self.flight
                if next_turn(row_token=self.row, carried=m.token, mine=self.mine(m),
                             age=self.age) is not Turn.DUPLICATE]


events = st.lists(st.tuples(st.sampled_from(["deliver", "duplicate", "fresh", "crash",
                                             "tick"]),
                            st.integers(0, 50), st.floats(0, 2 * HEARTBEAT)),
                  max_size=80)


@given(events=events)
def test_the_last_loop_never_ends_and_duplicates_die_out(
        events: list[tuple[str, int, float]]) -> None:
    world = World()
    world.publish_fresh()
    for kind, pick, seconds in events:
        if not world.flight:
            break
        index = pick % len(world.flight)
        match kind:
            case "deliver":
                world.deliver(index)
            case "crash":
                world.deliver(index, crash_before_hold=True)
            case "duplicate":  # a redelivery of the same message (a crash before commit)
                message = world.flight[index]
                world.flight.append(Message(message.token, message.origin))
            case "fresh":  # ingest or the sweeper publishes it again
                world.publish_fresh()
            case "tick":  # time passes by the database's clock
                world.age += seconds
        assert world.live_chains(), "the last loop ended"

    # then the chains run on their own: within a couple of heartbeats only one is left
    for _ in range(200):
        if len({m.origin for m in world.live_chains()}) <= 1 and len(world.flight) == 1:
            break
        world.age += HEARTBEAT / 4
        world.deliver(0)
        assert world.live_chains(), "the last loop ended"
    assert len(world.flight) == 1, f"duplicates live on: {world.flight}"
