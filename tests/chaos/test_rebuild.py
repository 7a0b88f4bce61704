"""A member rebuilt from its engine's replay is one transaction for subscribers: a restarted
engine's new incarnation replaces the old image in one step, so blocks held before and after the
restart never vanish from a subscriber's filter on the way (real relay, real gRPC subscriber)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.pool.ckf import contains
from kvrelay.relay import generation
from kvrelay.sim.traffic import TrafficConfig
from tests.relay.test_snapshot_cadence import SOURCE, _generation, _stores
from tests.support.fleet import ground_truth
from tests.support.rig import Consumer, eventually, subscribe, verify, wait_live
from tests.support.sglang import sglang_config, sglang_rig

# few shared system prompts and room for everything: blocks of the old incarnation come back in
# the new one, and nothing is evicted (a block never vanishes for a reason of its own)
TRAFFIC = TrafficConfig(n_system_prompts=2, system_len=(64, 96), arrivals_per_step=1.0)


def _record_tables(consumer: Consumer) -> list[np.ndarray]:
    """The subscriber's whole filter after every delta it applies."""
    seen: list[np.ndarray] = []
    feed = consumer.replica.feed

    def recording(fu: pb.FilterUpdate) -> None:
        feed(fu)
        if fu.kind == pb.FilterUpdateKind.DELTA:
            assert consumer.replica.table is not None
            seen.append(consumer.replica.table.copy())

    consumer.replica.feed = recording  # type: ignore[method-assign]
    return seen


async def _restart_and_watch() -> tuple[set[int], list[bool], int]:
    """Common blocks of both incarnations; per delta after the restart, whether the subscriber
    still held every one of them; rebuild holds the generation counted."""
    cfg = sglang_config("rb0", 71, capacity_blocks=4096, traffic=TRAFFIC)
    async with sglang_rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        for _ in range(20):
            await eng.step(1)
        await verify(r, consumer, probes=500)
        old = ground_truth([eng])[("rb0", 0)]
        tables = _record_tables(consumer)
        (sub,) = r.pool.subscribers.values()
        await eng.restart()  # same ports, seq 0, empty cache: the replay must rebuild it
        for _ in range(30):
            await eng.step(1)
        await eventually(lambda: sub.counters.incarnations_detected >= 1, what="rebuild")
        await verify(r, consumer, probes=500)
        common = old & ground_truth([eng])[("rb0", 0)]
        keys = np.array(sorted(common), dtype=np.uint64)
        seed = consumer.replica.seed
        kept = [bool(contains(t, seed, keys).all()) for t in tables]
        holds = r.metric("kvrelay_pool_rebuild_holds_total")
        await consumer.stop()
        return common, kept, int(holds)


async def test_a_rebuilt_member_is_published_as_one_delta() -> None:
    common, kept, holds = await _restart_and_watch()
    assert len(common) >= 8 and holds >= 1
    assert kept and all(kept), "blocks held before and after the rebuild vanished on the way"


# ---- the hold itself (Generation, no network; deterministic) -----------------------------------


async def _published_between(hold: bool) -> tuple[int, int]:
    """A member with blocks is reset; a publication delay passes (the replay is slow); its blocks
    come back. Returns (deltas published before the blocks came back, deltas in all)."""
    limits = RelayLimits(publication_delay_s=0.01)
    gen = _generation(limits)
    rng = np.random.default_rng(3)
    batch = _stores(rng, 20)
    gen.apply(SOURCE, batch)
    gen.flush()
    first = gen.batches_published
    if hold:
        gen.hold(SOURCE)
    gen.reset_member(SOURCE)
    await asyncio.sleep(0.2)  # many publication delays: the replay has not answered yet
    during = gen.batches_published - first
    gen.apply(SOURCE, batch)  # the replayed history
    if hold:
        gen.release(SOURCE)
    await asyncio.sleep(0.2)
    return during, gen.batches_published - first


async def test_a_held_rebuild_publishes_nothing_until_released() -> None:
    assert await _published_between(hold=False) == (1, 2)  # reset, then the blocks again
    assert await _published_between(hold=True) == (0, 0)  # net: nothing changed at all


async def test_a_hold_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "REBUILD_HOLD_MAX_S", 0.05)
    gen = _generation(RelayLimits(publication_delay_s=0.01))
    gen.apply(SOURCE, _stores(np.random.default_rng(4), 5))
    gen.flush()
    gen.hold(SOURCE)
    gen.reset_member(SOURCE)
    await eventually(lambda: gen.rebuild_holds_broken == 1, timeout=10, what="hold broken")
    assert gen.rebuilding == 0 and gen.batches_published == 2
