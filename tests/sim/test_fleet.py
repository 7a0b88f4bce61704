"""SimFleet wiring and the background run mode."""

from __future__ import annotations

import asyncio

from kvrelay.sim import SimConfig, SimEngine, SimFleet, TrafficConfig

TRAFFIC = TrafficConfig(system_len=(32, 64), user_len=(4, 16), max_prompt_tokens=128)


async def test_fleet_engines_are_distinct_but_share_prompt_pool() -> None:
    base = SimConfig(dp_size=2, capacity_blocks=256, traffic=TRAFFIC, metrics_port=None)
    async with SimFleet.uniform(3, base) as fleet:
        assert await fleet.step(30) > 0
        names = [e.cfg.name for e in fleet.engines]
        assert names == ["engine-0", "engine-1", "engine-2"]
        assert len({e.instance_id for e in fleet.engines}) == 3
        eps = {p.endpoint for e in fleet.engines for p in e.publishers}
        assert len(eps) == 6
        truths = [e.ground_truth(r) for e in fleet.engines for r in range(2)]
        assert all(truths)
        # same seed => same system prompts => shared prefixes across engines and ranks
        assert set.intersection(*truths)
        # but traffic streams differ per (engine, rank)
        assert len({frozenset(t) for t in truths}) == 6


async def test_background_run_steps_until_stopped() -> None:
    eng = SimEngine(SimConfig(grpc_port=None, metrics_port=None, traffic=TRAFFIC))
    await eng.start()
    try:
        eng.run(rate=200.0)
        await asyncio.sleep(0.25)
        await eng.stop_running()
        steps = eng.steps
        assert steps > 5
        await asyncio.sleep(0.05)
        assert eng.steps == steps
        task = eng.run(rate=500.0, duration=0.05)
        await asyncio.wait_for(task, timeout=2)
        assert eng.steps > steps
    finally:
        await eng.stop()
