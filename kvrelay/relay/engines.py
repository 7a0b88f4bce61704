"""What a pool knows about each of its engines, and what the engines say the pool *is*.

``EngineState`` holds an engine's latest discovery snapshot plus the relay's own judgement of it
(when its probe started failing, whether it was declared down); ``EngineTable`` is a pool's
engines by target and by member id, and records what each discovery event says of its engine.
``pool_identity`` turns the
engines' reports into the identity a generation is built for — model, model source, block size —
or into a conflict when reachable engines disagree (the pool is then withdrawn, never merged into
one filter, as Dynamo refuses a card conflict).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import blake3

from kvrelay.discovery.errors import InvalidEndpoint
from kvrelay.discovery.events import ChangeEvent, EngineReachable, EngineUnreachableEvent
from kvrelay.discovery.snapshot import EngineSnapshot
from kvrelay.discovery.watcher import EngineTarget
from kvrelay.logging import get_logger
from kvrelay.relay.settings import EngineSpec, PoolSpec, Reach, engine_reach

_log = get_logger("kvrelay.relay.pool_runtime")  # the events keep the logger they had


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
    #: Publisher endpoints it reported that vLLM connects to instead of binding (logged once).
    connecting: frozenset[str] = frozenset()

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


class EngineTable:
    """A pool's engines, by watcher target (``engines``) and by member id (``by_worker``)."""

    __slots__ = ("by_worker", "engines", "reach")

    def __init__(self) -> None:
        self.engines: dict[str, EngineState] = {}
        self.by_worker: dict[int, EngineState] = {}
        #: where each engine is reached (``engine_reach``) → its name: the relay asks whether a
        #: new engine would be one already here, in one lookup per endpoint
        self.reach: dict[Reach, str] = {}

    def add(self, spec: EngineSpec) -> EngineTarget:
        """A new engine of this pool (from config, or found by DNS); probed before it is used."""
        target = EngineTarget(host=spec.host, grpc_port=spec.grpc_port, static=spec.static)
        st = EngineState(spec, worker_id_for(spec.name), target)
        self.engines[target.name] = st
        self.by_worker[st.worker_id] = st
        for key in _reach_keys(spec):
            self.reach.setdefault(key, spec.name)
        return target

    def target_of(self, engine_name: str) -> str | None:
        for key, st in self.engines.items():
            if st.spec.name == engine_name:
                return key
        return None

    def remove(self, target: str) -> None:
        st = self.engines.pop(target)
        del self.by_worker[st.worker_id]
        for key in _reach_keys(st.spec):
            if self.reach.get(key) == st.spec.name:
                del self.reach[key]

    def observe(self, ev: ChangeEvent, pool: str) -> EngineState | None:
        """Store what a discovery event says of its engine (None: not one of this pool's)."""
        st = self.engines.get(ev.target)
        if st is None:
            return None
        st.snapshot = ev.snapshot
        st.probed = True
        if ev.snapshot.reachable:
            st.last_good = ev.snapshot
            st.unreachable_since = None
            if st.down:
                st.down = False
                _log.info("engine_back", pool=pool, engine=st.spec.name)
        elif st.unreachable_since is None:
            st.unreachable_since = time.monotonic()
        if isinstance(ev, EngineUnreachableEvent):  # once per outage
            _log.warning("engine_unreachable", pool=pool, engine=st.spec.name, error=ev.error)
        elif isinstance(ev, EngineReachable):
            _log.info("engine_reachable", pool=pool, engine=st.spec.name)
        return st


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


def _reach_keys(spec: EngineSpec) -> list[Reach]:
    """``engine_reach``'s keys for ``spec``; none where its endpoints are invalid (its own
    probe reports that)."""
    try:
        return [key for key, _what in engine_reach(spec)]
    except InvalidEndpoint:
        return []
