"""Chaos, ingest side: faults injected into a live relay's event sources.

Each test runs the simulated fleet → relay → gRPC consumer replica, injects one fault, and then
requires the filter to equal the simulator's ground truth (nothing missing, nothing phantom) — or,
where the fault destroys information, a subset of it that holds every block stored since — and
the fault to show in a metric.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.relay.settings import EngineSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.rig import (
    eventually,
    member_resets,
    rig,
    stored_after,
    subscribe,
    verify,
    wait_live,
)

POOL = "ns/backend/generate"


def _only_sub(r: Any) -> Subscriber:
    (sub,) = r.pool.subscribers.values()
    assert isinstance(sub, Subscriber)
    return sub


async def test_subscriber_crash_resets_counts_restarts_and_repairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of two sources crashes: its member is reset at once (the pool stays up on the other
    source), the crash is counted, and the restarted source rebuilds its member from replay."""
    cfgs = [SimConfig(name="c0", seed=41, capacity_blocks=128),
            SimConfig(name="c0b", seed=47, capacity_blocks=128)]  # fmt: skip
    async with rig(cfgs) as r, r.channel() as ch:
        await wait_live(r.relay, 2)
        consumer = await subscribe(r, ch)
        for e in r.engines:
            await e.step(10)
        await verify(r, consumer, probes=2_000)
        before = set(r.pool.subscribers.values())
        real = Decoder.decode

        def buggy(self: Decoder, payload: bytes, **kw: Any) -> Any:  # an unexpected ingest error
            monkeypatch.setattr(Decoder, "decode", real)
            raise RuntimeError("injected decoder bug")

        monkeypatch.setattr(Decoder, "decode", buggy)
        await r.engines[0].step(5)
        await eventually(lambda: r.pool.counters.source_failures == 1, what="crash counted")
        crashed = [s for s in before if s.state == "failed"]
        assert len(crashed) == 1 and crashed[0] not in r.pool.subscribers.values()
        await eventually(
            lambda: len(r.pool.subscribers) == 2
            and all(s.state == "live" for s in r.pool.subscribers.values()),
            what="source restarted",
        )
        for e in r.engines:
            await e.step(5)
        await verify(r, consumer, probes=2_000)  # rebuilt from replay: exact again
        assert consumer.end is None  # the pool never left the catalog
        assert r.pool.counters.member_resets.get("source_failed") == 1
        assert r.metric("kvrelay_pool_source_failures_total") == 1
        await consumer.stop()


async def test_crash_of_the_only_source_withdraws_then_rebuilds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = SimConfig(name="c5", seed=48, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(8)
        await verify(r, consumer, probes=2_000)
        real = Decoder.decode

        def buggy(self: Decoder, payload: bytes, **kw: Any) -> Any:
            monkeypatch.setattr(Decoder, "decode", real)
            raise RuntimeError("injected decoder bug")

        monkeypatch.setattr(Decoder, "decode", buggy)
        await r.engines[0].step(3)
        end = await consumer.wait_end()  # no active source left: withdrawn, never stale
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        await wait_live(r.relay, 1)
        again = await subscribe(r, ch)
        await r.engines[0].step(4)
        await verify(r, again, probes=2_000)
        assert again.producer.layout_generation > consumer.producer.layout_generation
        await again.stop()


async def test_subscriber_that_fails_to_start_is_retried_with_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = Subscriber.start
    failures = {"left": 2}

    async def flaky(self: Subscriber) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("injected: cannot open the socket")
        await real(self)

    monkeypatch.setattr(Subscriber, "start", flaky)
    cfg = SimConfig(name="c1", seed=42, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await eventually(lambda: r.pool.counters.source_failures == 2, what="two start failures")
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(8)
        await verify(r, consumer, probes=2_000)
        assert r.metric("kvrelay_pool_source_failures_total") == 2
        await consumer.stop()


async def test_corrupted_live_batch_is_repaired_from_replay() -> None:
    cfg = SimConfig(name="c2", seed=43, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        sub = _only_sub(r)
        for i in range(2):
            await r.engines[0].step(6)
            r.engines[0].corrupt_next(1, replay_good=True)  # garbled in transit, fine in replay
            await r.engines[0].step(6)
            await eventually(lambda n=i + 1: sub.counters.repairs == n, what="bad batch repaired")
        await verify(r, consumer, probes=2_000)  # nothing lost: exact
        assert sub.counters.bad_batches == 2 and sub.counters.resets == 0
        assert member_resets(r.relay) == 0
        m = {"worker": "c2", "dp_rank": "0"}
        assert r.metric("kvrelay_ingest_repairs_total", **m) == 2
        assert r.metric("kvrelay_ingest_bad_batches_total", **m) == 2
        await consumer.stop()


async def test_batch_bad_in_the_replay_too_resets_the_member() -> None:
    cfg = SimConfig(name="c3", seed=44, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        eng = r.engines[0]
        await eng.step(6)
        await verify(r, consumer, probes=2_000)
        eng.corrupt_next(1, replay_good=False)  # the engine itself emitted garbage
        await eng.step(1)
        sub = _only_sub(r)
        await eventually(lambda: sub.counters.bad_batches >= 2, what="bad twice (live, replay)")
        before = set(eng.held_blocks(0))
        await eng.step(6)
        await eventually(lambda: sub.counters.resets == 1, what="member reset")
        assert sub.counters.resets_by_reason == {"bad_batch": 1} and sub.counters.repairs == 0
        await verify(
            r, consumer, exact=False, must_have=stored_after(eng, 0, before), probes=2_000
        )
        assert r.metric("kvrelay_ingest_member_resets_total", reason="bad_batch", worker="c3",
                        dp_rank="0") == 1  # fmt: skip
        await consumer.stop()


def _static_spec(eng: SimEngine) -> EngineSpec:
    from kvrelay.discovery.endpoints import StaticSourceConfig

    pub = eng.publishers[0]
    return EngineSpec(
        name=eng.cfg.name,
        static=StaticSourceConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint),
    )


@pytest.mark.parametrize("replay", [True, False])
async def test_static_engine_restart_with_missed_first_batches(replay: bool) -> None:
    """A pre-0.27 engine (no instance id) restarts on the same ports and publishes its new
    incarnation's first batches before the relay's SUB has reconnected: the relay must not apply
    the new incarnation on top of the old state (it sees a reconnect and cannot vouch for it)."""
    eng = SimEngine(
        SimConfig(
            name="st0", seed=45, capacity_blocks=96, grpc_port=None, metrics_port=None,
            replay_port=0 if replay else None,
        )
    )  # fmt: skip
    await eng.start()
    # pin the ports the restart must reuse (the sim rebinds the configured ones)
    import dataclasses

    pub = eng.publishers[0]
    port = int(pub.endpoint.rsplit(":", 1)[1])
    rport = int(pub.replay_endpoint.rsplit(":", 1)[1]) if replay else None
    eng.cfg = dataclasses.replace(eng.cfg, pub_port=port, replay_port=rport, bind_host="127.0.0.1")
    static = (_static_spec(eng),)
    async with rig(
        [], engines_started=[], static=static, model="sim-model", kv_block_size=16
    ) as r, r.channel() as ch:
        r.engines.append(eng)  # stopped by the rig
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        for _ in range(30):
            await eng.step(1)
        sub = _only_sub(r)
        await eventually(lambda: sub.counters.batches >= 10, what="old incarnation applied")
        await verify(r, consumer, truth={("st0", 0): eng.ground_truth(0)}, probes=2_000)
        await eng.restart()  # same ports, seq 0, empty cache
        for _ in range(45):  # most of these go out before the SUB reconnects
            await eng.step(1)
        await eventually(lambda: sub.counters.reconnects >= 1, what="reconnect seen")
        for _ in range(5):
            await eng.step(1)
            await asyncio.sleep(0.02)
        truth = {("st0", 0): eng.ground_truth(0)}
        if replay:  # rebuilt from the new incarnation's replay at 0: exact
            await verify(r, consumer, truth=truth, probes=2_000)
            assert sub.counters.incarnations_detected >= 1
        else:  # reset on reconnect: nothing of the old incarnation survives
            await verify(r, consumer, exact=False, truth=truth, probes=2_000)
            assert sub.counters.resets_by_reason.get("reconnect", 0) >= 1
        assert r.metric("kvrelay_ingest_reconnects_total", worker="st0", dp_rank="0") >= 1
        await consumer.stop()


async def test_control_engine_restart_on_same_ports_with_missed_batches() -> None:
    cfg = SimConfig(name="c4", seed=46, capacity_blocks=96)
    async with rig([cfg]) as r, r.channel() as ch:
        eng = r.engines[0]
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await eng.step(20)
        await verify(r, consumer, probes=2_000)
        await eng.restart(rebind=False)  # new instance id, seq 0, same sockets
        await eng.step(40)
        await asyncio.sleep(0.3)  # discovery sees the new instance id meanwhile
        await eng.step(3)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()


def _reachable(r: Any) -> Callable[[], bool]:
    return lambda: all(st.reachable for st in r.pool.engines.values())
