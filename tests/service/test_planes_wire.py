"""Every message the planes emit, parsed by official protobuf: field numbers and encodings."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import betterproto2

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.catalog import CatalogPlane, LoraSpec, descriptor
from kvrelay.publication.load import LoadPlane, RankLoad
from kvrelay.publication.readiness import EndpointState, ReadinessPlane

Role = pb.WorkerRole
MARKER = 0x4B565231
U64 = (1 << 64) - 1


def _roundtrip(msg: betterproto2.Message, official_cls: Any) -> Any:
    """Official parse of our bytes; its canonical re-encoding must be byte-identical."""
    ours = bytes(msg)
    theirs = official_cls()
    theirs.ParseFromString(ours)
    # Dropping unknown fields (recursively) changes nothing: every field we emit is declared.
    theirs.DiscardUnknownFields()
    assert theirs.SerializeToString(deterministic=True) == ours
    assert type(msg).parse(theirs.SerializeToString()) == msg
    return theirs


def _envelope(o: Any, relay: pb.RelayIdentity) -> None:
    assert o.protocol_version == 1
    assert o.contract_marker == MARKER
    assert o.relay.drt_instance_id == relay.drt_instance_id
    assert o.relay.relay_incarnation == relay.relay_incarnation


def test_catalog_update_wire(
    official_pb2: dict[str, ModuleType],
    relay: pb.RelayIdentity,
    producer: Callable[..., pb.ProducerIdentity],
) -> None:
    R = official_pb2["relay"]
    plane = CatalogPlane(relay)
    o = _roundtrip(plane.current()[1], R.KvPoolCatalogUpdate)
    _envelope(o, relay)
    assert o.revision == 0 and o.HasField("snapshot") and len(o.snapshot.pools) == 0

    d = descriptor(
        producer=producer(4, generation=7),
        namespace="prod",
        component="vllm",
        endpoint="generate",
        base_model="meta/llama",
        base_aliases=["llama"],
        loras=[LoraSpec("sql-lora", adapter="sql", aliases=["sql2"])],
        kv_block_size=512,
        hash_format=pb.KvQueryHashFormat.DYNAMO_EAGLE_V1,
        roles=[Role.DECODE, Role.PREFILL],
    )
    plane.set_pools([d])
    o = _roundtrip(plane.current()[1], R.KvPoolCatalogUpdate)
    _envelope(o, relay)
    assert o.revision == 1
    (pool,) = o.snapshot.pools
    p = pool.producer
    assert p.layout_generation == 7
    assert p.producer_incarnation == relay.relay_incarnation
    assert p.pool_id.identity_version == 1 and p.pool_id.dc_id == 0x4F0A_1234_5678_9ABC
    cs = p.pool_id.indexer_domain.cache_semantics
    assert cs.digest == bytes([4]) * 16 and cs.source == R.IDENTITY_SOURCE_DEFAULT_DERIVED
    assert p.pool_id.indexer_domain.routing_scope.source == R.IDENTITY_SOURCE_EXPLICIT
    f = p.ckf_format
    assert (f.format_version, f.seed, f.bucket_count, f.fingerprint_bits, f.slots_per_bucket) == (
        1,
        0x5DEECE66D1B54A33,
        524_288,
        16,
        4,
    )
    ep = pool.serving_endpoint
    assert (ep.namespace, ep.component, ep.endpoint) == ("prod", "vllm", "generate")
    base, lora = pool.registrations
    assert base.canonical_model_id == "meta/llama" and list(base.aliases) == ["llama"]
    assert base.target.WhichOneof("target") == "base"
    assert base.target.base.base_model == "meta/llama"
    assert lora.target.WhichOneof("target") == "lora"
    assert (lora.target.lora.base_model, lora.target.lora.adapter) == ("meta/llama", "sql")
    assert list(lora.aliases) == ["sql2"]
    assert pool.query_semantics.kv_block_size == 512
    assert pool.query_semantics.hash_format == R.KV_QUERY_HASH_FORMAT_DYNAMO_EAGLE_V1
    assert list(pool.pool_roles) == [R.WORKER_ROLE_PREFILL, R.WORKER_ROLE_DECODE]


def test_readiness_update_wire(
    official_pb2: dict[str, ModuleType],
    relay: pb.RelayIdentity,
    pool_id: Callable[[int], pb.KvPoolId],
) -> None:
    R = official_pb2["relay"]
    plane = ReadinessPlane(relay)
    o = _roundtrip(plane.current()[1], R.ServingReadinessUpdate)
    _envelope(o, relay)
    assert o.revision == 0 and len(o.entries) == 0

    def es(comp: str, roles: set[pb.WorkerRole], live: int, **kw: Any) -> EndpointState:
        kw.setdefault("probed", True)
        return EndpointState(
            "ns", comp, "gen", frozenset(roles), live=live, models=frozenset({"m"}), **kw
        )

    plane.set_topology(
        [
            es("pre1", {Role.PREFILL}, 0, pool_id=pool_id(1)),
            es("pre2", {Role.PREFILL}, 0),
            es(
                "dec",
                {Role.DECODE},
                2,
                needs=(frozenset({Role.PREFILL}),),
                adapters={"sql": "m"},
                pool_id=pool_id(2),
            ),
            es("old", set(), 1),
        ]
    )
    o = _roundtrip(plane.current()[1], R.ServingReadinessUpdate)
    _envelope(o, relay)
    assert o.revision == 1
    (e,) = o.entries
    assert (e.namespace, e.canonical_model_id) == ("ns", "m")
    assert e.state == R.SERVING_READINESS_STATE_READY  # legacy fallback
    assert e.legacy_fallback_active is True
    assert list(e.present_roles) == [R.WORKER_ROLE_DECODE]
    assert list(e.missing_roles) == []
    assert list(e.duplicate_role_endpoints) == [R.WORKER_ROLE_PREFILL]
    members = {m.endpoint.component: m for m in e.members}
    assert list(members) == ["dec", "old", "pre1", "pre2"]
    assert members["dec"].HasField("pool_id") and members["dec"].pool_id.dc_id == pool_id(2).dc_id
    assert not members["pre2"].HasField("pool_id")  # proto3 optional: absent, not default
    assert list(members["old"].roles) == [R.WORKER_ROLE_LEGACY]
    assert members["pre1"].endpoint.namespace == "ns" and members["pre1"].endpoint.endpoint == "gen"
    (a,) = e.adapters
    assert a.canonical_model_id == "sql"
    assert a.state == R.SERVING_READINESS_STATE_UNAVAILABLE  # the live legacy endpoint lacks it
    assert list(a.missing_roles) == [R.WORKER_ROLE_LEGACY]

    # UNKNOWN is the zero value: still a complete, parseable entry
    plane.set_topology([es("x", {Role.AGGREGATED}, 1, probed=False)])
    o = _roundtrip(plane.current()[1], R.ServingReadinessUpdate)
    assert o.entries[0].state == R.SERVING_READINESS_STATE_UNKNOWN and o.revision == 2


def test_load_update_wire(
    official_pb2: dict[str, ModuleType],
    relay: pb.RelayIdentity,
    producer: Callable[..., pb.ProducerIdentity],
) -> None:
    R = official_pb2["relay"]
    plane = LoadPlane(
        relay,
        window_ms=750,
        provider=lambda: [
            (producer(1), [RankLoad(U64, U64), RankLoad(3, 9)]),
            (producer(2), [RankLoad(None, None), RankLoad(5, 6)]),
        ],
    )
    for seq in (0, 1):
        if seq:
            plane.publish_window()
        o = _roundtrip(plane.current()[1], R.KvPoolLoadUpdate)
        _envelope(o, relay)
        assert o.window_sequence == seq and o.window_ms == 750 and o.observed_ms > 1.7e12
        by_gen = {p.producer.pool_id.indexer_domain.cache_semantics.digest[0]: p for p in o.pools}
        one, two = by_gen[1], by_gen[2]
        assert (one.kv_used_blocks, one.total_kv_blocks) == (U64, U64)
        assert (one.kv_observed_ranks, one.kv_expected_ranks) == (2, 2)
        assert (two.kv_used_blocks, two.total_kv_blocks) == (5, 0)
        assert (two.kv_observed_ranks, two.kv_expected_ranks) == (1, 2)
        assert two.producer.layout_generation == 1
