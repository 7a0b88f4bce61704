"""A fence and a reconcile that was already waiting for the pool's lock.

A fence retires the generation and schedules its rebuild (stop the subscribers, start fresh ones
that replay from the start). A reconcile queued on the lock before the rebuild (a discovery
result, an engine-down probe, a connected member's first batch) ran first: it built the next
generation and kept the old subscribers feeding it, and their replacements then replayed every
batch onto that generation again. Stores counted twice stay in the filter after the engine's
one eviction: phantoms. Real engine simulator, ZMQ and replay; the oracle is the engines' own
ground truth.
"""

from __future__ import annotations

import asyncio

from kvrelay.relay.relay import Relay
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually, ground_truth, relay_view
from tests.support.rig import make_settings


def _live(r: Relay) -> bool:
    p = r.pools[0]
    return p.generation is not None and len(p.subscribers) == 2 and all(
        s.state == "live" for s in p.subscribers.values()
    )


def _off(r: Relay, e: SimEngine) -> tuple[int, int]:
    """(phantom, missing) blocks over every member."""
    truth, view = ground_truth([e]), relay_view(r)
    phantom = sum(len(view.get(k, set()) - truth[k]) for k in truth)
    missing = sum(len(truth[k] - view.get(k, set())) for k in truth)
    return phantom, missing


async def test_a_reconcile_waiting_for_the_lock_at_a_fence_counts_nothing_twice() -> None:
    e = SimEngine(SimConfig(name="fi0", seed=11, dp_size=2, capacity_blocks=512,
                            buffer_steps=200))  # fmt: skip
    await e.start()
    r = Relay(make_settings([e], expected_blocks=16_384))
    await r.start()
    try:
        await eventually(lambda: _live(r), what="live")
        for _ in range(5):
            await e.step(8)
        await eventually(lambda: _off(r, e) == (0, 0), what="exact")
        p = r.pools[0]
        old = dict(p.subscribers)
        async with p._reconcile_lock:  # a reconcile queues behind whoever holds the lock
            waiting = asyncio.ensure_future(p.reconcile())
            await asyncio.sleep(0)
            assert p.generation is not None
            p.fence(p.generation, "injected")
        await waiting  # it ran before the fence's rebuild
        assert p.generation is not None
        assert not set(old.values()) & set(p.subscribers.values()), "an old subscriber feeds it"
        for _ in range(4):
            await e.step(8)
        await eventually(lambda: _live(r) and _off(r, e) == (0, 0), what="rebuilt, exact")
        for _ in range(30):  # evictions: a store counted twice would stay in the filter
            await e.step(8)
        await eventually(lambda: _off(r, e) == (0, 0), what="exact after evictions")
        assert all(s.state == "stopped" for s in old.values())
    finally:
        await r.stop()
        await e.stop()
