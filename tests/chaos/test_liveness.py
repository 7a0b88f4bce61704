"""Chaos, discovery side: the data plane decides whether a pool lives.

Control outages, older Control services, dead workers, identity changes and disagreements, and
bad engine metadata, each injected into a live relay over the simulator; the filter is compared
with the ground truth and the fault must show in a metric.
"""

from __future__ import annotations

import asyncio
import dataclasses

import zmq

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.settings import PoolSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import engine_spec, fleet_and_relay, ground_truth
from tests.support.rig import (
    catalog_pool_count,
    eventually,
    readiness_state,
    readiness_until,
    rig,
    subscribe,
    verify,
    wait_live,
)

READY = pb.ServingReadinessState.READY


async def test_control_outage_keeps_a_live_pool_exact() -> None:
    cfg = SimConfig(name="l0", seed=51, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        eng = r.engines[0]
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await eng.step(8)
        await verify(r, consumer, probes=2_000)
        assert aliases(r) == ["sim-model-alias"]
        revision = r.relay.catalog.revision
        await eng.stop_control()  # Control gone, ZMQ streams fine
        await eventually(lambda: not r.pool.engines[eng_name(r)].reachable, what="probe fails")
        await asyncio.sleep(3 * 0.6)  # well past the engine-down grace
        await eng.step(8)
        await verify(r, consumer, probes=2_000)
        assert consumer.end is None and r.pool.generation is not None
        # the deployment's aliases did not change: routers that resolve a request by an alias
        # still find the pool (they lost it while Control was down), and the catalog is not
        # republished for nothing
        assert aliases(r) == ["sim-model-alias"] and r.relay.catalog.revision == revision
        assert r.pool.counters.engines_down == 0
        assert r.metric("kvrelay_engine_reachable", worker="l0") == 0
        await eng.start_control()
        await eventually(lambda: r.pool.engines[eng_name(r)].reachable, what="probe back")
        await eng.step(3)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()


def aliases(r: object) -> list[str]:
    """The registrations' aliases of the pool's catalog entry, as routers read them."""
    (d,) = r.relay._catalog_set  # type: ignore[attr-defined]
    return [a for reg in d.registrations for a in reg.aliases]


def eng_name(r: object) -> str:
    (name,) = r.pool.engines  # type: ignore[attr-defined]
    return str(name)


async def test_pool_materializes_against_a_control_without_optional_rpcs() -> None:
    cfg = SimConfig(
        name="l1", seed=52, capacity_blocks=128,
        unimplemented_rpcs=("ListLoras", "IsSleeping", "IsPaused"),
    )  # fmt: skip
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(6)
        await verify(r, consumer, probes=2_000)
        for rpc in ("loras", "paused", "sleeping"):
            assert r.metric("kvrelay_engine_control_unknown", worker="l1", rpc=rpc) == 1
        state = readiness_state(await readiness_until(ch, lambda u: readiness_state(u) == READY))
        assert state == READY
        await consumer.stop()


async def test_dead_worker_is_cleared_while_others_keep_the_pool() -> None:
    """Its two DP ranks' members are cleared: two resets counted, each logged (one count per
    engine undercounted a DP engine, and nothing was logged)."""
    import structlog

    cfgs = [SimConfig(name="l2a", seed=53, capacity_blocks=128, dp_size=2),
            SimConfig(name="l2b", seed=54, capacity_blocks=128)]  # fmt: skip
    async with rig(cfgs) as r, r.channel() as ch:
        a, b = r.engines
        await wait_live(r.relay, 3)
        consumer = await subscribe(r, ch)
        await a.step(8)
        await b.step(8)
        await verify(r, consumer, probes=2_000)
        with structlog.testing.capture_logs() as logs:
            await a.stop()  # the worker dies: Control and ZMQ both go silent
            r.engines.remove(a)
            await eventually(lambda: r.pool.counters.engines_down == 1,
                             what="engine declared down")  # fmt: skip
            # (its members are reset by a task the declaration schedules)
            await eventually(lambda: r.pool.counters.member_resets.get("engine_down", 0) >= 2,
                             what="both members reset")  # fmt: skip
        await b.step(4)
        # nothing of the dead worker's blocks stays in the filter; the pool never left
        await verify(r, consumer, probes=2_000)
        assert consumer.end is None
        assert r.pool.counters.member_resets.get("engine_down") == 2
        resets = [(e["engine"], e["dp_rank"]) for e in logs
                  if e["event"] == "member_reset" and e["reason"] == "engine_down"]  # fmt: skip
        assert sorted(resets) == [("l2a", 0), ("l2a", 1)], logs
        assert r.metric("kvrelay_pool_engines_down_total") == 1
        assert r.metric("kvrelay_engine_down", worker="l2a") == 1
        await consumer.stop()


async def test_block_size_change_rematerializes_the_pool() -> None:
    cfg = SimConfig(name="l3", seed=55, capacity_blocks=128)
    async with rig([cfg]) as r, r.channel() as ch:
        old = r.engines[0]
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await old.step(5)
        await verify(r, consumer, probes=2_000)
        grpc_port = old.grpc_port
        await old.stop()
        new = SimEngine(dataclasses.replace(old.cfg, block_size=32, grpc_port=grpc_port))
        await new.start()
        r.engines[0] = new
        end = await consumer.wait_end()
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        await eventually(
            lambda: r.pool.identity is not None and r.pool.identity.block_size == 32
            and r.pool.generation is not None,
            what="new generation with block size 32",
        )
        await wait_live(r.relay, 1)
        again = await subscribe(r, ch)
        assert again.producer.layout_generation > consumer.producer.layout_generation
        await new.step(5)
        await verify(r, again, probes=2_000)
        await again.stop()


async def test_engines_that_disagree_are_never_merged() -> None:
    cfgs = [SimConfig(name="l4a", seed=56, block_size=16),
            SimConfig(name="l4b", seed=57, block_size=32)]  # fmt: skip
    async with rig(cfgs) as r, r.channel() as ch:
        await eventually(lambda: r.pool.conflict is not None, what="conflict seen")
        assert "kv_block_size" in str(r.pool.conflict)
        assert r.pool.generation is None and await catalog_pool_count(ch) == 0
        assert r.metric("kvrelay_pool_identity_conflicts_total") == 1
        b = r.engines.pop()
        await b.stop()  # the odd one out leaves: the pool can be one filter again
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await r.engines[0].step(5)
        await verify(r, consumer, probes=2_000)
        await consumer.stop()


async def test_an_engine_off_the_pinned_block_size_is_skipped_and_counted_once() -> None:
    cfgs = [SimConfig(name="bs16", seed=58, block_size=16),
            SimConfig(name="bs32", seed=59, block_size=32)]  # fmt: skip
    async with rig(cfgs, kv_block_size=16) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        await eventually(lambda: r.metric("kvrelay_pool_block_size_conflicts_total") == 1,
                         what="the block size conflict counted")
        await asyncio.sleep(0.6)  # several more discovery passes (interval 0.1 s): counted once
        assert r.metric("kvrelay_pool_block_size_conflicts_total") == 1
        (good,) = [st for st in r.pool.engines.values() if st.spec.name == "bs16"]
        assert {k.worker_id for k in r.pool.subscribers} == {good.worker_id}
        consumer = await subscribe(r, ch)
        await r.engines[0].step(5)
        await verify(r, consumer, probes=2_000, truth=ground_truth(r.engines[:1]))
        await consumer.stop()


async def test_readiness_liveness_comes_from_control_not_from_kv_events() -> None:
    """An ENCODE worker publishes no KV events: it has no pool, yet it is live for readiness."""
    cfg = SimConfig(name="enc", seed=58, kv_events=False, served_model_name="mm-model")

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (e,) = engines
        return (
            PoolSpec(namespace="ns", component="encoder", endpoint="encode",
                     engines=(engine_spec(e),), role=pb.WorkerRole.ENCODE),
        )  # fmt: skip

    async with fleet_and_relay([cfg], pools=pools) as (_engines, relay, _server):
        def entry() -> pb.TopologyEntry | None:
            msg = relay.readiness.current()[1]
            return next((e for e in msg.entries if e.canonical_model_id == "mm-model"), None)

        await eventually(lambda: entry() is not None and entry().state == READY, what="ready")
        e = entry()
        assert e is not None and pb.WorkerRole.ENCODE in e.present_roles
        assert all(m.pool_id is None for m in e.members)  # no KV events: no pool
        assert relay.pools[0].generation is None


async def test_bad_metadata_drops_one_endpoint_never_the_plane() -> None:
    """One engine serves a name with surrounding whitespace: its pool and endpoint are left out
    (counted); another pool keeps updating, and a fence on it is still rebuilt."""
    good = SimConfig(name="ok", seed=59, capacity_blocks=128)
    bad = SimConfig(name="bad", seed=60, capacity_blocks=128, served_model_name=" spaced ")

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        g, b = engines
        return (
            PoolSpec(namespace="ns", component="backend", endpoint="generate",
                     engines=(engine_spec(g),)),
            PoolSpec(namespace="ns", component="other", endpoint="generate",
                     engines=(engine_spec(b),)),
        )  # fmt: skip

    async with fleet_and_relay([good, bad], pools=pools) as (engines, relay, _server):
        await eventually(lambda: relay.metadata_errors > 0, what="bad metadata counted")
        await eventually(lambda: len(relay.catalog.current()[1].snapshot.pools) == 1,
                         what="only the good pool in the catalog")  # fmt: skip
        await eventually(
            lambda: any(e.state == READY for e in relay.readiness.current()[1].entries),
            what="the good model ready",
        )
        assert ("catalog", "descriptor.text") in relay.metadata_rejections or any(
            plane == "catalog" for plane, _rule in relay.metadata_rejections
        )
        gen = relay.pools[0].generation
        assert gen is not None
        relay.pools[0].fence(gen, "injected")  # refreshing the planes must not stop the rebuild
        await eventually(
            lambda: relay.pools[0].generation is not None
            and relay.pools[0].generation.layout_generation > gen.layout_generation,
            what="fenced pool rebuilt",
        )
        rev = relay.catalog.revision
        await engines[0].step(3)
        await eventually(lambda: relay.catalog.revision >= rev, what="catalog still updating")


async def test_a_publisher_reported_on_the_unspecified_address_is_logged_once() -> None:
    """vLLM binds its publisher only for an endpoint with ``*`` or ``::``: one configured
    ``tcp://0.0.0.0:N`` connects instead of listening, its source stays silent, and nothing
    said why. The relay logs the endpoint the engine reports, once (the simulator binds
    anyway, so its stream still flows here)."""
    import socket

    import structlog

    for attempt in range(5):  # a port found free may be taken before the engine binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = SimConfig(name="zero", seed=61, bind_host="0.0.0.0", pub_port=port)
        engine = SimEngine(cfg)
        try:
            await engine.start()
            break
        except zmq.ZMQError:
            await engine.stop()
            if attempt == 4:
                raise
    with structlog.testing.capture_logs() as logs:
        async with rig([cfg], engines_started=[engine]) as r:
            await wait_live(r.relay, 1)
            await asyncio.sleep(0.4)  # more discovery passes (interval 0.1 s): logged once
    said = [e for e in logs if e["event"] == "engine_publisher_not_listening"]
    assert [(e["engine"], e["endpoint"]) for e in said] == [("zero", f"tcp://0.0.0.0:{port}")]
