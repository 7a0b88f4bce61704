"""Publication cadence while a subscriber receives its snapshot (§4.6, §8.4).

A real relay over a simulated engine publishing continuously, and a real grpclib subscriber
that reads the first chunk of a two-chunk snapshot, then stops reading for a while, as a slow
reader of a large lane does. Every delta published meanwhile waits in its 16-frame queue. With
the snapshot hold the relay spaces its publications out, the snapshot completes, the deltas that
follow obey base + 1 and the replica ends equal to the producer's table and to the simulator's
ground truth. With the hold switched off (its bound equal to the normal delay), the same reader
is ended as lagged: the test can tell the two apart.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from grpclib.client import Stream
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import PermitCounter, RelayLimits
from kvrelay.ingest.sink import SourceKey
from kvrelay.pool.batch import BatchBuilder, EventBatch
from kvrelay.pool.pool import FORMAT_STANDARD, Pool
from kvrelay.publication import cbi1
from kvrelay.relay.context import RelayContext
from kvrelay.relay.generation import Generation
from kvrelay.relay.observer import Observers
from kvrelay.relay.relay import Relay
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually, fleet_and_relay, ground_truth, in_sync, wait_subscribed
from tests.support.identities import make_producer
from tests.support.mem_relay import grpclib_channel, sub_request
from tests.support.replica import Replica
from tests.support.timing import scaled

SUBSCRIBE = "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool"
#: 2,097,152 expected blocks → 1,048,576 buckets: a snapshot of two 4 MiB chunks.
TWO_CHUNKS = 1 << 21
PAUSE_S = 0.8  # a reader of a 64 MiB lane at 80 MB/s takes about this long


async def _produce(engine: SimEngine, stop: asyncio.Event) -> int:
    """Engine steps every few milliseconds until ``stop`` (commands keep arriving)."""
    steps = 0
    while not stop.is_set():
        await engine.step(1)
        steps += 1
        await asyncio.sleep(0.003)
    return steps


async def _next(st: Stream[pb.SubscribeKvPoolRequest, pb.FilterUpdate]) -> pb.FilterUpdate:
    """The next frame; at the end of the stream its status is raised (GRPCError)."""
    msg = await st.recv_message()
    if msg is None:
        await st.recv_trailing_metadata()  # raises for any status but OK
        raise AssertionError("stream ended with status OK")
    return msg


async def _slow_subscriber(
    relay: Relay, port: int, replica_box: list[Replica], engine: SimEngine
) -> str | None:
    """Read chunk 0, stop reading for PAUSE_S while the engine publishes, then read on until the
    replica holds the producer's sequence; returns the error trailer, None on success."""
    gen = relay.pools[0].generation
    assert gen is not None
    replica = Replica(gen.producer, relay.relay_identity)
    replica_box.append(replica)
    stop = asyncio.Event()
    producer = asyncio.create_task(_produce(engine, stop))
    ch = grpclib_channel(port, window=65535)  # a client that reads slowly holds little data
    try:
        async with ch.request(
            SUBSCRIBE, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest, pb.FilterUpdate
        ) as st:
            await st.send_message(sub_request(gen.producer, "slow"), end=True)
            try:
                first = await _next(st)
                assert first.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
                replica.feed(first)
                await asyncio.sleep(PAUSE_S)  # mid-snapshot, not reading; deltas keep coming
                while replica.table is None:  # the rest of the snapshot
                    replica.feed(await _next(st))
                await asyncio.sleep(0.2)
                stop.set()
                await producer
                await eventually(lambda: in_sync([engine], relay), what="relay = ground truth")
                async with asyncio.timeout(scaled(20)):
                    # caught up = at the generation's sequence with nothing left to publish (a
                    # spaced publication may still be pending when the sequences first match)
                    while replica.sequence != gen.sequence or gen.pool.pending_dirty:
                        if replica.sequence == gen.sequence:
                            await asyncio.sleep(0.01)
                            continue
                        replica.feed(await _next(st))  # asserts base + 1 for every delta
                await st.cancel()
                return None
            except GRPCError:
                return dict(st.trailing_metadata or {}).get("kv-relay-error-reason", "?")
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await producer
        ch.close()


@pytest.mark.parametrize("hold", [True, False], ids=["hold", "no-hold"])
async def test_slow_reader_gets_its_snapshot_while_deltas_are_produced(hold: bool) -> None:
    limits = RelayLimits(
        publication_delay_s=0.001,
        # designed for a reader pausing PAUSE_S on a 4 MiB chunk (~5 MB/s); no hold: 1 ms
        snapshot_reader_bytes_per_second=4_000_000,
        snapshot_publication_delay_s=0.25 if hold else 0.001,
    )
    cfg = SimConfig(name="c0", seed=21, capacity_blocks=4096, max_running=32)
    async with fleet_and_relay([cfg], expected_blocks=TWO_CHUNKS, limits=limits) as (
        engines,
        relay,
        server,
    ):
        (engine,) = engines
        await wait_subscribed(relay, 1)
        await engine.step(20)
        await eventually(lambda: in_sync(engines, relay), what="initial sync")
        gen = relay.pools[0].generation
        assert gen is not None and gen.pool.bucket_count == 1 << 20
        box: list[Replica] = []
        reason = await _slow_subscriber(relay, server.port, box, engine)
        (replica,) = box
        if not hold:
            assert reason == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
            return
        assert reason is None
        assert replica.kinds["snapshot"] == 2 and replica.kinds["delta"] > 0
        assert replica.table is not None and np.array_equal(replica.table, gen.pool.table)
        truth = set().union(*ground_truth(engines).values())
        assert truth and bool(np.all(replica.contains(sorted(truth))))
        hub = gen._hub
        assert hub is not None and hub.lagged == 0 and hub.joiners == 0


# ---- Generation + PublicationHub in one loop, no network: what a held cut may contain -----------


def _generation(limits: RelayLimits, buckets: int = 1 << 14) -> Generation:
    relay = pb.RelayIdentity(drt_instance_id=1, relay_incarnation=2)
    ctx = RelayContext(
        relay_identity=relay,
        dc_id=7,
        limits=limits,
        hub_permits=PermitCounter("hubs", 4),
        encode_gate=asyncio.Semaphore(1),
        next_layout_generation=lambda: 1,
        schedule=lambda coro: coro.close(),
        changed=lambda: None,
        evict_idle_hub=lambda: False,
        observers=Observers(),
    )
    producer = make_producer(3)
    assert producer.ckf_format is not None
    producer.ckf_format.bucket_count = buckets
    fenced: list[str] = []
    gen = Generation(
        name="p",
        pool=Pool(buckets, int(producer.ckf_format.seed), BLOCK, FORMAT_STANDARD),
        producer=producer,
        ctx=ctx,
        on_fence=lambda _g, why: fenced.append(why),
    )
    return gen


def _stores(rng: np.random.Generator, n: int) -> EventBatch:
    """One engine message: ``n`` single-block root stores (new canonical hashes)."""
    b = BatchBuilder()
    for h in rng.integers(1, 2**63, size=n, dtype=np.uint64):
        b.store([int(h)], rng.integers(0, 50_000, size=BLOCK))
    return b.build()


BLOCK = 4
SOURCE = SourceKey(worker_id=11, dp_rank=0)


async def test_a_held_delta_is_cut_once_it_would_not_fit_a_queue_slot() -> None:
    """A joiner that never reads: the hold (5 s here) would keep every command back for the
    whole test, yet deltas keep coming once the touched buckets reach a slot's share of the
    byte bound, and the joiner's queue stays within it (it is not ended)."""
    limits = RelayLimits(
        publication_queue_capacity=1024,  # 4 KiB of the 4 MiB byte bound per slot
        publication_queue_bytes=4_194_624,
        publication_delay_s=5.0,
        snapshot_publication_delay_s=60.0,
    )
    gen = _generation(limits)
    cap = gen._bucket_cap  # publication.cadence.held_bucket_cap, shared with the pacer
    assert cap == (4_194_624 // 1024 - 256 - 60) // 12 == 315
    hub = gen.hub()
    joiner = await hub.subscribe()
    rng = np.random.default_rng(5)
    for _ in range(40):  # 40 messages × 64 stores, one message per loop iteration
        gen.apply(SOURCE, _stores(rng, 64))
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert hub.publication_hold() > 1.0  # still holding: only the cap can have cut
    assert gen.sequence >= 4 and joiner.error is None and hub.lagged == 0
    sizes = []
    for frame, _cost, _seq in joiner._frames:
        fu = pb.FilterUpdate.parse(frame)
        d = cbi1.decode(fu.payload, expected_seed=gen.pool.seed, expected_bucket_count=1 << 14)
        assert isinstance(d, cbi1.Delta)
        sizes.append(len(d.buckets))
    assert len(sizes) == gen.sequence and max(sizes) < cap + 64 * 4  # one message past the cap
    assert joiner._bytes <= limits.publication_queue_bytes
    joiner.close()
    gen.retire(None)


async def test_held_commands_go_out_when_the_last_joiner_catches_up() -> None:
    limits = RelayLimits(publication_delay_s=5.0, snapshot_publication_delay_s=60.0)
    gen = _generation(limits)
    hub = gen.hub()
    a, b = (await hub.subscribe()), (await hub.subscribe())
    gen.apply(SOURCE, _stores(np.random.default_rng(6), 20))  # 20 commands ≥ 16: a cut is due
    for _ in range(3):
        await asyncio.sleep(0)
    assert gen.sequence == 0 and hub.joiners == 2  # held back for the joiners
    a.close()
    for _ in range(3):
        await asyncio.sleep(0)
    assert gen.sequence == 0  # b still catching up
    b.close()
    for _ in range(3):
        await asyncio.sleep(0)
    assert gen.sequence == 1  # released: published at once, not 5 s later
    gen.retire(None)


async def test_the_hold_outlasts_the_pacers_max_delay_and_pacing_resumes_after() -> None:
    """Of the pacer's wait (at most ``publication_max_delay_s``) and the snapshot hold, the
    longer applies: with a joiner, commands pending for 8× the max delay are still held; once it
    leaves they go out at once, and with no joiner later commands are cut within the max delay."""
    limits = RelayLimits(
        publication_max_delay_s=0.005,
        publication_delay_s=0.001,
        snapshot_publication_delay_s=60.0,
        snapshot_reader_bytes_per_second=1_000,  # the joiner's snapshot keeps the hold for seconds
    )
    gen = _generation(limits)
    hub = gen.hub()
    joiner = await hub.subscribe()
    rng = np.random.default_rng(7)
    gen.apply(SOURCE, _stores(rng, 20))
    await asyncio.sleep(8 * limits.publication_max_delay_s)
    assert hub.publication_hold() > 1.0 and gen.sequence == 0
    joiner.close()
    await eventually(lambda: gen.sequence == 1, timeout=1.0)
    gen.apply(SOURCE, _stores(rng, 3))  # fewer than publish_every_n_events: the timer cuts
    await eventually(lambda: gen.sequence == 2, timeout=1.0)
    gen.retire(None)


def test_a_cut_armed_under_half_a_millisecond_on_uvloop_is_rearmed() -> None:
    """uvloop's ``call_later`` gives a plain ``Handle`` (no ``when()``) for a delay that rounds
    to 0 ms: a cut armed that close, then asked for again, raised ``AttributeError`` in the
    callback and the attempt was lost. On a real uvloop loop: armed at 0.1 ms, asked again at
    once and later, the pending commands still go out as one delta, with no error logged."""
    import uvloop

    async def main() -> tuple[int, list[object]]:
        errors: list[object] = []
        asyncio.get_running_loop().set_exception_handler(lambda _l, c: errors.append(c))
        gen = _generation(RelayLimits(publication_delay_s=5.0))
        gen.hub()
        gen._last_cut = asyncio.get_running_loop().time()
        gen.apply(SOURCE, _stores(np.random.default_rng(2), 3))  # the delay arms a timer
        gen._arm(0.0001)  # sooner: a plain Handle under uvloop
        assert not hasattr(gen._timer, "when")
        gen._arm(0.0001)  # asked again: compared with the recorded deadline
        gen._arm(1.0)  # a later one is already covered
        await asyncio.sleep(0.05)
        return gen.sequence, errors

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sequence, errors = runner.run(main())
    assert errors == [] and sequence == 1
