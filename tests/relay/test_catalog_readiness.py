"""Catalog and readiness follow the fleet: LoRA load/unload, withdrawal, re-materialization with a
new generation (stale subscribers get PRODUCER_CHANGED), and P/D readiness through sleep/wake.

Both are read over gRPC from a real relay fed by simulated engines' Control services.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpclib.const
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, StaticSourceConfig
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import MARKER, engine_spec, eventually, fleet_and_relay, wait_subscribed

State = pb.ServingReadinessState
Role = pb.WorkerRole


def catalog_pools(relay: Relay) -> list[pb.KvPoolDescriptor]:
    _rev, update = relay.catalog.current()
    assert update.snapshot is not None
    return list(update.snapshot.pools)


def registrations(desc: pb.KvPoolDescriptor) -> dict[str, str]:
    """canonical id → "base" or "lora:<base>"."""
    out = {}
    for r in desc.registrations:
        assert r.target is not None
        if r.target.lora is not None:
            out[r.canonical_model_id] = f"lora:{r.target.lora.base_model}"
        else:
            out[r.canonical_model_id] = "base"
    return out


async def subscribe_status(
    port: int, producer: pb.ProducerIdentity
) -> tuple[grpclib.const.Status | None, str | None]:
    """Open SubscribeKvPool and return (status, reason trailer) once the stream ends."""
    async with Channel("127.0.0.1", port) as channel:
        async with channel.request(
            "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool",
            grpclib.const.Cardinality.UNARY_STREAM,
            pb.SubscribeKvPoolRequest,
            pb.FilterUpdate,
        ) as stream:
            await stream.send_message(
                pb.SubscribeKvPoolRequest(
                    subscriber_id="stale", expected_producer=producer, contract_marker=MARKER
                ),
                end=True,
            )
            try:
                await stream.recv_initial_metadata()
                while await stream.recv_message() is not None:
                    pass
            except grpclib.exceptions.GRPCError as exc:
                trailers = dict(stream.trailing_metadata or {})
                return exc.status, str(trailers.get("kv-relay-error-reason"))
            return None, None


async def test_lora_load_unload_republishes_the_same_generation() -> None:
    async with fleet_and_relay([SimConfig(name="l0", seed=3)]) as (engines, relay, _server):
        (eng,) = engines
        await wait_subscribed(relay, 1)
        await eventually(lambda: len(catalog_pools(relay)) == 1, what="pool in catalog")
        (before,) = catalog_pools(relay)
        rev0 = relay.catalog.current()[0]
        assert registrations(before) == {"sim-model": "base"}
        eng.load_lora("sql-adapter")
        await eventually(
            lambda: "sql-adapter" in registrations(catalog_pools(relay)[0]), what="lora listed"
        )
        (with_lora,) = catalog_pools(relay)
        assert registrations(with_lora) == {"sim-model": "base", "sql-adapter": "lora:sim-model"}
        assert relay.catalog.current()[0] > rev0
        # registration changes keep the producer identity: no CKF restart for consumers
        assert bytes(with_lora.producer) == bytes(before.producer)
        eng.unload_lora("sql-adapter")
        await eventually(
            lambda: registrations(catalog_pools(relay)[0]) == {"sim-model": "base"},
            what="lora withdrawn",
        )


async def test_what_control_says_of_the_model_is_followed_without_another_change() -> None:
    """Aliases, the served name and the model source an engine's Control reports change with no
    other change (no LoRA, no incarnation, no source moved): the relay stored an engine's answer
    only on such events, so the catalog kept the old names (a router resolving the new name
    found no pool) until some later event applied them all at once."""
    async with fleet_and_relay([SimConfig(name="m0", seed=5)]) as (engines, relay, _server):
        (eng,) = engines
        await wait_subscribed(relay, 1)
        await eventually(lambda: len(catalog_pools(relay)) == 1, what="pool in catalog")
        (before,) = catalog_pools(relay)
        eng.cfg = dataclasses.replace(eng.cfg, aliases=("sim-alias",))
        await eventually(lambda: any("sim-alias" in r.aliases
                                     for r in catalog_pools(relay)[0].registrations),
                         what="alias listed")  # fmt: skip
        (aliased,) = catalog_pools(relay)
        assert bytes(aliased.producer) == bytes(before.producer)  # names only: same filter
        eng.cfg = dataclasses.replace(eng.cfg, served_model_name="sim-renamed",
                                      model_id="org/other-weights")  # fmt: skip
        await eventually(lambda: registrations(catalog_pools(relay)[0]) == {"sim-renamed": "base"}
                         if catalog_pools(relay) else False, what="renamed")  # fmt: skip


async def test_withdrawal_and_rematerialization_change_the_generation() -> None:
    async with fleet_and_relay([SimConfig(name="w0", seed=4)]) as (engines, relay, server):
        (eng,) = engines
        await wait_subscribed(relay, 1)
        await eng.step(5)
        await eventually(lambda: len(catalog_pools(relay)) == 1, what="pool in catalog")
        (first,) = catalog_pools(relay)
        assert first.producer is not None
        # only the KvPoolId part tells PRODUCER_CHANGED (same pool) from POOL_NOT_FOUND
        for field, want in (
            ("ckf_format.seed", (grpclib.const.Status.FAILED_PRECONDITION, "PRODUCER_CHANGED")),
            ("pool_id.dc_id", (grpclib.const.Status.NOT_FOUND, "POOL_NOT_FOUND")),
        ):
            other = pb.ProducerIdentity.parse(bytes(first.producer))
            part, name = field.split(".")
            setattr(getattr(other, part), name, getattr(getattr(other, part), name) ^ 1)
            status, reason = await subscribe_status(server.port, other)
            assert (status, reason) == (want[0], f"RELAY_ERROR_REASON_{want[1]}"), field
        grpc_port = eng.grpc_port
        await eng.stop()
        await eventually(lambda: catalog_pools(relay) == [], what="pool withdrawn")
        status, reason = await subscribe_status(server.port, first.producer)
        assert status == grpclib.const.Status.NOT_FOUND
        assert reason == "RELAY_ERROR_REASON_POOL_NOT_FOUND"

        # Only the control port is pinned: the relay learns the event endpoints from it. Pinning
        # the old ephemeral publisher ports too raced other loopback connections for them.
        again = SimEngine(dataclasses.replace(eng.cfg, grpc_port=grpc_port))
        await again.start()
        try:
            await eventually(lambda: len(catalog_pools(relay)) == 1, what="re-materialized")
            (second,) = catalog_pools(relay)
            assert second.producer is not None
            assert second.producer.layout_generation > first.producer.layout_generation
            assert second.producer.pool_id == first.producer.pool_id
            status, reason = await subscribe_status(server.port, first.producer)
            assert status == grpclib.const.Status.FAILED_PRECONDITION
            assert reason == "RELAY_ERROR_REASON_PRODUCER_CHANGED"
        finally:
            await again.stop()


def _pd_pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
    prefill, decode = engines
    return (
        PoolSpec(
            namespace="ns", component="prefill", endpoint="generate",
            engines=(engine_spec(prefill),), role=Role.PREFILL, expected_blocks=1024,
        ),
        PoolSpec(
            namespace="ns", component="decode", endpoint="generate",
            engines=(engine_spec(decode),), role=Role.DECODE,
            needs=(frozenset({Role.PREFILL}),), expected_blocks=1024,
        ),
    )


def entry(relay: Relay) -> pb.TopologyEntry | None:
    _rev, update = relay.readiness.current()
    for e in update.entries:
        if e.namespace == "ns" and e.canonical_model_id == "sim-model":
            return e
    return None


def state_is(relay: Relay, state: pb.ServingReadinessState) -> bool:
    e = entry(relay)
    return e is not None and e.state == state


async def test_prefill_decode_readiness_follows_sleep_and_wake() -> None:
    configs = [SimConfig(name="p0", seed=5), SimConfig(name="d0", seed=6)]
    async with fleet_and_relay(configs, pools=_pd_pools) as (engines, relay, server):
        prefill, decode = engines
        await wait_subscribed(relay, 2)
        await eventually(lambda: state_is(relay, State.READY), what="P/D ready")
        e = entry(relay)
        assert e is not None
        assert sorted(e.present_roles) == [Role.PREFILL, Role.DECODE]
        assert len(e.members) == 2 and all(m.pool_id is not None for m in e.members)
        assert len(catalog_pools(relay)) == 2

        prefill.sleep()
        await eventually(lambda: state_is(relay, State.UNAVAILABLE), what="prefill asleep")
        e = entry(relay)
        assert e is not None and list(e.missing_roles) == [Role.PREFILL]
        assert len(catalog_pools(relay)) == 2  # both pools stay published

        # the same answer over gRPC, with the readiness revision moving forward
        async with Channel("127.0.0.1", server.port) as channel:
            stub = pb.KvEventRelayStub(channel)
            async for upd in stub.subscribe_serving_readiness(
                pb.SubscribeServingReadinessRequest(subscriber_id="r", contract_marker=MARKER)
            ):
                (got,) = [x for x in upd.entries if x.canonical_model_id == "sim-model"]
                assert got.state == State.UNAVAILABLE
                break

        prefill.wake()
        decode.load_lora("ad-1")
        await eventually(lambda: state_is(relay, State.READY), what="ready after wake")

        def adapter_missing_prefill() -> bool:
            e = entry(relay)
            if e is None or not e.adapters:
                return False
            (ad,) = e.adapters
            return (
                ad.canonical_model_id == "ad-1"
                and ad.state == State.UNAVAILABLE
                and list(ad.missing_roles) == [Role.PREFILL]
            )

        await eventually(adapter_missing_prefill, what="adapter lacks prefill membership")
        prefill.load_lora("ad-1")

        def adapter_ready() -> bool:
            e = entry(relay)
            return e is not None and len(e.adapters) == 1 and e.adapters[0].state == State.READY

        await eventually(adapter_ready, what="adapter ready on both roles")


async def test_an_adapter_only_an_engine_asleep_carries_is_not_ready() -> None:
    """One pool of two engines; only the second has the adapter. Asleep (or paused), it cannot
    serve it, and the pool's other engine lacks it: the adapter is listed UNAVAILABLE, missing
    its role. It was READY: the pool was live (its first engine) and carried the adapter (any
    reachable engine's). Awake again, it is READY."""
    configs = [SimConfig(name="a0", seed=7), SimConfig(name="a1", seed=8)]
    async with fleet_and_relay(configs) as (engines, relay, _server):
        await wait_subscribed(relay, 2)
        engines[1].load_lora("ad-1")

        def adapter(state: pb.ServingReadinessState, missing: list[int]) -> bool:
            e = entry(relay)
            return e is not None and e.state == State.READY and [
                (a.canonical_model_id, a.state, list(a.missing_roles)) for a in e.adapters
            ] == [("ad-1", state, missing)]

        await eventually(lambda: adapter(State.READY, []), what="adapter ready")
        engines[1].sleep()
        await eventually(lambda: adapter(State.UNAVAILABLE, [Role.AGGREGATED]),
                         what="its only carrier asleep")  # fmt: skip
        engines[1].wake()
        await eventually(lambda: adapter(State.READY, []), what="awake again")
        engines[1].pause()
        await eventually(lambda: adapter(State.UNAVAILABLE, [Role.AGGREGATED]),
                         what="its only carrier paused")  # fmt: skip


async def test_adapters_a_pool_declares_are_registered_for_engines_without_control() -> None:
    """An SGLang engine (or any static publisher) salts its LoRA blocks by adapter name but has
    no ``vllm.Control`` to list its adapters: the catalog registered the base model only, so a
    router's lookup for an adapter found no pool, every adapter prefix uncached. The pool's
    ``lora_adapters`` registers them (a registration change: the same generation) and they are
    READY while an engine of the pool serves; a reload that changes them is followed."""

    def static_pool(adapters: tuple[str, ...]) -> Callable[[list[SimEngine]], tuple[PoolSpec, ...]]:
        def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
            pub = engines[0].publishers[0]
            return (PoolSpec(
                namespace="ns", component="backend", endpoint="generate", expected_blocks=8192,
                model="sim-model", kv_block_size=16, lora_adapters=adapters,
                engines=(EngineSpec(name="s0", static=StaticSourceConfig(
                    endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)),),
            ),)  # fmt: skip

        return pools

    configs = [SimConfig(name="s0", seed=9, grpc_port=None, metrics_port=None, replay_port=0)]
    async with fleet_and_relay(configs, pools=static_pool(("ad-1", "ad-2"))) as (
        _engines, relay, _server,
    ):
        await wait_subscribed(relay, 1)
        await eventually(lambda: len(catalog_pools(relay)) == 1, what="pool in catalog")
        (desc,) = catalog_pools(relay)
        assert registrations(desc) == {
            "sim-model": "base", "ad-1": "lora:sim-model", "ad-2": "lora:sim-model"}
        await eventually(lambda: state_is(relay, State.READY), what="ready")
        e = entry(relay)
        assert e is not None
        assert [(a.canonical_model_id, a.state) for a in e.adapters] == [
            ("ad-1", State.READY), ("ad-2", State.READY)]
        pool = relay.settings.pools[0]
        await relay.reconfigure(dataclasses.replace(
            relay.settings, pools=(dataclasses.replace(pool, lora_adapters=("ad-3",)),)))
        await eventually(lambda: registrations(catalog_pools(relay)[0]) == {
            "sim-model": "base", "ad-3": "lora:sim-model"}, what="the reload followed")
        assert bytes(catalog_pools(relay)[0].producer) == bytes(desc.producer)


async def test_an_unchanged_fleet_recomputes_no_plane() -> None:
    """A pool hands out the same descriptor object while nothing in it changed, and
    ``refresh_planes`` then leaves both planes alone (at 64 pools their recompute took ~28 ms per
    event); any change still reaches them."""
    async with fleet_and_relay([SimConfig(name="u0", seed=5)]) as (engines, relay, _server):
        (eng,) = engines
        await wait_subscribed(relay, 1)
        await eventually(lambda: len(catalog_pools(relay)) == 1, what="pool in catalog")
        (pool,) = relay.pools
        assert pool.descriptor() is pool.descriptor()
        calls: list[str] = []
        set_pools, set_topology = relay.catalog.set_pools, relay.readiness.set_topology
        relay.catalog.set_pools = lambda d: calls.append("catalog") or set_pools(d)  # type: ignore[method-assign]
        relay.readiness.set_topology = lambda e: calls.append("readiness") or set_topology(e)  # type: ignore[method-assign]
        relay.refresh_planes()
        relay.refresh_planes()
        rev, ready = relay.catalog.current()[0], relay.readiness.current()[0]
        relay.refresh_planes()
        assert (relay.catalog.current()[0], relay.readiness.current()[0]) == (rev, ready)
        assert calls.count("catalog") <= 1 and calls.count("readiness") <= 1  # first: catch-up
        calls.clear()
        before = pool.descriptor()
        eng.load_lora("sql-adapter")
        await eventually(
            lambda: "sql-adapter" in registrations(catalog_pools(relay)[0]), what="lora listed"
        )
        assert pool.descriptor() is not before and "catalog" in calls
        assert relay.catalog.current()[0] > rev
        calls.clear()
        ready = relay.readiness.current()[0]
        eng.sleep()  # not serving: its endpoint's live count changes
        await eventually(lambda: relay.readiness.current()[0] > ready, what="readiness follows")
        assert "readiness" in calls
