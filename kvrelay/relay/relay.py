"""``Relay``: owns identity, pools, discovery and the three planes (a ``RelayView``)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Coroutine
from typing import Any

from kvrelay._aio import cancel_all
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.discovery.events import ChangeEvent
from kvrelay.discovery.metrics_scrape import MetricsScrapeError, scrape_kv_usage
from kvrelay.discovery.watcher import EngineWatcher
from kvrelay.hashing import identity
from kvrelay.logging import get_logger
from kvrelay.relay.generation import Generation
from kvrelay.relay.pool_runtime import EngineState, PoolRuntime
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.errors import RelayError
from kvrelay.service.limits import PermitCounter
from kvrelay.service.planes.catalog import CatalogPlane
from kvrelay.service.planes.load import LoadPlane, PoolLoadInput
from kvrelay.service.planes.readiness import ReadinessPlane
from kvrelay.service.validation import producer_key

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
        self.hub_permits = PermitCounter(
            "initialized pool hubs", self.limits.max_initialized_pool_hubs
        )
        self.encode_gate = asyncio.Semaphore(self.limits.publication_encoding_concurrency)
        self.pools = [PoolRuntime(spec, self) for spec in settings.pools]
        self._by_target: dict[str, PoolRuntime] = {
            name: p for p in self.pools for name in p.engines
        }
        self.load = LoadPlane(
            self.relay_identity,
            window_ms=max(1, round(self.limits.load_window_s * 1000)),
            provider=self._load_inputs,
        )
        self.watcher = EngineWatcher(
            [st.target for p in self.pools for st in p.engines.values()],
            self._on_discovery,
            interval=settings.discovery_interval_s,
            timeout=settings.discovery_timeout_s,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        self._scrapers: list[asyncio.Task[None]] = []
        self.started = False
        self.metadata_errors = 0

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.started = True
        self.load.start()
        self.watcher.start()
        for p in self.pools:
            for st in p.engines.values():
                if st.spec.metrics_port is not None:
                    self._scrapers.append(asyncio.create_task(self._scrape_loop(p, st)))

    async def stop(self) -> None:
        await self.watcher.stop()
        await cancel_all(self._scrapers)
        self._scrapers.clear()
        for p in self.pools:
            await p.stop()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self.load.close()
        self.catalog.close()
        self.readiness.close()

    def schedule(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a background coroutine owned by the relay (cancelled on stop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- identity --------------------------------------------------------------------------------

    def next_layout_generation(self) -> int:
        return self._layout.next()

    # ---- RelayView -------------------------------------------------------------------------------

    def resolve_pool(self, expected: pb.ProducerIdentity) -> Generation:
        key = producer_key(expected)
        pool_part = key[:6]  # identity_version, both digests + sources, dc_id
        changed = False
        for p in self.pools:
            gen = p.generation
            if gen is None:
                continue
            if gen.key == key:
                return gen
            if gen.key[:6] == pool_part:
                changed = True
        if changed:
            raise RelayError.producer_changed()
        raise RelayError.pool_not_found()

    # ---- planes ----------------------------------------------------------------------------------

    def refresh_planes(self) -> None:
        """Recompute the catalog and topology; one pool's bad metadata never hides the others."""
        descriptors = []
        endpoints = []
        for p in self.pools:
            try:
                d = p.descriptor()
                e = p.endpoint_state()
            except ValueError as exc:  # CatalogError / TopologyError: engine-supplied metadata
                self.metadata_errors += 1
                _log.error("pool_metadata_rejected", pool=p.name, error=str(exc))
                continue
            if d is not None:
                descriptors.append(d)
            if e is not None:
                endpoints.append(e)
        self.catalog.set_pools(descriptors)
        self.readiness.set_topology(endpoints)

    def _load_inputs(self) -> list[PoolLoadInput]:
        out: list[PoolLoadInput] = []
        for p in self.pools:
            item = p.load_input()
            if item is not None:
                out.append(item)
        return out

    # ---- discovery -------------------------------------------------------------------------------

    async def _on_discovery(self, ev: ChangeEvent) -> None:
        pool = self._by_target.get(ev.target)
        if pool is not None:
            await pool.on_engine_event(ev)

    async def _scrape_loop(self, pool: PoolRuntime, st: EngineState) -> None:
        port = st.spec.metrics_port
        assert port is not None
        while True:
            try:
                usage = await scrape_kv_usage(
                    st.spec.host, port, pool.base_model(), timeout=self.settings.discovery_timeout_s
                )
                st.usage = {int(k): v for k, v in usage.items() if k.isdigit()}
            except (TimeoutError, MetricsScrapeError, OSError):
                st.usage = {}  # unknown, never zero
            await asyncio.sleep(self.settings.metrics_scrape_interval_s)
