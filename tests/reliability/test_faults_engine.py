"""Fault matrix, engine side: restarts, lost messages, no replay, slow joiners, Control flapping,
sleep/pause. Each test ends with ``verify``: nothing lost, nothing phantom, bounded, serving."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.sim.config import SimConfig
from kvrelay.sim.control import start_control_server, stop_control_server
from kvrelay.sim.engine import SimEngine
from tests.support.rig import (
    Consumer,
    Rig,
    eventually,
    in_sync,
    member_resets,
    readiness_state,
    readiness_until,
    relay_view,
    rig,
    stored_after,
    subscribe,
    verify,
    wait_live,
)
from tests.support.simwire_reader import send_probe
from tests.support.timing import scaled

READY = pb.ServingReadinessState.READY
UNAVAILABLE = pb.ServingReadinessState.UNAVAILABLE


async def spread_steps(engines: list[SimEngine], n: int, pause: float = 0.005) -> None:
    """Steps spread in time, as a scheduler emits them."""
    for _ in range(n):
        for e in engines:
            await e.step(1)
        await asyncio.sleep(pause)


def published(e: SimEngine) -> int:
    return sum(p.stats.published for p in e.publishers)


async def step_until(e: SimEngine, done: Callable[[], bool], max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if done():
            return
        await e.step(1)
        await asyncio.sleep(0.002)
    raise AssertionError(f"engine {e.cfg.name}: condition not reached in {max_steps} steps")


async def step_until_published(e: SimEngine, n: int) -> None:
    """Step until ``n`` more batches went out live (a gap is only seen at the next message)."""
    target = published(e) + n
    await step_until(e, lambda: published(e) >= target)


async def step_until_fresh(e: SimEngine, hole_held: set[int], want: int = 8) -> None:
    """Step until ``want`` held blocks have a chain stored entirely after the hole."""
    await step_until_published(e, 4)
    await step_until(e, lambda: len(stored_after(e, 0, hole_held)) >= want)


@pytest.mark.parametrize("rebind", [True, False], ids=["new-ports", "same-ports"])
async def test_engine_restart_mid_stream(rebind: bool) -> None:
    """The restart may reach the relay first as a backwards sequence on the ZMQ stream, as new
    event-source endpoints, or as a new ``instance_id`` in discovery, in any order. Whichever
    comes last must not wipe state that the new incarnation's replay already rebuilt: exact
    before discovery has seen the new incarnation, and still exact after."""
    cfg = SimConfig(name="r0", seed=11, dp_size=2, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        (eng,) = r.engines
        await wait_live(r.relay, 2)
        await spread_steps(r.engines, 10)
        consumer = await subscribe(r, ch)
        await spread_steps(r.engines, 5)
        await eventually_synced(r)
        before = r.pool.counters.member_resets.get("incarnation", 0)
        await eng.restart(rebind=rebind)  # new instance_id, seq back to 0, cache empty
        await spread_steps(r.engines, 12)
        await verify(r, consumer)
        # discovery polls every 0.1 s: wait until it has reported the new instance_id too
        await eventually(
            lambda: r.pool.counters.member_resets.get("incarnation", 0) > before,
            what="incarnation change counted",
        )
        await asyncio.sleep(0.3)  # a few more discovery polls
        await spread_steps(r.engines, 3)
        await verify(r, consumer)
        assert r.metric("kvrelay_pool_member_resets_total", reason="incarnation") >= 1
        assert consumer.end is None, "a restart must not end consumer streams"
        await consumer.stop()


async def eventually_synced(r: Rig) -> None:
    await eventually(lambda: in_sync(r.engines, r.relay), what="relay state = ground truth")


async def test_gap_filled_from_replay_history() -> None:
    cfg = SimConfig(name="g0", seed=12, dp_size=1, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        (eng,) = r.engines
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await spread_steps(r.engines, 8)
        await eventually_synced(r)
        resets = member_resets(r.relay)
        sub = next(iter(r.pool.subscribers.values()))
        gaps = sub.counters.gaps
        eng.drop_next(3, keep_in_replay=True)
        await step_until_published(eng, 3)
        await verify(r, consumer)
        assert sub.counters.gaps > gaps and sub.counters.replayed_messages >= 3
        assert member_resets(r.relay) == resets, "a replayable gap must not reset the member"
        w = {"worker": "g0", "dp_rank": "0"}
        assert r.metric("kvrelay_ingest_gaps_total", **w) >= 1
        assert r.metric("kvrelay_ingest_replayed_messages_total", **w) >= 3
        await consumer.stop()


async def _subset_after_loss(r: Rig, consumer: Consumer, hole_held: set[int]) -> None:
    """History gone: only chains stored entirely after the hole are guaranteed; never phantom."""
    (eng,) = r.engines
    must = stored_after(eng, 0, hole_held)
    assert must, "nothing was stored after the hole: the test proves nothing"
    await verify(r, consumer, exact=False, must_have=must)


async def test_gap_with_history_gone_is_subset_never_phantom() -> None:
    cfg = SimConfig(name="h0", seed=13, dp_size=1, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        (eng,) = r.engines
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await spread_steps(r.engines, 8)
        await eventually_synced(r)
        resets = r.pool.counters.member_resets.get("gap_unrecoverable", 0)
        eng.drop_next(3, keep_in_replay=False)
        lost = eng.publishers[0].stats.lost
        await step_until(eng, lambda: eng.publishers[0].stats.lost >= lost + 3)  # the lost three
        hole_held = set(eng.held_blocks(0))
        await step_until_fresh(eng, hole_held)
        await eventually(
            lambda: r.pool.counters.member_resets.get("gap_unrecoverable", 0) > resets,
            what="member reset after an unrecoverable gap",
        )
        await _subset_after_loss(r, consumer, hole_held)
        assert r.metric("kvrelay_pool_member_resets_total", reason="gap_unrecoverable") >= 1
        assert relay_view(r.relay)[("h0", 0)] <= eng.ground_truth(0)
        await consumer.stop()


async def _until_heard(r: Rig, eng: SimEngine) -> None:
    """Until the relay's subscription has reached ``eng``'s PUB. Without a replay, what the
    engine publishes before that is lost for good (ZeroMQ's slow joiner; the relay counts it as
    missing history): probes (frames the relay rejects, counted only) until one is counted."""
    sub = next(iter(r.pool.subscribers.values()))
    pub = eng.publishers[0]

    async def probe() -> bool:
        await send_probe(pub)
        await asyncio.sleep(0.02)
        return bool(sum(sub.counters.rejections.values()))

    for _ in range(int(scaled(10) / 0.02)):
        if await probe():
            return
    raise AssertionError("the relay's subscription never reached the engine")


async def test_replay_endpoint_down_resets_on_gap() -> None:
    cfg = SimConfig(name="n0", seed=14, dp_size=1, capacity_blocks=64, replay_port=None)
    async with rig([cfg]) as r, r.channel() as ch:
        (eng,) = r.engines
        await wait_live(r.relay, 1)
        await _until_heard(r, eng)
        consumer = await subscribe(r, ch)
        await spread_steps(r.engines, 8)
        await eventually_synced(r)
        sub = next(iter(r.pool.subscribers.values()))
        assert sub.counters.replays == 0 and sub.counters.missing_history == 0
        eng.drop_next(2, keep_in_replay=True)  # replayable in principle, but nobody serves it
        dropped = eng.publishers[0].stats.dropped_live
        await step_until(eng, lambda: eng.publishers[0].stats.dropped_live >= dropped + 2)
        hole_held = set(eng.held_blocks(0))
        await step_until_fresh(eng, hole_held)
        await eventually(
            lambda: r.pool.counters.member_resets.get("gap_no_replay", 0) >= 1,
            what="gap_no_replay reset",
        )
        assert sub.counters.replays == 0 and sub.counters.gaps >= 1
        assert r.metric("kvrelay_pool_member_resets_total", reason="gap_no_replay") >= 1
        await _subset_after_loss(r, consumer, hole_held)
        await consumer.stop()


async def test_late_joining_subscriber_recovers_by_replay_from_zero() -> None:
    """Everything published before the relay's SUB connected is recovered through replay."""
    cfg = SimConfig(name="l0", seed=15, dp_size=2, capacity_blocks=96)
    eng = SimEngine(cfg)
    await eng.start()
    await eng.step(25)  # nobody subscribed yet: PUB drops all of this
    assert all(eng.ground_truth(rk) for rk in range(2))
    async with rig([cfg], engines_started=[eng]) as r, r.channel() as ch:
        await wait_live(r.relay, 2)
        await eventually_synced(r)
        consumer = await subscribe(r, ch)
        subs = list(r.pool.subscribers.values())
        assert all(s.counters.replayed_messages > 0 for s in subs)
        assert member_resets(r.relay) == 0
        replayed = sum(
            r.metric("kvrelay_ingest_replayed_messages_total", worker="l0", dp_rank=str(k))
            for k in range(2)
        )
        assert replayed >= 2
        await spread_steps(r.engines, 5)
        await verify(r, consumer)
        await consumer.stop()


async def test_control_flapping_keeps_serving_from_the_stream() -> None:
    cfgs = [
        SimConfig(name="f0", seed=16, dp_size=1, capacity_blocks=64),
        SimConfig(name="f1", seed=17, dp_size=1, capacity_blocks=64),
    ]
    async with rig(cfgs) as r, r.channel() as ch:
        flap = r.engines[1]
        await wait_live(r.relay, 2)
        consumer = await subscribe(r, ch)
        await readiness_until(ch, lambda u: readiness_state(u) == READY)
        assert _live(r) == 2
        generations = r.pool.counters.generations
        port = flap.grpc_port
        for _ in range(2):  # two flaps
            await stop_control_server(flap._grpc)
            flap._grpc = None
            await eventually(
                lambda: not r.pool.engines[f"127.0.0.1:{port}"].reachable, what="probe fails"
            )
            assert r.metric("kvrelay_engine_reachable", worker="f1") == 0
            await spread_steps(r.engines, 6)  # the ZMQ stream keeps flowing
            await eventually_synced(r)
            await eventually(lambda: _live(r) == 1, what="flapping engine not live")
            upd = await readiness_until(ch, lambda u: readiness_state(u) is not None)
            assert readiness_state(upd) == READY  # the other engine still serves
            assert r.pool.generation is not None
            flap.cfg = dataclasses.replace(flap.cfg, grpc_port=port)
            flap._grpc, bound = await start_control_server(flap)
            assert bound == port
            await eventually(lambda: _live(r) == 2, what="flapping engine live again")
        assert r.pool.counters.generations == generations, "flapping must not re-materialize"
        assert r.metric("kvrelay_pool_generations_total") == 1
        assert r.metric("kvrelay_engine_reachable", worker="f1") == 1
        assert member_resets(r.relay) == 0
        await spread_steps(r.engines, 4)
        await verify(r, consumer)
        assert consumer.end is None
        await consumer.stop()


def _live(r: Rig) -> int:
    """Engines the relay counts live for readiness (Control reachable, serving, stream active)."""
    state = r.pool.endpoint_state()
    return 0 if state is None else int(state.live)


async def test_sleep_pause_wake_readiness() -> None:
    cfg = SimConfig(name="s0", seed=18, dp_size=1, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        (eng,) = r.engines
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await spread_steps(r.engines, 8)
        await readiness_until(ch, lambda u: readiness_state(u) == READY)
        sub = next(iter(r.pool.subscribers.values()))
        eng.sleep()  # level-1 sleep: AllBlocksCleared, then nothing scheduled
        await readiness_until(ch, lambda u: readiness_state(u) == UNAVAILABLE)
        await verify(r, consumer)
        assert eng.ground_truth(0) == set() and sub.counters.events_by_kind["cleared"] >= 1
        cleared = {"worker": "s0", "dp_rank": "0", "kind": "cleared"}
        assert r.metric("kvrelay_ingest_events_total", **cleared) >= 1
        eng.wake()
        await readiness_until(ch, lambda u: readiness_state(u) == READY)
        await spread_steps(r.engines, 6)
        eng.pause()
        await readiness_until(ch, lambda u: readiness_state(u) == UNAVAILABLE)
        await verify(r, consumer)  # pause keeps the cache: state still exact
        assert eng.ground_truth(0)
        eng.resume()
        await readiness_until(ch, lambda u: readiness_state(u) == READY)
        await spread_steps(r.engines, 4)
        await verify(r, consumer)
        assert consumer.end is None
        await consumer.stop()
