"""``[[pools]] max_member_blocks``: a member holding more blocks than that is reset.

An engine that announces stores and never removes them (a bug, a lost remove path, a hostile
engine the configuration trusts) would otherwise grow the relay's exact state without bound.
The oracle is the simulator's own caches: a reset member holds a subset of its engine's blocks
(false negatives, never a phantom), and under the cap the pool stays exact.
"""

from __future__ import annotations

from dataclasses import replace

from kvrelay.relay.settings import PoolSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import (
    engine_spec,
    eventually,
    fleet_and_relay,
    ground_truth,
    in_sync,
    relay_view,
    wait_subscribed,
)

CAP = 24


def _capped(cap: int):  # type: ignore[no-untyped-def]
    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        return (PoolSpec(namespace="ns", component="backend", endpoint="generate",
                         engines=tuple(engine_spec(e) for e in engines), expected_blocks=8192,
                         max_member_blocks=cap),)  # fmt: skip

    return pools


async def test_a_member_over_the_cap_is_reset_and_holds_no_phantom() -> None:
    cfg = SimConfig(name="cap0", seed=5, capacity_blocks=256, max_running=6)
    async with fleet_and_relay([cfg], pools=_capped(CAP)) as (engines, relay, _):
        await wait_subscribed(relay, 1)
        pool = relay.pools[0]
        most = 0
        for _ in range(30):
            await engines[0].step(1)
            most = max(most, *(len(v) for v in ground_truth(engines).values()))
            if pool.counters.member_resets.get("block_cap"):
                break
        assert most > CAP, "the engine never held more than the cap: nothing was tested"
        await eventually(lambda: pool.counters.member_resets.get("block_cap", 0) >= 1,
                         what="a block_cap reset")  # fmt: skip
        truth, view = ground_truth(engines), relay_view(relay)
        for key, hashes in view.items():
            assert hashes <= truth[key], "a reset member holds only what its engine holds"
        gen = pool.generation
        assert gen is not None
        assert all(gen.pool.member_blocks(mid) <= CAP + 64 for mid in gen.pool.members())


async def test_under_the_cap_the_pool_stays_exact() -> None:
    cfg = SimConfig(name="cap1", seed=5, capacity_blocks=16, max_running=2)
    async with fleet_and_relay([replace(cfg)], pools=_capped(CAP)) as (engines, relay, _):
        await wait_subscribed(relay, 1)
        for _ in range(20):
            await engines[0].step(1)
        await eventually(lambda: in_sync(engines, relay), what="in sync")
        assert relay.pools[0].counters.member_resets.get("block_cap", 0) == 0
