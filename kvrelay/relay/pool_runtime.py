"""One configured pool at run time: its engines, subscribers and current generation.

Discovery is level-triggered here: every watcher event stores the engine's latest snapshot and
then ``reconcile`` makes subscribers and the generation match what the snapshots say. Rules:

* The data plane decides whether a pool lives. A source is *active* while its subscriber runs
  (not crashed) and its engine is not declared down; Control's opinion alone never withdraws a
  pool whose ZMQ streams are live. A pool is materialized (has a generation, is in the catalog)
  while ≥ 1 source is active; when the last one goes the generation is retired, and the next
  materialization is a fresh generation rebuilt from replay and live events.
* An engine whose probe fails *and* whose every source is disconnected for
  ``engine_down_grace_s`` is declared down: its members are cleared (a dead worker's blocks must
  not stay in the filter while other engines keep the pool alive) and its subscribers stopped;
  they start again, replaying from 0, once the engine answers.
* The pool's identity (model, model source, block size) comes from the engines and the config.
  When it changes the pool is re-materialized as a new generation; when reachable engines
  disagree the pool is withdrawn with a logged, counted reason — never merged.
* A new engine incarnation (``instance_id``) clears that engine's members and restarts their
  subscribers, which rebuild from the new incarnation's replay at 0. Restarting (not just
  clearing) matters because the ZMQ stream may already have shown the restart (a backwards
  sequence) and rebuilt the member before discovery noticed.
* A subscriber that crashes (at start or later) is counted and logged with the engine's name, its
  member is reset, and it is restarted with jittered exponential backoff; meanwhile it is not an
  active source.
* Any doubt about exact state fences the generation. The catalog withdrawal is published before
  the generation is torn down, and a pool that keeps getting fenced is rebuilt with backoff.
* Connect mode (§22, ``relay/connected.py``): members that connect to the pool's bound SUB count
  as active sources; the pool materializes before a member's first batch (nothing can be
  replayed) and withdraws when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, fields
from typing import Any

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
from kvrelay.relay.connected import ConnectedMembers, counter_values
from kvrelay.relay.context import RelayContext
from kvrelay.relay.engines import EngineState, PoolIdentity, pool_identity, worker_id_for
from kvrelay.relay.generation import Generation
from kvrelay.relay.handover import RESTORE_VOUCH_S, MemberResume, RestoredPool
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.relay.stats import (
    EngineStats,
    GenerationStats,
    GenerationTotals,
    PoolStats,
    SourceStats,
    merged,
)

__all__ = ["EngineState", "PoolCounters", "PoolRuntime", "worker_id_for"]

_log = get_logger(__name__)

#: Crashed-source restarts: delay = min(max, initial · 2^attempt) · U(0.5, 1); the attempt count
#: is forgotten once a restarted source has stayed connected this long.
RESTART_INITIAL_S = 0.2
RESTART_MAX_S = 10.0
RESTART_STABLE_S = 30.0
#: A generation that lived this long before a fence resets the fence backoff.
FENCE_STABLE_S = 60.0
FENCE_BACKOFF_INITIAL_S = 0.5
FENCE_BACKOFF_MAX_S = 30.0


def _jittered(initial: float, ceiling: float, attempt: int) -> float:
    return float(min(ceiling, initial * (2 ** min(attempt, 16))) * random.uniform(0.5, 1.0))


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
    source_failures: int = 0  # subscribers that crashed or failed to start
    engines_down: int = 0  # engines declared down (members cleared)
    identity_changes: int = 0  # re-materialized for a new model / model source / block size
    identity_conflicts: int = 0  # withdrawn because reachable engines disagree
    rebuild_backoffs: int = 0  # rebuilds after a fence that waited (repeated fences)
    reconfigurations: int = 0  # re-materialized because a reload changed filter settings
    members_resumed: int = 0  # restored members whose subscriber resumed (then vouched or reset)
    members_vouched: int = 0  # restored members their engine vouched for (kept)
    restores_discarded: int = 0  # restored state not used: another identity, or unloadable

    def reset(self, reason: str) -> None:
        self.member_resets[reason] = self.member_resets.get(reason, 0) + 1


class PoolRuntime:
    """Implements ``kvrelay.ingest.sink.BatchSink`` for the pool's members."""

    def __init__(
        self, spec: PoolSpec, ctx: RelayContext, engine_down_grace_s: float = 30.0
    ) -> None:
        self.spec = spec
        self._ctx = ctx
        self.engine_down_grace_s = engine_down_grace_s
        self.engines: dict[str, EngineState] = {}
        self.by_worker: dict[int, EngineState] = {}
        for e in spec.engines:
            if e.dns is None:  # DNS templates stand for engines that membership adds later
                self.add_engine(e)
        self.subscribers: dict[SourceKey, Subscriber] = {}
        self.source_specs: dict[SourceKey, SourceSpec] = {}
        self.generation: Generation | None = None
        self.counters = PoolCounters()
        self.identity: PoolIdentity | None = None
        self.conflict: str | None = None
        self._reconcile_lock = asyncio.Lock()
        self._restarts: dict[SourceKey, tuple[int, float]] = {}  # key → (attempt, not before)
        self._materialized_at = 0.0
        self._fence_streak = 0
        self._rebuild_not_before = 0.0
        self._stopped = False
        # Final counters of retired subscribers and generations (monotonic stats).
        self._source_totals: dict[SourceKey, SubscriberCounters] = {}
        self._generation_totals = GenerationTotals()
        self.connected = ConnectedMembers(self) if spec.connect is not None else None
        #: A state file's contents, used by the first materialization if the identity matches.
        self.restored: RestoredPool | None = None
        self._resume: dict[SourceKey, MemberResume] = {}  # restored members not yet resumed
        self._resume_deadline = 0.0

    # ---- BatchSink -------------------------------------------------------------------------------

    def on_batch(self, source: SourceKey, seq: int, batch: EventBatch) -> None:
        gen = self.generation
        if gen is None:
            self.counters.dropped_without_generation += 1
            return
        result = gen.apply(source, batch)  # MalformedBatch propagates: the subscriber handles it
        if result is None:
            return  # the generation retired (or this batch fenced it)
        self.counters.batches += 1
        self.counters.events += batch.n_events
        self.counters.events_rejected += result.events_rejected

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.counters.reset(reason.value)
        gen = self.generation
        if gen is None:
            return
        gen.reset_member(source)
        _log.warning(
            "member_reset", pool=self.name, engine=self._engine_name(source.worker_id),
            dp_rank=source.dp_rank, reason=reason.value,
        )  # fmt: skip

    def on_vouched(self, source: SourceKey) -> None:
        """A member restored from a state file was vouched for by its engine."""
        self.counters.members_vouched += 1

    def on_failed(self, source: SourceKey, error: BaseException) -> None:
        """A subscriber crashed: reset its member, count it, restart it later with backoff."""
        sub = self.subscribers.get(source)
        if sub is None or self._stopped:
            return
        self.counters.source_failures += 1
        attempt = self._restarts.get(source, (0, 0.0))[0]
        delay = _jittered(RESTART_INITIAL_S, RESTART_MAX_S, attempt)
        self._restarts[source] = (attempt + 1, time.monotonic() + delay)
        _log.error(
            "source_failed", pool=self.name, engine=self._engine_name(source.worker_id),
            dp_rank=source.dp_rank, error=f"{type(error).__name__}: {error}",
            restart_in_s=round(delay, 3),
        )  # fmt: skip
        del self.subscribers[source]
        self.source_specs.pop(source, None)
        self._fold_source(source, sub.counters)
        self._ctx.schedule(sub.stop())
        self.counters.reset("source_failed")
        gen = self.generation
        if gen is not None:
            gen.reset_member(source)
        self._ctx.schedule(self._reconcile_after(0.0))
        self._ctx.schedule(self._reconcile_after(delay))

    # ---- what connected members need (relay/connected.py: PoolHost) ------------------------------

    def is_configured(self, worker_id: int) -> bool:
        return worker_id in self.by_worker

    def count_reset(self, reason: str) -> None:
        self.counters.reset(reason)

    def count_source_failure(self) -> None:
        self.counters.source_failures += 1

    def schedule(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._ctx.schedule(coro)

    def ensure_generation(self) -> None:
        """Materialize now if the pool can (a connected member's first batch is due)."""
        if self.generation is not None or self._stopped:
            return
        if time.monotonic() < self._rebuild_not_before:
            return  # a delayed rebuild after repeated fences: batches until then are dropped
        ident, conflict = pool_identity(self.spec, list(self.engines.values()), self.identity)
        if conflict is None and ident is not None:
            self.identity = ident
            self._materialize(ident)
            self._ctx.changed()

    async def _reconcile_after(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        if not self._stopped:
            await self.reconcile()

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
        """The canonical model id the pool registers (config, else what its engines serve)."""
        if self.identity is not None:
            return self.identity.model
        target, _conflict = pool_identity(self.spec, list(self.engines.values()), None)
        if target is not None:
            return target.model
        snap = self._first_snapshot()
        return self.spec.model or (snap.served_model_name if snap is not None else None) or None

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
        gen, ident = self.generation, self.identity
        if gen is None or ident is None:
            return None
        snap = self._first_snapshot()
        aliases = snap.served_model_aliases if snap is not None else ()
        return descriptor(
            producer=gen.producer,
            namespace=self.spec.namespace,
            component=self.spec.component,
            endpoint=self.spec.endpoint,
            base_model=ident.model,
            kv_block_size=ident.block_size,
            hash_format=self.spec.hash_format,
            roles=[self.spec.role],
            base_aliases=[a for a in aliases if a.strip() == a and a],
            loras=[LoraSpec(canonical_model_id=n) for n in self.lora_names()],
        )

    def endpoint_state(self) -> EndpointState | None:
        model = self.base_model()
        if model is None:
            return None
        return EndpointState(
            namespace=self.spec.namespace,
            component=self.spec.component,
            endpoint=self.spec.endpoint,
            roles=frozenset({self.spec.role}) if self.spec.role != pb.WorkerRole.LEGACY
            else frozenset(),
            needs=self.spec.needs,
            live=sum(1 for st in self.engines.values() if st.serving)
            + (self.connected.live_engines() if self.connected else 0),
            probed=all(st.probed for st in self.engines.values()),
            models=frozenset({model}),
            adapters={n: model for n in self.lora_names()},
            pool_id=None if self.generation is None else self.generation.producer.pool_id,
        )

    def load_input(self) -> tuple[pb.ProducerIdentity, list[RankLoad]] | None:
        """One entry per rank every engine declares, reachable or not: a rank without a live
        source or a fresh scrape is unknown (observed < expected), never zero."""
        gen = self.generation
        if gen is None:
            return None
        ranks: list[RankLoad] = []
        for st in self.engines.values():
            total = st.spec.total_kv_blocks
            if st.snapshot is not None and st.snapshot.reachable and st.snapshot.total_kv_blocks:
                total = st.snapshot.total_kv_blocks
            for rank in st.declared_ranks():
                usage = None
                if SourceKey(st.worker_id, rank) in self.subscribers and not st.down:
                    usage = st.usage.get(rank)
                used = None
                if usage is not None and total is not None:
                    used = max(0, round(usage * total))
                ranks.append(RankLoad(kv_used_blocks=used, total_kv_blocks=total))
        if self.connected is not None:
            ranks += self.connected.rank_loads()
        return gen.producer, ranks

    def _producer(self, ident: PoolIdentity) -> pb.ProducerIdentity:
        fmt = identity.CkfFormatSpec(seed=self.spec.ckf_seed, bucket_count=self.spec.bucket_count)
        return pb.ProducerIdentity(
            pool_id=pb.KvPoolId(
                identity_version=1,
                indexer_domain=pb.IndexerDomainId(
                    cache_semantics=pb.DigestIdentity(
                        digest=identity.cache_semantics_digest(
                            ident.model_source, ident.block_size, int(self.spec.hash_format)
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

    def _restored_pool(
        self, ident: PoolIdentity
    ) -> tuple[Pool, dict[SourceKey, MemberResume]] | None:
        """The state file's pool, if it was saved under this identity (consumed either way)."""
        r, self.restored = self.restored, None
        if r is None:
            return None
        why = None
        if r.identity != ident:
            why = f"saved for {r.identity!r}, the engines now give {ident!r}"
        else:
            try:
                return r.pool(self.spec), dict(r.members)
            except Exception as exc:  # arrays that do not make a consistent pool: not trusted
                why = f"unloadable: {type(exc).__name__}: {exc}"
        self.counters.restores_discarded += 1
        _log.warning("state_discarded", pool=self.name, why=why)
        return None

    def _materialize(self, ident: PoolIdentity) -> Generation:
        restored = self._restored_pool(ident)
        if restored is not None:
            pool, resume = restored
        else:
            pool, resume = Pool(
                bucket_count=self.spec.bucket_count,
                seed=self.spec.ckf_seed,
                block_size=ident.block_size,
                hash_format=int(self.spec.hash_format),
            ), {}
        gen = Generation(
            name=self.name, pool=pool, producer=self._producer(ident), ctx=self._ctx,
            on_fence=self.fence,
        )  # fmt: skip
        self.generation = gen
        self._materialized_at = time.monotonic()
        self.counters.generations += 1
        _log.info(
            "pool_materialized", pool=self.name, layout_generation=gen.layout_generation,
            block_size=ident.block_size, model=ident.model, restored=restored is not None,
            restored_members=len(resume),
        )  # fmt: skip
        if restored is not None:
            # members saved without a resume point (nothing applied, a rebuild under way) or of
            # engines no longer configured hold nothing the relay can vouch for
            for wid, rank in list(pool.members().values()):
                key = SourceKey(wid, rank)
                if key in resume and wid in self.by_worker:
                    continue
                if wid in self.by_worker:
                    gen.reset_member(key)
                else:
                    gen.remove_member(key)
            self._resume = {k: r for k, r in resume.items() if k.worker_id in self.by_worker}
            self._resume_deadline = self._materialized_at + RESTORE_VOUCH_S
        return gen

    def _resume_for(self, key: SourceKey, gen: Generation) -> tuple[int, int] | None:
        """The restored position to resume ``key`` from, if its engine is the incarnation that
        was saved; otherwise its restored state is dropped before a fresh start."""
        r = self._resume.pop(key, None)
        if r is None:
            return None
        st = self.by_worker.get(key.worker_id)
        now = "" if st is None or st.snapshot is None else st.snapshot.instance_id
        if now != r.incarnation:
            gen.reset_member(key)
            self.counters.reset("incarnation")
            return None
        self.counters.members_resumed += 1
        return (r.last_seq, r.digest)

    def fence(self, gen: Generation, why: str) -> None:
        """Withdraw ``gen`` and rebuild a fresh generation from replay + live events (with
        backoff when fences repeat, so a deterministic fault cannot loop generations)."""
        if gen is not self.generation:
            return
        self.counters.fences += 1
        now = time.monotonic()
        self._fence_streak = 1 if now - self._materialized_at >= FENCE_STABLE_S else (
            self._fence_streak + 1
        )
        delay = 0.0
        if self._fence_streak > 1:
            delay = _jittered(FENCE_BACKOFF_INITIAL_S, FENCE_BACKOFF_MAX_S, self._fence_streak - 2)
            self.counters.rebuild_backoffs += 1
        self._rebuild_not_before = now + delay
        _log.error(
            "generation_fenced", pool=self.name, generation=gen.layout_generation, why=why,
            rebuild_in_s=round(delay, 3),
        )  # fmt: skip
        self._retire(gen, RelayError.publication_unavailable(f"generation fenced: {why}"))
        self._ctx.schedule(self._rebuild(delay))

    async def _rebuild(self, delay: float) -> None:
        async with self._reconcile_lock:
            await self._stop_subscribers(list(self.subscribers))
        await self._reconcile_after(delay)

    def _retire(self, gen: Generation, error: RelayError | None, *, publish: bool = True) -> None:
        """Retire ``gen``: the catalog without it is published first, then its subscribers end
        with ``error`` (or a clean EOF), and its final counters are kept."""
        if self.generation is gen:
            self.generation = None
        if publish:
            self._ctx.changed()
        if not gen.retired:
            gen.retire(error)
            self._generation_totals.add(_generation_totals(gen))

    # ---- discovery -------------------------------------------------------------------------------

    async def on_engine_event(self, ev: ChangeEvent) -> None:
        st = self.engines.get(ev.target)
        if st is None:
            return
        st.snapshot = ev.snapshot
        st.probed = True
        if ev.snapshot.reachable:
            st.last_good = ev.snapshot
            st.unreachable_since = None
            if st.down:
                st.down = False
                _log.info("engine_back", pool=self.name, engine=st.spec.name)
        elif st.unreachable_since is None:
            st.unreachable_since = time.monotonic()
        if isinstance(ev, EngineUnreachableEvent):  # once per outage
            _log.warning("engine_unreachable", pool=self.name, engine=st.spec.name, error=ev.error)
        elif isinstance(ev, EngineReachable):
            _log.info("engine_reachable", pool=self.name, engine=st.spec.name)
        if isinstance(ev, IncarnationChanged):
            async with self._reconcile_lock:
                await self._restart_engine_members(st.worker_id)
        await self.reconcile()

    def add_engine(self, spec: EngineSpec) -> EngineTarget:
        """A new engine of this pool (from config, or found by DNS); probed before it is used."""
        target = EngineTarget(host=spec.host, grpc_port=spec.grpc_port, static=spec.static)
        st = EngineState(spec, worker_id_for(spec.name), target)
        self.engines[target.name] = st
        self.by_worker[st.worker_id] = st
        return target

    def target_of(self, engine_name: str) -> str | None:
        for key, st in self.engines.items():
            if st.spec.name == engine_name:
                return key
        return None

    async def remove_engine(self, engine_name: str, *, reconcile: bool = True) -> None:
        """The engine left the fleet: its subscribers stop and its members are removed
        (``reconcile=False``: a reload that adds engines next reconciles once at the end)."""
        key = self.target_of(engine_name)
        if key is None:
            return
        st = self.engines[key]
        async with self._reconcile_lock:
            gone = [k for k in self.subscribers if k.worker_id == st.worker_id]
            await self._stop_subscribers(gone)
            gen = self.generation
            if gen is not None:
                for wid, rank in list(gen.pool.members().values()):
                    if wid == st.worker_id:
                        gen.remove_member(SourceKey(wid, rank))
                        self.counters.reset("engine_removed")
            del self.engines[key]
            del self.by_worker[st.worker_id]
        if reconcile:
            await self.reconcile()

    async def _restart_engine_members(self, worker_id: int) -> None:
        """New incarnation: stop the engine's subscribers, clear its members; ``reconcile`` then
        starts fresh subscribers that replay the new incarnation from sequence 0."""
        await self._stop_subscribers([k for k in self.subscribers if k.worker_id == worker_id])
        gen = self.generation
        if gen is None:
            return
        gen.reset_engine(worker_id)
        self.counters.reset("incarnation")

    def tick(self, now: float) -> None:
        """Periodic checks (the relay calls this about once a second): engines down, and
        restart backoff forgotten for sources that have been healthy again for a while; the
        connect endpoint bound (or re-bound after a failure); restored members expired."""
        if self.connected is not None:
            self.connected.tick(now)
        if self._resume and now >= self._resume_deadline:
            self._expire_resumes()
        for key, (_attempt, not_before) in list(self._restarts.items()):
            sub = self.subscribers.get(key)
            if sub is not None and sub.connected and now - not_before >= RESTART_STABLE_S:
                del self._restarts[key]
        grace = self.engine_down_grace_s
        for st in self.engines.values():
            if st.down or st.unreachable_since is None or now - st.unreachable_since < grace:
                continue
            subs = [s for k, s in self.subscribers.items() if k.worker_id == st.worker_id]
            if any(s.disconnected_since is None or now - s.disconnected_since < grace
                   for s in subs):
                continue  # a live ZMQ stream outvotes Control: the state is still exact
            st.down = True
            self.counters.engines_down += 1
            _log.warning(
                "engine_down", pool=self.name, engine=st.spec.name, grace_s=grace,
                error=None if st.snapshot is None else st.snapshot.error,
            )  # fmt: skip
            self._ctx.schedule(self._engine_down(st.worker_id))

    def _expire_resumes(self) -> None:
        """Restored members whose engine never offered a source to vouch for them: cleared."""
        gen, pending, self._resume = self.generation, self._resume, {}
        for key in pending:
            if gen is not None:
                gen.reset_member(key)
            self.counters.reset("restore_unverified")
        _log.warning("state_members_unverified", pool=self.name, members=len(pending))

    async def _engine_down(self, worker_id: int) -> None:
        async with self._reconcile_lock:
            await self._stop_subscribers([k for k in self.subscribers if k.worker_id == worker_id])
            gen = self.generation
            if gen is not None and gen.reset_engine(worker_id):
                self.counters.reset("engine_down")
        await self.reconcile()

    def _desired(self, block_size: int) -> dict[SourceKey, SourceSpec]:
        desired: dict[SourceKey, SourceSpec] = {}
        for st in self.engines.values():
            snap = st.snapshot
            if snap is None or st.down:
                continue
            if not snap.reachable:
                # keep what runs (state stays valid while the stream lives), add nothing new
                for key, spec in self.source_specs.items():
                    if key.worker_id == st.worker_id and spec.kv_block_size == block_size:
                        desired[key] = spec
                continue
            if snap.kv_block_size and snap.kv_block_size != block_size:
                if st.block_size_conflict != snap.kv_block_size:  # once per conflict, not per pass
                    st.block_size_conflict = snap.kv_block_size
                    self.counters.block_size_conflicts += 1
                    _log.warning(
                        "engine_block_size_conflict", pool=self.name, engine=st.spec.name,
                        engine_block_size=snap.kv_block_size, pool_block_size=block_size,
                    )  # fmt: skip
                continue
            st.block_size_conflict = None
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
                    kind=st.spec.kind,
                    engine=st.spec.name,
                    pool=self.name,
                )
        return desired

    def _startable(self, key: SourceKey, now: float) -> bool:
        entry = self._restarts.get(key)
        return entry is None or now >= entry[1]

    async def reconcile(self) -> None:
        if self._stopped:
            return
        async with self._reconcile_lock:
            await self._reconcile()
        self._ctx.changed()

    async def _reconcile(self) -> None:
        ident, conflict = pool_identity(self.spec, list(self.engines.values()), self.identity)
        if conflict is not None:
            if conflict != self.conflict:
                self.counters.identity_conflicts += 1
                _log.error("pool_identity_conflict", pool=self.name, reason=conflict)
            self.conflict = conflict
            await self._withdraw(f"pool withdrawn: {conflict}")
            return
        self.conflict = None
        if ident is None:
            return  # nothing known yet: nothing to subscribe
        if self.generation is not None and self.identity != ident:
            self.counters.identity_changes += 1
            _log.warning(
                "pool_identity_changed", pool=self.name,
                old=None if self.identity is None else repr(self.identity), new=repr(ident),
            )  # fmt: skip
            await self._withdraw("pool identity changed; requires a fresh snapshot")
        self.identity = ident
        desired = self._desired(ident.block_size)
        now = time.monotonic()
        connected = self.connected is not None and self.connected.live
        if not connected and not any(
            self._startable(k, now) or k in self.subscribers for k in desired
        ):
            if any(not st.probed for st in self.engines.values()):
                return  # an engine just added (a reload, DNS) may bring sources: its probe decides
            await self._withdraw("pool withdrawn: no active source")
            return
        if self.generation is None:
            if now < self._rebuild_not_before:
                return  # a delayed rebuild is scheduled (repeated fences)
            self._materialize(ident)
        gen = self.generation
        assert gen is not None
        gone = [
            k for k in self.subscribers if k not in desired or desired[k] != self.source_specs[k]
        ]
        await self._stop_subscribers(gone)
        for key in gone:
            gen.remove_member(key)
        for key, spec in desired.items():
            if key in self.subscribers or not self._startable(key, now):
                continue
            sub = Subscriber(spec, self, resume=self._resume_for(key, gen))
            self.subscribers[key] = sub
            self.source_specs[key] = spec
            try:
                await sub.start()
            except Exception as exc:  # e.g. an endpoint ZMQ refuses: counted, retried later
                self.on_failed(key, exc)

    async def _withdraw(self, why: str) -> None:
        if self.generation is not None:
            gen = self.generation
            self._retire(gen, RelayError.publication_unavailable(why))
            _log.warning(
                "pool_withdrawn", pool=self.name, generation=gen.layout_generation, why=why
            )
        await self._stop_subscribers(list(self.subscribers))

    async def _stop_subscribers(self, keys: list[SourceKey]) -> None:
        for key in keys:
            sub = self.subscribers.pop(key, None)
            self.source_specs.pop(key, None)
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.stop()
                self._fold_source(key, sub.counters)

    async def respec(self, spec: PoolSpec, *, rematerialize: bool) -> None:
        """A reload changed the pool's settings (the caller adds and removes engines, then
        reconciles). With ``rematerialize`` the generation is withdrawn, to be rebuilt under the
        new settings; otherwise it goes on (sources whose settings changed restart on reconcile)."""
        async with self._reconcile_lock:
            connect_changed = spec.connect != self.spec.connect
            self.spec = spec
            if connect_changed:  # a new endpoint or pattern: its members start over (§22)
                if self.connected is not None:
                    await self.connected.stop(retire=True)
                self.connected = ConnectedMembers(self) if spec.connect is not None else None
            if rematerialize:
                self.counters.reconfigurations += 1
                await self._withdraw("pool settings changed by a reload; requires a fresh snapshot")
                self._restarts.clear()

    async def close(self, why: str) -> None:
        """The pool left the configuration: its subscribers end with PUBLICATION_UNAVAILABLE
        (after the catalog without it is published) and its sources stop."""
        self._stopped = True
        async with self._reconcile_lock:
            if self.connected is not None:
                await self.connected.stop()
            await self._withdraw(why)

    async def stop(self, save: Callable[[PoolSpec, PoolIdentity, Pool, list[MemberResume]], None]
                   | None = None) -> None:
        """Stop every source, then (``save``) hand the exact state to the state file, then end
        the streams with a clean EOF."""
        self._stopped = True
        async with self._reconcile_lock:
            if self.connected is not None:
                await self.connected.stop()
            subs = dict(self.subscribers)
            await self._stop_subscribers(list(self.subscribers))
            gen = self.generation
            if save is not None and gen is not None and self.identity is not None:
                save(self.spec, self.identity, gen.pool, self.members_to_save(subs))
            if gen is not None:  # shutdown: clean EOF for subscribers
                self._retire(gen, None, publish=False)

    def members_to_save(self, subs: dict[SourceKey, Subscriber]) -> list[MemberResume]:
        """Where each member stands for a state file: restored members not yet vouched for
        unchanged, and each subscriber's resume point (none: not saved, rebuilt on restore)."""
        members = list(self._resume.values())
        for key, sub in subs.items():
            point = sub.resume_point()
            st = self.by_worker.get(key.worker_id)
            if point is None or st is None:
                continue
            inc = "" if st.snapshot is None else st.snapshot.instance_id
            members.append(MemberResume(key.worker_id, key.dp_rank, st.spec.name, inc,
                                        point[0], point[1]))  # fmt: skip
        return members

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
        if self.connected is not None:
            sources += self.connected.source_stats()
        c = self.counters
        return PoolStats(
            name=self.name,
            bucket_count=self.spec.bucket_count,
            materialized=gen is not None,
            counters={f.name: getattr(c, f.name) for f in fields(c) if f.name != "member_resets"}
            | counter_values(self.connected.counters if self.connected else None),
            member_resets=dict(c.member_resets),
            generations=totals,
            generation=gstats,
            sources=tuple(sources),
            engines=tuple(
                EngineStats(
                    st.spec.name, st.reachable, st.down,
                    tuple(sorted(st.snapshot.unknown)) if st.snapshot is not None else (),
                )
                for st in self.engines.values()
            ),
        )

    def _engine_name(self, worker_id: int) -> str:
        st = self.by_worker.get(worker_id)
        if st is not None:
            return st.spec.name
        named = self.connected.name_of(worker_id) if self.connected else None
        return named if named is not None else str(worker_id)


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
