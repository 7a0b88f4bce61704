"""``ServerFrameBudget`` reads frame headers from reads split anywhere: a payload that holds
bytes shaped like PING headers is skipped, and the budget trips at the same frame however the
stream is cut."""

from __future__ import annotations

import random

import pytest

from kvrelay import _grpc as fb


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


PING = _frame(fb.PING, 0, bytes(8))
# a DATA frame whose payload is PING frames: read as payload, never counted
DECOY = _frame(0x0, 0, PING * 200)


def _trip_at(stream: bytes, cuts: list[int]) -> tuple[int, str | None]:
    """How many bytes were fed before ``feed`` said False (the whole stream: never)."""
    budget = fb.ServerFrameBudget()
    pos = 0
    for end in [*cuts, len(stream)]:
        if not budget.feed(stream[pos:end]):
            return end, budget.tripped
        pos = end
    return len(stream), budget.tripped


@pytest.mark.parametrize("seed", range(20))
def test_the_budget_trips_at_the_same_frame_however_the_reads_fall(seed: int) -> None:
    r = random.Random(seed)
    head = _frame(fb.SETTINGS, 0) + DECOY + _frame(fb.PING, fb.ACK, bytes(8)) * 500
    stream = head + PING * fb.MAX_PINGS + DECOY + PING + PING * 10
    tripping = len(head) + len(PING) * fb.MAX_PINGS + len(DECOY) + len(PING)
    cuts = sorted(r.sample(range(1, len(stream)), r.randrange(1, 60)))
    end, why = _trip_at(stream, cuts)
    assert why == "ping_flood"
    # the read that held the frame past the budget is the one refused
    assert end == min(c for c in [*cuts, len(stream)] if c >= tripping - len(PING) + 9)
    assert _trip_at(stream[: tripping - len(PING)], cuts)[1] is None


def test_acks_and_data_are_never_budgeted() -> None:
    stream = (_frame(fb.PING, fb.ACK, bytes(8)) + _frame(fb.SETTINGS, fb.ACK) + DECOY) * 500
    assert _trip_at(stream, list(range(1, len(stream), 7)))[1] is None
