"""Chaos, exact state: an error raised on any path that mutates a member fences the generation,
the pool is rebuilt exact from replay, and a fault that keeps coming back is rebuilt with backoff
instead of looping generations and catalog revisions."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvrelay.pool.pool import Pool
from kvrelay.publication.hub import PublicationHub
from kvrelay.sim.config import SimConfig
from tests.support.rig import eventually, rig, subscribe, verify, wait_live


async def test_apply_raising_fences_and_rebuilds_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SimConfig(name="f0", seed=61, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(6)
        await verify(r, consumer, probes=2_000)
        real = Pool.apply

        def broken(self: Pool, member: int, batch: Any) -> Any:
            monkeypatch.setattr(Pool, "apply", real)
            raise MemoryError("injected")

        monkeypatch.setattr(Pool, "apply", broken)
        await r.engines[0].step(3)
        end = await consumer.wait_end()
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert "fenced" in (end.message or "")
        await wait_live(r.relay, 1)
        again = await subscribe(r, ch)
        assert again.producer.layout_generation > consumer.producer.layout_generation
        await r.engines[0].step(3)
        await verify(r, again, probes=2_000)
        assert r.pool.counters.fences == 1
        assert r.metric("kvrelay_pool_fences_total") == 1
        await again.stop()


async def test_publishing_raising_fences_at_once_and_rebuilds_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hub raising something other than an invariant while it publishes (an encoder or
    fan-out bug; here an allocation failure) fences the generation at once: its streams end
    ``PUBLICATION_UNAVAILABLE`` naming the fault, and the pool is rebuilt exact. The error used
    to escape the cut (a loop callback's log line, nothing counted): the hub stayed a delta
    behind the pool, still sending heartbeats, until a later publication found the gap."""
    cfg = SimConfig(name="f4", seed=64, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(6)
        await verify(r, consumer, probes=2_000)
        real = PublicationHub.publish

        def broken(self: PublicationHub, *args: Any) -> None:
            monkeypatch.setattr(PublicationHub, "publish", real)
            raise MemoryError("injected")

        monkeypatch.setattr(PublicationHub, "publish", broken)
        await r.engines[0].step(1)  # one publication, and none after it
        end = await consumer.wait_end(timeout=5.0)
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert "publishing raised MemoryError: injected" in (end.message or "")
        assert r.pool.counters.fences == 1
        await wait_live(r.relay, 1)
        again = await subscribe(r, ch)
        assert again.producer.layout_generation > consumer.producer.layout_generation
        await r.engines[0].step(3)
        await verify(r, again, probes=2_000)
        await again.stop()


async def test_reset_raising_fences(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reset path (here: discovery sees a new engine incarnation and clears the engine's
    members) fences on error, and the rebuild from the new incarnation's replay is exact."""
    cfg = SimConfig(name="f1", seed=62, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(6)
        real = Pool.reset_member

        def broken(self: Pool, member: int) -> None:
            monkeypatch.setattr(Pool, "reset_member", real)
            raise RuntimeError("injected")

        monkeypatch.setattr(Pool, "reset_member", broken)
        await r.engines[0].restart(rebind=False)  # new instance id: discovery restarts members
        await r.engines[0].step(2)
        end = await consumer.wait_end()
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        await eventually(lambda: r.pool.counters.fences == 1, what="fence counted")
        await wait_live(r.relay, 1)
        again = await subscribe(r, ch)
        await r.engines[0].step(3)
        await verify(r, again, probes=2_000)
        await again.stop()


async def test_a_fault_that_keeps_coming_back_is_rebuilt_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = SimConfig(name="f2", seed=63, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        real = Pool.apply

        def always(self: Pool, member: int, batch: Any) -> Any:
            raise RuntimeError("injected, deterministic")

        monkeypatch.setattr(Pool, "apply", always)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            await r.engines[0].step(1)
            await asyncio.sleep(0.05)
        fences = r.pool.counters.fences
        # without backoff every batch would fence (dozens); with it: 0.5 s, 1 s, 2 s, … pauses
        assert 2 <= fences <= 6, fences
        assert r.pool.counters.rebuild_backoffs >= 1
        assert r.metric("kvrelay_pool_rebuild_backoffs_total") >= 1
        generations = r.pool.counters.generations
        assert generations <= fences + 1
        monkeypatch.setattr(Pool, "apply", real)  # the fault goes away: the pool recovers
        await eventually(lambda: r.pool.generation is not None, timeout=40, what="rebuilt")
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(3)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()
