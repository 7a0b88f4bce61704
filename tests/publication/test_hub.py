"""PublicationHub without the network: sequencing, encode-once fan-out, bounds, terminations."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.publication import cbi1
from kvrelay.publication.hub import PublicationHub, PublicationInvariantError, Subscription
from kvrelay.publication.splice import FilterUpdateEncoder
from tests.support.fleet import eventually
from tests.support.timing import scaled

SEED, DC = 0x5EED, 7
R = pb.RelayErrorReason


def producer(bc: int) -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=b"a" * 16, source=1),
                routing_scope=pb.DigestIdentity(digest=b"b" * 16, source=1),
            ),
            dc_id=DC,
        ),
        producer_incarnation=9,
        layout_generation=1,
        ckf_format=pb.CkfFormat(
            format_version=1, seed=SEED, bucket_count=bc, fingerprint_bits=16, slots_per_bucket=4
        ),
    )


def make_hub(bc: int = 1024, seq: int = 0, **limits: Any) -> tuple[PublicationHub, np.ndarray]:
    table = np.random.default_rng(bc).integers(0, 2**64, size=bc, dtype=np.uint64)
    enc = FilterUpdateEncoder(
        pb.RelayIdentity(drt_instance_id=1, relay_incarnation=2), producer(bc)
    )
    hub = PublicationHub(
        enc,
        seed=SEED,
        bucket_count=bc,
        dc_id=DC,
        table=table,
        sequence=seq,
        limits=RelayLimits(**limits),
    )
    return hub, table.copy()


class Collector:
    """A `send` callable that records frames (decoded with betterproto2)."""

    def __init__(self, block_after: int | None = None) -> None:
        self.frames: list[pb.FilterUpdate] = []
        self.raw: list[bytes] = []
        self.block_after = block_after
        self.gate = asyncio.Event()

    async def __call__(self, data: bytes) -> None:
        if self.block_after is not None and len(self.raw) >= self.block_after:
            await self.gate.wait()
        self.raw.append(data)
        self.frames.append(pb.FilterUpdate.parse(data))


def rebuild(frames: list[pb.FilterUpdate], bc: int) -> tuple[np.ndarray, int]:
    asm = cbi1.SnapshotAssembler()
    table: np.ndarray | None = None
    seq = -1
    for f in frames:
        if f.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
            done = asm.feed(cbi1.decode(f.payload, expected_seed=SEED, expected_bucket_count=bc))  # type: ignore[arg-type]
            if done is not None:
                table, seq = np.array(done.words), f.sequence
        elif f.kind == pb.FilterUpdateKind.DELTA:
            assert table is not None and f.base_sequence == seq and f.sequence == seq + 1
            d = cbi1.decode(f.payload, expected_seed=SEED, expected_bucket_count=bc)
            assert isinstance(d, cbi1.Delta) and d.dc_id == DC and d.epoch == f.sequence
            table[d.buckets.astype(np.int64)] = d.words
            seq = f.sequence
        else:
            assert f.kind == pb.FilterUpdateKind.HEARTBEAT and f.sequence == seq == f.base_sequence
    assert table is not None
    return table, seq


async def pump_until(sub: Subscription, col: Collector) -> asyncio.Task[None]:
    """Start pumping and wait until the whole snapshot has been sent."""
    task = asyncio.ensure_future(sub.pump(col))
    chunks = await asyncio.wait_for(asyncio.shield(sub._snapshot), scaled(10))
    for _ in range(1000):
        if len(col.frames) >= len(chunks) or task.done():
            break
        await asyncio.sleep(0.005)
    return task


async def test_invariants_never_half_apply() -> None:
    hub, table = make_hub(seq=4)
    sub = await hub.subscribe()
    for seq, b, w in [
        (6, [1], [1]),  # gap
        (4, [1], [1]),  # replay
        (5, [1024], [1]),  # out of range
        (5, [-1], [1]),
        (5, [3, 3], [1, 2]),  # duplicate
        (5, [1, 2], [1]),  # length mismatch
        (5, [1.5], [1]),  # not integers
        (5, [7, 1, 1024, 3], [1, 2, 3, 4]),  # out of range, not first
        (5, [7, -2, 3], [1, 2, 3]),  # negative among others
        (5, [9, 4, 2, 4, 8], [1, 2, 3, 4, 5]),  # duplicate, not adjacent
        (5, np.array([5, 5], np.uint32), [1, 2]),  # duplicate, the pool's dtype
    ]:
        with pytest.raises(PublicationInvariantError):
            hub.publish(seq, np.asarray(b), np.asarray(w))
        assert hub.sequence == 4 and hub.mirror_copy().tobytes() == table.tobytes()
    assert len(sub._frames) == 0
    hub.retire(None)
    with pytest.raises(PublicationInvariantError):
        hub.publish(5, np.array([1]), np.array([1]))
    with pytest.raises(RelayError) as ei:
        await hub.subscribe()
    assert ei.value.reason == R.PUBLICATION_UNAVAILABLE


async def test_encode_once_shared_bytes_and_snapshot_reuse() -> None:
    hub, table = make_hub(seq=3)
    a, b = (await hub.subscribe()), (await hub.subscribe())
    assert a._snapshot is b._snapshot  # one snapshot build per sequence
    chunks_a = await a._snapshot
    assert chunks_a is await b._snapshot
    hub.publish(4, np.array([5, 9]), np.array([0, 77], dtype=np.uint64))
    assert a._frames[0][0] is b._frames[0][0]  # the same bytes object fans out
    c = await hub.subscribe()
    assert c._snapshot is not a._snapshot and c.start_sequence == 4
    table[[5, 9]] = [0, 77]
    col = Collector()
    task = await pump_until(c, col)
    got, seq = rebuild(col.frames, 1024)
    assert seq == 4 and got.tobytes() == table.tobytes()
    assert col.frames[0].base_sequence == col.frames[0].sequence == 4
    hub.retire(None)
    await task  # clean EOF
    for s in (a, b, c):
        s.close()
    assert hub.subscriber_count == 0


async def test_pump_delivers_snapshot_deltas_heartbeats() -> None:
    hub, table = make_hub(bc=1 << 20, seq=0, pool_heartbeat_s=0.05)  # 2 chunks, built in a thread
    rng = np.random.default_rng(0)
    sub = await hub.subscribe()
    col = Collector()
    task = asyncio.ensure_future(sub.pump(col))
    await sub._snapshot  # deltas published while a 2-chunk build runs would queue (bound 16)
    for seq in range(1, 30):
        b = rng.choice(1 << 20, size=int(rng.integers(1, 500)), replace=False)
        w = rng.integers(0, 2**64, size=b.size, dtype=np.uint64)
        table[b] = w
        hub.publish(seq, b, w)
        await asyncio.sleep(0)
    await eventually(lambda: len(col.frames) >= 33, what="snapshot, 29 deltas, heartbeats")
    kinds = [int(f.kind) for f in col.frames]
    assert kinds[:2] == [1, 1] and kinds[2:31] == [2] * 29 and set(kinds[31:]) == {3}
    assert len(kinds) >= 33
    got, seq = rebuild(col.frames, 1 << 20)
    assert seq == 29 and got.tobytes() == table.tobytes() == hub.mirror_copy().tobytes()
    hub.retire(RelayError.publication_unavailable())
    with pytest.raises(RelayError) as ei:
        await task
    assert ei.value.reason == R.PUBLICATION_UNAVAILABLE
    sub.close()


async def test_queue_frame_and_byte_bounds() -> None:
    # 16 frames: the 17th pending frame lags only the stalled subscriber
    hub, _ = make_hub()
    stalled, live = (await hub.subscribe()), (await hub.subscribe())
    col = Collector()
    task = asyncio.ensure_future(live.pump(col))
    for seq in range(1, 18):
        hub.publish(seq, np.array([seq]), np.array([seq]))
        await asyncio.sleep(0.001)
    assert stalled.error is not None and stalled.error.reason == R.SUBSCRIBER_LAGGED
    assert live.error is None and hub.lagged == 1
    assert [f.sequence for f in col.frames if f.kind == 2] == list(range(1, 18))
    hub.retire(None)
    await task
    # bytes: three max-size deltas (3 × (4,194,368 + 256)) fit in 16 MiB, the fourth does not
    hub, _ = make_hub(bc=1 << 19)
    sub = await hub.subscribe()
    big = np.arange(cbi1.MAX_DELTA_IMAGES)
    for seq in (1, 2, 3):
        hub.publish(seq, big, big)
        assert sub.error is None
    hub.publish(4, big, big)
    assert sub.error is not None and sub.error.reason == R.SUBSCRIBER_LAGGED
    assert len(sub._frames) == 0 and sub._bytes == 0


async def test_oversize_resets_subscribers_and_rebootstraps() -> None:
    hub, table = make_hub(bc=1 << 19, seq=10)
    sub = await hub.subscribe()
    col = Collector()
    task = await pump_until(sub, col)
    b = np.arange(cbi1.MAX_DELTA_IMAGES + 1)
    hub.publish(11, b, b)
    with pytest.raises(RelayError) as ei:
        await task
    assert ei.value.reason == R.PUBLICATION_UNAVAILABLE
    sub.close()
    table[b] = b
    assert hub.sequence == 11 and hub.resets == 1
    fresh = await hub.subscribe()
    col2 = Collector()
    task2 = await pump_until(fresh, col2)
    got, seq = rebuild(col2.frames, 1 << 19)
    assert seq == 11 and got.tobytes() == table.tobytes()
    hub.retire(None)
    await task2


async def test_snapshot_progress_timeout_and_watchdog() -> None:
    # the reset grace stretches on a busy machine: these waits must end inside it
    hub, _ = make_hub(snapshot_progress_timeout_s=0.05, stalled_stream_reset_s=scaled(0.3))
    released: list[int] = []
    sub = await hub.subscribe(on_release=lambda: released.append(1))
    col = Collector(block_after=0)  # never drains the first snapshot frame
    task = asyncio.ensure_future(sub.pump(col))
    await eventually(lambda: sub.error is not None, what="snapshot progress timeout")
    assert sub.error is not None and sub.error.reason == R.SNAPSHOT_PROGRESS_TIMEOUT
    # the failed subscriber stops counting at once, while its send is still blocked
    assert hub.subscriber_count == 0 and released == [1] and not task.done()
    hub.publish(1, np.array([1]), np.array([1]))
    assert len(sub._frames) == 0  # detached: no more queueing
    await asyncio.sleep(0.1)
    assert not task.done()  # the error stays pending for the client (no cancel, no reset)
    col.gate.set()  # the client resumes: the status is observed after the in-flight frame
    with pytest.raises(RelayError) as ei:
        await task
    assert ei.value.reason == R.SNAPSHOT_PROGRESS_TIMEOUT and len(col.raw) == 1
    sub.close()
    assert released == [1]  # once
    # a client that never resumes: after the grace the stream is reset and the pump stopped
    resets: list[int] = []
    sub2 = await hub.subscribe()
    task2 = asyncio.ensure_future(
        sub2.pump(Collector(block_after=0), reset=lambda: resets.append(1))
    )
    await eventually(lambda: sub2.error is not None, what="second snapshot progress timeout")
    assert not task2.done() and resets == []
    await eventually(lambda: task2.done(), what="stalled stream reset")
    assert task2.cancelled() and resets == [1]
    sub2.close()
    assert hub.subscriber_count == 0


async def test_per_pool_subscriber_limit() -> None:
    hub, _ = make_hub(max_subscribers_per_pool=2)
    a, _b = (await hub.subscribe()), (await hub.subscribe())
    with pytest.raises(RelayError) as ei:
        await hub.subscribe()
    assert ei.value.reason == R.RESOURCE_LIMIT
    a.close()
    a.close()  # idempotent
    await hub.subscribe()


async def test_batched_pump_preserves_order_and_bounds() -> None:
    hub, table = make_hub(seq=0)
    sub = await hub.subscribe()
    col = Collector()
    batches: list[int] = []

    async def send_batch(frames: list[bytes]) -> None:
        batches.append(len(frames))
        for f in frames:
            await col(f)

    await sub._snapshot
    for seq in range(1, 16):  # queued before the pump runs → coalesced writes
        hub.publish(seq, np.array([seq, 1000 - seq]), np.array([seq, 0]))
        table[[seq, 1000 - seq]] = [seq, 0]
    task = asyncio.ensure_future(sub.pump(col, send_batch))
    await asyncio.sleep(0.05)
    got, seq = rebuild(col.frames, 1024)
    assert seq == 15 and got.tobytes() == table.tobytes()
    assert batches == [15] and sum(batches) == 15
    hub.retire(None)
    await task


async def test_send_now_writes_idle_streams_in_order_and_falls_back_to_the_queue() -> None:
    """Deltas published while the pump is idle go out through ``send_now`` (no pump wake-up);
    when it refuses (transport full), frames queue and the pump sends them, and ``send_now`` is
    not used again before the queue has drained: the stream stays base+1 contiguous."""
    hub, table = make_hub(bc=1024)
    sub = await hub.subscribe()
    col = Collector()
    accept = [True]

    def send_now(frame: bytes) -> bool:
        if not accept[0]:
            return False
        col.raw.append(frame)
        col.frames.append(pb.FilterUpdate.parse(frame))
        return True

    task = asyncio.ensure_future(sub.pump(col, send_now=send_now))
    for _ in range(100):
        if sub._parked:
            break
        await asyncio.sleep(0.001)
    assert sub._parked  # snapshot sent, pump idle
    seq = 0

    def step(k: int) -> None:
        nonlocal seq
        for _ in range(k):
            seq += 1
            b = np.array([seq % 1024, (seq * 7 + 3) % 1024])
            b = np.unique(b)
            hub.publish(seq, b, np.full(b.size, seq, np.uint64))
            table[b] = seq

    step(5)  # written synchronously by publish itself
    assert hub.direct_frames == 5 and len(col.frames) == 6 and not sub._frames
    accept[0] = False
    step(3)  # refused: queued for the pump
    assert hub.direct_frames == 5 and len(sub._frames) >= 1
    accept[0] = True
    step(2)  # the queue is not empty yet: these queue behind it, never overtake
    for _ in range(100):
        if not sub._frames and sub._parked:
            break
        await asyncio.sleep(0.001)
    step(4)  # idle again: direct once more
    await asyncio.sleep(0)
    got, last = rebuild(col.frames, 1024)  # asserts base+1 contiguity frame by frame
    assert last == seq == 14 and got.tobytes() == table.tobytes()
    assert hub.direct_frames == 5 + 4
    hub.retire(None)
    await task


async def test_a_refusing_send_now_still_ends_a_stalled_subscriber_as_lagged() -> None:
    """The direct path never bypasses the bound: a transport that takes nothing more (its
    client stopped reading) leaves frames to the queue, which overflows as before."""
    hub, _ = make_hub(bc=1024, publication_queue_capacity=3)
    sub = await hub.subscribe()
    col = Collector(block_after=1)  # the pump blocks in its first send after the snapshot
    task = asyncio.ensure_future(sub.pump(col, send_now=lambda frame: False))
    for _ in range(100):
        if sub._parked:
            break
        await asyncio.sleep(0.001)
    for seq in range(1, 7):
        hub.publish(seq, np.array([seq]), np.array([seq], np.uint64))
        await asyncio.sleep(0)
    assert hub.lagged == 1 and hub.direct_frames == 0
    assert sub.error is not None and sub.error.reason == R.SUBSCRIBER_LAGGED
    col.gate.set()
    with pytest.raises(RelayError):
        await asyncio.wait_for(task, scaled(5))


async def test_cancelled_subscriber_does_not_cancel_shared_snapshot_build() -> None:
    hub, table = make_hub(bc=1 << 20)  # built in a thread: still pending when we cancel
    a, b = (await hub.subscribe()), (await hub.subscribe())
    ta = asyncio.ensure_future(a.pump(Collector()))
    col = Collector()
    tb = asyncio.ensure_future(b.pump(col))
    await asyncio.sleep(0)
    ta.cancel()  # client A disconnects while the shared snapshot is being built
    with pytest.raises(asyncio.CancelledError):
        await ta
    a.close()
    chunks = await asyncio.wait_for(asyncio.shield(b._snapshot), scaled(10))
    assert len(chunks) == 2
    for _ in range(1000):
        if len(col.frames) == 2:
            break
        await asyncio.sleep(0.005)
    got, seq = rebuild(col.frames, 1 << 20)
    assert seq == 0 and got.tobytes() == table.tobytes()
    hub.retire(None)
    await tb


async def test_publication_hold_while_a_snapshot_is_being_sent() -> None:
    """The spacing a producer is asked for: 0 without a joiner; while one catches up, what it
    still has to read at ``snapshot_reader_bytes_per_second`` over its free queue slots but one,
    within [publication_delay_s, snapshot_publication_delay_s]; 0 again, with one release
    callback, once it holds its snapshot and has drained its queue."""
    rate = 100_000  # bytes/s: a 1024-bucket snapshot (8,256 bytes) then "takes" 83 ms
    hub, table = make_hub(
        publication_queue_capacity=8,
        publication_delay_s=0.001,
        snapshot_publication_delay_s=0.2,
        snapshot_reader_bytes_per_second=rate,
    )
    released: list[int] = []
    hub.on_hold_released = lambda: released.append(hub.sequence)
    assert hub.publication_hold() == 0.0 and hub.joiners == 0
    sub = await hub.subscribe()
    assert hub.joiners == 1
    # nothing sent yet: the whole snapshot (estimated until encoded) over 7 spare slots
    assert hub.publication_hold() == pytest.approx((8 * 1024 + 128) / 7 / rate)
    holds = []
    rng = np.random.default_rng(3)
    for seq in range(1, 8):
        b = rng.choice(1024, size=4, replace=False)
        w = rng.integers(1, 2**64, size=4, dtype=np.uint64)
        table[b] = w
        hub.publish(seq, b, w)
        holds.append(hub.publication_hold())
    assert all(x < y for x, y in itertools.pairwise(holds))  # fuller queue: wider
    assert holds[-2] == pytest.approx((8 * 1024 + 128 + 6 * sub._frames[0][1]) / 1 / rate)
    assert holds[-1] == 0.2  # no spare slot left: the longest spacing
    assert released == []
    col = Collector(block_after=3)  # the snapshot chunk and two deltas, then a stalled send
    task = asyncio.ensure_future(sub.pump(col))
    for _ in range(400):
        if len(col.frames) == 3:
            break
        await asyncio.sleep(0.005)
    assert len(col.frames) == 3 and col.frames[0].kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
    # snapshot out, 5 deltas still to read: still holding back
    assert sub._snapshot_left == 0 and hub.joiners == 1 and released == []
    queued = len(sub._frames)
    assert hub.publication_hold() == pytest.approx(
        max(0.001, sub._bytes / (8 - queued - 1) / rate)
    )
    col.gate.set()
    for _ in range(400):
        if len(col.frames) == 8 and released:
            break
        await asyncio.sleep(0.005)
    assert hub.publication_hold() == 0.0 and hub.joiners == 0
    assert released == [7]  # once, when the snapshot and the 7 deltas were out
    got, seq = rebuild(col.frames, 1024)
    assert seq == 7 and got.tobytes() == table.tobytes()  # every held delta, base + 1 each
    hub.retire(None)
    await task
    sub.close()
    assert released == [7]


async def test_hold_released_by_a_joiner_that_ends_or_lags() -> None:
    hub, _ = make_hub(publication_queue_capacity=2)
    released: list[str] = []
    hub.on_hold_released = lambda: released.append("x")
    a, b = (await hub.subscribe()), (await hub.subscribe())
    assert hub.joiners == 2
    a.close()  # a client that went away mid-snapshot holds nothing back
    assert hub.joiners == 1 and released == []
    for seq in (1, 2, 3):  # the third delta overflows b's 2-frame queue
        hub.publish(seq, np.array([seq]), np.array([seq], dtype=np.uint64))
    assert b.error is not None and b.error.reason == R.SUBSCRIBER_LAGGED
    assert hub.joiners == 0 and released == ["x"]
    assert hub.publication_hold() == 0.0
    b.close()
    assert released == ["x"]


class Turns:
    """A connection's turn as the hub sees it: ``__call__`` returns once the test opens it."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.asked = 0

    async def __call__(self) -> None:
        self.asked += 1
        await self.open.wait()


async def test_a_joiner_waiting_its_turn_holds_nothing_and_its_clocks_wait() -> None:
    """While its turn on the connection has not come: no progress timer (it would have fired
    ten times over), no joiner for the spacing, no queued deltas; at its turn the stale cut is
    taken again at the current sequence and the replica is exact there."""
    hub, table = make_hub(bc=1024, snapshot_progress_timeout_s=0.05)
    sub = await hub.subscribe()
    turns, col = Turns(), Collector()
    task = asyncio.ensure_future(sub.pump(col, turn=turns))
    await eventually(lambda: turns.asked > 0, timeout=1.0, what="the stream asks for its turn")
    assert turns.asked == 1 and hub.publication_hold() == 0.0, "waiting: holds nothing back"
    rng = np.random.default_rng(3)
    for seq in range(1, 41):  # far more than the queue's 16 slots
        b = rng.choice(1024, size=4, replace=False)
        w = rng.integers(1, 2**63, size=4, dtype=np.uint64)
        hub.publish(seq, b, w)
        table[b] = w
    await asyncio.sleep(0.3)  # six progress timeouts' worth of waiting
    assert sub.error is None and len(sub._frames) == 0 and not col.frames
    turns.open.set()
    await eventually(lambda: bool(col.frames) and int(col.frames[-1].kind)
                     == int(pb.FilterUpdateKind.SNAPSHOT_CHUNK), timeout=2.0,
                     what="the snapshot at its turn")  # fmt: skip
    assert hub.recuts == 1 and sub.start_sequence == 40
    hub.publish(41, np.array([5]), np.array([77], dtype=np.uint64))
    table[5] = 77
    await eventually(lambda: bool(col.frames) and col.frames[-1].sequence == 41, timeout=2.0,
                     what="the delta after the snapshot")  # fmt: skip
    got, seq = rebuild(col.frames, 1024)
    assert seq == 41 and np.array_equal(got, table)
    sub.shutdown()
    await asyncio.wait_for(task, 5)
    sub.close()


async def test_a_joiner_that_fails_while_waiting_gives_up_its_turn_unsent() -> None:
    hub, _ = make_hub(bc=1024)
    sub = await hub.subscribe()
    turns, col = Turns(), Collector()
    task = asyncio.ensure_future(sub.pump(col, turn=turns))
    await eventually(lambda: turns.asked > 0, timeout=1.0, what="the stream asks for its turn")
    hub.retire(RelayError.publication_unavailable("fenced"))
    turns.open.set()
    with pytest.raises(RelayError) as ei:
        await asyncio.wait_for(task, 5)
    assert ei.value.reason == R.PUBLICATION_UNAVAILABLE and not col.raw, "not one byte"
    sub.close()
