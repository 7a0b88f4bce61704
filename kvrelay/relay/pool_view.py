"""What one pool shows the planes: its catalog descriptor, readiness endpoint state and load.

Read-only functions over a pool's parts (its settings, engines, live generation, identity and
connected members), so the catalog, readiness and load planes see a pool the same way wherever
it is asked from; ``PoolRuntime`` calls them with its own state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.discovery.snapshot import EngineSnapshot
from kvrelay.ingest.sink import SourceKey
from kvrelay.publication.catalog import LoraSpec, descriptor
from kvrelay.publication.load import RankLoad
from kvrelay.publication.readiness import EndpointState
from kvrelay.relay.connected import ConnectedMembers
from kvrelay.relay.engines import EngineState, PoolIdentity, pool_identity
from kvrelay.relay.generation import Generation
from kvrelay.relay.settings import PoolSpec

__all__ = ["DescriptorInputs", "base_model", "build_descriptor", "descriptor_inputs",
           "endpoint_state", "first_snapshot", "load_input", "lora_names"]  # fmt: skip


def first_snapshot(engines: Iterable[EngineState]) -> EngineSnapshot | None:
    """The first reachable engine's Control snapshot (static sources say nothing of a model)."""
    for st in engines:
        if st.reachable and st.snapshot is not None and st.snapshot.sources_via != "static":
            return st.snapshot
    return None


def known_aliases(engines: Collection[EngineState]) -> tuple[str, ...]:
    """The served model's aliases: the first reachable engine's, else the last any engine said
    while reachable. Why: they come from the deployment, which an engine's Control outage does
    not change; read from reachable engines only, they left the catalog while the pool stayed
    published (its streams on), and routers resolving requests by an alias lost the pool."""
    snap = first_snapshot(engines)
    if snap is None:
        snap = next((st.last_good for st in engines if st.last_good is not None
                     and st.last_good.sources_via != "static"), None)  # fmt: skip
    return tuple(snap.served_model_aliases) if snap is not None else ()


def base_model(
    spec: PoolSpec, engines: Collection[EngineState], identity: PoolIdentity | None
) -> str | None:
    """The canonical model id the pool registers (config, else what its engines serve)."""
    if identity is not None:
        return identity.model
    target, _conflict = pool_identity(spec, list(engines), None)
    if target is not None:
        return target.model
    snap = first_snapshot(engines)
    return spec.model or (snap.served_model_name if snap is not None else None) or None


def lora_names(
    spec: PoolSpec, engines: Collection[EngineState], identity: PoolIdentity | None
) -> list[str]:
    """LoRA adapters any reachable engine serves, and those the pool declares
    (``lora_adapters``: engines without Control report none); names that could not be a
    registration, empty, padded or equal to the base model, are left out."""
    names: set[str] = set(spec.lora_adapters)
    for st in engines:
        if st.reachable and st.snapshot is not None:
            names |= st.snapshot.lora_names
    base = base_model(spec, engines, identity)
    return sorted(n for n in names if n and n == n.strip() and n != base)


@dataclass(frozen=True, slots=True)
class DescriptorInputs:
    """Everything a pool's catalog entry is made of: equal inputs make an equal descriptor
    (``producer`` by identity: a generation's identity object never changes)."""

    producer: pb.ProducerIdentity = field(compare=False)
    namespace: str
    component: str
    endpoint: str
    base_model: str
    kv_block_size: int
    hash_format: pb.KvQueryHashFormat
    role: pb.WorkerRole
    base_aliases: tuple[str, ...]
    loras: tuple[str, ...]

    def same(self, other: DescriptorInputs | None) -> bool:
        return other is not None and other.producer is self.producer and other == self


def descriptor_inputs(
    spec: PoolSpec,
    engines: Collection[EngineState],
    gen: Generation | None,
    ident: PoolIdentity | None,
) -> DescriptorInputs | None:
    """What the catalog entry of a materialized pool is made of (None while it has no
    generation)."""
    if gen is None or ident is None:
        return None
    return DescriptorInputs(
        producer=gen.producer,
        namespace=spec.namespace,
        component=spec.component,
        endpoint=spec.endpoint,
        base_model=ident.model,
        kv_block_size=ident.block_size,
        hash_format=spec.hash_format,
        role=spec.role,
        base_aliases=tuple(a for a in known_aliases(engines) if a.strip() == a and a),
        loras=tuple(lora_names(spec, engines, ident)),
    )


def build_descriptor(inputs: DescriptorInputs) -> pb.KvPoolDescriptor:
    return descriptor(
        producer=inputs.producer,
        namespace=inputs.namespace,
        component=inputs.component,
        endpoint=inputs.endpoint,
        base_model=inputs.base_model,
        kv_block_size=inputs.kv_block_size,
        hash_format=inputs.hash_format,
        roles=[inputs.role],
        base_aliases=list(inputs.base_aliases),
        loras=[LoraSpec(canonical_model_id=n) for n in inputs.loras],
    )


def endpoint_state(
    spec: PoolSpec,
    engines: Collection[EngineState],
    gen: Generation | None,
    identity: PoolIdentity | None,
    connected: ConnectedMembers | None,
) -> EndpointState | None:
    """The pool's endpoint for the readiness plane (None while no model is known)."""
    model = base_model(spec, engines, identity)
    if model is None:
        return None
    live = sum(1 for st in engines if st.serving) + (connected.live_engines() if connected else 0)
    return EndpointState(
        namespace=spec.namespace,
        component=spec.component,
        endpoint=spec.endpoint,
        roles=frozenset({spec.role}) if spec.role != pb.WorkerRole.LEGACY else frozenset(),
        needs=spec.needs,
        live=live,
        probed=all(st.probed for st in engines),
        models=frozenset({model}),
        adapters={n: model for n in lora_names(spec, engines, identity)},
        pool_id=None if gen is None else gen.producer.pool_id,
        # an adapter only on an engine asleep or paused is listed, and not served; a declared
        # one is served while an engine of the pool is (nothing reports it otherwise)
        live_adapters=frozenset(
            n for st in engines if st.serving and st.snapshot is not None
            for n in st.snapshot.lora_names
        ) | (frozenset(spec.lora_adapters) if live else frozenset()),
    )


def load_input(
    engines: Iterable[EngineState],
    gen: Generation | None,
    subscribed: Collection[SourceKey],
    connected: ConnectedMembers | None,
) -> tuple[pb.ProducerIdentity, list[RankLoad]] | None:
    """One entry per rank every engine declares, reachable or not: a rank without a live
    source or a fresh scrape is unknown (observed < expected), never zero. An engine declared
    down (``engine_down_grace_s``: its members cleared) has departed, as a worker leaving
    Dynamo's discovery has: its ranks are not expected until it is back."""
    if gen is None:
        return None
    ranks: list[RankLoad] = []
    for st in engines:
        if st.down:
            continue
        declared = st.declared_ranks()
        total = st.spec.total_kv_blocks  # per rank (config)
        # the last answer of a reachable Control: capacity is the deployment's, which a Control
        # outage (a probe timing out on a busy engine) does not change; read from reachable
        # snapshots only, it went unknown, and the pool's load with it, while the engine's
        # stream and /metrics page went on
        good = st.last_good
        if good is not None and good.total_kv_blocks:
            # vLLM's frontend reports the sum over the engine cores it serves (one per DP rank):
            # each rank has its share
            total = good.total_kv_blocks // max(1, len(declared))
        for rank in declared:
            usage = None
            if SourceKey(st.worker_id, rank) in subscribed:
                usage = st.usage.get(rank)
            used = None
            if usage is not None and total is not None:
                used = max(0, round(usage * total))
            ranks.append(RankLoad(kv_used_blocks=used, total_kv_blocks=total))
    if connected is not None:
        ranks += connected.rank_loads()
    return gen.producer, ranks
