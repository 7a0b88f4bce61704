"""A hostile or broken engine with a replay endpoint cannot make a subscriber log per message.

Each bad or out-of-sequence message of such an engine makes the relay reset the member, ask the
replay and rebuild: the source flips between ``replaying`` and ``live`` at message rate, and the
replay's own outcomes (a vouch it cannot give, no answer, a restart told while it is read) come
as often. Every one of them is counted; each event is logged at most once per period per source
(``subscriber_state`` once per period per state), the next line saying how many were not. The
member is still reset and rebuilt exactly as before: the sink sees the same batches and resets.

Real ZMQ sockets on loopback, both live readers (``reader``, from ``test_subscriber``).
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import zmq.asyncio

from kvrelay import logging as kvlog
from kvrelay.ingest import subscriber as submod
from kvrelay.ingest.sink import ResetReason
from kvrelay.logging import INPUT_LOG_S
from tests.ingest.test_subscriber import (  # noqa: F401 (fixtures)
    RecordingSink,
    _synced,
    ctx,
    make,
    msg,
    reader,
)
from tests.support.concurrent_replay import ConcurrentReplayPublisher
from tests.support.vllm_publisher import TestPublisher, until

#: Hostile rounds per test: with a line per round, each event would be logged this often.
ROUNDS = 30
BAD = b"\xc1 not msgpack"


class Lines(list[dict[str, Any]]):
    """The JSON lines logged (info and up) inside ``log_lines``: ``read()`` parses those so far."""

    def __init__(self, buf: io.StringIO) -> None:
        super().__init__()
        self._buf = buf

    def read(self) -> Lines:
        self[:] = [json.loads(x) for x in self._buf.getvalue().splitlines()]
        return self


@contextmanager
def log_lines() -> Iterator[Lines]:
    """Lines logged inside the block (all of them, once it ends)."""
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    lines = Lines(buf)
    try:
        yield lines
    finally:
        kvlog.configure(level="WARNING", stream=sys.stderr)
        lines.read()


@asynccontextmanager
async def subscribed(
    pub: TestPublisher, context: zmq.asyncio.Context, synced: int, **kw: Any
) -> AsyncIterator[tuple[RecordingSink, submod.Subscriber, Lines]]:
    """A subscriber of ``pub`` (``make``'s ``kw``) synced with its first ``synced`` batches, its
    sink, and the lines logged from its start to the block's end (``log_lines``). Then what the
    test held of ``pub``'s replay (``gate``, ``mid``) is let go, the subscriber is stopped and
    ``pub`` closed."""
    sink = RecordingSink()
    sub = make(pub, sink, context, **kw)
    try:
        with log_lines() as lines:
            await _synced(pub, sink, sub, synced)
            yield sink, sub, lines
    finally:
        pub.gate.set()
        pub.mid.set()
        await sub.stop()
        await pub.close()


def events(lines: list[dict[str, Any]], event: str, **fields: Any) -> list[dict[str, Any]]:
    """The lines of ``event`` whose ``fields`` have those values."""
    return [
        x for x in lines if x["event"] == event and all(x.get(k) == v for k, v in fields.items())
    ]


def logged_once_per_period(
    lines: list[dict[str, Any]], event: str, elapsed: float
) -> list[dict[str, Any]]:
    """The lines of ``event``: at least one, at most one per period of a run of ``elapsed`` s,
    the first saying that none went unlogged before it."""
    logged = events(lines, event)
    assert 1 <= len(logged) <= windows(elapsed), (event, len(logged))
    assert logged[0]["not_logged"] == 0, logged[0]
    return logged


async def good_then_bad(
    pub: TestPublisher, sink: RecordingSink, sub: submod.Subscriber
) -> list[int]:
    """``ROUNDS`` times a good batch, applied, then one that does not decode, after which the
    member is reset and live again; the good batches' sequence numbers."""
    goods: list[int] = []
    for i in range(ROUNDS):
        good = await pub.publish(msg(pub.seq))
        goods.append(good)
        await until(lambda g=good: g in sink.seqs)  # type: ignore[misc]
        await pub.publish(BAD)
        await until(lambda n=i + 1: len(sink.resets) == n and sub.state == "live")  # type: ignore[misc]
    return goods


def applied(seq: int) -> tuple[str, Any]:
    """``seq``'s batch (``msg``) as ``RecordingSink`` records it."""
    return ("batch", (seq, [10_000 + seq]))


def windows(elapsed: float, period: float = INPUT_LOG_S) -> int:
    """Throttle periods a run of ``elapsed`` seconds touches: the most lines one key may log."""
    return 1 + int(elapsed / period)


def held(sink: RecordingSink) -> set[int]:
    """The member's blocks by the reference model of ``msg``: seq % 3 == 0 stores 10_000 + seq,
    the others remove a block never stored; a reset clears everything."""
    out: set[int] = set()
    for kind, value in sink.items:
        if kind == "reset":
            out.clear()
        elif kind == "batch":
            seq, hashes = value
            if seq % 3 == 0:
                out.update(hashes)
    return out


def truth(seqs: range | list[int]) -> set[int]:
    return {10_000 + s for s in seqs if s % 3 == 0}


async def test_bad_batches_a_replay_cannot_vouch_for_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """The engine sends a batch that does not decode after each good one, and its replay holds
    nothing (the audit's ``badbatch``): each bad batch is re-fetched, the replay cannot vouch for
    the batch before it (``incarnation_unverified``), the member is reset and rebuilt from what
    the replay has (nothing), and the next good batch is a gap the replay cannot fill. Four
    ``subscriber_state`` lines and one ``incarnation_unverified`` per round before; now each at
    most once per period. Every bad batch still resets the member, every good one is applied,
    and once the replay holds the history again the member is rebuilt to the engine's state."""
    pub = TestPublisher(ctx)
    # synced with 0..2, vouched by the bootstrap replay
    async with subscribed(pub, ctx, 3) as (sink, sub, lines):
        pub.history = deque(maxlen=0)  # the replay holds nothing from now on
        t0 = time.monotonic()
        goods = await good_then_bad(pub, sink, sub)
        elapsed = time.monotonic() - t0
        c = sub.counters
        assert c.bad_batches == ROUNDS and c.incarnations_detected == ROUNDS
        # the member's lifecycle, exactly: each good batch applied, each bad one a reset
        expected = [x for g in goods for x in (applied(g), ("reset", ResetReason.INCARNATION))]
        assert sink.items[3:] == expected
        assert held(sink) == set()
        # the engine behaves again: a restart, its replay holding 0..6
        pub.history = deque()
        pub.restart()
        for s in range(6):
            await pub.publish(msg(s), live=False)
        await pub.publish(msg(6))
        await until(lambda: sink.seqs[-7:] == list(range(7)) and sub.state == "live")
        assert held(sink) == truth(range(7))
        await until(lambda: sub.state == "live")
    n = windows(elapsed)
    logged_once_per_period(lines, "incarnation_unverified", elapsed)
    assert len(events(lines, "bad_batch")) <= n
    # the bootstrap's replaying and live, then at most one line per state and period
    states = events(lines, "subscriber_state")
    assert len(states) <= 2 + 2 * n, [(x["state"], x["not_logged"]) for x in states]
    assert all("not_logged" in x for x in states)


async def test_a_replay_that_never_answers_logs_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """The engine's replay takes every request and never answers, and each good batch is
    followed by a bad one: each bad batch asks the replay to vouch for the batch before it
    (``replay_timeout``), the member is reset (``vouch_unanswered``) and its rebuild's replay
    times out too. Five lines per round before; now each event at most once per period. Each
    bad batch still resets the member once, and the next good batch is its new baseline, once
    the replay was asked from 0 once more (it may have been too busy to answer)."""
    pub = TestPublisher(ctx)
    async with subscribed(pub, ctx, 2, replay_timeout=0.05) as (sink, sub, lines):
        pub.gate.clear()  # requests taken, never answered
        t0 = time.monotonic()
        goods = await good_then_bad(pub, sink, sub)
        elapsed = time.monotonic() - t0
        c = sub.counters
        # per round: the vouch, the rebuild from 0, and that asked again at the next good
        # batch (the last round's is still to come)
        assert c.bad_batches == ROUNDS and c.replay_failures == 3 * ROUNDS - 1
        reset = ("reset", ResetReason.VOUCH_TIMEOUT)
        expected = [x for g in goods for x in (applied(g), reset)]
        assert sink.items[2:] == expected
        assert held(sink) == set() and sub.next_seq is None  # the next batch: a baseline
    n = windows(elapsed)
    for event in ("vouch_unanswered", "replay_timeout"):
        logged_once_per_period(lines, event, elapsed)
    assert len(events(lines, "subscriber_state")) <= 2 + 2 * n


async def test_restarts_told_during_a_replay_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """While the member is rebuilt from the replay, the live stream goes back again and again
    (the audit's ``backwards``): each time the rebuild starts over from 0, and
    ``sequence_backwards`` (``during: replay``) was logged each time, with the source flipping
    to ``live`` and back to ``replaying``. Now at most once per period (the live path's line
    shares the period). The member is reset at each restart and ends rebuilt exactly."""
    pub = ConcurrentReplayPublisher(ctx)
    async with subscribed(pub, ctx, 10) as (sink, sub, lines):  # 0..9
        pub.pause_after = 3  # each replay gives 0..2, then waits for ``mid``
        pub.mid.clear()
        t0 = time.monotonic()
        # the live stream goes back: the member is rebuilt from the replay at 0
        await pub.send_raw([pub.topic, (2).to_bytes(8, "big"), msg(2)])
        for i in range(ROUNDS):
            await until(lambda n=i + 1: len(pub.requests) == 1 + n and sub.next_seq == 3)  # type: ignore[misc]
            # back again while the rebuild is read: another restart, the rebuild from 0 again
            await pub.send_raw([pub.topic, (0).to_bytes(8, "big"), msg(0)])
            await until(lambda n=i + 2: len(sink.resets) == n)  # type: ignore[misc]
        await until(lambda: len(pub.requests) == 2 + ROUNDS and sub.next_seq == 3)
        elapsed = time.monotonic() - t0
        assert sink.resets == [ResetReason.INCARNATION] * (ROUNDS + 1)
        pub.mid.set()  # the last rebuild goes on: 3..9
        await until(lambda: sub.state == "live" and sub.next_seq == 10)
        last = max(i for i, (k, _) in enumerate(sink.items) if k == "reset")
        assert [v[0] for k, v in sink.items[last + 1:] if k == "batch"] == list(range(10))
        assert held(sink) == truth(range(10))
    backwards = logged_once_per_period(lines, "sequence_backwards", elapsed)
    assert backwards[0]["during"] == "live"
    assert len(events(lines, "subscriber_state")) <= 2 + 2 * windows(elapsed)


async def test_an_isolated_state_change_is_logged_at_once_and_flapping_once_per_period(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Gaps filled by the replay in quick succession flip the source to ``replaying`` and back
    each time; after a quiet period, the next one is logged at once with how many flips into
    that state went unlogged since the last line (here a 1 s period)."""
    monkeypatch.setattr(submod, "STATE_LOG_S", 1.0)
    pub = TestPublisher(ctx)
    async with subscribed(pub, ctx, 2) as (sink, sub, lines):
        t0 = time.monotonic()
        for _ in range(ROUNDS):  # a lost batch, then a live one: one gap replay each
            await pub.publish(msg(pub.seq), live=False)
            last = await pub.publish(msg(pub.seq))
            await until(lambda s=last: s in sink.seqs and sub.state == "live")  # type: ignore[misc]
        elapsed = time.monotonic() - t0
        await until(lambda: time.monotonic() - t0 > elapsed + 1.1)  # a quiet period
        await pub.publish(msg(pub.seq), live=False)
        last = await pub.publish(msg(pub.seq))
        await until(lambda: last in sink.seqs and sub.state == "live")
        # logged at once, not at some later flip: the line is there now
        isolated = events(lines.read(), "subscriber_state", state="replaying")[-1]
        assert isolated["next_seq"] == last - 1 and isolated["not_logged"] > 0
        assert sub.counters.gaps == ROUNDS + 1 and sink.resets == []
        assert sink.seqs == list(range(pub.seq))
    replaying = events(lines, "subscriber_state", state="replaying")
    # the bootstrap's, then the gaps': each flip is a line or counted in a later line's not_logged
    assert sum(1 + x["not_logged"] for x in replaying) == 1 + ROUNDS + 1, replaying
    assert len(replaying) <= 1 + windows(elapsed, 1.0) + 1
    assert replaying[-1] == isolated
    lives = events(lines, "subscriber_state", state="live")
    assert sum(1 + x["not_logged"] for x in lives) == 1 + ROUNDS + 1, lives


async def test_live_batches_repaired_from_the_replay_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """Each live batch arrives corrupted and the replay holds it intact: each is re-fetched and
    applied (``bad_batch_repaired``, a line per batch before). Every batch is applied once, in
    order, and nothing is reset."""
    pub = TestPublisher(ctx)
    async with subscribed(pub, ctx, 2) as (sink, sub, lines):
        t0 = time.monotonic()
        for _ in range(ROUNDS):
            seq = await pub.publish(msg(pub.seq), live=False)  # the replay holds it intact
            await pub.send_raw([pub.topic, seq.to_bytes(8, "big"), BAD])  # live: corrupted
            await until(lambda s=seq: s in sink.seqs and sub.state == "live")  # type: ignore[misc]
        elapsed = time.monotonic() - t0
        assert sink.seqs == list(range(pub.seq)) and sink.resets == []
        assert sub.counters.repairs == ROUNDS and sub.counters.bad_batches == ROUNDS
    logged_once_per_period(lines, "bad_batch_repaired", elapsed)
    assert len(events(lines, "bad_batch")) <= windows(elapsed)


async def test_gaps_whose_history_is_gone_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """The engine's replay keeps only its newest batch, and it loses a live batch each round: the
    gap's replay starts past what was asked (``replay_history_missing``, a line per gap
    before). Each gap still resets the member once, before the batch after it."""
    pub = TestPublisher(ctx, keep=1)
    async with subscribed(pub, ctx, 1) as (sink, sub, lines):
        t0 = time.monotonic()
        after: list[int] = []
        for i in range(ROUNDS):
            await pub.publish(msg(pub.seq), live=False)  # lost, and gone from the replay
            after.append(await pub.publish(msg(pub.seq)))
            await until(lambda n=i + 1: len(sink.resets) == n and after[-1] in sink.seqs)  # type: ignore[misc]
        elapsed = time.monotonic() - t0
        reset = ("reset", ResetReason.GAP_UNRECOVERABLE)
        expected = [x for s in after for x in (reset, applied(s))]
        assert sink.items[1:] == expected
        assert sub.counters.missing_history == ROUNDS
    logged_once_per_period(lines, "replay_history_missing", elapsed)


async def test_replies_that_skip_batches_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """Each round two live batches are lost and the replay's reply skips one of them (a ROUTER
    past its send high-water mark): asked again from the hole (``replay_gap``, a line per reply
    before), and the gap is filled: every batch applied once, in order, nothing reset."""
    pub = TestPublisher(ctx)
    async with subscribed(pub, ctx, 2) as (sink, sub, lines):
        t0 = time.monotonic()
        for _ in range(ROUNDS):
            await pub.publish(msg(pub.seq), live=False)
            skipped = await pub.publish(msg(pub.seq), live=False)
            pub.reply_drops.append({skipped})  # the first reply: the vouch, one, not two
            last = await pub.publish(msg(pub.seq))
            await until(lambda s=last: s in sink.seqs and sub.state == "live")  # type: ignore[misc]
        elapsed = time.monotonic() - t0
        assert sink.seqs == list(range(pub.seq)) and sink.resets == []
        assert sub.counters.replay_gaps == ROUNDS
    logged_once_per_period(lines, "replay_gap", elapsed)


async def test_reorder_overflows_log_once_per_period(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """Each round a gap's replay does not answer while more live batches come than the reorder
    buffer holds (two here): the buffer overflows (``reorder_overflow``, a line per round
    before), the member is reset and goes on from the next live batch."""
    pub = TestPublisher(ctx)
    async with subscribed(pub, ctx, 2, reorder_max_messages=2) as (sink, sub, lines):
        pub.gate.clear()  # requests taken, never answered
        t0 = time.monotonic()
        for i in range(ROUNDS):
            await pub.publish(msg(pub.seq), live=False)  # lost: a gap, a replay
            for _ in range(3):  # past the buffer's bound while the replay is silent
                await pub.publish(msg(pub.seq))
            await until(lambda n=i + 1: sub.counters.reorder_overflows == n)  # type: ignore[misc]
            base = await pub.publish(msg(pub.seq))  # after the overflow: the new baseline
            await until(lambda s=base: s in sink.seqs and sub.state == "live")  # type: ignore[misc]
        elapsed = time.monotonic() - t0
        assert sink.resets == [ResetReason.REORDER_OVERFLOW] * ROUNDS
        # after each reset only the baseline and what follows it: nothing from before
        for k, (kind, _) in enumerate(sink.items):
            if kind == "reset":
                assert sink.items[k + 1][0] == "batch"
    logged_once_per_period(lines, "reorder_overflow", elapsed)
