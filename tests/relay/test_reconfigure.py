"""Reload: the plan (what changes how) and ``Relay.reconfigure`` live, over real sockets.

Routers must see no re-snapshot where nothing they read changed: an unchanged pool, and a pool
whose engines come and go, keep their generation and sequence, and the subscriber's replica goes
on from deltas. A filter setting that changed re-materializes the pool; a removed pool ends its
streams with a status.
"""

from __future__ import annotations

import dataclasses

import grpclib.const

from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.relay.reconfigure import plan_reload
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually, ground_truth
from tests.support.rig import (
    Consumer,
    catalog_pool_count,
    catalog_producer,
    relay_info,
    rig,
    subscribe,
    verify,
    wait_live,
)


def _engine(name: str, port: int = 1) -> EngineSpec:
    return EngineSpec(name=name, grpc_port=port)


def _pool(endpoint: str, *engines: EngineSpec, **kw: object) -> PoolSpec:
    return PoolSpec(namespace="ns", component="backend", endpoint=endpoint, engines=engines,
                    **kw)  # type: ignore[arg-type]


def _settings(*pools: PoolSpec, **kw: object) -> RelaySettings:
    return RelaySettings(dc_name="dc", pools=pools, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the plan


def test_an_identical_configuration_changes_nothing() -> None:
    s = _settings(_pool("a", _engine("e0")), _pool("b", _engine("e1", 2)))
    plan = plan_reload(s, s)
    assert plan.empty and plan.unchanged == ("ns/backend/a", "ns/backend/b")
    assert plan.restart_required == () and plan.settings == s


def test_engines_added_removed_and_redefined_keep_the_generation() -> None:
    old = _settings(_pool("a", _engine("e0"), _engine("e1", 2), _engine("e2", 3)))
    new = _settings(_pool("a", _engine("e0"), _engine("e2", 9), _engine("e3", 4)))
    (change,) = plan_reload(old, new).changed
    assert not change.rematerialize
    assert sorted(change.engines_removed) == ["e1", "e2"]  # e2 redefined: removed, then re-added
    assert sorted(e.name for e in change.engines_added) == ["e2", "e3"]


def test_filter_settings_rematerialize_and_readiness_settings_do_not() -> None:
    base = _pool("a", _engine("e0"))
    for field, value in (("expected_blocks", 4096), ("ckf_seed", 7), ("hash_format", 2),
                         ("engine_reports", True)):
        new = dataclasses.replace(base, **{field: value})  # type: ignore[arg-type]
        (change,) = plan_reload(_settings(base), _settings(new)).changed
        assert change.rematerialize, field
    new = dataclasses.replace(base, role=2)  # type: ignore[arg-type]
    (change,) = plan_reload(_settings(base), _settings(new)).changed
    assert not change.rematerialize


def test_dns_templates_retire_and_pools_come_and_go() -> None:
    tmpl = EngineSpec(name="pods", dns="vllm.svc", grpc_port=50051)
    old = _settings(_pool("a", _engine("e0"), tmpl), _pool("gone", _engine("e9", 9)))
    new = _settings(
        _pool("a", _engine("e0"), dataclasses.replace(tmpl, grpc_port=50052)),
        _pool("new", _engine("e9", 9)),  # an engine may move to another pool
    )
    plan = plan_reload(old, new)
    assert plan.removed == ("ns/backend/gone",)
    assert [p.endpoint for p in plan.added] == ["new"]
    (change,) = plan.changed
    assert change.templates_retired == ("pods",)
    assert change.engines_removed == () and change.engines_added == ()


def test_identity_and_limits_wait_for_a_restart() -> None:
    from kvrelay.contract.limits import RelayLimits

    old = _settings(_pool("a", _engine("e0")))
    new = RelaySettings(
        dc_name="dc-2", pools=old.pools, drt_instance_id=5,
        limits=RelayLimits(max_pool_streams_total=3), discovery_interval_s=1.0,
        zmq_reader="libzmq",
    )  # fmt: skip
    plan = plan_reload(old, new)
    assert sorted(plan.restart_required) == ["relay.dc_name", "relay.drt_instance_id",
                                             "relay.limits", "relay.zmq_reader"]
    assert plan.settings.zmq_reader == "zmtp"
    assert plan.settings.dc_name == "dc" and plan.settings.limits == old.limits
    assert plan.settings.drt_instance_id is None
    assert plan.settings.discovery_interval_s == 1.0  # live settings are taken


# ---------------------------------------------------------------- live


def _spec(e: SimEngine) -> EngineSpec:
    return EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port)


def _truth(*engines: SimEngine) -> dict[tuple[str, int], set[int]]:
    return ground_truth(list(engines))


async def test_membership_changes_keep_the_generation_and_the_stream() -> None:
    extra = SimEngine(SimConfig(name="rc1", seed=82, dp_size=2))
    await extra.start()
    try:
        async with rig([SimConfig(name="rc0", seed=81, dp_size=2)]) as r, r.channel() as ch:
            await wait_live(r.relay, 2)
            (e0,) = r.engines
            await e0.step(6)
            consumer = await subscribe(r, ch)
            await verify(r, consumer, truth=_truth(e0), probes=2_000)
            gen = r.pool.generation
            assert gen is not None
            pool = r.relay.settings.pools[0]

            # an engine joins: same generation, the replica follows by deltas only
            plan = await r.relay.reconfigure(dataclasses.replace(
                r.relay.settings, pools=(dataclasses.replace(
                    pool, engines=(*pool.engines, _spec(extra))),),
            ))  # fmt: skip
            assert [len(c.engines_added) for c in plan.changed] == [1]
            await wait_live(r.relay, 4)
            await extra.step(6)
            await e0.step(3)
            await verify(r, consumer, truth=_truth(e0, extra), probes=2_000)
            assert r.pool.generation is gen and consumer.end is None
            snapshots = consumer.replica.kinds["snapshot"]

            # the first engine leaves: its blocks go, the stream goes on
            await r.relay.reconfigure(dataclasses.replace(
                r.relay.settings, pools=(dataclasses.replace(pool, engines=(_spec(extra),)),),
            ))  # fmt: skip
            await eventually(lambda: len(r.pool.subscribers) == 2, what="e0's sources gone")
            await extra.step(4)
            await verify(r, consumer, truth=_truth(extra), probes=2_000)
            assert r.pool.generation is gen and consumer.end is None
            assert consumer.replica.kinds["snapshot"] == snapshots, "a re-snapshot happened"
            assert r.pool.counters.member_resets.get("engine_removed") == 2
            await consumer.stop()
    finally:
        await extra.stop()


async def test_a_filter_setting_rematerializes_and_ends_the_old_stream_with_a_status() -> None:
    async with rig([SimConfig(name="rm0", seed=83)]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        await r.engines[0].step(5)
        consumer = await subscribe(r, ch)
        old = r.pool.generation
        assert old is not None
        pool = r.relay.settings.pools[0]
        plan = await r.relay.reconfigure(dataclasses.replace(
            r.relay.settings, pools=(dataclasses.replace(pool, expected_blocks=16_384),),
        ))  # fmt: skip
        assert [c.rematerialize for c in plan.changed] == [True]
        end = await consumer.wait_end()
        assert end.status == grpclib.const.Status.UNAVAILABLE
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        await wait_live(r.relay, 1)
        new = r.pool.generation
        assert new is not None and new.layout_generation > old.layout_generation
        assert new.pool.bucket_count > old.pool.bucket_count
        fresh = await subscribe(r, ch)
        await r.engines[0].step(3)
        await verify(r, fresh, probes=2_000)
        assert r.metric("kvrelay_pool_reconfigurations_total") == 1
        await fresh.stop()


async def test_pools_added_and_removed_live() -> None:
    other = SimEngine(SimConfig(name="pa1", seed=85))
    await other.start()
    try:
        async with rig([SimConfig(name="pa0", seed=84)]) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            consumer = await subscribe(r, ch)
            gen = r.pool.generation
            second = _pool("second", _spec(other), expected_blocks=4096)
            await r.relay.reconfigure(dataclasses.replace(
                r.relay.settings, pools=(*r.relay.settings.pools, second)))
            await eventually(lambda: len(r.relay.pools) == 2 and r.relay.pools[1].generation
                             is not None, what="second pool materialized")  # fmt: skip
            assert await catalog_pool_count(ch) == 2
            assert r.pool.generation is gen and consumer.end is None

            # subscribe to the second pool, then remove it: its stream ends with a status
            info = await relay_info(ch)
            assert info.relay is not None
            gen2 = r.relay.pools[1].generation
            assert gen2 is not None
            sub2 = Consumer(ch, gen2.producer, info.relay, "second").start()
            await sub2.first.wait()
            await r.relay.reconfigure(dataclasses.replace(
                r.relay.settings, pools=r.relay.settings.pools[:1]))
            end = await sub2.wait_end()
            assert end.status is not None and end.reason is not None
            assert len(r.relay.pools) == 1 and await catalog_pool_count(ch) == 1
            assert r.pool.generation is gen and consumer.end is None
            assert other.cfg.name not in {st.spec.name for st in r.pool.engines.values()}
            await r.engines[0].step(3)
            await verify(r, consumer, probes=2_000)
            assert bytes(await catalog_producer(ch)) == bytes(gen.producer)  # type: ignore[union-attr]
            await consumer.stop()
    finally:
        await other.stop()


async def test_a_static_engine_redefined_rebuilds_only_its_member() -> None:
    """Another static endpoint for the same engine name: its member is removed and rebuilt; the
    generation goes on."""
    e = SimEngine(SimConfig(name="st0", seed=86, grpc_port=None, metrics_port=None, replay_port=0))
    await e.start()
    spare = SimEngine(SimConfig(name="st0", seed=87, grpc_port=None, metrics_port=None,
                                replay_port=0))  # fmt: skip
    await spare.start()
    try:
        def static(engine: SimEngine) -> EngineSpec:
            pub = engine.publishers[0]
            return EngineSpec(name="st0", static=StaticSourceConfig(
                endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint))

        async with rig([], engines_started=[], static=(static(e),), model="sim-model",
                       kv_block_size=16) as r, r.channel() as ch:  # fmt: skip
            await wait_live(r.relay, 1)
            await e.step(4)
            consumer = await subscribe(r, ch)
            gen = r.pool.generation
            pool = r.relay.settings.pools[0]
            await r.relay.reconfigure(dataclasses.replace(
                r.relay.settings, pools=(dataclasses.replace(pool, engines=(static(spare),)),)))
            await spare.step(4)
            await verify(r, consumer, truth=_truth(spare), probes=2_000)
            assert r.pool.generation is gen and consumer.end is None
            await consumer.stop()
    finally:
        await e.stop()
        await spare.stop()


async def test_a_reload_that_fails_part_way_leaves_settings_that_say_what_runs() -> None:
    """A step that raises half-way through a pool's change (here the filter rebuild, as an
    allocation failure would) drops that pool, its stream ending with a status, and leaves
    ``settings`` saying what runs: the same file reloaded again then adds the pool whole, with
    the engine the failed reload had not yet added, and the pool the failed reload never
    reached. (``settings`` used to take the new file first: the retry planned nothing.)"""
    extra = SimEngine(SimConfig(name="hf1", seed=89))
    other = SimEngine(SimConfig(name="hf2", seed=90))
    await extra.start()
    await other.start()
    try:
        async with rig([SimConfig(name="hf0", seed=88)]) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            (e0,) = r.engines
            await e0.step(4)
            consumer = await subscribe(r, ch)
            pool = r.relay.settings.pools[0]
            target = dataclasses.replace(r.relay.settings, pools=(
                dataclasses.replace(pool, engines=(*pool.engines, _spec(extra)),
                                    expected_blocks=16_384),
                _pool("second", _spec(other), expected_blocks=4096),
            ))  # fmt: skip
            failing = r.pool

            async def no_memory(*_: object, **__: object) -> None:
                raise MemoryError("injected: the new filter could not be allocated")

            failing.respec = no_memory  # type: ignore[method-assign]
            try:
                await r.relay.reconfigure(target)
            except MemoryError:
                pass
            else:
                raise AssertionError("the injected failure did not surface")
            end = await consumer.wait_end()
            assert end.status == grpclib.const.Status.UNAVAILABLE
            assert r.relay.pools == [] and r.relay.settings.pools == ()
            assert await catalog_pool_count(ch) == 0

            plan = await r.relay.reconfigure(target)  # the same file again
            assert [p.endpoint for p in plan.added] == [pool.endpoint, "second"]
            await wait_live(r.relay, 3)
            assert r.relay.settings == target
            again = r.relay.pools[0]
            assert again is not failing and again.spec.expected_blocks == 16_384
            assert {st.spec.name for st in again.engines.values()} == {"hf0", "hf1"}
            await eventually(lambda: all(p.generation is not None for p in r.relay.pools),
                             what="both pools materialized")  # fmt: skip
            assert await catalog_pool_count(ch) == 2
            await extra.step(3)
            info = await relay_info(ch)
            gen = again.generation
            assert info.relay is not None and gen is not None
            fresh = Consumer(ch, gen.producer, info.relay, "fresh").start()
            await fresh.first.wait()
            await verify(r, fresh, truth=_truth(e0, extra), probes=2_000)
            await fresh.stop()
    finally:
        await extra.stop()
        await other.stop()


async def test_a_pool_whose_removal_fails_part_way_still_ends_its_streams_with_a_status() -> None:
    """A reload removes the pool and a step of its removal raises before the pool is closed
    (here: taking its engine off the discovery watcher). The pool leaves the list and the
    catalog as before, and now its stream ends ``PUBLICATION_UNAVAILABLE`` and its sources stop:
    the stream used to stay open on heartbeats, its sources ingesting, for a pool the relay no
    longer listed."""
    async with rig([SimConfig(name="rf0", seed=91)]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        await r.engines[0].step(3)
        consumer = await subscribe(r, ch)
        removed = r.pool

        async def broken(_name: str) -> None:
            raise RuntimeError("injected: the watcher failed")

        r.relay.watcher.remove_target = broken  # type: ignore[method-assign]
        try:
            await r.relay.reconfigure(dataclasses.replace(r.relay.settings, pools=()))
        except RuntimeError:
            pass
        else:
            raise AssertionError("the injected failure did not surface")
        end = await consumer.wait_end(timeout=5.0)
        assert end.status == grpclib.const.Status.UNAVAILABLE
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert r.relay.pools == [] and await catalog_pool_count(ch) == 0
        assert removed.generation is None and not removed.subscribers
