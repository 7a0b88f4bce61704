"""What a pool knows about each of its engines, and what the engines say the pool *is*.

``EngineState`` holds an engine's latest discovery snapshot plus the relay's own judgement of it
(when its probe started failing, whether it was declared down). ``pool_identity`` turns the
engines' reports into the identity a generation is built for — model, model source, block size —
or into a conflict when reachable engines disagree (the pool is then withdrawn, never merged into
one filter, as Dynamo refuses a card conflict).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import blake3

from kvrelay.discovery.snapshot import EngineSnapshot
from kvrelay.discovery.watcher import EngineTarget
from kvrelay.relay.settings import EngineSpec, PoolSpec


def worker_id_for(engine_name: str) -> int:
    """Stable u64 member id from the operator's engine name (never from the incarnation)."""
    digest = blake3.blake3(b"kvrelay/worker-id/v1\x00" + engine_name.encode()).digest()
    return int.from_bytes(digest[:8], "little") or 1


@dataclass(slots=True)
class EngineState:
    spec: EngineSpec
    worker_id: int
    target: EngineTarget
    snapshot: EngineSnapshot | None = None
    #: The last reachable snapshot (the engine's declared ranks survive an outage).
    last_good: EngineSnapshot | None = None
    probed: bool = False
    usage: dict[int, float] = field(default_factory=dict)  # dp rank → KV usage fraction
    #: monotonic time the probe started failing in the current outage (None while reachable).
    unreachable_since: float | None = None
    #: Declared down (probe failing and every source disconnected for the grace): members cleared.
    down: bool = False
    #: The engine's block size last seen in conflict with the pool's (counted and logged once).
    block_size_conflict: int | None = None

    @property
    def reachable(self) -> bool:
        return self.snapshot is not None and self.snapshot.reachable

    @property
    def serving(self) -> bool:
        """Live for readiness: reachable, not sleeping, not paused (whether or not it publishes
        KV events: an ENCODE endpoint or an engine with events off is live too)."""
        s = self.snapshot
        return s is not None and s.reachable and not s.sleeping and not s.paused

    def declared_ranks(self) -> tuple[int, ...]:
        """The DP ranks this engine declares, reachable or not (load's expected ranks)."""
        if self.spec.static is not None:
            return tuple(self.spec.static.dp_ranks)
        snap = self.last_good
        if snap is not None:
            if snap.sources:
                return tuple(sorted({s.dp_rank for s in snap.sources}))
            return tuple(range(max(1, snap.data_parallel_size_local)))
        return (0,)  # never reached: at least one rank whose usage is unknown


@dataclass(frozen=True, slots=True)
class PoolIdentity:
    """What a generation's producer identity and query semantics derive from."""

    model: str
    model_source: str
    block_size: int


def pool_identity(
    spec: PoolSpec, engines: list[EngineState], current: PoolIdentity | None
) -> tuple[PoolIdentity | None, str | None]:
    """``(identity, conflict)``: the identity reachable Control engines (and the config) agree
    on; ``current`` when none can say (engines unreachable: the streams keep what they have);
    ``conflict`` explains why the engines cannot share one filter. Configured values win."""
    votes = [
        st.snapshot
        for st in engines
        if st.snapshot is not None
        and st.snapshot.reachable
        and st.snapshot.sources_via != "static"
    ]
    models = sorted({s.served_model_name for s in votes if s.served_model_name})
    sizes = sorted({s.kv_block_size for s in votes if s.kv_block_size > 0})
    sources = sorted({s.model_id for s in votes if s.model_id})
    model = spec.model
    if model is None:
        if len(models) > 1:
            return None, f"engines serve different models: {', '.join(models)}"
        model = models[0] if models else None
    block = spec.kv_block_size
    if block is None:
        if len(sizes) > 1:
            return None, f"engines report different kv_block_size: {', '.join(map(str, sizes))}"
        block = sizes[0] if sizes else None
    source = spec.model_source
    if source is None:
        if len(sources) > 1:
            return None, f"engines load different models: {', '.join(sources)}"
        source = sources[0] if sources else model
    if model is None or block is None or source is None:
        return current, None
    return PoolIdentity(model, source, block), None
