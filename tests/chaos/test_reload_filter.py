"""A reload that changes ``expected_blocks`` or ``ckf_seed`` builds the new generation's filter
from the exact state the relay holds, not from replay: with a history far longer than the
engines' replay buffers, the new generation is exact at once (a rebuild from replay would miss
most blocks), its sources never restart, and the old generation's streams end with a status."""

from __future__ import annotations

import dataclasses

import grpclib.const
import pytest

from kvrelay.sim.config import SimConfig
from tests.support.fleet import eventually, ground_truth, relay_view
from tests.support.rig import Rig, rig, subscribe, verify, wait_live


def _exact(r: Rig) -> bool:
    if r.pool.generation is None:
        return False
    truth, view = ground_truth(r.engines), relay_view(r.relay)
    return all(view.get(k, set()) == v for k, v in truth.items())


@pytest.mark.parametrize(("field", "value"), [("expected_blocks", 65_536), ("ckf_seed", 99_991)])
async def test_a_reload_of_the_filter_shape_keeps_the_exact_state(field: str, value: int) -> None:
    cfgs = [SimConfig(name=f"rf{i}", seed=501 + i, dp_size=2, capacity_blocks=4096,
                      buffer_steps=8) for i in range(2)]  # fmt: skip
    async with rig(cfgs, expected_blocks=16_384) as r, r.channel() as ch:
        await wait_live(r.relay, 4)
        for _ in range(30):  # 240 steps: far more than the 8-step replay buffers
            for e in r.engines:
                await e.step(8)
        await eventually(lambda: _exact(r), what="exact before the reload")
        consumer = await subscribe(r, ch)
        old = r.pool.generation
        assert old is not None
        subs = dict(r.pool.subscribers)
        pool = r.relay.settings.pools[0]
        await r.relay.reconfigure(dataclasses.replace(
            r.relay.settings, pools=(dataclasses.replace(pool, **{field: value}),),
        ))  # fmt: skip
        new = r.pool.generation
        assert new is not None and new is not old and new.layout_generation > old.layout_generation
        assert (new.pool.bucket_count, new.pool.seed) == (
            r.relay.settings.pools[0].bucket_count, r.relay.settings.pools[0].ckf_seed)
        assert _exact(r), "exact at once: built from the exact state, not from replay"
        assert r.pool.subscribers == subs, "sources go on, nothing replayed"
        assert r.pool.counters.member_resets == {}
        end = await consumer.wait_end()
        assert end.status == grpclib.const.Status.UNAVAILABLE
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        fresh = await subscribe(r, ch)
        for e in r.engines:
            await e.step(3)
        await verify(r, fresh, probes=2_000)
        assert r.metric("kvrelay_pool_reconfigurations_total") == 1
        await fresh.stop()


async def test_a_reload_of_the_hash_format_still_rebuilds_from_replay() -> None:
    async with rig([SimConfig(name="rh0", seed=511, dp_size=1)]) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(4)
        old = r.pool.generation
        subs = dict(r.pool.subscribers)
        pool = r.relay.settings.pools[0]
        await r.relay.reconfigure(dataclasses.replace(
            r.relay.settings, pools=(dataclasses.replace(
                pool, decode=dataclasses.replace(pool.decode, cache_salt_namespacing=True)),),
        ))  # fmt: skip
        await wait_live(r.relay, 1)
        assert r.pool.generation is not old
        assert r.pool.subscribers != subs, "other canonical hashes: the sources start over"
