"""CatalogPlane: revision only on change, deterministic snapshots, one test per §3.3 rule."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.wire import U32_MAX
from kvrelay.publication.catalog import (
    CatalogError,
    CatalogPlane,
    LoraSpec,
    descriptor,
    validate_descriptor,
)
from kvrelay.service.canonical import _official, canonicalize
from tests.support.timing import scaled

Role = pb.WorkerRole
STD = pb.KvQueryHashFormat.DYNAMO_STANDARD_V1
MakeProducer = Callable[..., pb.ProducerIdentity]


def _desc(mk: MakeProducer, n: int = 1, **over: Any) -> pb.KvPoolDescriptor:
    kw: dict[str, Any] = dict(
        producer=mk(n),
        namespace="prod",
        component="vllm",
        endpoint=f"generate-{n}",
        base_model="meta/llama",
        kv_block_size=16,
        hash_format=STD,
        roles=[Role.AGGREGATED],
    )
    kw.update(over)
    return descriptor(**kw)


# ---------------------------------------------------------------------------------- builder


def test_descriptor_builder_shape(producer: MakeProducer) -> None:
    d = _desc(
        producer,
        base_aliases=["llama", "meta/llama", "llama", "a-llama"],
        loras=[
            LoraSpec("sql-lora", aliases=["sql", "sql", "sql-lora"]),
            LoraSpec("chat", adapter="chat-v2"),
        ],
        roles=[Role.DECODE, Role.PREFILL],
    )
    assert [r.canonical_model_id for r in d.registrations] == ["meta/llama", "chat", "sql-lora"]
    base, chat, sql = d.registrations
    assert base.aliases == ["a-llama", "llama"]  # sorted, deduped, canonical removed
    assert base.target.base.base_model == "meta/llama" and base.target.lora is None
    assert chat.target.base is None
    assert (chat.target.lora.base_model, chat.target.lora.adapter) == ("meta/llama", "chat-v2")
    assert (sql.target.lora.adapter, sql.aliases) == ("sql-lora", ["sql"])
    assert d.pool_roles == [Role.PREFILL, Role.DECODE]  # sorted
    assert d.query_semantics == pb.KvQuerySemantics(kv_block_size=16, hash_format=STD)
    assert d.serving_endpoint.endpoint == "generate-1"


def test_descriptor_oneof_is_never_doubly_set(producer: MakeProducer) -> None:
    d = _desc(producer, loras=[LoraSpec("x")])
    for reg in d.registrations:
        raw = bytes(reg.target)
        # exactly one top-level field in ModelTarget's encoding: tag 0x0a (base) or 0x12 (lora)
        assert raw[0] in (0x0A, 0x12)
        assert len(raw) == 2 + raw[1]


# ---------------------------------------------------------------------------------- rules
# Each case breaks exactly one rule of §3.3/§4.2 starting from a valid descriptor.

RULES: list[tuple[str, Callable[[pb.KvPoolDescriptor], None], str]] = [
    ("producer missing", lambda d: setattr(d, "producer", None), "producer.invalid"),
    (
        "layout_generation 0",
        lambda d: setattr(d.producer, "layout_generation", 0),
        "producer.invalid",
    ),
    (
        "digest length",
        lambda d: setattr(d.producer.pool_id.indexer_domain.routing_scope, "digest", b"x" * 15),
        "producer.invalid",
    ),
    (
        "bucket count not pow2",
        lambda d: setattr(d.producer.ckf_format, "bucket_count", 3),
        "producer.invalid",
    ),
    ("endpoint missing", lambda d: setattr(d, "serving_endpoint", None), "endpoint.missing"),
    (
        "namespace empty",
        lambda d: setattr(d.serving_endpoint, "namespace", ""),
        "endpoint.namespace",
    ),
    (
        "component whitespace",
        lambda d: setattr(d.serving_endpoint, "component", " vllm"),
        "endpoint.component",
    ),
    (
        "endpoint whitespace",
        lambda d: setattr(d.serving_endpoint, "endpoint", "gen\n"),
        "endpoint.endpoint",
    ),
    ("no registrations", lambda d: setattr(d, "registrations", []), "registration.empty"),
    (
        "model id whitespace",
        lambda d: setattr(d.registrations[0], "canonical_model_id", "llama "),
        "registration.canonical_model_id",
    ),
    (
        "alias empty",
        lambda d: setattr(d.registrations[0], "aliases", [""]),
        "registration.alias",
    ),
    (
        "alias duplicate",
        lambda d: setattr(d.registrations[0], "aliases", ["a", "a"]),
        "registration.alias_duplicate",
    ),
    (
        "alias equals canonical",
        lambda d: setattr(d.registrations[0], "aliases", ["meta/llama"]),
        "registration.alias_is_canonical",
    ),
    (
        "target unset",
        lambda d: setattr(d.registrations[0], "target", pb.ModelTarget()),
        "registration.target_unset",
    ),
    (
        "target both",
        lambda d: setattr(
            d.registrations[0].target,
            "lora",
            pb.LoraModelTarget(base_model="meta/llama", adapter="a"),
        ),
        "registration.target_ambiguous",
    ),
    (
        "duplicate registration",
        lambda d: d.registrations.append(pb.ModelRegistration.parse(bytes(d.registrations[0]))),
        "registration.duplicate",
    ),
    (
        "two base registrations",
        lambda d: d.registrations.append(
            pb.ModelRegistration(
                canonical_model_id="other",
                target=pb.ModelTarget(base=pb.BaseModelTarget(base_model="other")),
            )
        ),
        "registration.base_count",
    ),
    (
        "lora backed by another base",
        lambda d: d.registrations.append(
            pb.ModelRegistration(
                canonical_model_id="l",
                target=pb.ModelTarget(lora=pb.LoraModelTarget(base_model="other", adapter="l")),
            )
        ),
        "registration.lora_base",
    ),
    (
        "lora adapter empty",
        lambda d: d.registrations.append(
            pb.ModelRegistration(
                canonical_model_id="l",
                target=pb.ModelTarget(lora=pb.LoraModelTarget(base_model="meta/llama")),
            )
        ),
        "registration.adapter",
    ),
    ("query missing", lambda d: setattr(d, "query_semantics", None), "query.missing"),
    (
        "block size 0",
        lambda d: setattr(d.query_semantics, "kv_block_size", 0),
        "query.block_size",
    ),
    (
        "hash format unspecified",
        lambda d: setattr(d.query_semantics, "hash_format", pb.KvQueryHashFormat.UNSPECIFIED),
        "query.hash_format",
    ),
    (
        "hash format unknown number",
        lambda d: setattr(d.query_semantics, "hash_format", pb.KvQueryHashFormat(9)),
        "query.hash_format",
    ),
    ("roles empty", lambda d: setattr(d, "pool_roles", []), "roles.empty"),
    (
        "role unspecified",
        lambda d: setattr(d, "pool_roles", [Role.UNSPECIFIED]),
        "roles.invalid",
    ),
    ("role unknown number", lambda d: setattr(d, "pool_roles", [Role(9)]), "roles.invalid"),
    (
        "role duplicate",
        lambda d: setattr(d, "pool_roles", [Role.DECODE, Role.DECODE]),
        "roles.duplicate",
    ),
]


@pytest.mark.parametrize(("name", "breaker", "rule"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_is_enforced(
    producer: MakeProducer,
    name: str,
    breaker: Callable[[pb.KvPoolDescriptor], None],
    rule: str,
) -> None:
    good = _desc(producer)
    validate_descriptor(good)  # the starting point is valid
    bad = pb.KvPoolDescriptor.parse(bytes(good))
    breaker(bad)
    with pytest.raises(CatalogError) as info:
        validate_descriptor(bad)
    assert info.value.rule == rule

    plane = CatalogPlane(pb.RelayIdentity(drt_instance_id=1, relay_incarnation=2))
    plane.set_pools([good])
    before = bytes(plane.current()[1])
    with pytest.raises(CatalogError):
        plane.set_pools([good, bad])  # never half-applies
    assert bytes(plane.current()[1]) == before
    assert plane.rejected == 1


@pytest.mark.parametrize(
    ("kw", "rule"),
    [
        ({"roles": []}, "roles.empty"),
        ({"roles": [Role.AGGREGATED, Role.AGGREGATED]}, "roles.duplicate"),
        ({"roles": [0]}, "roles.invalid"),
        ({"kv_block_size": 0}, "query.block_size"),
        ({"kv_block_size": 1 << 32}, "query.block_size"),
        ({"namespace": ""}, "endpoint.namespace"),
        ({"base_model": " x"}, "registration.canonical_model_id"),
        ({"base_aliases": ["ok", "bad "]}, "registration.alias"),
        ({"loras": [LoraSpec("meta/llama")]}, "registration.duplicate"),
    ],
)
def test_builder_rejects(producer: MakeProducer, kw: dict[str, Any], rule: str) -> None:
    with pytest.raises(CatalogError) as info:
        _desc(producer, **kw)
    assert info.value.rule == rule


# ---------------------------------------------------------------------------------- plane


async def test_initial_empty_snapshot_at_revision_zero(relay: pb.RelayIdentity) -> None:
    plane = CatalogPlane(relay)
    rev, msg = plane.current()
    assert rev == 0 == msg.revision
    assert msg.snapshot is not None and msg.snapshot.pools == []
    assert (msg.protocol_version, msg.contract_marker) == (1, 0x4B565231)
    assert msg.relay == relay


async def test_revision_bumps_only_on_change(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    plane = CatalogPlane(relay)
    a, b = _desc(producer, 1), _desc(producer, 2)
    assert plane.set_pools([a, b]) is True
    assert plane.revision == 1
    assert plane.set_pools([b, a]) is False  # same content, other order
    shuffled = pb.KvPoolDescriptor.parse(bytes(a))
    shuffled.pool_roles = list(reversed(shuffled.pool_roles))
    assert plane.set_pools([shuffled, b]) is False
    assert plane.revision == 1
    # registration change republishes with the same producer identity
    a2 = _desc(producer, 1, loras=[LoraSpec("sql")])
    assert plane.set_pools([a2, b]) is True
    assert plane.revision == 2
    # withdrawal = absence (no tombstone)
    assert plane.set_pools([b]) is True
    rev, msg = plane.current()
    assert rev == msg.revision == 3
    assert [p.producer for p in msg.snapshot.pools] == [b.producer]
    assert plane.set_pools([]) is True and plane.current()[1].snapshot.pools == []


async def test_snapshot_order_is_by_pool_identity(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    plane = CatalogPlane(relay)
    ds = [_desc(producer, n) for n in (5, 1, 3)]
    plane.set_pools(ds)
    pools = plane.current()[1].snapshot.pools
    keys = [bytes(p.producer.pool_id) for p in pools]
    assert keys == sorted(keys) and len(keys) == 3


async def test_duplicate_pool_id_rejected(relay: pb.RelayIdentity, producer: MakeProducer) -> None:
    plane = CatalogPlane(relay)
    a = _desc(producer, 1)
    a_next_gen = _desc(producer, 1, producer=producer(1, generation=2), endpoint="other")
    with pytest.raises(CatalogError) as info:
        plane.set_pools([a, a_next_gen])
    assert info.value.rule == "catalog.duplicate_pool"
    assert plane.revision == 0 and plane.rejected == 1


async def test_published_snapshot_is_isolated_from_caller_mutation(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    plane = CatalogPlane(relay)
    d = _desc(producer)
    plane.set_pools([d])
    before = bytes(plane.current()[1])
    d.serving_endpoint.endpoint = "mutated"
    relay.relay_incarnation = 99
    assert bytes(plane.current()[1]) == before


async def test_watchers_wake_on_change_only(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    plane = CatalogPlane(relay)
    w = asyncio.create_task(plane.wait_newer(0))
    plane.set_pools([])  # no change: no wake-up
    await asyncio.sleep(0.01)
    assert not w.done()
    plane.set_pools([_desc(producer)])
    rev, msg = await asyncio.wait_for(w, scaled(1))
    assert rev == 1 and len(msg.snapshot.pools) == 1
    plane.close()
    from kvrelay.publication.plane import PlaneClosed

    with pytest.raises(PlaneClosed):
        await plane.wait_newer(1)


# ---------------------------------------------------------------------------------- wire


def _random_catalog(rng: random.Random, producer: MakeProducer) -> list[pb.KvPoolDescriptor]:
    out = []
    for n in rng.sample(range(1, 200), rng.randrange(0, 24)):
        loras = [LoraSpec(f"lora-{k}", aliases=[f"a{k}", f"b{k}"][: rng.randrange(3)])
                 for k in rng.sample(range(9), rng.randrange(0, 4))]  # fmt: skip
        roles = rng.sample([Role.AGGREGATED, Role.PREFILL, Role.DECODE], rng.randrange(1, 3))
        aliases = [f"alias-{rng.randrange(5)}" for _ in range(rng.randrange(3))]
        out.append(_desc(producer, n, loras=loras, roles=roles, base_aliases=aliases,
                         kv_block_size=rng.choice([1, 16, 64, U32_MAX])))  # fmt: skip
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(8))
async def test_catalog_wire_matches_betterproto_and_canonical(
    seed: int, relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    """The snapshot's wire bytes, laid out from each descriptor's cached canonical bytes, are
    byte for byte betterproto2's serialization of the published message and protobuf's
    canonical encoding (official runtime); revisions that changed a few pools stay so."""
    rng = random.Random(seed)
    plane = CatalogPlane(relay)
    assert plane.wire(0) is None  # the empty revision 0 has no cached pieces: serialized as is
    pools = _random_catalog(rng, producer)
    for _ in range(4):
        if plane.set_pools(pools):
            version, message = plane.current()
            wire = plane.wire(version)
            assert wire is not None and wire == bytes(message)
            assert wire == canonicalize(wire, pb.KvPoolCatalogUpdate)
            official = _official("KvPoolCatalogUpdate")()
            official.ParseFromString(wire)
            assert official.revision == version and len(official.snapshot.pools) == len(
                {bytes(d.producer.pool_id) for d in pools})  # fmt: skip
            assert plane.wire(version - 1) is None  # an older revision has none
        # the next revision: some pools kept (same objects), some rebuilt, some new
        kept = [d for d in pools if rng.random() < 0.7]
        rebuilt = [pb.KvPoolDescriptor.parse(bytes(d)) for d in pools if rng.random() < 0.2]
        fresh = _random_catalog(rng, producer)[:2]
        by_id = {bytes(d.producer.pool_id): d for d in [*kept, *rebuilt, *fresh]}
        pools = list(by_id.values())


async def test_an_unchanged_descriptor_is_serialized_once(
    relay: pb.RelayIdentity, producer: MakeProducer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plane serializes a descriptor object once, however many catalogs list it: one pool
    changing costs one pool's serialization. The copies it publishes are never the caller's."""
    import kvrelay.publication.catalog as catalog

    calls: list[int] = []
    real = catalog._canonical_bytes

    def counted(d: pb.KvPoolDescriptor) -> bytes:
        calls.append(id(d))
        return real(d)

    monkeypatch.setattr(catalog, "_canonical_bytes", counted)
    plane = CatalogPlane(relay)
    pools = [_desc(producer, n) for n in range(1, 11)]
    assert plane.set_pools(pools) is True
    assert len(calls) == 10
    changed = _desc(producer, 3, loras=[LoraSpec("sql")])
    assert plane.set_pools([changed if i == 2 else d for i, d in enumerate(pools)]) is True
    assert len(calls) == 11 and calls[-1] == id(changed)
    assert plane.set_pools(pools) is True  # back: only the replaced one is serialized again
    assert len(calls) == 12 and calls[-1] == id(pools[2])  # (a pool never hands it out again)
    published = plane.current()[1].snapshot.pools
    assert not {id(p) for p in published} & {id(d) for d in pools}
    assert sorted(bytes(p) for p in published) == sorted(real(d) for d in pools)


async def test_replaced_descriptors_are_not_kept(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    """Only the live pools' descriptors stay memoized. The memo's count bound alone kept 4,096
    replaced ones, each as large as its engine's list of adapters: an engine changing its LoRA
    adapters every probe grew the relay by ~240 KB a probe, 4,096 descriptors' worth."""
    plane = CatalogPlane(relay)
    other = _desc(producer, 2)
    for i in range(50):
        d = _desc(producer, 1, loras=[LoraSpec(f"lora-{i}-{j}") for j in range(20)])
        assert plane.set_pools([d, other]) is True
    assert len(plane._descriptors) == 2 and len(plane._pool_ids) == 2
    assert plane.set_pools([other]) is True
    assert len(plane._descriptors) == 1 and len(plane._pool_ids) == 1
    with pytest.raises(CatalogError):  # a refused catalog changes nothing, the memo included
        plane.set_pools([other, _desc(producer, 2, endpoint="x")])
    assert len(plane._descriptors) == 1
