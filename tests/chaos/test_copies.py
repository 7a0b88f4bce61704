"""Duplicate stores end to end: simulated vLLM engines that hold several physical blocks under one
hash (fully cached block-aligned prompts sent again, n > 1 siblings, EAGLE dropping the last hit
block) and re-announce hits (report mode), through real ZMQ into a relay: after every step the
relay holds exactly what each engine holds, no block missing, no phantom."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.ops.metrics import RelayMetrics
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import PoolSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.traffic import TrafficConfig
from tests.support.fleet import (
    engine_spec,
    eventually,
    fleet_and_relay,
    ground_truth,
    in_sync,
    relay_view,
    wait_subscribed,
)

BS = 4
TRAFFIC = TrafficConfig(
    n_system_prompts=3,
    system_len=(2 * BS, 6 * BS),  # every prompt has 2+ blocks
    user_len=(0, 2 * BS),
    max_new_tokens=(1, 2 * BS),
    arrivals_per_step=2.0,
    multi_turn_fraction=0.3,
    lora_fraction=0.0,
    salt_fraction=0.0,
    repeat_fraction=0.35,
    parallel_fraction=0.25,
    parallel_n=3,
    max_prompt_tokens=12 * BS,
)
BASE = SimConfig(
    name="dup0", seed=11, dp_size=2, block_size=BS, capacity_blocks=40, max_running=6,
    traffic=TRAFFIC,
)  # fmt: skip


def _pool_stats(relay: Relay) -> tuple[int, int, int]:
    """The pool's counters, checked against what the metrics page says."""
    gen = relay.pools[0].generation
    assert gen is not None
    p = gen.pool
    out = (p.duplicate_stores, p.copy_removals, p.ambiguous_stores)
    reg = RelayMetrics(relay).registry
    names = ("duplicate_stores", "copy_removals", "ambiguous_stores")
    scraped = tuple(
        reg.get_sample_value(f"kvrelay_pool_{n}_total", {"pool": "ns/backend/generate"})
        for n in names
    )
    assert scraped == tuple(float(v) for v in out)
    return out


def _copies_held(engines: list[SimEngine]) -> int:
    return sum(
        1
        for e in engines
        for r in range(e.cfg.dp_size)
        for ids in e.schedulers[r].blocks.by_hash.values()
        if len(ids) > 1
    )


async def _run_exact(engines: list[SimEngine], relay: Relay, steps: int) -> int:
    """Step the engines; after each step the relay must equal them. Returns how many steps
    ended with some hash held in two or more physical blocks."""
    await wait_subscribed(relay, sum(e.cfg.dp_size for e in engines))
    with_copies = 0
    for step in range(steps):
        for e in engines:
            await e.step(1)
        await eventually(lambda: in_sync(engines, relay), what=f"in sync after step {step}")
        with_copies += _copies_held(engines) > 0
    return with_copies


@pytest.mark.parametrize("spec_eagle", [False, True])
async def test_physical_copies_are_counted_exactly(spec_eagle: bool) -> None:
    cfg = replace(BASE, spec_eagle=spec_eagle)
    async with fleet_and_relay([cfg]) as (engines, relay, _):
        with_copies = await _run_exact(engines, relay, 60)
        dups, copy_removals, ambiguous = _pool_stats(relay)
        assert with_copies > 0 and dups > 0 and copy_removals > 0  # the paths ran
        assert ambiguous == 0  # without reports nothing is ambiguous
        assert relay_view(relay) == ground_truth(engines)


async def test_reports_are_not_counted_as_copies() -> None:
    """Report mode: every cache hit is re-announced from block 0; the pool says reports are
    possible, takes each such store as a report (counted as ambiguous) and stays exact."""
    cfg = replace(BASE, name="rep0", report_reused=True)

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        return (
            PoolSpec(
                namespace="ns", component="backend", endpoint="generate",
                engines=tuple(engine_spec(e) for e in engines), expected_blocks=8192,
                engine_reports=True,
            ),
        )  # fmt: skip

    async with fleet_and_relay([cfg], pools=pools) as (engines, relay, _):
        with_copies = await _run_exact(engines, relay, 60)
        dups, copy_removals, ambiguous = _pool_stats(relay)
        assert with_copies > 0 and dups > 0 and copy_removals > 0 and ambiguous > 0
