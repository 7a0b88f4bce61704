"""One configured pool at run time: its engines, subscribers and current generation.

This module is the member lifecycle (subscribers, reconcile, fences, withdrawal, stop); its
other jobs sit beside it: the engine table (``engines.py``), what the planes see of the pool
(``pool_view.py``), a new generation's parts (``materialize.py``), the restored state from a
state file to vouched members and back (``restore.py``), and the pool's stats (``pool_stats.py``).

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
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.discovery.endpoints import SourceInfo, connects_instead_of_binding
from kvrelay.discovery.events import ChangeEvent, IncarnationChanged
from kvrelay.discovery.watcher import EngineTarget
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.sink import ResetReason, SourceKey, SourceSpec
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.logging import LogThrottle, get_logger
from kvrelay.pool.batch import AnyBatch
from kvrelay.pool.pool import Pool
from kvrelay.pool.scrub import Finding
from kvrelay.publication.load import RankLoad
from kvrelay.publication.readiness import EndpointState
from kvrelay.relay import pool_view
from kvrelay.relay.connected import ConnectedMembers
from kvrelay.relay.context import RelayContext
from kvrelay.relay.engines import (
    EngineState,
    EngineTable,
    PoolIdentity,
    pool_identity,
    worker_id_for,
)
from kvrelay.relay.generation import Generation
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.materialize import empty_pool, producer_identity
from kvrelay.relay.pool_stats import generation_totals, pool_stats
from kvrelay.relay.restore import PoolRestore
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.relay.stats import GenerationTotals, PoolCounters, PoolStats, merged

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


class PoolRuntime:
    """Implements ``kvrelay.ingest.sink.BatchSink`` for the pool's members."""

    def __init__(
        self, spec: PoolSpec, ctx: RelayContext, engine_down_grace_s: float = 30.0
    ) -> None:
        self.spec = spec
        self._ctx = ctx
        self.engine_down_grace_s = engine_down_grace_s
        self.table = EngineTable()
        self.engines: dict[str, EngineState] = self.table.engines  # the same dicts
        self.by_worker: dict[int, EngineState] = self.table.by_worker
        for e in spec.engines:
            if e.dns is None:  # DNS templates stand for engines that membership adds later
                self.add_engine(e)
        self.subscribers: dict[SourceKey, Subscriber] = {}
        self.source_specs: dict[SourceKey, SourceSpec] = {}
        self.generation: Generation | None = None
        self.counters = PoolCounters()
        # ``member_reset`` at most every 10 s per member and reason: a publisher (on a connect
        # socket, anyone it admits) resets its member at each message numbered past a gap, or
        # undecodable; each member's first reset is still logged
        self._reset_log = LogThrottle()
        self.identity: PoolIdentity | None = None
        self.conflict: str | None = None
        self._reconcile_lock = asyncio.Lock()
        self._restarts: dict[SourceKey, tuple[int, float]] = {}  # key → (attempt, not before)
        #: sources left out for another engine's at the same publisher (``_without_duplicates``)
        self._duplicates: set[SourceKey] = set()
        self._materialized_at = 0.0
        self._fence_streak = 0
        self._rebuild_not_before = 0.0
        #: subscribers a fence took out, until its rebuild (or the pool's stop) has stopped them
        self._detached: list[tuple[SourceKey, Subscriber]] = []
        self._stopped = False
        #: The last catalog entry and what it was made of (``descriptor``).
        self._descriptor: tuple[pool_view.DescriptorInputs, pb.KvPoolDescriptor] | None = None
        # Final counters of retired subscribers and generations (monotonic stats), by source
        # for the engines the pool has now; those of engines that left are summed in
        # ``_departed`` (a fleet whose pods come back under new addresses grew this, and the
        # metrics' series, by one entry per (engine, rank) ever seen).
        self._source_totals: dict[SourceKey, SubscriberCounters] = {}
        self._departed: SubscriberCounters | None = None
        self._generation_totals = GenerationTotals()
        self.connected = ConnectedMembers(self) if spec.connect is not None else None
        #: The connect section a reload last replaced or removed: its counters (and departed
        #: members') go on in the next one, so they never go backwards within the process.
        self._connect_before: ConnectedMembers | None = None
        #: The state file's pool and members, from a start's restore to their vouching.
        self.restore = PoolRestore(self.counters)

    # ---- BatchSink -------------------------------------------------------------------------------

    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
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
        if result.blocks_stored and gen.held(source) > self.spec.max_member_blocks:
            self.on_reset(source, ResetReason.BLOCK_CAP)  # what it holds cannot be an engine's

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self.counters.reset(reason.value)
        gen = self.generation
        if gen is None:
            return
        gen.reset_member(source)
        self._settled(source)
        self._log_reset(source, reason.value)

    def _log_reset(self, source: SourceKey, reason: str) -> None:
        not_logged = self._reset_log.due(f"{reason} {source.worker_id} {source.dp_rank}")
        if not_logged is None:
            return  # counted (kvrelay_pool_member_resets_total); logged at most every 10 s each
        _log.warning(
            "member_reset", pool=self.name, engine=self._engine_name(source.worker_id),
            dp_rank=source.dp_rank, reason=reason, resets_not_logged=not_logged,
        )  # fmt: skip

    def _reset_engine(self, gen: Generation, worker_id: int, reason: str) -> None:
        """Every member of one engine reset at once: each counted and logged as one reset
        would be (one count per engine undercounted a DP engine's resets, and none was
        logged)."""
        for rank in gen.reset_engine(worker_id):
            self.counters.reset(reason)
            self._log_reset(SourceKey(worker_id, rank), reason)

    def on_rebuild(self, source: SourceKey, active: bool) -> None:
        gen = self.generation
        if gen is None:
            return
        if active:
            gen.hold(source)
        else:
            gen.release(source)

    def on_vouched(self, source: SourceKey) -> None:
        """A member restored from a state file was vouched for by its engine."""
        self.counters.members_vouched += 1
        self._settled(source)

    def _settled(self, source: SourceKey) -> None:
        if self.restore.settled(source):
            _log.info("state_members_vouched", pool=self.name)
            self._ctx.changed()  # the generation is published now

    @property
    def published(self) -> Generation | None:
        """The generation routers may see: none while members restored from a file still wait
        for their engine to vouch for them (``restore.awaiting``)."""
        gen = self.generation
        return None if gen is None or self.restore.awaiting else gen

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
            self._settled(source)
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

    def base_model(self) -> str | None:
        """The canonical model id the pool registers (config, else what its engines serve)."""
        return pool_view.base_model(self.spec, self.engines.values(), self.identity)

    def lora_names(self) -> list[str]:
        """LoRA adapters any reachable engine serves (see ``pool_view.lora_names``)."""
        return pool_view.lora_names(self.spec, self.engines.values(), self.identity)

    def descriptor(self) -> pb.KvPoolDescriptor | None:
        """The pool's catalog entry: the same object while nothing it is made of changed (so
        ``Relay.refresh_planes`` can tell an unchanged catalog without serializing it)."""
        inputs = pool_view.descriptor_inputs(
            self.spec, self.engines.values(), self.published, self.identity
        )
        if inputs is None:
            return None
        held = self._descriptor
        if held is not None and inputs.same(held[0]):
            return held[1]
        d = pool_view.build_descriptor(inputs)
        self._descriptor = (inputs, d)
        return d

    def endpoint_state(self) -> EndpointState | None:
        return pool_view.endpoint_state(
            self.spec, self.engines.values(), self.published, self.identity, self.connected
        )

    def load_input(self) -> tuple[pb.ProducerIdentity, list[RankLoad]] | None:
        """One entry per rank every engine declares (see ``pool_view.load_input``)."""
        return pool_view.load_input(
            self.engines.values(), self.published, self.subscribers, self.connected
        )

    # ---- generations -----------------------------------------------------------------------------

    def _materialize(self, ident: PoolIdentity) -> Generation:
        restored = self.restore.take_pool(self.spec, ident, self.name)
        pool, resume = restored if restored is not None else (empty_pool(self.spec, ident), {})
        gen = Generation(
            name=self.name, pool=pool, producer=producer_identity(self.spec, self._ctx, ident),
            ctx=self._ctx,
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
            self.restore.begin(gen, resume, self.by_worker, self._materialized_at)
        return gen

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
        self._ctx.schedule(self._rebuild(self._detach_subscribers(), delay))

    def _detach_subscribers(self) -> list[tuple[SourceKey, Subscriber]]:
        """Take every subscriber out of the pool now, fed to nothing, to be stopped later. A
        reconcile that runs before they stop (one already waiting for the lock, a connected
        member's first batch) would otherwise build the next generation and keep them feeding
        it; their replacements then replay from the start onto that generation, and its batches
        count twice (stores as extra copies: phantoms once the engine evicts)."""
        out = []
        for key in list(self.subscribers):
            sub = self.subscribers.pop(key)
            self.source_specs.pop(key, None)
            self.restore.settled(key)
            sub.detach()
            out.append((key, sub))
        self._detached += out
        return out

    async def _rebuild(self, detached: list[tuple[SourceKey, Subscriber]], delay: float) -> None:
        await self._stop_detached(detached)
        await self._reconcile_after(delay)

    async def _stop_detached(self, detached: list[tuple[SourceKey, Subscriber]]) -> None:
        for item in detached:
            if item not in self._detached:
                continue  # stopped already (the pool's stop came first)
            self._detached.remove(item)
            key, sub = item
            with contextlib.suppress(Exception):
                await sub.stop()
            self._fold_source(key, sub.counters)

    def _retire(
        self, gen: Generation, error: RelayError | None, *, publish: bool = True,
        state_goes: bool = True,
    ) -> None:
        """Retire ``gen``: the catalog without it is published first, then its subscribers end
        with ``error`` (or a clean EOF), and its final counters are kept. ``state_goes``: its
        exact state goes with it (not so for a refilter, whose new generation carries it)."""
        if self.generation is gen:
            self.generation = None
        if error is not None and state_goes:  # (a clean stop saves the waiting members as is)
            self.restore.abandon(gen, self.name)
        if publish:
            self._ctx.changed()
        if not gen.retired:
            gen.retire(error)
            self._generation_totals.add(generation_totals(gen))

    # ---- discovery -------------------------------------------------------------------------------

    async def on_engine_event(self, ev: ChangeEvent) -> None:
        st = self.table.observe(ev, self.name)
        if st is None:
            return
        if isinstance(ev, IncarnationChanged):
            async with self._reconcile_lock:
                await self._restart_engine_members(st.worker_id)
        await self.reconcile()

    def add_engine(self, spec: EngineSpec) -> EngineTarget:
        """A new engine of this pool (from config, or found by DNS); probed before it is used."""
        return self.table.add(spec)

    def target_of(self, engine_name: str) -> str | None:
        return self.table.target_of(engine_name)

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
            self.table.remove(key)
            self._forget_sources(st.worker_id)
        if reconcile:
            await self.reconcile()

    async def _restart_engine_members(self, worker_id: int) -> None:
        """New incarnation: stop the engine's subscribers, clear its members; ``reconcile`` then
        starts fresh subscribers that replay the new incarnation from sequence 0."""
        await self._stop_subscribers([k for k in self.subscribers if k.worker_id == worker_id])
        gen = self.generation
        if gen is not None:
            self._reset_engine(gen, worker_id, ResetReason.INCARNATION.value)

    def tick(self, now: float) -> None:
        """Periodic checks (the relay calls this about once a second): engines down, and
        restart backoff forgotten for sources that have been healthy again for a while; the
        connect endpoint bound (or re-bound after a failure); restored members expired."""
        if self.connected is not None:
            self.connected.tick(now)
        if self.restore.due(now):
            self.restore.expire(self.generation, self.name)
            if not self.restore.awaiting:
                self._ctx.changed()
        # resumed, never vouched for (or caught up with the replay after it) nor reset: restarted
        for key in self.restore.overdue(now, self._next_seq):
            self.on_failed(key, TimeoutError("restored state not vouched for in time"))
            if not self.restore.awaiting:
                self._ctx.changed()
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

    def _next_seq(self, key: SourceKey) -> int | None:
        """The next sequence ``key``'s subscriber expects (how far its replay has come)."""
        sub = self.subscribers.get(key)
        return None if sub is None else sub.next_seq

    async def _engine_down(self, worker_id: int) -> None:
        async with self._reconcile_lock:
            await self._stop_subscribers([k for k in self.subscribers if k.worker_id == worker_id])
            gen = self.generation
            if gen is not None:
                self._reset_engine(gen, worker_id, "engine_down")
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
            self._note_connecting(st, snap.sources)
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
        return self._without_duplicates(desired)

    def _without_duplicates(
        self, desired: dict[SourceKey, SourceSpec]
    ) -> dict[SourceKey, SourceSpec]:
        """One subscription per publisher: a source another engine of the pool already reports
        (the same endpoint, topic and DP rank; two Control endpoints, or a proxy and the engine,
        naming one engine) would count that engine's blocks twice, and keep them after one of
        the two went down. The source already subscribed wins, else the engine listed first;
        the other is left out, counted and logged once, and taken when the first one goes."""
        owner: dict[tuple[str, bytes, int], SourceKey] = {}
        found: set[SourceKey] = set()
        for key in sorted(desired, key=lambda k: k not in self.subscribers):
            spec = desired[key]
            where = (spec.endpoint, spec.topic, spec.dp_rank)
            first = owner.setdefault(where, key)
            if first.worker_id == key.worker_id:
                continue
            del desired[key]
            found.add(key)
            if key not in self._duplicates:
                self.counters.source_duplicates += 1
                _log.warning(
                    "engine_source_duplicate", pool=self.name, engine=spec.engine,
                    dp_rank=key.dp_rank, endpoint=spec.endpoint,
                    same_as=desired[first].engine,
                )  # fmt: skip
        self._duplicates = found
        return desired

    def _note_connecting(self, st: EngineState, sources: Iterable[SourceInfo]) -> None:
        """Log, once per endpoint, a publisher the engine reports on ``tcp://0.0.0.0:…``: vLLM
        binds only an endpoint with ``*`` or ``::``, so that engine connects there instead of
        listening and its source stays silent (``connects_instead_of_binding``)."""
        found = frozenset(s.advertised_endpoint for s in sources
                          if connects_instead_of_binding(s.advertised_endpoint))  # fmt: skip
        for endpoint in sorted(found - st.connecting):
            _log.warning("engine_publisher_not_listening", pool=self.name, engine=st.spec.name,
                         endpoint=endpoint)  # fmt: skip
        st.connecting = found

    def _startable(self, key: SourceKey, now: float) -> bool:
        entry = self._restarts.get(key)
        return entry is None or now >= entry[1]

    async def reconcile(self) -> None:
        if self._stopped:
            return
        async with self._reconcile_lock:
            await self._reconcile()
            self._forget_undeclared()
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
            # its engine no longer lists the rank (or its block size no longer fits, or another
            # engine reports its publisher), or reports it at another endpoint: the blocks go
            reason = "source_changed" if key in desired else "rank_removed"
            self.counters.reset(reason)
            self._log_reset(key, reason)
        for key, spec in desired.items():
            if key in self.subscribers or not self._startable(key, now):
                continue
            r = self.restore.resume_for(key, gen, self.by_worker, now)
            sub = Subscriber(
                spec,
                self,
                resume=None if r is None else (r.last_seq, r.digest),
                groups=None if r is None else dict(r.groups),
                groups_unsure=r is not None and r.groups_unsure,
                reader=self._ctx.zmq_reader,
            )
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
            # no longer awaited: every caller resets, removes or retires its state next
            self.restore.settled(key)
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.stop()
                self._fold_source(key, sub.counters)

    async def respec(self, spec: PoolSpec, *, rematerialize: bool) -> None:
        """A reload changed the pool's settings (the caller adds and removes engines, then
        reconciles). With ``rematerialize`` a new generation is needed: when only the filter's
        shape changed (``expected_blocks``, ``ckf_seed``) it is built at once from the exact
        state the relay holds, its sources going on; otherwise (hash or decode settings: other
        canonical hashes) the generation is withdrawn and rebuilt from replay. Without it the
        generation goes on (sources whose settings changed restart on reconcile)."""
        async with self._reconcile_lock:
            connect_changed = spec.connect != self.spec.connect
            old_spec, self.spec = self.spec, spec
            if connect_changed:  # a new endpoint or pattern: its members start over (§22)
                old = self.connected
                if old is not None:
                    await old.stop(retire=True)  # (their counters go on: ``carried``)
                    self._connect_before = old
                self.connected = (
                    ConnectedMembers(self, self._connect_before)
                    if spec.connect is not None else None
                )  # fmt: skip
            if rematerialize:
                self.counters.reconfigurations += 1
                if not self._refilter(old_spec, spec):
                    await self._withdraw(
                        "pool settings changed by a reload; requires a fresh snapshot"
                    )
                self._restarts.clear()

    def _refilter(self, old: PoolSpec, new: PoolSpec) -> bool:
        """Replace the generation by one holding the same exact state under the new filter shape;
        False when that does not apply (no generation, or settings that change what the exact
        state holds)."""
        gen = self.generation
        shape_only = (old.hash_format, old.decode, old.engine_reports) == (
            new.hash_format, new.decode, new.engine_reports
        )
        if gen is None or not shape_only:
            return False
        return self._regenerate(
            gen, "pool settings changed by a reload; requires a fresh snapshot", "reload"
        )

    def _regenerate(self, gen: Generation, why: str, cause: str) -> bool:
        """Retire ``gen`` (its streams end with ``PUBLICATION_UNAVAILABLE: why``) for a new
        generation whose filter is built from ``gen``'s exact state under the current settings
        (``Pool.refiltered``); its sources go on, nothing is replayed. False, changing nothing,
        when there is no identity or the exact state does not load as one consistent state."""
        ident = self.identity
        if ident is None or gen.retired or gen is not self.generation:
            return False
        try:
            pool = gen.pool.refiltered(self.spec.bucket_count, self.spec.ckf_seed)
        except ValueError as exc:
            _log.error("pool_refilter_failed", pool=self.name, cause=cause, error=str(exc))
            return False
        self._retire(gen, RelayError.publication_unavailable(why), state_goes=False)
        fresh = Generation(
            name=self.name, pool=pool, producer=producer_identity(self.spec, self._ctx, ident),
            ctx=self._ctx, on_fence=self.fence,
        )  # fmt: skip
        self.generation = fresh
        self.restore.carry(gen, fresh)  # restored members still waiting wait on in ``fresh``
        self._materialized_at = time.monotonic()
        self.counters.generations += 1
        _log.info(
            "pool_refiltered", pool=self.name, cause=cause,
            layout_generation=fresh.layout_generation, bucket_count=self.spec.bucket_count,
            fingerprints=pool.occupancy, capacity_omissions=pool.capacity_omissions,
        )  # fmt: skip
        self._ctx.changed()
        return True

    def on_scrubbed(self, gen: Generation, finding: Finding | None) -> None:
        """A full scrub pass over ``gen`` ended. A divergence fences it: a filter that is not the
        exact state's is rebuilt from the exact state at once; an exact state that disagrees
        with itself is rebuilt from replay (``fence``)."""
        if gen is not self.generation:
            return
        self.counters.scrub_passes += 1
        if finding is None:
            return
        self.counters.scrub_divergences += 1
        _log.error(
            "scrub_divergence", pool=self.name, generation=gen.layout_generation,
            why=finding.why, exact_state=finding.exact_state,
        )  # fmt: skip
        why = f"generation fenced: scrub: {finding.why}"
        if not finding.exact_state and self._regenerate(gen, why, "scrub"):
            self.counters.fences += 1
            return
        self.fence(gen, f"scrub: {finding.why}")

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
            await self._stop_detached(list(self._detached))
            gen = self.generation
            if save is not None and gen is not None and self.identity is not None:
                save(self.spec, self.identity, gen.pool, self.members_to_save(subs))
            if gen is not None:  # shutdown: clean EOF for subscribers
                self._retire(gen, None, publish=False)

    def members_to_save(self, subs: dict[SourceKey, Subscriber]) -> list[MemberResume]:
        """Where each member stands for a state file (a clean stop's or a checkpoint's)."""
        return self.restore.members_to_save(subs, self.by_worker)

    def _fold_source(self, key: SourceKey, counters: SubscriberCounters) -> None:
        if key.worker_id not in self.by_worker:  # its engine left (a stop that ended late)
            self._fold_departed(counters)
            return
        prev = self._source_totals.get(key)
        self._source_totals[key] = counters if prev is None else merged(prev, counters)

    def _fold_departed(self, counters: SubscriberCounters) -> None:
        prev = self._departed
        self._departed = counters if prev is None else merged(prev, counters)

    def _forget_sources(self, worker_id: int) -> None:
        """An engine left the pool: nothing stays keyed by an engine the pool no longer has."""
        self._drop_records(lambda k: k.worker_id == worker_id)

    def _drop_records(self, drop: Callable[[SourceKey], bool]) -> list[SourceKey]:
        """The per-source records of the sources ``drop`` names go: what they counted joins the
        departed sum, their restart backoff is forgotten. Returns those that had counted."""
        for key in [k for k in self._restarts if drop(k)]:
            del self._restarts[key]
        gone = [k for k in self._source_totals if drop(k)]
        for key in gone:
            self._fold_departed(self._source_totals.pop(key))
        return gone

    def _forget_undeclared(self) -> None:
        """Per-source records only for the DP ranks each engine declares now (or that run):
        a rank its engine no longer lists leaves what its sources counted to the departed sum,
        its restart backoff goes, and the member its source left behind (a failed source's,
        reset by ``on_failed``; a down or restarted engine's, reset by ``reset_engine``) is
        removed, counted as ``rank_removed``. A Control that named other ranks at every probe
        grew all three, and ``/metrics`` by one set of series per rank, without bound. Every
        such member's source was folded into ``_source_totals`` when it stopped, so only those
        keys are looked at. Connected members (no configured engine) are not this method's,
        nor anything while restored members are still awaited (``RESTORE_VOUCH_S`` at most)."""
        if self.restore.awaiting:
            return
        declared: dict[int, frozenset[int]] = {}

        def stale(key: SourceKey) -> bool:
            if key in self.subscribers:
                return False
            st = self.by_worker.get(key.worker_id)
            if st is None:
                return False  # an engine that left (``_forget_sources``) or a connected member
            ranks = declared.get(key.worker_id)
            if ranks is None:
                listed = [s.dp_rank for s in st.last_good.sources] if st.last_good else []
                ranks = declared[key.worker_id] = frozenset((*st.declared_ranks(), *listed))
            return key.dp_rank not in ranks

        gone = self._drop_records(stale)
        if not gone:
            return
        gen = self.generation
        held = set(gen.pool.members().values()) if gen is not None and not gen.retired else set()
        for key in gone:
            if gen is not None and (key.worker_id, key.dp_rank) in held:
                gen.remove_member(key)
                self.counters.reset("rank_removed")

    # ---- statistics ------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """A snapshot of the pool's counters and gauges (monotonic across replacements)."""
        return pool_stats(
            name=self.name,
            bucket_count=self.spec.bucket_count,
            gen=self.generation,
            retired=self._generation_totals,
            source_totals=self._source_totals,
            departed=self._departed,
            subscribers=self.subscribers,
            # (a section a reload removed: its counters stay, as they were)
            connected=self.connected or self._connect_before,
            counters=self.counters,
            engines=self.engines.values(),
            engine_name=self._engine_name,
        )

    def _engine_name(self, worker_id: int) -> str:
        st = self.by_worker.get(worker_id)
        if st is not None:
            return st.spec.name
        named = self.connected.name_of(worker_id) if self.connected else None
        return named if named is not None else str(worker_id)

