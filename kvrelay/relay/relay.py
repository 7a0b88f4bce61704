"""``Relay``: owns identity, pools, discovery and the three planes; implements ``RelayView``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from kvrelay._aio import cancel_all, stop_all
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay._text import is_decimal
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import PermitCounter
from kvrelay.contract.producer import producer_key
from kvrelay.discovery.dns import make_resolver
from kvrelay.discovery.errors import InvalidEndpoint
from kvrelay.discovery.events import ChangeEvent
from kvrelay.discovery.metrics_scrape import MetricsScrapeError, scrape_engine_page
from kvrelay.discovery.watcher import EngineWatcher
from kvrelay.hashing import identity
from kvrelay.logging import get_logger
from kvrelay.publication.catalog import CatalogPlane, validate_descriptor
from kvrelay.publication.hub import Subscription
from kvrelay.publication.load import LoadPlane, PoolLoadInput
from kvrelay.publication.readiness import EndpointState, ReadinessPlane, validate_endpoint
from kvrelay.publication.serving_load import ServingLoadInputs, ServingLoadPlane
from kvrelay.publication.window import unix_ms
from kvrelay.relay import checkpoint, handover, safe_files
from kvrelay.relay.context import RelayContext
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.generation import Generation
from kvrelay.relay.membership import DnsMembership
from kvrelay.relay.observer import Observers
from kvrelay.relay.pool_runtime import EngineState, PoolRuntime
from kvrelay.relay.reconfigure import ReloadPlan, plan_reload
from kvrelay.relay.scrubber import Scrubber
from kvrelay.relay.serving import Page, ServingInputs, page_model
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings, engine_reach
from kvrelay.relay.stats import RelayStats

#: A downstream relay's spacing request lapses this long after its last renewal.
HOLD_TTL_S = 1.0

_log = get_logger(__name__)


class Relay:
    """The orchestrator. Start it inside a running event loop; ``stop()`` ends everything."""

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.relay_incarnation = identity.new_relay_incarnation()
        drt = settings.drt_instance_id
        if drt is None:
            drt = int.from_bytes(secrets.token_bytes(8), "little") or 1
        self.relay_identity = pb.RelayIdentity(
            drt_instance_id=drt, relay_incarnation=self.relay_incarnation
        )
        self.dc_id = identity.dc_id(settings.dc_name)
        self._layout = identity.LayoutGenerationCounter()
        self.catalog = CatalogPlane(self.relay_identity)
        self.readiness = ReadinessPlane(self.relay_identity)
        #: What the planes were last set from without an error (``refresh_planes``).
        self._catalog_set: list[pb.KvPoolDescriptor] | None = None
        self._topology_set: list[tuple[object, ...]] | None = None
        self.hub_permits = PermitCounter(
            "initialized pool hubs", self.limits.max_initialized_pool_hubs
        )
        self.observers = Observers()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ctx = ctx = RelayContext(
            relay_identity=self.relay_identity,
            dc_id=self.dc_id,
            limits=self.limits,
            hub_permits=self.hub_permits,
            encode_gate=asyncio.Semaphore(self.limits.publication_encoding_concurrency),
            next_layout_generation=self._layout.next,
            schedule=self._schedule,
            changed=self.refresh_planes,
            evict_idle_hub=self._evict_idle_hub,
            observers=self.observers,
            zmq_reader=self.settings.zmq_reader,
        )
        self.pools = [
            PoolRuntime(spec, ctx, engine_down_grace_s=settings.engine_down_grace_s)
            for spec in settings.pools
        ]
        self._by_target: dict[str, PoolRuntime] = {
            name: p for p in self.pools for name in p.engines
        }
        #: (pool, engine) → spec of configured engines a reload could not add because another
        #: engine (one DNS found) is reached there; added once that one goes (``_retry_skipped``)
        self._skipped: dict[tuple[str, str], EngineSpec] = {}
        self.load = LoadPlane(
            self.relay_identity,
            window_ms=max(1, round(self.limits.load_window_s * 1000)),
            provider=self._load_inputs,
        )
        self._serving = ServingInputs(lambda: self.pools)
        self.serving_load = ServingLoadPlane(
            self.relay_identity,
            window_ms=self.load.window_ms,
            provider=self._serving_inputs,
        )
        self.watcher = EngineWatcher(
            [st.target for p in self.pools for st in p.engines.values()],
            self._on_discovery,
            interval=settings.discovery_interval_s,
            timeout=settings.discovery_timeout_s,
        )
        self.membership: DnsMembership | None = None
        self._membership_task: asyncio.Task[None] | None = None
        self._sync_membership()
        self._scrapers: dict[tuple[str, str], asyncio.Task[None]] = {}  # (pool, engine) → task
        self._reload_lock = asyncio.Lock()
        self._ticker: asyncio.Task[None] | None = None
        self.started = False
        self.metadata_errors = 0
        self.hubs_evicted = 0
        self.metadata_rejections: dict[tuple[str, str], int] = {}
        self._last_rejection: dict[tuple[str, str], str] = {}
        self.scrape_errors = 0
        #: engine pages not read, by ``MetricsScrapeError.reason`` (a hostile or broken page
        #: is counted, not only logged as an unknown load)
        self.scrape_failures: dict[str, int] = {}
        #: State files at start, by outcome (restored, none, corrupt, version, stale, ...), and
        #: saves at stop (saved, failed).
        self.state_restores: dict[str, int] = {}
        self.state_saves: dict[str, int] = {}
        #: ``state_dir_unusable`` at a bounded rate: every checkpoint round asks again
        self._state_dir_throttle = checkpoint.LogThrottle()
        #: Periodic checkpoints (``relay/checkpoint.py``), counted in ``state_saves``.
        self.checkpoints = checkpoint.Checkpointer(
            lambda r: self._count(self.state_saves, r),
            rate=lambda: self.settings.checkpoint_bytes_per_second,
        )  # fmt: skip
        self._next_checkpoint = 0.0
        #: The online scrub (``relay/scrubber.py``): one task, a bounded step per loop turn.
        self.scrubber = Scrubber(lambda: self.pools, lambda: self.settings.scrub_interval_s)
        self._scrub_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self, handed_over: Mapping[str, handover.RestoredPool] | None = None) -> None:
        """Start every pool; ``handed_over`` (a hot upgrade's cut, ``relay/takeover.py``) stands in
        for the state files a start would read, for the pools it holds."""
        self.started = True
        self._restore_state(handed_over)
        self.load.start()
        self.serving_load.start()
        self.watcher.start()
        self._ticker = asyncio.create_task(self._tick_loop(), name="kvrelay-relay-tick")
        self._scrub_task = asyncio.create_task(self.scrubber.run(), name="kvrelay-scrub")
        self._start_membership()
        for p in self.pools:
            for st in p.engines.values():
                self._start_scraper(p, st)

    async def stop(self, *, save_state: bool = True) -> None:
        """Stop every source and end every stream; ``save_state=False`` after a hot upgrade handed
        the state over (a file saved now would be older than the successor's own)."""
        if self._membership_task is not None:
            await cancel_all([self._membership_task])
            self._membership_task = None
        await self.watcher.stop()
        if self._ticker is not None:
            await cancel_all([self._ticker])
            self._ticker = None
        if self._scrub_task is not None:
            await cancel_all([self._scrub_task])
            self._scrub_task = None
        await cancel_all(list(self._scrapers.values()))
        self._scrapers.clear()
        await self.checkpoints.drain()  # the final save below is the last word
        keep = save_state and self._state_dir(self.state_saves) is not None
        save = self._save_pool if keep else None
        for p in self.pools:
            await p.stop(save)
        self.checkpoints.close()
        await stop_all(list(self._tasks))
        self.load.close()
        self.serving_load.close()
        self.catalog.close()
        self.readiness.close()

    # ---- state handover ------------------------------------------------------------------------

    def _state_dir(self, counts: dict[str, int] | None = None) -> Path | None:
        """The state directory, created private if missing; None (counted in ``counts`` and
        logged, once a minute per reason: each checkpoint round asks) when it cannot be made or
        another user could write to it (``safe_files``)."""
        d = self.settings.state_dir
        if d is None:
            return None
        path = Path(d)
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            safe_files.check_private_dir(path)
        except (safe_files.UnsafeDirectory, OSError) as exc:
            reason = exc.kind if isinstance(exc, safe_files.UnsafeDirectory) else "unusable_dir"
            if counts is not None:
                self._count(counts, reason)
            not_logged = self._state_dir_throttle.due(reason)
            if not_logged is not None:
                _log.error("state_dir_unusable", path=d, reason=reason, error=str(exc),
                           failures_not_logged=not_logged)  # fmt: skip
            return None
        return path

    def _restore_state(self, cut: Mapping[str, handover.RestoredPool] | None = None) -> None:
        """Offer each pool its state file (``relay/handover.py``): used if nothing is in doubt.

        ``cut``: a hot upgrade's, for the pools it holds. A pool it lacks had no generation in
        the old process (its engines' Control not answering yet, say), which may hold its state
        file still unused: read as a start would, it keeps the coverage a restart keeps instead
        of being rebuilt from replay alone (and the file replaced by its first checkpoint).
        Nothing is swept then: the old process still writes in the state directory."""
        pools = self.pools
        if cut is not None:
            for p in self.pools:
                p.restore.file = cut.get(p.name)
            pools = [p for p in self.pools if p.name not in cut]
            if not pools:
                return
        d = self._state_dir(self.state_restores)
        if d is None:
            return
        for p in pools:
            if cut is None:
                safe_files.remove_stale_temps(d, handover.path_for(d, p.spec).name)
            try:
                r = handover.load(d, p.spec, max_age_s=self.settings.state_max_age_s, keep=True)
            except handover.Refused as exc:
                self._count(self.state_restores, exc.kind)
                _log.warning("state_refused", pool=p.name, reason=exc.kind, why=str(exc))
                continue
            except Exception as exc:  # a bug reading it: never trusted, never fatal
                self._count(self.state_restores, "corrupt")
                _log.exception("state_refused", pool=p.name, reason="corrupt", why=str(exc))
                continue
            if r is None:
                self._count(self.state_restores, "none")
                continue
            p.restore.file = r
            self._count(self.state_restores, "restored")
            _log.info("state_loaded", pool=p.name, members=len(r.members),
                      age_s=round(time.time() - r.written_unix, 3))  # fmt: skip
        if cut is not None:
            return
        keep = {handover.path_for(d, p.spec).name for p in self.pools}
        removed = handover.remove_orphans(d, keep, self.settings.state_max_age_s, time.time())
        if removed:
            _log.info("state_orphans_removed", files=removed)

    def _save_pool(
        self, spec: PoolSpec, ident: PoolIdentity, pool: Any, members: list[handover.MemberResume]
    ) -> None:
        d = self._state_dir(self.state_saves)
        if d is None:
            return
        name = "/".join(spec.triple)
        try:
            n = handover.save(d, spec, ident, pool, members)
        except Exception as exc:  # a full disk must not turn a clean stop into a failure
            self._count(self.state_saves, "failed")
            _log.exception("state_save_failed", pool=name, error=str(exc))
            return
        self._count(self.state_saves, "saved")
        _log.info("state_saved", pool=name, members=len(members), bytes=n)

    @staticmethod
    def _count(d: dict[str, int], key: str) -> None:
        d[key] = d.get(key, 0) + 1

    def _schedule(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine owned by the relay (cancelled on stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- RelayView -------------------------------------------------------------------------------

    def _live_generation(self, expected: pb.ProducerIdentity) -> Generation:
        key = producer_key(expected)
        changed = False
        for p in self.pools:
            gen = p.published  # not a generation whose restored members await their vouch
            if gen is None:
                continue
            if gen.key == key:
                return gen
            if gen.key.pool_part == key.pool_part:
                changed = True
        if changed:
            raise RelayError.producer_changed()
        raise RelayError.pool_not_found()

    def _evict_idle_hub(self) -> bool:
        """Free a hub permit: retire the hub that has been without subscribers the longest."""
        idle = [
            (since, p.generation)
            for p in self.pools
            if p.generation is not None and (since := p.generation.hub_idle_since) is not None
        ]
        if not idle:
            return False
        _since, gen = min(idle, key=lambda item: item[0])
        gen.drop_hub()
        self.hubs_evicted += 1
        _log.info("hub_evicted", pool=gen.name, generation=gen.layout_generation)
        return True

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        """Admit one subscriber to exactly ``expected``.

        The generation is resolved first, so a stale request never initializes the replacement
        generation's hub; then its hub is created if this is the first subscriber (a barrier
        snapshot). A generation that retired on the way is PUBLICATION_UNAVAILABLE.
        """
        gen = self._live_generation(expected)
        hub = gen.hub()
        sub = await hub.subscribe(on_release)  # may wait for a snapshot slot
        if gen.retired:
            sub.close()
            raise RelayError.publication_unavailable("generation retired during hub initialization")
        return sub

    async def hold_pool(
        self, expected: pb.ProducerIdentity, requester: str, seconds: float
    ) -> float:
        """Space ``expected``'s publications for a downstream relay whose joiners catch up
        (``PublicationHub.request_hold``); no hub yet: nothing to space (0)."""
        return self._live_generation(expected).request_hold(requester, seconds, HOLD_TTL_S)

    # ---- planes ----------------------------------------------------------------------------------

    def refresh_planes(self, *, force: bool = False) -> None:
        """Recompute the catalog and topology. Never raises: a pool whose engine-supplied
        metadata is invalid (a served name with surrounding whitespace, say) leaves the catalog,
        or the topology, alone and counted; every other pool and endpoint is published.

        A plane whose inputs are the ones it was last set from is left alone (``force``: set
        it anyway, e.g. after something other than this method changed it)."""
        descriptors: list[pb.KvPoolDescriptor] = []
        endpoints: list[EndpointState] = []
        for p in self.pools:
            try:
                d = p.descriptor()
                if d is not None:
                    validate_descriptor(d)
                    descriptors.append(d)
            except Exception as exc:  # CatalogError (or any bug building it): this pool only
                self._metadata_rejected(p.name, "catalog", exc)
            try:
                e = p.endpoint_state()
                if e is not None:
                    validate_endpoint(e)
                    endpoints.append(e)
            except Exception as exc:  # TopologyError: this endpoint only
                self._metadata_rejected(p.name, "readiness", exc)
        # Unchanged inputs make an unchanged plane: skip serializing every pool to find that out
        # (at 64 pools: 0.99 ms instead of 2.10, or 29.37 from nothing kept; fleet_planes.json).
        if force or not _same_objects(descriptors, self._catalog_set):
            try:
                self.catalog.set_pools(descriptors)
                self._catalog_set = descriptors
            except Exception as exc:  # cross-pool rules (e.g. a duplicate pool id)
                self._metadata_rejected("*", "catalog", exc)
        topology = [_endpoint_key(e) for e in endpoints]
        if force or topology != self._topology_set:
            try:
                self.readiness.set_topology(endpoints)
                self._topology_set = topology
            except Exception as exc:
                self._metadata_rejected("*", "readiness", exc)

    def _metadata_rejected(self, pool: str, plane: str, exc: Exception) -> None:
        rule = str(getattr(exc, "rule", type(exc).__name__))
        self.metadata_errors += 1
        key = (plane, rule)
        self.metadata_rejections[key] = self.metadata_rejections.get(key, 0) + 1
        text = f"{type(exc).__name__}: {exc}"
        if self._last_rejection.get((pool, plane)) != text:  # log a change, count every time
            self._last_rejection[(pool, plane)] = text
            _log.error("pool_metadata_rejected", pool=pool, plane=plane, rule=rule, error=text)

    def _load_inputs(self) -> list[PoolLoadInput]:
        out: list[PoolLoadInput] = []
        for p in self.pools:
            item = p.load_input()
            if item is not None:
                out.append(item)
        return out

    def _serving_inputs(self) -> ServingLoadInputs:
        return self._serving.build()

    # ---- statistics ------------------------------------------------------------------------------

    def stats(self) -> RelayStats:
        """A snapshot of every counter and gauge (monotonic across pool and source churn)."""
        return RelayStats(
            dc_name=self.settings.dc_name,
            dc_id=self.dc_id,
            drt_instance_id=int(self.relay_identity.drt_instance_id),
            relay_incarnation=self.relay_incarnation,
            catalog_revision=self.catalog.revision,
            readiness_revision=self.readiness.revision,
            load_version=self.load.version,
            hubs_initialized=self.hub_permits.in_use,
            hubs_limit=self.hub_permits.capacity,
            metadata_errors=self.metadata_errors,
            metadata_rejections=dict(self.metadata_rejections),
            hubs_evicted=self.hubs_evicted,
            scrape_errors=self.scrape_errors,
            scrape_failures=dict(self.scrape_failures),
            pools=tuple(p.stats() for p in self.pools),
            state_restores=dict(self.state_restores),
            state_saves=dict(self.state_saves),
            checkpoint_unix=dict(self.checkpoints.last_unix),
            scrub_last=dict(self.scrubber.last),
            **self._dns_stats(),
            window_errors={
                (plane, kind): n
                for plane, w in (("load", self.load), ("serving_load", self.serving_load))
                for kind, n in (("window", w.provider_errors), ("entry", w.entry_errors))
            },
        )

    async def _tick_loop(self) -> None:
        armed = self.settings.checkpoint_interval_s  # the interval the next checkpoint is from
        self._next_checkpoint = time.monotonic() + armed
        while True:
            every = min(1.0, self.settings.engine_down_grace_s / 4)
            if self.settings.checkpoint_interval_s > 0 and self.settings.state_dir is not None:
                every = min(every, self.settings.checkpoint_interval_s)
            await asyncio.sleep(every)
            now = time.monotonic()
            for p in self.pools:
                try:
                    p.tick(now)
                except Exception:  # a bug in one pool's checks must not stop the others
                    _log.exception("pool_tick_failed", pool=p.name)
            self._forget_removed_pools()
            interval = self.settings.checkpoint_interval_s
            if interval != armed:  # a reload: a shorter interval applies now, not after the old
                armed = interval
                self._next_checkpoint = min(self._next_checkpoint, now + interval)
            if interval > 0 and now >= self._next_checkpoint:
                self._next_checkpoint = now + interval
                self.checkpoint_now()

    def checkpoint_now(self) -> int:
        """Cut every materialized pool's state and hand it to the checkpoint writer (a no-op
        without ``state_dir``); returns how many were submitted."""
        if self.settings.state_dir is None:
            return 0
        d = self._state_dir(self.state_saves)
        if d is None:
            return 0
        n = 0
        for p in self.pools:
            if p.generation is None or p.identity is None:
                continue
            n += self.checkpoints.submit(p.name, d, functools.partial(_cut, p))
        return n

    # ---- membership ------------------------------------------------------------------------------

    def _pool(self, name: str) -> PoolRuntime:
        return next(p for p in self.pools if p.name == name)

    async def add_engine(self, pool: str, spec: EngineSpec) -> str | None:
        """A new engine of ``pool`` (found by DNS, or added by a reload): watched and, once
        probed, subscribed. Nothing is added where an engine of any pool is already reached there
        (``engine_reach``: a DNS answer naming a configured engine's address, two templates
        resolving to one address): that engine's ``pool/name`` is returned. Added anyway, one of
        the two would go unwatched, or the engine's blocks would be counted twice."""
        p = self._pool(pool)
        other = self._reached_as(spec)
        if other is not None:
            return other
        target = p.add_engine(spec)
        self._by_target[target.name] = p
        self.watcher.add_target(target)
        if self.started:
            self._start_scraper(p, p.engines[target.name])
        return None

    def _reached_as(self, spec: EngineSpec) -> str | None:
        """``pool/engine`` of an engine the relay already reaches where ``spec`` would be
        reached; None where no engine is (one lookup per endpoint and pool)."""
        try:
            wanted = [key for key, _what in engine_reach(spec)]
        except InvalidEndpoint:
            return None  # (the engine's own probe reports it)
        for p in self.pools:
            for key in wanted:
                name = p.table.reach.get(key)
                if name is not None:
                    return f"{p.name}/{name}"
        return None

    async def remove_engine(self, pool: str, engine: str, *, reconcile: bool = True) -> None:
        """``engine`` left ``pool``: no longer watched; its subscribers stop, its members go."""
        p = self._pool(pool)
        target = p.target_of(engine)
        if target is None:
            self._skipped.pop((pool, engine), None)  # (a skipped engine the reload took out)
            return
        await self.watcher.remove_target(target)
        self._by_target.pop(target, None)
        await self._stop_scraper(pool, engine)
        await p.remove_engine(engine, reconcile=reconcile)
        await self._retry_skipped()

    def _skip(self, pool: str, spec: EngineSpec, other: str) -> None:
        """A configured engine of ``pool`` is reached already as ``other`` (an engine DNS
        found): kept aside, and added by ``_retry_skipped`` once that one goes."""
        self._skipped[(pool, spec.name)] = spec
        _log.warning("engine_duplicate", pool=pool, engine=spec.name, same_as=other)

    async def _retry_skipped(self) -> None:
        """Add the configured engines a reload skipped whose endpoints are free now (the engine
        DNS had found there went, or its pool did); forget those of pools no longer here."""
        pools = {p.name for p in self.pools}
        for (pool, name), spec in list(self._skipped.items()):
            if pool not in pools:
                del self._skipped[(pool, name)]
            elif self._reached_as(spec) is None:
                del self._skipped[(pool, name)]
                await self.add_engine(pool, spec)
                _log.info("engine_duplicate_added", pool=pool, engine=name)

    def _dns_removable(self, pool: str, engine: str) -> bool:
        """May an engine absent from DNS go? Only once every ZMQ stream of it has been
        disconnected for ``engine_down_grace_s`` (a live stream keeps the state exact)."""
        p = self._pool(pool)
        target = p.target_of(engine)
        if target is None:
            return True
        wid, now = p.engines[target].worker_id, time.monotonic()
        grace = self.settings.engine_down_grace_s
        return all(
            sub.disconnected_since is not None and now - sub.disconnected_since >= grace
            for key, sub in p.subscribers.items()
            if key.worker_id == wid
        )

    def _templates(self) -> list[tuple[str, EngineSpec]]:
        return [(p.name, e) for p in self.pools for e in p.spec.engines if e.dns is not None]

    def _sync_membership(self) -> None:
        """Follow the DNS templates of the current pools (a membership exists once any does)."""
        templates, s = self._templates(), self.settings
        if self.membership is None:
            if not templates:
                return
            self.membership = DnsMembership(
                templates,
                make_resolver(s.dns_server, s.discovery_timeout_s),
                s.dns_interval_s,
                self.add_engine,
                self.remove_engine,
                self._dns_removable,
            )
            return
        self.membership.interval_s = s.dns_interval_s
        self.membership.set_templates(templates)

    def _start_membership(self) -> None:
        if self.membership is not None and self._membership_task is None:
            self._membership_task = asyncio.create_task(
                self.membership.run(), name="kvrelay-dns-membership"
            )

    # ---- reload ----------------------------------------------------------------------------------

    async def reconfigure(self, new: RelaySettings) -> ReloadPlan:
        """Apply a reloaded configuration live (see ``relay/reconfigure.py`` for what changes
        how). Removals go first, so an engine that moved between pools is never in two.

        A step that raises part-way leaves ``settings`` saying what runs, so that the next
        reload's plan is taken from it: each pool keeps the settings it had until its change is
        complete, and a pool left between the two is removed (its streams end with a status), so
        the next reload adds it again whole."""
        async with self._reload_lock:
            plan = plan_reload(self.settings, new)
            membership = self.membership
            resolver = None  # built before anything changes: a bad server changes nothing
            if self.settings.dns_server != plan.settings.dns_server and membership is not None:
                resolver = make_resolver(
                    plan.settings.dns_server, plan.settings.discovery_timeout_s
                )
            running = {"/".join(ps.triple): ps for ps in self.settings.pools}
            base = self.settings
            unsettled: set[str] = set()  # pools whose change started and did not finish
            lock = membership.lock if membership is not None else contextlib.nullcontext()
            try:
                async with lock:  # no DNS pass re-adds what this reload retires
                    for name in plan.removed:
                        unsettled.add(name)
                        await self._remove_pool(self._pool(name))
                        del running[name]
                        unsettled.discard(name)
                    for change in plan.changed:
                        if change.templates_retired or change.engines_removed:
                            unsettled.add(change.name)
                        p = self._pool(change.name)
                        for template in change.templates_retired:
                            assert membership is not None  # a template existed: membership too
                            for engine in membership.forget(p.name, template):
                                await self.remove_engine(p.name, engine, reconcile=False)
                        for engine in change.engines_removed:
                            await self.remove_engine(p.name, engine, reconcile=False)
                    if resolver is not None and membership is not None:
                        membership.resolver = resolver
                    self.settings = base = plan.settings
                    self.watcher.interval = plan.settings.discovery_interval_s
                    self.watcher.timeout = plan.settings.discovery_timeout_s
                    for p in self.pools:
                        p.engine_down_grace_s = plan.settings.engine_down_grace_s
                    for change in plan.changed:
                        unsettled.add(change.name)
                        p = self._pool(change.name)
                        await p.respec(change.spec, rematerialize=change.rematerialize)
                        for spec in change.engines_added:
                            other = await self.add_engine(p.name, spec)
                            if other is not None:  # (one DNS found; the file never has two)
                                self._skip(p.name, spec, other)
                        await p.reconcile()
                        running[change.name] = change.spec
                        unsettled.discard(change.name)
                    for pool_spec in plan.added:
                        name = "/".join(pool_spec.triple)
                        unsettled.add(name)
                        self._add_pool(pool_spec)
                        running[name] = pool_spec
                        unsettled.discard(name)
            except BaseException:
                await self._drop_unsettled(unsettled, running)
                raise
            finally:
                order = dict.fromkeys(["/".join(ps.triple) for ps in plan.settings.pools])
                order.update(dict.fromkeys(running))
                self.settings = dataclasses.replace(
                    base, pools=tuple(running[n] for n in order if n in running)
                )
                self._sync_membership()
            if self.started:
                self._start_membership()
            self.refresh_planes()
            return plan

    async def _drop_unsettled(self, unsettled: set[str], running: dict[str, PoolSpec]) -> None:
        """A reload failed part-way through these pools' changes: each runs with settings that
        are neither the old nor the new ones, so it is removed (streams end with a status) and
        out of ``running``; the next reload adds it whole."""
        for name in sorted(unsettled):
            running.pop(name, None)
            p = next((q for q in self.pools if q.name == name), None)
            _log.error("config_reload_pool_dropped", pool=name,
                       reason="its reload failed part-way; the next reload adds it again")
            if p is None:
                continue
            try:
                await self._remove_pool(p)
            except Exception as exc:  # out of the planes and the pool list all the same
                _log.error("config_reload_pool_drop_failed", pool=name, error=repr(exc))

    def _add_pool(self, spec: PoolSpec) -> None:
        p = PoolRuntime(spec, self._ctx, engine_down_grace_s=self.settings.engine_down_grace_s)
        for target, st in list(p.engines.items()):  # a reload's pool: as ``add_engine`` does
            other = self._reached_as(st.spec)  # (the other pools only: ``p`` is not listed yet)
            if other is not None:
                p.table.remove(target)
                self._skip(p.name, st.spec, other)
        self.pools.append(p)
        for name, st in p.engines.items():
            self._by_target[name] = p
            self.watcher.add_target(st.target)
            if self.started:
                self._start_scraper(p, st)

    async def _remove_pool(self, p: PoolRuntime) -> None:
        """The pool left the configuration: out of the pool list first, then its streams end.
        Whatever fails on the way, it ends out of the list, the target map and the planes, and
        its streams end with a status all the same (its sources stop)."""
        try:
            for st in list(p.engines.values()):  # while it is listed: its last pages are folded
                await self._stop_scraper(p.name, st.spec.name)  # into the serving totals
            self.pools.remove(p)
            if self.membership is not None:
                for _pool, template in [t for t in self.membership.templates if t[0] == p.name]:
                    self.membership.forget(p.name, template.name)
            for name in list(p.engines):
                await self.watcher.remove_target(name)
                self._by_target.pop(name, None)
        finally:  # whatever failed above: out of the list (the catalog leaves it first), closed
            if p in self.pools:
                self.pools.remove(p)
            for target in [t for t, q in self._by_target.items() if q is p]:
                del self._by_target[target]
            try:
                await p.close("pool removed from the relay's configuration")
            finally:
                self.refresh_planes()
        self._forget_removed_pools()
        self.observers.pool_removed(p.name)
        await self._retry_skipped()

    def _forget_removed_pools(self) -> None:
        """Drop what is kept by pool name for pools no longer configured: each pool a reload
        removed left its scrub and checkpoint gauges, and these entries, for the relay's life.
        Also run at each tick, for a checkpoint that finished after its pool left."""
        names = {p.name for p in self.pools}
        self.scrubber.keep_only(names)
        self.checkpoints.keep_only(names)
        for key in [k for k in self._last_rejection if k[0] != "*" and k[0] not in names]:
            del self._last_rejection[key]

    # ---- discovery -------------------------------------------------------------------------------

    def _dns_stats(self) -> dict[str, int]:
        """``RelayStats``' DNS fields (all 0 without a DNS-discovered engine)."""
        if self.membership is None:
            return {}
        c = self.membership.counters
        return {
            "dns_removals_deferred": c.removals_deferred, "dns_duplicates": c.duplicates,
            "dns_resolutions": c.resolutions, "dns_failures": c.failures,
            "dns_engines_added": c.engines_added, "dns_engines_removed": c.engines_removed,
        }  # fmt: skip

    async def _on_discovery(self, ev: ChangeEvent) -> None:
        pool = self._by_target.get(ev.target)
        if pool is not None:
            await pool.on_engine_event(ev)

    def _start_scraper(self, pool: PoolRuntime, st: EngineState) -> None:
        key = (pool.name, st.spec.name)
        if st.spec.metrics_port is not None and key not in self._scrapers:
            self._scrapers[key] = asyncio.create_task(
                self._scrape_loop(pool, st), name=f"kvrelay-scrape-{st.spec.name}"
            )

    async def _stop_scraper(self, pool: str, engine: str) -> None:
        task = self._scrapers.pop((pool, engine), None)
        if task is not None:
            await cancel_all([task])
        self._serving.forget(pool, engine)

    async def _scrape_loop(self, pool: PoolRuntime, st: EngineState) -> None:
        port = st.spec.metrics_port
        assert port is not None
        while True:
            try:
                page = await scrape_engine_page(
                    st.spec.host,
                    port,
                    page_model(pool, st),
                    timeout=self.settings.discovery_timeout_s,
                )
                st.usage = {int(k): v for k, v in page.kv_usage.items() if is_decimal(k)}
                self._serving.store(pool.name, st.spec.name, Page(unix_ms(), page))
            except (TimeoutError, MetricsScrapeError, OSError) as exc:
                st.usage = {}  # unknown, never zero
                self._serving.store(pool.name, st.spec.name, None)
                why = exc.reason if isinstance(exc, MetricsScrapeError) else "unreachable"
                self._count(self.scrape_failures, why)
            except Exception:  # whatever else: unknown too, and the scraper goes on
                st.usage = {}
                self._serving.store(pool.name, st.spec.name, None)
                self.scrape_errors += 1
                _log.exception("scrape_failed", pool=pool.name, engine=st.spec.name)
            await asyncio.sleep(self.settings.metrics_scrape_interval_s)


def _cut(p: PoolRuntime) -> checkpoint.Cut | None:
    """What a checkpoint of ``p`` holds, taken now (the writer's turn came): its generation's pool
    and every member's cursor (None when it has no generation any more)."""
    gen, ident = p.generation, p.identity
    if gen is None or ident is None:
        return None
    return checkpoint.Cut(p.spec, ident, gen.pool, p.members_to_save(p.subscribers))


def _same_objects(a: list[pb.KvPoolDescriptor], b: list[pb.KvPoolDescriptor] | None) -> bool:
    """The same descriptor objects in the same order (a pool hands out the same object while
    nothing its entry is made of changed, and nobody changes one once built)."""
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _endpoint_key(e: EndpointState) -> tuple[object, ...]:
    """Every field of an endpoint, which is all ``ReadinessPlane.set_topology`` reads of it (its
    class compares by identity); the pool id compares equal at once when it is the generation's
    same object."""
    return tuple(getattr(e, f.name) for f in dataclasses.fields(e))
