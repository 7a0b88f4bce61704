"""SGLang engines end to end: simulated SGLang publisher → relay → gRPC consumer replica.

The same exactness bar as vLLM engines (``verify``: the replica's filter equals the producer's
table, the relay's state equals the simulator's ground truth, nothing phantom) for every wire
layout SGLang has published, plus its faults: a gap filled from replay, lost history, restarts
(told by the sequence or by the epoch in the topic), DP ranks and EAGLE bigram pages.
"""

from __future__ import annotations

import asyncio

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.sim.sglang_wire import SglLayout
from kvrelay.sim.traffic import TrafficConfig
from tests.support.rig import Rig, eventually, stored_after, subscribe, verify, wait_live
from tests.support.sglang import sglang_config, sglang_rig

SALTY = TrafficConfig(salt_fraction=0.5)  # many salted requests: the metadata slots are used


def _subs(r: Rig) -> list[Subscriber]:
    return list(r.pool.subscribers.values())


@pytest.mark.parametrize("layout", list(SglLayout))
async def test_every_sglang_layout_is_exact(layout: SglLayout) -> None:
    """Clean streams of each revision's layout (the oldest without a rank in the envelope; the
    newest naming LoRA adapters, whose blocks the relay salts with the name)."""
    cfg = sglang_config(
        "sg0", 61, sglang_layout=layout, traffic=SALTY,
        sglang_rank_in_envelope=layout is not SglLayout.NO_MEDIUM,
    )  # fmt: skip
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        if layout.names_adapters:
            eng.load_lora("adapter-a")
        await eng.step(40)
        # the layouts with a salt slot carry it, and it is honoured by default
        truth = {("sg0", 0): eng.ground_truth(0, cache_salt_namespacing=layout.carries_salt)}
        await verify(r, consumer, truth=truth, probes=2_000)
        adapter = any(b.lora_name for b in eng.held_blocks(0).values())
        assert adapter == layout.names_adapters  # adapter blocks held, salted by their name
        (sub,) = _subs(r)
        c = sub.counters
        assert c.batches >= 25 and c.malformed_events == 0 and not c.rejections
        assert c.resets == 0 and c.events_by_kind["removed"] > 0  # evictions happened
        await consumer.stop()


@pytest.mark.parametrize("namespacing", [False, True])
@pytest.mark.parametrize("layout", [SglLayout.METADATA, SglLayout.ALIGNED])
async def test_cache_salt_namespaces_from_the_metadata_slot(
    layout: SglLayout, namespacing: bool
) -> None:
    """The salt SGLang attaches to every salted store becomes the namespace, by default (as
    Dynamo does) and with ``cache_salt_namespacing``: salted and unsalted blocks never merge, the
    filter equals the namespaced ground truth."""
    cfg = sglang_config("sg1", 62, sglang_layout=layout, traffic=SALTY)
    opts = DecodeOptions(cache_salt_namespacing=namespacing)
    async with sglang_rig([cfg], decode=opts) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        await eng.step(40)
        truth = {("sg1", 0): eng.ground_truth(0, cache_salt_namespacing=True)}
        assert truth[("sg1", 0)] != eng.ground_truth(0)  # salted blocks are held
        await verify(r, consumer, truth=truth, probes=2_000)
        await consumer.stop()


@pytest.mark.parametrize("layout", [SglLayout.ALIGNED, SglLayout.MAP_LORA])
async def test_gap_is_filled_from_replay_then_lost_history_resets(layout: SglLayout) -> None:
    """Replies of 3 frames, and from 0.5.22 of 4 (with the topic)."""
    cfg = sglang_config("sg2", 63, sglang_layout=layout)
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        await eng.step(10)
        eng.drop_next(3, keep_in_replay=True)  # lost live, still in the replay
        await eng.step(10)
        await verify(r, consumer, probes=2_000)
        (sub,) = _subs(r)
        assert sub.counters.gaps == 1 and sub.counters.resets == 0
        pub = eng.publishers[0]
        lost = pub.stats.lost + 3
        eng.drop_next(3, keep_in_replay=False)  # gone for good
        while pub.stats.lost < lost:
            await eng.step(1)
        before = set(eng.held_blocks(0))  # what the lost batches may have touched
        await eng.step(10)
        await eventually(lambda: sub.counters.resets == 1, what="member reset")
        assert sub.counters.resets_by_reason == {"gap_unrecoverable": 1}
        await verify(r, consumer, exact=False, must_have=stored_after(eng, 0, before),
                     probes=2_000)  # fmt: skip
        await consumer.stop()


async def test_restart_on_the_same_ports_rebuilds_from_replay() -> None:
    """A restarted SGLang engine numbers from 0 again and most of its first batches go out
    before the relay's SUB reconnects: the replay must vouch for the reconnect (it cannot)."""
    cfg = sglang_config("sg3", 64, capacity_blocks=96)
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        for _ in range(25):
            await eng.step(1)
        await verify(r, consumer, probes=2_000)
        (sub,) = _subs(r)
        await eng.restart()  # same ports, seq 0, empty cache
        for _ in range(40):
            await eng.step(1)
        await eventually(lambda: sub.counters.reconnects >= 1, what="reconnect seen")
        for _ in range(5):
            await eng.step(1)
            await asyncio.sleep(0.02)
        await verify(r, consumer, probes=2_000)
        assert sub.counters.incarnations_detected >= 1 and sub.counters.epoch_changes == 0
        await consumer.stop()


async def test_epoch_tells_a_restart_the_sequence_cannot() -> None:
    """The restart the sequence cannot show: same sockets (no reconnect), and the new
    incarnation's first batches are lost live until its sequence is back where the old one
    stopped. Only SGLang's epoch says it is another publisher; the relay rebuilds from the new
    epoch's replay at 0."""
    cfg = sglang_config("sg6", 67, sglang_epoch=True, capacity_blocks=96)
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        await eng.step(25)
        await verify(r, consumer, probes=2_000)
        (sub,) = _subs(r)
        old_next = eng.publishers[0].seq
        await eng.restart(rebind=False)  # same sockets, new epoch, seq 0
        eng.drop_next(old_next, keep_in_replay=True)  # lost live, kept for the replay
        while eng.publishers[0].seq <= old_next:
            await eng.step(1)
        await eng.step(5)
        await verify(r, consumer, probes=2_000)
        assert sub.counters.epoch_changes == 1 and sub.counters.reconnects == 0
        assert r.metric("kvrelay_ingest_epoch_changes_total", worker="sg6", dp_rank="0") == 1
        await consumer.stop()


async def test_dp_ranks_on_offset_ports() -> None:
    cfg = sglang_config("sg4", 65, dp_size=2, sglang_layout=SglLayout.MEDIUM)
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 2)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(30)
        await verify(r, consumer, probes=2_000)
        assert {s.key.dp_rank for s in _subs(r)} == {0, 1}
        assert all(s.counters.rejections == {} for s in _subs(r))  # envelope ranks agree
        await consumer.stop()


@pytest.mark.parametrize("layout", [SglLayout.MEDIUM, SglLayout.ALIGNED])
async def test_eagle_bigram_pages_are_exact(layout: SglLayout) -> None:
    """EAGLE: each page is ``B`` bigram keys over ``B + 1`` tokens; an EAGLE pool hashes every
    block over that window (one-page stores, or coalesced multi-page ones)."""
    cfg = sglang_config("sg5", 66, eagle=True, sglang_layout=layout)
    async with sglang_rig([cfg], hash_format=pb.KvQueryHashFormat.DYNAMO_EAGLE_V1) as r, \
            r.channel() as ch:  # fmt: skip
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(40)
        await verify(r, consumer, probes=2_000)
        (sub,) = _subs(r)
        assert sub.counters.eagle_bigram > 0 and sub.counters.truncated == 0
        assert sub.counters.drops == {}
        await consumer.stop()
