"""Subscriber over real ZMQ sockets on loopback: replay bootstrap, gaps, resets, bounds."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvrelay import logging as kvlog
from kvrelay.ingest.sink import ResetReason, SourceKey, SourceSpec
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.pool.batch import AnyBatch, as_events
from tests.support import vllm_wire as W
from tests.support.concurrent_replay import ConcurrentReplayPublisher
from tests.support.vllm_publisher import TestPublisher, until

B = 4


class RecordingSink:
    def __init__(self) -> None:
        self.items: list[tuple[str, Any]] = []
        self.rebuilds: list[tuple[bool, int]] = []

    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
        assert source == SourceKey(42, 0)
        self.items.append(("batch", (seq, as_events(batch).ext_hashes.tolist())))

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.items.append(("reset", reason))

    def on_rebuild(self, source: SourceKey, active: bool) -> None:
        # where in ``items`` the rebuild began / ended (kept apart: tests index ``items``)
        self.rebuilds.append((active, len(self.items)))

    def on_vouched(self, source: SourceKey) -> None:
        self.items.append(("vouched", source))

    @property
    def seqs(self) -> list[int]:
        return [v[0] for k, v in self.items if k == "batch"]

    @property
    def resets(self) -> list[ResetReason]:
        return [v for k, v in self.items if k == "reset"]


def msg(seq: int, era: str = "map") -> bytes:
    """One message per seq; its content names the seq (so the oracle is the seq list itself)."""
    if seq % 3 == 0:
        ev = W.stored(era, block_hashes=[10_000 + seq], token_ids=list(range(B)), block_size=B)
    else:
        ev = W.removed(era, [10_000 + seq])
    return W.batch([ev])


@pytest.fixture(autouse=True, params=["zmtp", "libzmq"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with both live readers (the ZMTP reader, libzmq's SUB socket)."""
    from kvrelay.ingest import subscriber as submod

    real = submod.open_source
    monkeypatch.setattr(
        submod, "open_source",
        lambda c, endpoint, hwm, _reader, on_error=None: real(
            c, endpoint, hwm, request.param, on_error
        ),
    )  # fmt: skip
    return str(request.param)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def make(
    pub: TestPublisher, sink: RecordingSink, ctx: zmq.asyncio.Context, **kw: Any
) -> Subscriber:
    spec = SourceSpec(
        endpoint=pub.endpoint,
        replay_endpoint=kw.pop("replay_endpoint", pub.replay_endpoint),
        topic=pub.topic,
        dp_rank=0,
        worker_id=42,
        kv_block_size=B,
    )
    kw.setdefault("replay_timeout", 1.0)
    return Subscriber(spec, sink, context=ctx, **kw)


async def replay_only(
    pub: TestPublisher, ctx: zmq.asyncio.Context, n: int
) -> tuple[RecordingSink, Subscriber]:
    """Batches 0..n-1 in ``pub``'s replay only (published before the relay joined), and a
    subscriber on it, not started."""
    for s in range(n):
        await pub.publish(msg(s), live=False)
    sink = RecordingSink()
    return sink, make(pub, sink, ctx)


def assert_exact(sink: RecordingSink, seqs: list[int]) -> None:
    got = [v for k, v in sink.items if k == "batch"]
    assert got == [(s, [10_000 + s]) for s in seqs]


@pytest.mark.parametrize(("shape", "era"), [(3, "array"), (4, "map")])
async def test_bootstrap_replay_with_live_interleaving_and_duplicates(
    ctx: zmq.asyncio.Context, shape: int, era: str
) -> None:
    pub = TestPublisher(ctx, reply_shape=shape)
    for s in range(20):
        await pub.publish(msg(s, era), live=False)  # before the subscriber existed
    pub.gate.clear()  # hold the replay until live traffic overlaps it
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await until(lambda: pub.requests == [0])
        for s in range(20, 30):
            await pub.publish(msg(s, era))  # live, and also in the replay history
        await until(lambda: sub.counters.messages >= 10)
        pub.gate.set()
        await until(lambda: sub.state == "live")
        for s in range(30, 40):
            await pub.publish(msg(s, era))
        await until(lambda: len(sink.seqs) >= 40)
        await asyncio.sleep(0.05)
        assert_exact(sink, list(range(40)))
        c = sub.counters
        assert c.duplicates == 10 and c.resets == 0 and c.missing_history == 0
        assert c.replays == 1 and c.gaps == 0 and c.replayed_messages == 30
        assert c.events_by_kind["stored"] == 14 and c.blocks == 40
    finally:
        await sub.stop()
        await pub.close()


async def test_missing_history_at_bootstrap(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx, keep=5)
    for s in range(10):
        await pub.publish(msg(s), live=False)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await until(lambda: sub.state == "live")
        await pub.publish(msg(10))
        await until(lambda: 10 in sink.seqs)
        assert_exact(sink, list(range(5, 11)))
        assert sub.counters.missing_history == 1
        assert sink.resets == []  # nothing had been applied: nothing to clear
    finally:
        await sub.stop()
        await pub.close()


async def test_a_bootstrap_replay_that_did_not_answer_is_asked_again_at_the_first_batch(
    ctx: zmq.asyncio.Context,
) -> None:
    """The engine's replay takes the bootstrap request and does not answer in time (a frozen or
    overloaded engine: the audit's SIGSTOP through a hot upgrade). Its first live batch was
    then the baseline and the history before it was given up (``missing_history``) though the
    replay held it; the replay is now asked once more at that batch, which answers: exact."""
    pub = TestPublisher(ctx)
    for s in range(10):
        await pub.publish(msg(s), live=False)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, replay_timeout=0.2)
    pub.gate.clear()  # the request is taken, not answered
    await sub.start()
    try:
        await pub.wait_subscribed()
        await until(lambda: sub.state == "live" and sub.counters.replay_failures == 1)
        pub.gate.set()  # it thaws
        await pub.publish(msg(10))
        await until(lambda: 10 in sink.seqs)
        assert_exact(sink, list(range(11)))
        c = sub.counters
        assert (c.missing_history, c.resets, c.replay_failures) == (0, 0, 1)
        assert pub.requests == [0, 0]
    finally:
        pub.gate.set()
        await sub.stop()
        await pub.close()


async def _synced(pub: TestPublisher, sink: RecordingSink, sub: Subscriber, n: int) -> None:
    await sub.start()
    await pub.wait_subscribed()
    await until(lambda: sub.state == "live")
    for _ in range(n):
        await pub.publish(msg(pub.seq))
    await until(lambda: len(sink.seqs) >= n)


async def test_runtime_gap_filled_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 3)
        await pub.publish(msg(3), live=False)  # lost by PUB (HWM / network)
        await pub.publish(msg(4), live=False)
        for s in range(5, 8):
            await pub.publish(msg(s))
        await until(lambda: len(sink.seqs) >= 8)
        assert_exact(sink, list(range(8)))
        c = sub.counters
        # the gap replay starts at the last applied batch (2): the same bytes vouch for the
        # incarnation before 3 and 4 are applied
        assert c.gaps == 1 and c.replays == 2 and c.resets == 0 and pub.requests == [0, 2]
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("holed", [1, 2])
async def test_a_reply_that_skips_a_batch_is_asked_again_once(
    ctx: zmq.asyncio.Context, holed: int
) -> None:
    """A replay reply with a hole after its first batch (vLLM's ROUTER drops what passes its
    send high-water mark): the history is still there, so the rest is asked again, from the
    last batch applied (vouched), and nothing is reset. Asked again once: a hole in that reply
    too is a gap nothing fills (reset, then on from the batch after the hole)."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 3)
        for s in range(3, 7):
            await pub.publish(msg(s), live=False)  # lost live
        pub.reply_drops.extend([{4}] * holed)  # the first reply: 2 (vouch), 3, then 5, 6
        await pub.publish(msg(7))
        await until(lambda: 7 in sink.seqs)
        c = sub.counters
        assert c.replay_gaps == 1 and pub.requests == [0, 2, 3]
        if holed == 1:
            assert_exact(sink, list(range(8)))
            assert (c.resets, c.missing_history) == (0, 0)
        else:
            assert sink.resets == [ResetReason.GAP_UNRECOVERABLE] and c.resets == 1
            assert_exact(sink, [0, 1, 2, 3, 5, 6, 7])
    finally:
        await sub.stop()
        await pub.close()


async def test_runtime_gap_without_history_resets(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx, keep=3)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 2)
        for s in range(2, 6):
            await pub.publish(msg(s), live=False)  # 2..5 lost live; replay keeps 4, 5, 6
        await pub.publish(msg(6))
        await until(lambda: 6 in sink.seqs)
        assert sink.resets == [ResetReason.GAP_UNRECOVERABLE]
        assert_exact(sink, [0, 1, 4, 5, 6])
        assert sink.items[2] == ("reset", ResetReason.GAP_UNRECOVERABLE)
        assert sub.counters.missing_history == 1 and sub.counters.resets == 1
    finally:
        await sub.stop()
        await pub.close()


async def test_gap_without_replay_endpoint_resets(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx, replay=False)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await pub.publish(msg(0), live=False)  # published before we joined: start from live
        await _synced(pub, sink, sub, 2)
        await pub.publish(msg(3), live=False)
        await pub.publish(msg(4))
        await until(lambda: 4 in sink.seqs)
        assert_exact(sink, [1, 2, 4])
        assert sink.resets == [ResetReason.GAP_NO_REPLAY] and sub.counters.gaps == 1
        # joined at 1: batch 0 is history nothing can give back (the gap is not counted again)
        assert sub.counters.missing_history == 1
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("replay", [True, False])
async def test_sequence_decrease_is_a_new_incarnation(
    ctx: zmq.asyncio.Context, replay: bool
) -> None:
    pub = TestPublisher(ctx, replay=replay)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 5)
        pub.restart()
        for _ in range(3):
            await pub.publish(msg(pub.seq))
        await until(lambda: len(sink.seqs) >= 8)
        assert sink.resets == [ResetReason.INCARNATION]
        assert_exact(sink, [0, 1, 2, 3, 4, 0, 1, 2])
        assert sink.items[5] == ("reset", ResetReason.INCARNATION)
        assert sink.rebuilds == []  # seq 0 arrived live: nothing to rebuild from a replay
        assert sub.counters.missing_history == 0  # joined at 0; the restart is an incarnation
    finally:
        await sub.stop()
        await pub.close()


async def test_a_restart_right_after_the_bootstrap_is_no_duplicate(
    ctx: zmq.asyncio.Context,
) -> None:
    """The bootstrap replayed 0..5 and no live batch has come since, so 0..5 count as the
    replay's duplicates. The engine restarts behind a proxy (no reconnect seen) and sends its
    new 0: other bytes than the replayed 0, so a new incarnation, not a duplicate; its batches
    are never dropped as old ones, nor the next applied onto the old state."""
    pub = TestPublisher(ctx)
    sink, sub = await replay_only(pub, ctx, 6)
    try:
        await sub.start()
        await pub.wait_subscribed()
        await until(lambda: len(sink.seqs) >= 6)
        pub.restart()
        for s in range(8):
            await pub.publish(msg(s, era="array"))  # the same blocks, other bytes
        await until(lambda: len(sink.seqs) >= 14)
        assert sink.resets == [ResetReason.INCARNATION]
        assert_exact(sink, list(range(6)) + list(range(8)))
        # a live batch is a duplicate only of the new incarnation's replay (on a busy host the
        # replay after the reset may take them first), never of the old 0..5
        c = sub.counters
        assert c.duplicates <= c.replayed_messages - 6, c
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("during_replay", [False, True])
async def test_a_restart_after_a_replay_that_lost_history_is_no_duplicate(
    ctx: zmq.asyncio.Context, during_replay: bool
) -> None:
    """The engine keeps 3 batches: the bootstrap asks for 0 and gets 7, 8, 9 (history gone:
    reset, then applied). The engine restarts behind a proxy and sends 0, 1, 2, … live, after
    the replay or while it is still answering. Numbered below the first batch the replay gave,
    they duplicate nothing: a new incarnation. They were taken for the replay's duplicates and
    dropped, and the batches past 9 applied onto the old incarnation's blocks (phantoms)."""
    pub = TestPublisher(ctx, keep=3)
    for s in range(10):
        await pub.publish(msg(s), live=False)
    if during_replay:
        pub.pause_after, pub.mid = 1, asyncio.Event()  # 7 comes, then the replay waits
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await sub.start()
        await pub.wait_subscribed()
        await until(lambda: sink.seqs[-1:] == ([7] if during_replay else [9]))
        if not during_replay:  # after the replay: its end too (9 applied, the end marker may
            await until(lambda: sub.state == "live")  # not be in yet on a loaded machine)
        pub.restart()
        for s in range(3 if during_replay else 13):  # (3: the new replay still has its 0)
            await pub.publish(msg(s, era="array"))
        if during_replay:
            await until(lambda: ResetReason.INCARNATION in sink.resets)
            pub.mid.set()  # the old replay ends; the new incarnation's is served
        await until(lambda: sink.seqs[-1:] == [2 if during_replay else 12])
        old = [7] if during_replay else [7, 8, 9]
        assert sink.resets == [ResetReason.INCARNATION]  # (nothing was held before the 7)
        assert sink.items[len(old)] == ("reset", ResetReason.INCARNATION)
        assert_exact(sink, old + list(range(3 if during_replay else 13)))
        if not during_replay:  # (there the new replay gives what came live: duplicates)
            assert sub.counters.duplicates == 0
    finally:
        pub.mid.set()
        await sub.stop()
        await pub.close()


async def test_a_rebuild_from_the_replay_is_reported_as_one(ctx: zmq.asyncio.Context) -> None:
    """A new incarnation seen first at seq 2: the reset and the replayed 0, 1 (and 2) form one
    rebuild, begun before the reset and ended after the replayed batches."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 5)
        pub.restart()
        for _ in range(2):
            await pub.publish(msg(pub.seq), live=False)  # only in the replay
        await pub.publish(msg(pub.seq))
        await until(lambda: len(sink.seqs) >= 8 and len(sink.rebuilds) == 2)
        assert sink.resets == [ResetReason.INCARNATION]
        assert_exact(sink, [0, 1, 2, 3, 4, 0, 1, 2])
        assert sink.rebuilds == [(True, 5), (False, 9)]  # around items 5 (reset) .. 8
        assert sink.items[5] == ("reset", ResetReason.INCARNATION)
    finally:
        await sub.stop()
        await pub.close()


async def test_reorder_buffer_overflow_resets_and_restarts_from_live(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, reorder_max_messages=3, replay_timeout=5.0)
    try:
        await _synced(pub, sink, sub, 3)
        pub.gate.clear()  # the replay for the coming gap never answers in time
        await pub.publish(msg(3), live=False)
        for s in range(4, 9):  # 4 triggers the replay; 5, 6 buffered; 7 overflows
            await pub.publish(msg(s))
        await until(lambda: sub.counters.reorder_overflows == 1)
        await pub.publish(msg(9))
        await until(lambda: 9 in sink.seqs)
        assert sink.resets == [ResetReason.REORDER_OVERFLOW]
        seqs = sink.seqs
        assert seqs[:3] == [0, 1, 2] and seqs[-1] == 9
        assert all(b == a + 1 for a, b in itertools.pairwise(seqs[3:]))
        assert 3 not in seqs
    finally:
        pub.gate.set()
        await sub.stop()
        await pub.close()


async def test_replay_timeout_starts_from_live(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    pub.gate.clear()
    for s in range(3):
        await pub.publish(msg(s), live=False)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, replay_timeout=0.2)
    await sub.start()
    try:
        await pub.wait_subscribed()
        await until(lambda: sub.state == "live")
        assert sub.counters.replay_failures == 1 and sub.next_seq is None
        await pub.publish(msg(3))
        await pub.publish(msg(4))
        await until(lambda: 4 in sink.seqs)
        assert_exact(sink, [3, 4])
    finally:
        pub.gate.set()
        await sub.stop()
        await pub.close()


async def test_bad_frames_and_payloads_are_counted_not_applied(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx, topic=b"kv", replay=False)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 1)
        await pub.send_raw([b"vk", (99).to_bytes(8, "big"), msg(99)])  # no "kv" prefix
        await pub.send_raw([b"kv", b"\x00\x01", msg(1)])
        await pub.send_raw([b"kv", (1).to_bytes(8, "big")])
        await pub.publish(b"\xc1 not msgpack")  # seq 1: consumed, rejected, no batch
        await pub.publish(msg(2))
        await until(lambda: 2 in sink.seqs)
        assert_exact(sink, [0, 2])
        assert sub.counters.rejections == {
            "topic_mismatch": 1,
            "seq_length": 1,
            "frame_count": 1,
            "malformed_payload": 1,
        }
        # without a replay to re-fetch it from, a batch that cannot be decoded leaves the
        # member's state unvouched: it is reset before going on
        assert sub.counters.gaps == 0 and sink.resets == [ResetReason.BAD_BATCH]
        assert sub.counters.bad_batches == 1
    finally:
        await sub.stop()
        await pub.close()
    assert sub.state == "stopped"


async def test_new_incarnation_mid_stream_replays_from_zero(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 5)
        pub.restart()
        await pub.publish(msg(0), live=False)  # the new engine's first batches were missed
        await pub.publish(msg(1), live=False)
        await pub.publish(msg(2))  # 2 < 5: sequence went backwards
        await until(lambda: len(sink.seqs) >= 8)
        assert sink.resets == [ResetReason.INCARNATION]
        assert_exact(sink, [0, 1, 2, 3, 4, 0, 1, 2])
        assert pub.requests == [0, 0] and sub.counters.missing_history == 0
    finally:
        await sub.stop()
        await pub.close()


async def test_burst_is_drained_in_order_without_loss(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, drain=64)
    try:
        await _synced(pub, sink, sub, 1)
        for _ in range(1999):
            await pub.publish(msg(pub.seq))
        await until(lambda: len(sink.seqs) >= 2000, timeout=20)
        assert_exact(sink, list(range(2000)))
        c = sub.counters
        assert c.gaps == 0 and c.resets == 0 and c.batches == 2000 and c.slow_path_messages == 0
    finally:
        await sub.stop()
        await pub.close()


async def test_replay_timeout_fires_despite_live_traffic(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, replay_timeout=0.3)
    try:
        await _synced(pub, sink, sub, 2)
        pub.gate.clear()  # the replay for the coming gap never answers
        await pub.publish(msg(2), live=False)
        for _ in range(40):  # live keeps flowing while the replay is pending
            await pub.publish(msg(pub.seq))
            await asyncio.sleep(0.01)
        await until(lambda: 42 in sink.seqs)
        assert sub.counters.replay_failures == 1
        assert sink.resets == [ResetReason.REPLAY_FAILED]
        assert_exact(sink, [0, 1, *range(3, 43)])
    finally:
        pub.gate.set()
        await sub.stop()
        await pub.close()


async def test_topic_is_a_prefix_and_a_mismatch_is_logged_once_with_the_topic_seen(
    ctx: zmq.asyncio.Context,
) -> None:
    """"kv" accepts "kv-events" (a ZMQ subscription's prefix rule); "vllm" is dropped, counted
    every time, and logged once per source with the topic it carried and the source's names."""
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    pub = TestPublisher(ctx, topic=b"kv-events", replay=False)
    sink = RecordingSink()
    spec = SourceSpec(
        endpoint=pub.endpoint, replay_endpoint=None, topic=b"kv", dp_rank=0, worker_id=42,
        kv_block_size=B, engine="gpu-node-1", pool="ns/backend/generate",
    )
    sub = Subscriber(spec, sink, context=ctx)
    try:
        await _synced(pub, sink, sub, 2)
        for seq in (50, 51, 52):
            await pub.send_raw([b"vllm", seq.to_bytes(8, "big"), msg(seq)])
        await pub.publish(msg(2))
        await until(lambda: 2 in sink.seqs)
        assert_exact(sink, [0, 1, 2])
        assert sub.counters.rejections == {"topic_mismatch": 3}
    finally:
        await sub.stop()
        await pub.close()
        kvlog.configure(level="WARNING", stream=sys.stderr)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    mismatches = [x for x in lines if x["event"] == "topic_mismatch"]
    assert len(mismatches) == 1, lines
    (m,) = mismatches
    assert (m["level"], m["topic"], m["seen"]) == ("warning", "kv", "vllm")
    assert (m["engine"], m["pool"], m["dp_rank"]) == ("gpu-node-1", "ns/backend/generate", 0)
    states = [x for x in lines if x["event"] == "subscriber_state"]
    assert states and all(x["engine"] == "gpu-node-1" for x in states)


# ---- resuming a restored member (a state file from before a relay restart) -------------------


def _digest(payload: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(payload)


async def _resumed(
    ctx: zmq.asyncio.Context, pub: TestPublisher, resume: tuple[int, int], **kw: Any
) -> tuple[RecordingSink, Subscriber]:
    sink = RecordingSink()
    sub = make(pub, sink, ctx, resume=resume, **kw)
    await sub.start()
    await pub.wait_subscribed()
    await until(lambda: sub.state == "live")
    return sink, sub


async def test_a_resumed_member_is_vouched_for_then_continues(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx)
    for s in range(20):
        await pub.publish(msg(s), live=False)  # 10..19 were published while the relay was down
    sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))))
    try:
        await pub.publish(msg(20))
        await until(lambda: 20 in sink.seqs)
        assert pub.requests == [9]  # the replay is asked for the last batch the state holds
        assert_exact(sink, list(range(10, 21)))
        assert sink.resets == [] and sub.counters.resets == 0
        # told once the replay after the saved position is applied (10..19), before the live
        # stream goes on: until then the pool holds the saved state, behind the engine
        told = sink.items.index(("vouched", SourceKey(42, 0)))
        assert [v[0] for k, v in sink.items[:told]] == list(range(10, 20))
    finally:
        await sub.stop()
        await pub.close()


async def test_a_replay_that_does_not_answer_is_not_a_vouch(ctx: zmq.asyncio.Context) -> None:
    """The replay takes the vouching request and never answers (a hung engine): the restored
    state is reset and rebuilt (here from the live stream, as its replay stays silent), never
    kept as exact."""
    pub = TestPublisher(ctx)
    for s in range(20):
        await pub.publish(msg(s), live=False)
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))),
                                   replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout=0.3)
        try:
            assert sink.resets == [ResetReason.VOUCH_TIMEOUT]
            assert ("vouched", SourceKey(42, 0)) not in sink.items
            assert sub.counters.replay_failures == 2  # the vouch, then the rebuild's replay
            await pub.publish(msg(pub.seq))
            await until(lambda: len(sink.seqs) == 1)  # a fresh baseline, nothing kept
            assert sink.items[0] == ("reset", ResetReason.VOUCH_TIMEOUT)
        finally:
            await sub.stop()
    finally:
        mute.close(linger=0)
        await pub.close()


@pytest.mark.parametrize("missed", [True, False])
async def test_a_reconnect_whose_vouch_is_not_answered_is_reset(
    ctx: zmq.asyncio.Context, missed: bool
) -> None:
    """The engine restarts on the same endpoint; its replay takes the vouching request and never
    answers, and the new incarnation's live stream climbs past the old next sequence meanwhile.
    Its numbers below that were dropped as duplicates, the ones above were contiguous, and the
    member went on over the old incarnation's state with no reset: the old blocks were never
    removed (phantoms). An unanswered vouch resets the member, whatever the live stream did.
    When the live stream itself goes back (``missed`` False: the SUB reads the new 0..9 after
    the old 0..9), that alone tells the restart, before the vouch times out."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx, replay_timeout=1.0)
    try:
        await _synced(pub, sink, sub, 10)  # the old incarnation: 0..9 applied
        endpoint = pub.endpoint
        pub.pub.close(linger=0)
        await asyncio.sleep(0.3)
        restarted = ctx.socket(zmq.XPUB)
        restarted.setsockopt(zmq.LINGER, 0)
        restarted.bind(endpoint)
        pub.pub = restarted
        pub.restart()
        pub.gate.clear()  # its replay takes requests and does not answer
        await pub.wait_subscribed()
        await until(lambda: sub.state == "replaying")
        assert sink.seqs == list(range(10))
        for s in range(12):  # the new incarnation: 0..11 (0..9 before the SUB had it: missed)
            await pub.publish(msg(s), live=not missed or s >= 10)
            await asyncio.sleep(0.02)
        reason = ResetReason.VOUCH_TIMEOUT if missed else ResetReason.INCARNATION
        await until(lambda: reason in sink.resets, timeout=5.0)
        after = sink.items[10:]
        assert after[0] == ("reset", reason), after  # before anything new
    finally:
        pub.gate.set()
        await sub.stop()
        await pub.close()


async def test_a_restart_inside_the_last_replayed_range_is_no_duplicate(
    ctx: zmq.asyncio.Context,
) -> None:
    """A gap's replay (4..6) leaves its duplicate window open until a live batch past it is
    applied. The engine then restarts and its first live batch, 5, falls inside that window: it
    was dropped as the replay's duplicate, and the member kept the old incarnation's blocks
    (phantoms) with nothing of the new one. The live stream had already delivered 6, and a live
    stream never goes back, so 5 is another incarnation's: reset, rebuild from its replay."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 5)  # 0..4 applied
        await pub.publish(msg(5), live=False)  # lost: a gap
        await pub.publish(msg(6))
        await until(lambda: sink.seqs == list(range(7)) and sub.state == "live")
        pub.restart()
        for s in range(6):  # the new incarnation: 0..4 missed, 5 live
            ev = W.stored("map", block_hashes=[20_000 + s], token_ids=list(range(B)), block_size=B)
            await pub.publish(W.batch([ev], ts=2.0), live=s == 5)
        await until(lambda: len(sink.seqs) >= 13)
        after = sink.items[7:]
        assert after[0] == ("reset", ResetReason.INCARNATION), after
        assert [v for k, v in after if k == "batch"] == [(s, [20_000 + s]) for s in range(6)]
        assert sub.counters.incarnations_detected == 0 and sub.counters.resets == 1
    finally:
        await sub.stop()
        await pub.close()


async def test_a_restart_past_the_live_position_inside_the_replayed_range_is_no_duplicate(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay of a gap gave more than the live stream had delivered (5..10 while live
    showed 8), and the live batches 9 and 10 were lost. The engine then restarts, and the first
    of its batches the relay sees, 9, is above the live stream's position, inside the replayed
    range: the stream does not visibly go back. Its bytes differ from the replayed 9's, so it
    is another incarnation's, not the replay's duplicate (it was dropped, and the member kept
    the old incarnation's blocks)."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 5)  # 0..4 applied
        pub.gate.clear()  # the gap's replay waits until 9 and 10 exist
        for s in (5, 6, 7):
            await pub.publish(msg(s), live=False)  # lost: a gap
        await pub.publish(msg(8))
        await until(lambda: len(pub.requests) >= 2)  # (it asks from 4: the vouch)
        for s in (9, 10):
            await pub.publish(msg(s), live=False)  # lost too (past the live position)
        pub.gate.set()
        await until(lambda: sink.seqs == list(range(11)) and sub.state == "live")
        pub.restart()
        for s in range(10):  # the new incarnation: 0..8 missed, 9 live
            ev = W.stored("map", block_hashes=[30_000 + s], token_ids=list(range(B)), block_size=B)
            await pub.publish(W.batch([ev], ts=3.0), live=s == 9)
        await until(lambda: len(sink.seqs) >= 21)
        after = sink.items[11:]
        assert after[0] == ("reset", ResetReason.INCARNATION), after
        assert [v for k, v in after if k == "batch"] == [(s, [30_000 + s]) for s in range(10)]
    finally:
        await sub.stop()
        await pub.close()


async def test_a_resumed_member_of_another_incarnation_is_rebuilt(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = TestPublisher(ctx)
    for s in range(12):
        await pub.publish(msg(s), live=False)  # a restarted engine: seq 9 carries other bytes
    sink, sub = await _resumed(ctx, pub, (9, _digest(b"the batch 9 of the previous run")))
    try:
        await until(lambda: len(sink.seqs) >= 12)
        assert sink.resets == [ResetReason.INCARNATION]
        assert sink.items[0] == ("reset", ResetReason.INCARNATION)  # before anything applies
        assert_exact(sink, list(range(12)))
        assert sub.counters.incarnations_detected == 1
    finally:
        await sub.stop()
        await pub.close()


async def test_a_resumed_member_whose_history_is_gone_resets(ctx: zmq.asyncio.Context) -> None:
    pub = TestPublisher(ctx, keep=5)
    for s in range(20):
        await pub.publish(msg(s), live=False)  # the replay holds 15..19 only
    sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))))
    try:
        await until(lambda: 19 in sink.seqs)
        assert sink.resets == [ResetReason.GAP_UNRECOVERABLE]
        assert_exact(sink, list(range(15, 20)))
    finally:
        await sub.stop()
        await pub.close()


async def test_a_resumed_member_whose_last_batch_just_left_the_replay_resets(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay starts exactly at the next batch: the one to vouch with is gone, so nothing
    vouches for the saved state (the engine may have restarted and counted up to here again).
    The member is reset and goes on from there, never applied onto the unvouched state."""
    pub = TestPublisher(ctx, keep=10)
    for s in range(20):
        await pub.publish(msg(s), live=False)  # the replay holds 10..19; batch 9 is gone
    sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))))
    try:
        await until(lambda: 19 in sink.seqs)
        assert sink.resets == [ResetReason.GAP_UNRECOVERABLE]
        assert sink.items[0] == ("reset", ResetReason.GAP_UNRECOVERABLE)  # before any batch
        assert_exact(sink, list(range(10, 20)))
        assert ("vouched", SourceKey(42, 0)) not in sink.items
    finally:
        await sub.stop()
        await pub.close()


async def test_a_resumed_member_without_replay_cannot_be_vouched_for(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = TestPublisher(ctx)
    sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))), replay_endpoint=None)
    try:
        assert sink.resets == [ResetReason.RESTORE_UNVERIFIED]
        await pub.publish(msg(pub.seq))
        await until(lambda: len(sink.seqs) == 1)  # the next live batch is a fresh baseline
        assert pub.requests == []
    finally:
        await sub.stop()
        await pub.close()


async def test_a_peer_that_accepts_and_drops_is_not_live_and_logs_rarely(
    ctx: zmq.asyncio.Context,
) -> None:
    """A static endpoint whose port accepts TCP and closes at once (no publisher behind it):
    ZMQ reconnects several times a second. The source is `flapping`, not `live`, and
    `source_reconnected` is logged at most once per RECONNECT_LOG_S with the count it skipped.
    It stays disconnected since its start: a connection without a message that ends at once
    does not count, so the engine is declared down after ``engine_down_grace_s`` as one whose
    port refuses (each reconnect restarted that clock, and such an engine was never down)."""
    from kvrelay.ingest import subscriber as submod

    accepted = 0

    async def drop(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        w.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    buf = io.StringIO()
    kvlog.configure(level="INFO", json=True, stream=buf)
    spec = SourceSpec(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=None, topic=b"",
                      dp_rank=0, worker_id=42, kv_block_size=B)  # fmt: skip
    sub = Subscriber(spec, RecordingSink(), context=ctx)
    try:
        await sub.start()
        started = sub.disconnected_since
        assert started is not None
        await until(lambda: sub.counters.reconnects >= 6, timeout=30)
        await until(lambda: sub.state == "flapping", timeout=10)
        assert sub.state == "flapping"
        await until(lambda: not sub.connected, timeout=10)
        assert sub.disconnected_since == started
    finally:
        await sub.stop()
        server.close()
        await server.wait_closed()
        kvlog.configure(level="WARNING", stream=sys.stderr)
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    logged = [x for x in lines if x["event"] == "source_reconnected"]
    elapsed_windows = 1 + int(30 / submod.RECONNECT_LOG_S)
    assert 1 <= len(logged) <= elapsed_windows, (len(logged), sub.counters.reconnects)
    assert len(logged) < sub.counters.reconnects  # rate-limited, not one per reconnect
    assert logged[-1]["reconnects_not_logged"] >= 0 and accepted >= 6
    states = [x["state"] for x in lines if x["event"] == "subscriber_state"]
    assert states.count("flapping") == 1, states  # one transition, not one per flap


async def test_a_remove_that_does_not_decode_is_not_skipped(ctx: zmq.asyncio.Context) -> None:
    """The engine removes a block in a batch whose remove event is badly typed: skipping the
    event left the block held (a phantom, for as long as the member lived). The batch is bad:
    re-fetched once from the replay (the same bytes), then the member is reset."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 1)  # seq 0 stores block 10_000
        bad = W.batch([{"type": "BlockRemoved", "block_hashes": [10_000], "group_idx": "0"}])
        await pub.publish(bad)
        await pub.publish(msg(2))
        await until(lambda: 2 in sink.seqs)
        assert sink.resets == [ResetReason.BAD_BATCH]
        assert sub.counters.rejections.get("malformed_removal", 0) >= 1
        assert_exact(sink, [0, 2])  # the reset comes before 2: 10_000 is no longer held
        assert sink.items.index(("reset", ResetReason.BAD_BATCH)) == 1
    finally:
        await sub.stop()
        await pub.close()


async def test_a_live_duplicate_after_a_restart_told_by_the_vouch_is_no_restart(
    ctx: zmq.asyncio.Context,
) -> None:
    """The engine restarts on the same endpoint; the reconnect's vouch tells it (the replay no
    longer holds the last batch) and the member is rebuilt from the new incarnation's replay
    (0..5). The new engine's live 5, read only after the replay applied it, is that replay's
    duplicate. The live stream's position was still the old incarnation's 9, so 5 passed for
    the stream going back: a needless second reset and rebuild."""
    pub = TestPublisher(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await _synced(pub, sink, sub, 10)  # the old incarnation: 0..9 applied, live
        endpoint = pub.endpoint
        pub.pub.close(linger=0)
        await asyncio.sleep(0.3)
        restarted = ctx.socket(zmq.XPUB)
        restarted.setsockopt(zmq.LINGER, 0)
        restarted.bind(endpoint)
        pub.pub = restarted
        pub.restart()
        for s in range(6):  # published before the relay's SUB reconnected
            await pub.publish(msg(s), live=False)
        await pub.wait_subscribed()
        await until(lambda: len(sink.seqs) >= 16 and sub.state == "live")
        assert sink.resets == [ResetReason.INCARNATION]
        await pub.send_raw([pub.topic, (5).to_bytes(8, "big"), msg(5)])  # the live 5, late
        await pub.publish(msg(6))
        await until(lambda: 6 in sink.seqs[16:])
        assert sink.resets == [ResetReason.INCARNATION], sink.items[10:]
        assert sink.seqs[10:] == list(range(7))
        assert sub.counters.duplicates >= 1
    finally:
        await sub.stop()
        await pub.close()


async def _paused_bootstrap(
    ctx: zmq.asyncio.Context, pub: TestPublisher, stall_after: int, replay_timeout: float
) -> tuple[RecordingSink, Subscriber]:
    """``pub`` with 0..9 published before the subscriber, its replay pausing after
    ``stall_after`` batches (until ``pub.mid`` is set), and a started subscriber."""
    for s in range(10):
        await pub.publish(msg(s), live=False)
    pub.pause_after, pub.mid = stall_after, asyncio.Event()
    sink = RecordingSink()
    sub = make(pub, sink, ctx, replay_timeout=replay_timeout)
    await sub.start()
    return sink, sub


async def test_a_replay_that_goes_silent_part_way_is_asked_again_from_where_it_stopped(
    ctx: zmq.asyncio.Context,
) -> None:
    """The bootstrap replay gives 0..4 of 0..9 and goes silent, no end marker (a slow engine, a
    reply cut short), and the engine publishes nothing more: the replay is asked again from 5,
    vouching for 4, and its answer completes the member: exact, nothing reset."""
    pub = ConcurrentReplayPublisher(ctx)
    sink, sub = await _paused_bootstrap(ctx, pub, 5, replay_timeout=0.3)
    try:
        await pub.wait_subscribed()
        await until(lambda: pub.requests == [0])
        pub.pause_after = None  # the next request is answered whole
        await until(lambda: sub.state == "live" and len(sink.seqs) == 10)
        assert_exact(sink, list(range(10)))
        assert pub.requests == [0, 4] and sink.resets == []
        assert sub.counters.replay_failures == 1 and sub.next_seq == 10
    finally:
        pub.mid.set()
        await sub.stop()
        await pub.close()


async def test_a_bootstrap_replay_cut_short_for_good_is_not_kept(
    ctx: zmq.asyncio.Context,
) -> None:
    """The bootstrap replay gives 0..4 of 0..9 and goes silent for good, and the engine
    publishes nothing more. 5..9 removed what 0..4 stored: the member went on "in sync" holding
    them until the engine's next batch (forever on an idle engine). A replay that never says
    where the history ends vouches for nothing: the member is reset, the replay asked again at
    the next live batch, and its full answer rebuilds the member."""
    pub = TestPublisher(ctx)  # (one request at a time: the stalled reply holds the others)
    sink, sub = await _paused_bootstrap(ctx, pub, 5, replay_timeout=0.3)
    try:
        await pub.wait_subscribed()
        await until(lambda: sub.state == "live" and sub.next_seq is None, timeout=10.0)
        assert sink.seqs[:5] == list(range(5)) and len(sink.seqs) == 5
        assert sink.items[5][0] == "reset"  # before anything else applied
        assert _held(sink) == set()
        pub.pause_after = None
        pub.mid.set()
        await pub.publish(msg(10))
        await until(lambda: 10 in sink.seqs)
        assert _held(sink) == _model(range(11))
    finally:
        pub.mid.set()
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("stall_after", [1, 2])
async def test_a_vouch_whose_replay_stops_without_its_end_is_no_vouch(
    ctx: zmq.asyncio.Context, stall_after: int
) -> None:
    """A restored member: the replay gives the saved batch (the vouch), maybe one more, and
    goes silent for good. The engine removed blocks after that while the relay was down: the
    saved state was told vouched for and published as current, and checkpointed again. A
    replay that never says where the history ends vouches for nothing: the member is reset."""
    pub = TestPublisher(ctx)
    for s in range(20):
        await pub.publish(msg(s), live=False)
    pub.pause_after, pub.mid = stall_after, asyncio.Event()
    sink, sub = await _resumed(ctx, pub, (9, _digest(msg(9))), replay_timeout=0.3)
    try:
        await until(lambda: sub.next_seq is None, timeout=10.0)
        assert ("vouched", SourceKey(42, 0)) not in sink.items
        assert sink.resets and sink.seqs == list(range(10, 10 + stall_after - 1))
        assert _held(sink) == set()
    finally:
        pub.mid.set()
        await sub.stop()
        await pub.close()


def other_msg(seq: int) -> bytes:
    """A restarted engine's batch ``seq``: other blocks than ``msg(seq)``'s."""
    return W.batch([W.stored("map", block_hashes=[20_000 + seq], token_ids=list(range(B)),
                             block_size=B)])  # fmt: skip


async def test_an_engine_restart_during_the_bootstrap_replay_is_not_taken_as_its_sequel(
    ctx: zmq.asyncio.Context,
) -> None:
    """The engine answers the bootstrap replay with 0..2 of 0..9 and dies; a new incarnation
    binds the same endpoints, its 0..2 go out before the relay's SUB reconnected (missed), its 3
    comes live while the dead replay is still awaited. 3 followed the replay's 2, so it was
    applied after it, and the reconnect's vouch then checked 3 against the engine that sent it:
    the old incarnation's 0..2 stayed for good. The live stream is held from the disconnect
    until the reconnect is vouched for: the member is reset, then rebuilt from the new
    incarnation's replay (with the one paused reply of this publisher, the replay asked again
    is answered once the old reply ends: by the new incarnation, whose batch 2 is another's)."""
    pub = TestPublisher(ctx)
    sink, sub = await _paused_bootstrap(ctx, pub, 3, replay_timeout=1.0)
    try:
        await pub.wait_subscribed()
        await until(lambda: sink.seqs == [0, 1, 2])
        endpoint = pub.endpoint
        pub.pub.close(linger=0)  # the engine dies
        restarted = ctx.socket(zmq.XPUB)
        restarted.setsockopt(zmq.LINGER, 0)
        await _bind_again(restarted, endpoint)
        pub.pub = restarted
        pub.restart()
        for s in range(3):
            await pub.publish(other_msg(s), live=False)  # before the SUB reconnected
        await pub.wait_subscribed()
        await pub.publish(other_msg(3))  # live, while the old replay is awaited
        await until(lambda: sub.counters.replay_failures >= 1, timeout=5.0)
        pub.pause_after = None
        pub.mid.set()  # the old reply ends (to a gone reader); the next request is answered
        await until(lambda: 20_003 in _held(sink), timeout=5.0)
        assert _held(sink) == {20_000, 20_001, 20_002, 20_003}
        first_new = next(i for i, (k, v) in enumerate(sink.items)
                         if k == "batch" and v[1][0] >= 20_000)  # fmt: skip
        # reset before the new incarnation's first batch: the replay went silent (or, asked
        # again, vouched against the new incarnation's batch 2: another incarnation)
        assert [k for k, _ in sink.items[:first_new]] == ["batch"] * 3 + ["reset"]
    finally:
        pub.mid.set()
        await sub.stop()
        await pub.close()


async def _bind_again(sock: zmq.asyncio.Socket, endpoint: str) -> None:
    """Bind where a socket just closed: libzmq's I/O thread releases the port a moment later."""
    for _ in range(200):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.01)
    sock.bind(endpoint)


def _model(seqs: Any) -> set[int]:
    """What the engine holds after ``msg`` of each of ``seqs`` (in order)."""
    held: set[int] = set()
    for seq in seqs:
        held = held | {10_000 + seq} if seq % 3 == 0 else held - {10_000 + seq}
    return held


def _held(sink: RecordingSink) -> set[int]:
    """The hashes the member holds: the batches applied since its last reset (each batch stores
    or removes its seq's hash: ``msg``, ``other_msg``)."""
    held: set[int] = set()
    for kind, value in sink.items:
        if kind == "reset":
            held.clear()
        elif kind == "batch":
            seq, hashes = value
            stored = hashes[0] >= 20_000 or seq % 3 == 0
            held = held | set(hashes) if stored else held - set(hashes)
    return held


async def test_a_replay_that_jumps_to_a_number_far_ahead_does_not_swallow_the_live_stream(
    ctx: zmq.asyncio.Context,
) -> None:
    """A replay answering 0..4 and then a batch numbered 10^18 (a hostile or broken engine):
    the member is reset and goes on from that batch, and the live stream's 5, 6, … were all
    dropped as duplicates of the replay, for ever, counted as duplicates only (the replay's
    window reached 10^18). Numbers below where the state now starts duplicate nothing: the
    first one is another incarnation's, and the member is rebuilt (counted, logged)."""
    pub = TestPublisher(ctx)
    sink, sub = await replay_only(pub, ctx, 5)
    pub.history.append((10**18, W.batch([])))  # in the replay only
    try:
        await sub.start()
        await pub.wait_subscribed()
        await until(lambda: ResetReason.GAP_UNRECOVERABLE in sink.resets)  # (asked again)
        pub.history.pop()  # the engine's replay is honest again
        await pub.publish(msg(5))
        await until(lambda: ResetReason.INCARNATION in sink.resets)
        await until(lambda: sink.seqs[-1:] == [5])
        assert sub.counters.duplicates <= 6, sub.counters  # never the live 5 (0..4 at most)
    finally:
        await sub.stop()


async def test_a_refused_last_batch_of_a_replay_is_no_finished_replay(
    ctx: zmq.asyncio.Context,
) -> None:
    """The replay's last batch comes with five frames (refused), then the end marker: the reply
    counted as complete, the member went live expecting that batch, and a removal in it left
    a phantom until the engine published again. A reply with a refused batch is one that went
    silent there: asked again from it, then the member is reset (``replay_failed``)."""

    class BadLast(TestPublisher):
        async def _reply(self, ident: bytes, start: int, pause: int | None) -> None:
            assert self.router is not None
            last = self.history[-1][0]
            for seq, payload in list(self.history):
                if seq >= start:
                    extra = [b"x"] if seq == last else []
                    await self.router.send_multipart(
                        [ident, b"", self.topic, seq.to_bytes(8, "big"), payload, *extra]
                    )
            await self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    pub = BadLast(ctx)
    sink, sub = await replay_only(pub, ctx, 6)  # 5 (a removal) is the refused one
    try:
        await sub.start()
        await pub.wait_subscribed()
        await until(lambda: ResetReason.REPLAY_FAILED in sink.resets)
        assert sub.counters.rejections.get("frame_count", 0) >= 2  # asked again, refused again
        assert pub.requests == [0, 4], pub.requests  # again from 5, vouching for 4
        assert sink.items[-1] == ("reset", ResetReason.REPLAY_FAILED)  # nothing after it
    finally:
        await sub.stop()


async def test_a_gap_replay_that_starts_before_the_batch_asked_for_vouches_for_it(
    ctx: zmq.asyncio.Context,
) -> None:
    """A gap's replay re-reads the last applied batch to vouch for the engine; one that answers
    from earlier batches (a ROUTER keeping more than asked) compared the first batch it gave
    with the one to vouch for, and took the engine for another incarnation: a needless
    rebuild, counted as ``incarnation``. The batch compared is the one asked for."""

    class FromEarlier(TestPublisher):
        async def _reply(self, ident: bytes, start: int, pause: int | None) -> None:
            await super()._reply(ident, max(0, start - 3), pause)

    pub = FromEarlier(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await sub.start()
        await pub.wait_subscribed()
        for s in range(6):
            await pub.publish(msg(s))
        await until(lambda: sink.seqs == list(range(6)))
        await pub.publish(msg(6), live=False)  # lost on the live stream
        await pub.publish(msg(7))  # the hole: replay asked from 5 (to vouch for it), gives 2..
        await until(lambda: sink.seqs[-2:] == [6, 7])
        assert sink.resets == [] and sub.counters.incarnations_detected == 0
        assert_exact(sink, list(range(8)))
    finally:
        await sub.stop()


async def lose_10_of_12(pub: TestPublisher, sink: RecordingSink, sub: Subscriber) -> None:
    """``sub`` started and 0..9 applied live; then 10 is lost on the live stream and 11 shows it
    missing (the gap's replay is asked from 9, to vouch for it)."""
    await sub.start()
    await pub.wait_subscribed()
    for s in range(10):
        await pub.publish(msg(s))
    await until(lambda: sink.seqs == list(range(10)))
    await pub.publish(msg(10), live=False)
    await pub.publish(msg(11))


async def test_a_buffered_live_batch_below_a_reply_that_skipped_ahead_is_no_duplicate(
    ctx: zmq.asyncio.Context,
) -> None:
    """Live 11 shows 10 lost; the gap's reply (from 9, to vouch for it) holds only a batch
    numbered 10^18. The member is reset there, and live 11, buffered during the replay, was
    then dropped as a duplicate: the member kept the made-up batch and missed 11 until the
    engine published again. Below where the state starts it is a batch the member never had:
    rebuilt from 0 (the engine's replay is honest again)."""

    class SkipOnce(TestPublisher):
        lies = 1

        async def _reply(self, ident: bytes, start: int, pause: int | None) -> None:
            assert self.router is not None
            if start > 0 and self.lies:
                self.lies -= 1
                far = (10**18).to_bytes(8, "big")
                await self.router.send_multipart([ident, b"", self.topic, far, W.batch([])])
                await self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
                return
            await super()._reply(ident, start, pause)

    pub = SkipOnce(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await lose_10_of_12(pub, sink, sub)
        await until(lambda: ResetReason.INCARNATION in sink.resets)
        await until(lambda: sink.seqs[-1:] == [11])
        assert sink.resets == [ResetReason.GAP_UNRECOVERABLE, ResetReason.INCARNATION]
        rebuilt = len(sink.items) - 1 - sink.items[::-1].index(("reset", ResetReason.INCARNATION))
        assert [v[0] for k, v in sink.items[rebuilt:] if k == "batch"] == list(range(12))
    finally:
        await sub.stop()


async def test_a_reply_whose_only_new_batch_is_refused_is_asked_again(
    ctx: zmq.asyncio.Context,
) -> None:
    """A gap's reply vouches for the last applied batch and then gives the missing one refused
    (five frames): nothing past the vouch applied, and the member was reset at once. It is asked
    again from there (vouching again), and the honest second answer keeps the member exact."""

    class BadOnce(TestPublisher):
        bad = 1

        async def _reply(self, ident: bytes, start: int, pause: int | None) -> None:
            assert self.router is not None
            if start > 0 and self.bad:
                self.bad -= 1
                for seq, payload in list(self.history):
                    if start <= seq <= start + 1:  # the vouch, then the missing one refused
                        extra = [b"x"] if seq == start + 1 else []
                        await self.router.send_multipart(
                            [ident, b"", self.topic, seq.to_bytes(8, "big"), payload, *extra]
                        )
                await self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
                return
            await super()._reply(ident, start, pause)

    pub = BadOnce(ctx)
    sink = RecordingSink()
    sub = make(pub, sink, ctx)
    try:
        await lose_10_of_12(pub, sink, sub)
        await until(lambda: sink.seqs[-1:] == [11])
        assert sink.resets == [], sink.resets
        assert_exact(sink, list(range(12)))
        assert pub.requests.count(9) == 2, pub.requests  # asked again, vouching for 9
    finally:
        await sub.stop()
