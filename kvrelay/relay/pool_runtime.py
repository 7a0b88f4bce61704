"""One configured pool at run time: its engines, subscribers and current generation.

Discovery is level-triggered here: every watcher event stores the engine's latest snapshot and
then ``reconcile`` makes subscribers and the generation match what the snapshots say. Rules:

* A source is *active* while its subscriber runs and its engine's last probe was reachable. A
  pool is materialized (has a generation, is in the catalog) only while ≥ 1 source is active;
  when the last one goes the generation is retired and every subscriber stopped, and the next
  materialization is a fresh generation rebuilt from replay and live events.
* A Control probe that fails does not flush a member's state while others keep the pool alive:
  the ZMQ stream is the authority for state and the subscriber's sequence checks catch restarts.
* A new engine incarnation (``instance_id``) clears that engine's members and restarts their
  subscribers, which rebuild from the new incarnation's replay at 0. Restarting (not just
  clearing) matters because the ZMQ stream may already have shown the restart (a backwards
  sequence) and rebuilt the member before discovery noticed: clearing alone would then wipe a
  correct state while the subscriber streamed on.
* Any producer inconsistency fences the generation and materializes a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, fields

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.discovery.events import (
    ChangeEvent,
    EngineReachable,
    EngineUnreachableEvent,
    IncarnationChanged,
)
from kvrelay.discovery.snapshot import EngineSnapshot
from kvrelay.discovery.watcher import EngineTarget
from kvrelay.hashing import identity
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.sink import ResetReason, SourceKey, SourceSpec
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.logging import get_logger
from kvrelay.pool.batch import EventBatch
from kvrelay.pool.pool import Pool
from kvrelay.publication.catalog import LoraSpec, descriptor
from kvrelay.publication.load import RankLoad
from kvrelay.publication.readiness import EndpointState
from kvrelay.relay.context import RelayContext
from kvrelay.relay.generation import Generation
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.relay.stats import (
    EngineStats,
    GenerationStats,
    GenerationTotals,
    PoolStats,
    SourceStats,
    merged,
)

_log = get_logger(__name__)


def worker_id_for(engine_name: str) -> int:
    """Stable u64 member id from the operator's engine name (never from the incarnation)."""
    import blake3

    digest = blake3.blake3(b"kvrelay/worker-id/v1\x00" + engine_name.encode()).digest()
    return int.from_bytes(digest[:8], "little") or 1


@dataclass(slots=True)
class EngineState:
    spec: EngineSpec
    worker_id: int
    target: EngineTarget
    snapshot: EngineSnapshot | None = None
    probed: bool = False
    usage: dict[int, float] = field(default_factory=dict)  # dp rank → KV usage fraction

    @property
    def reachable(self) -> bool:
        return self.snapshot is not None and self.snapshot.reachable

    @property
    def serving(self) -> bool:
        s = self.snapshot
        return s is not None and s.reachable and not s.sleeping and not s.paused


@dataclass(slots=True)
class PoolCounters:
    batches: int = 0
    events: int = 0
    events_rejected: int = 0
    dropped_without_generation: int = 0
    member_resets: dict[str, int] = field(default_factory=dict)
    generations: int = 0
    fences: int = 0
    block_size_conflicts: int = 0


class PoolRuntime:
    """Implements ``kvrelay.ingest.sink.BatchSink`` for the pool's members."""

    def __init__(self, spec: PoolSpec, ctx: RelayContext) -> None:
        self.spec = spec
        self._ctx = ctx
        self.engines: dict[str, EngineState] = {}
        for e in spec.engines:
            target = EngineTarget(host=e.host, grpc_port=e.grpc_port, static=e.static)
            self.engines[target.name] = EngineState(e, worker_id_for(e.name), target)
        self.by_worker = {st.worker_id: st for st in self.engines.values()}
        self.subscribers: dict[SourceKey, Subscriber] = {}
        self.source_specs: dict[SourceKey, SourceSpec] = {}
        self.generation: Generation | None = None
        self.counters = PoolCounters()
        self._reconcile_lock = asyncio.Lock()
        self._model: str | None = None
        self._model_source: str | None = None
        self._block_size: int | None = None
        # Final counters of retired subscribers and generations (monotonic stats).
        self._source_totals: dict[SourceKey, SubscriberCounters] = {}
        self._generation_totals = GenerationTotals()

    # ---- BatchSink -------------------------------------------------------------------------------

    def on_batch(self, source: SourceKey, seq: int, batch: EventBatch) -> None:
        gen = self.generation
        if gen is None:
            self.counters.dropped_without_generation += 1
            return
        result = gen.apply(source, batch)
        if result is None:
            return  # the generation retired (or this batch fenced it)
        self.counters.batches += 1
        self.counters.events += batch.n_events
        self.counters.events_rejected += result.events_rejected

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.counters.member_resets[reason.value] = (
            self.counters.member_resets.get(reason.value, 0) + 1
        )
        gen = self.generation
        if gen is None:
            return
        gen.reset_member(source)
        _log.warning(
            "member_reset", pool=self.name, engine=self._engine_name(source.worker_id),
            dp_rank=source.dp_rank, reason=reason.value,
        )

    # ---- identity & descriptors ------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "/".join(self.spec.triple)

    def _first_snapshot(self) -> EngineSnapshot | None:
        for st in self.engines.values():
            if st.reachable and st.snapshot is not None and st.snapshot.sources_via != "static":
                return st.snapshot
        return None

    def base_model(self) -> str | None:
        if self.spec.model:
            return self.spec.model
        snap = self._first_snapshot()
        if snap is not None and snap.served_model_name:
            return snap.served_model_name
        return self._model

    def block_size(self) -> int | None:
        if self._block_size is not None:
            return self._block_size
        if self.spec.kv_block_size:
            return self.spec.kv_block_size
        snap = self._first_snapshot()
        if snap is not None and snap.kv_block_size > 0:
            return snap.kv_block_size
        return None

    def lora_names(self) -> list[str]:
        """LoRA adapters any reachable engine serves (names that could not be a registration,
        empty, padded or equal to the base model, are left out)."""
        names: set[str] = set()
        for st in self.engines.values():
            if st.reachable and st.snapshot is not None:
                names |= st.snapshot.lora_names
        base = self.base_model()
        return sorted(n for n in names if n and n == n.strip() and n != base)

    def descriptor(self) -> pb.KvPoolDescriptor | None:
        gen = self.generation
        model = self._model
        if gen is None or model is None or self._block_size is None:
            return None
        snap = self._first_snapshot()
        aliases = snap.served_model_aliases if snap is not None else ()
        return descriptor(
            producer=gen.producer,
            namespace=self.spec.namespace,
            component=self.spec.component,
            endpoint=self.spec.endpoint,
            base_model=model,
            kv_block_size=self._block_size,
            hash_format=self.spec.hash_format,
            roles=[self.spec.role],
            base_aliases=[a for a in aliases if a.strip() == a and a],
            loras=[LoraSpec(canonical_model_id=n) for n in self.lora_names()],
        )

    def endpoint_state(self) -> EndpointState | None:
        model = self.base_model()
        if model is None:
            return None
        active = {k.worker_id for k in self.subscribers}
        live = sum(1 for st in self.engines.values() if st.serving and st.worker_id in active)
        return EndpointState(
            namespace=self.spec.namespace,
            component=self.spec.component,
            endpoint=self.spec.endpoint,
            roles=frozenset({self.spec.role}) if self.spec.role != pb.WorkerRole.LEGACY
            else frozenset(),
            needs=self.spec.needs,
            live=live,
            probed=all(st.probed for st in self.engines.values()),
            models=frozenset({model}),
            adapters={n: model for n in self.lora_names()},
            pool_id=None if self.generation is None else self.generation.producer.pool_id,
        )

    def load_input(self) -> tuple[pb.ProducerIdentity, list[RankLoad]] | None:
        gen = self.generation
        if gen is None:
            return None
        ranks: list[RankLoad] = []
        for key in sorted(self.source_specs):
            st = self.by_worker[key.worker_id]
            total = st.spec.total_kv_blocks
            if st.snapshot is not None and st.snapshot.total_kv_blocks > 0:
                total = st.snapshot.total_kv_blocks
            usage = st.usage.get(key.dp_rank)
            used = None
            if usage is not None and total is not None:
                used = max(0, round(usage * total))
            ranks.append(RankLoad(kv_used_blocks=used, total_kv_blocks=total))
        return gen.producer, ranks

    def _producer(self, model_source: str, block_size: int) -> pb.ProducerIdentity:
        fmt = identity.CkfFormatSpec(seed=self.spec.ckf_seed, bucket_count=self.spec.bucket_count)
        return pb.ProducerIdentity(
            pool_id=pb.KvPoolId(
                identity_version=1,
                indexer_domain=pb.IndexerDomainId(
                    cache_semantics=pb.DigestIdentity(
                        digest=identity.cache_semantics_digest(
                            model_source, block_size, int(self.spec.hash_format)
                        ),
                        source=pb.IdentitySource.DEFAULT_DERIVED,
                    ),
                    routing_scope=pb.DigestIdentity(
                        digest=identity.routing_scope_digest(*self.spec.triple),
                        source=pb.IdentitySource.DEFAULT_DERIVED,
                    ),
                ),
                dc_id=self._ctx.dc_id,
            ),
            producer_incarnation=self._ctx.relay_incarnation,
            layout_generation=self._ctx.next_layout_generation(),
            ckf_format=fmt.to_proto(),
        )

    # ---- generations -----------------------------------------------------------------------------

    def _materialize(self, block_size: int, model: str, model_source: str) -> Generation:
        pool = Pool(
            bucket_count=self.spec.bucket_count,
            seed=self.spec.ckf_seed,
            block_size=block_size,
            hash_format=int(self.spec.hash_format),
        )
        gen = Generation(
            name=self.name,
            pool=pool,
            producer=self._producer(model_source, block_size),
            ctx=self._ctx,
            on_fence=self.fence,
        )
        self._block_size, self._model, self._model_source = block_size, model, model_source
        self.generation = gen
        self.counters.generations += 1
        _log.info(
            "pool_materialized", pool=self.name, layout_generation=gen.layout_generation,
            block_size=block_size, model=model,
        )
        return gen

    def fence(self, gen: Generation, why: str) -> None:
        """Withdraw ``gen`` and rebuild a fresh generation from replay + live events."""
        if gen is not self.generation:
            return
        self.counters.fences += 1
        _log.error("generation_fenced", pool=self.name, generation=gen.layout_generation, why=why)
        self._retire(gen, RelayError.publication_unavailable(f"generation fenced: {why}"))
        self._ctx.changed()
        self._ctx.schedule(self._rebuild())

    async def _rebuild(self) -> None:
        await self._stop_subscribers(list(self.subscribers))
        await self.reconcile()

    # ---- discovery -------------------------------------------------------------------------------

    async def on_engine_event(self, ev: ChangeEvent) -> None:
        st = self.engines.get(ev.target)
        if st is None:
            return
        st.snapshot = ev.snapshot
        st.probed = True
        if isinstance(ev, EngineUnreachableEvent):  # once per outage
            _log.warning("engine_unreachable", pool=self.name, engine=st.spec.name, error=ev.error)
        elif isinstance(ev, EngineReachable):
            _log.info("engine_reachable", pool=self.name, engine=st.spec.name)
        if isinstance(ev, IncarnationChanged):
            async with self._reconcile_lock:
                await self._restart_engine_members(st.worker_id)
        await self.reconcile()

    async def _restart_engine_members(self, worker_id: int) -> None:
        """New incarnation: stop the engine's subscribers, clear its members; ``reconcile`` then
        starts fresh subscribers that replay the new incarnation from sequence 0."""
        await self._stop_subscribers([k for k in self.subscribers if k.worker_id == worker_id])
        gen = self.generation
        if gen is None:
            return
        gen.reset_engine(worker_id)
        self.counters.member_resets["incarnation"] = (
            self.counters.member_resets.get("incarnation", 0) + 1
        )

    def _desired(self, block_size: int) -> dict[SourceKey, SourceSpec]:
        desired: dict[SourceKey, SourceSpec] = {}
        for st in self.engines.values():
            snap = st.snapshot
            if snap is None:
                continue
            if not snap.reachable:
                # keep what runs (state stays valid while the stream lives), add nothing new
                for key, spec in self.source_specs.items():
                    if key.worker_id == st.worker_id:
                        desired[key] = spec
                continue
            if snap.kv_block_size and snap.kv_block_size != block_size:
                self.counters.block_size_conflicts += 1
                _log.warning(
                    "engine_block_size_conflict", pool=self.name, engine=st.spec.name,
                    engine_block_size=snap.kv_block_size, pool_block_size=block_size,
                )
                continue
            for src in snap.sources:
                if src.transport != "zmq" or not src.endpoint:
                    continue
                key = SourceKey(st.worker_id, src.dp_rank)
                desired[key] = SourceSpec(
                    endpoint=src.endpoint,
                    replay_endpoint=src.replay_endpoint or None,
                    topic=src.topic.encode(),
                    dp_rank=src.dp_rank,
                    worker_id=st.worker_id,
                    kv_block_size=block_size,
                    hash_format=int(self.spec.hash_format),
                    options=self.spec.decode,
                    engine=st.spec.name,
                    pool=self.name,
                )
        return desired

    def _active_count(self, desired: dict[SourceKey, SourceSpec]) -> int:
        return sum(1 for k in desired if self.by_worker[k.worker_id].reachable)

    async def reconcile(self) -> None:
        async with self._reconcile_lock:
            await self._reconcile()
        self._ctx.changed()

    async def _reconcile(self) -> None:
        block_size = self._block_size or self.block_size()
        model = self.base_model()
        if block_size is None or model is None:
            return  # nothing known yet: nothing to subscribe
        desired = self._desired(block_size)
        if self._active_count(desired) == 0:
            if self.generation is not None:
                gen = self.generation
                why = RelayError.publication_unavailable("pool withdrawn: no active source")
                self._retire(gen, why)
                _log.warning("pool_withdrawn", pool=self.name, generation=gen.layout_generation)
            await self._stop_subscribers(list(self.subscribers))
            return
        if self.generation is None:
            snap = self._first_snapshot()
            source = self.spec.model_source or (snap.model_id if snap and snap.model_id else model)
            self._materialize(block_size, model, source)
        current = self.generation
        assert current is not None
        gen = current
        gone = [
            k for k in self.subscribers if k not in desired or desired[k] != self.source_specs[k]
        ]
        await self._stop_subscribers(gone)
        for key in gone:
            gen.remove_member(key)
        for key, spec in desired.items():
            if key not in self.subscribers:
                sub = Subscriber(spec, self)
                self.subscribers[key] = sub
                self.source_specs[key] = spec
                await sub.start()

    async def _stop_subscribers(self, keys: list[SourceKey]) -> None:
        for key in keys:
            sub = self.subscribers.pop(key, None)
            self.source_specs.pop(key, None)
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.stop()
                self._fold_source(key, sub.counters)

    async def stop(self) -> None:
        async with self._reconcile_lock:
            await self._stop_subscribers(list(self.subscribers))
            if self.generation is not None:
                self._retire(self.generation, None)  # shutdown: clean EOF for subscribers

    def _retire(self, gen: Generation, error: RelayError | None) -> None:
        """Retire ``gen`` (subscribers end with ``error``) and keep its final counters."""
        if self.generation is gen:
            self.generation = None
        if not gen.retired:
            gen.retire(error)
            self._generation_totals.add(_generation_totals(gen))

    def _fold_source(self, key: SourceKey, counters: SubscriberCounters) -> None:
        prev = self._source_totals.get(key)
        self._source_totals[key] = counters if prev is None else merged(prev, counters)

    # ---- statistics ------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """A snapshot of the pool's counters and gauges (monotonic across replacements)."""
        gen = self.generation
        totals = self._generation_totals.copy()
        gstats: GenerationStats | None = None
        if gen is not None:
            totals.add(_generation_totals(gen))
            pool = gen.pool
            gstats = GenerationStats(
                layout_generation=gen.layout_generation,
                sequence=gen.sequence,
                subscribers=gen.subscriber_count,
                occupancy=pool.occupancy,
                members=len(pool.members()),
                memberships=pool.memberships,
                distinct_blocks=pool.distinct_canonical,
                state_bytes=pool.memory_bytes(),
            )
        sources: list[SourceStats] = []
        for key in sorted(set(self._source_totals) | set(self.subscribers)):
            sub = self.subscribers.get(key)
            prev = self._source_totals.get(key)
            if sub is None:
                assert prev is not None
                counters, state = prev, "stopped"
            else:
                counters = sub.counters if prev is None else merged(prev, sub.counters)
                state = sub.state
            name = self._engine_name(key.worker_id)
            sources.append(SourceStats(name, key.dp_rank, state, counters))
        c = self.counters
        return PoolStats(
            name=self.name,
            bucket_count=self.spec.bucket_count,
            materialized=gen is not None,
            counters={f.name: getattr(c, f.name) for f in fields(c) if f.name != "member_resets"},
            member_resets=dict(c.member_resets),
            generations=totals,
            generation=gstats,
            sources=tuple(sources),
            engines=tuple(EngineStats(st.spec.name, st.reachable) for st in self.engines.values()),
        )

    def _engine_name(self, worker_id: int) -> str:
        st = self.by_worker.get(worker_id)
        return st.spec.name if st is not None else str(worker_id)


def _generation_totals(gen: Generation) -> GenerationTotals:
    p = gen.pool
    hub = gen.hub_stats()
    return GenerationTotals(
        capacity_omissions=p.capacity_omissions,
        unknown_removals=p.unknown_removals,
        invariant_violations=p.invariant_violations,
        deltas=gen.batches_published,
        hub_resets=hub["resets"],
        lagged=hub["lagged"],
        snapshots_served=hub["snapshots_served"],
        snapshots_built=hub["snapshots_built"],
        errors=dict(p.errors_by_kind),
    )
