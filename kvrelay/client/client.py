"""``RelayClient``: the asyncio consumer SDK for one or more kvrelay / Dynamo relays.

Usage::

    async with RelayClient(["relay-a:50161", "relay-b:50161"]) as client:
        await client.wait_ready()
        depths = client.overlap(tokens, model="llama-3-8b")   # {PoolKey: depth_in_blocks}

Everything runs on the caller's event loop; queries are synchronous reads of the installed
replicas (the loop is single-threaded, so a query never sees a half-applied delta).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from types import TracebackType

import numpy as np
import numpy.typing as npt

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.config import ClientConfig
from kvrelay.client.connection import PoolFilter, PoolSlot, RelayConnection
from kvrelay.client.probe import contains
from kvrelay.client.query import HashCache, QueryPlan, plan_for
from kvrelay.client.rpc import RelayAddress
from kvrelay.client.search import first_miss
from kvrelay.client.views import (
    LoadView,
    ModelServingView,
    PoolKey,
    PoolServingView,
    ReadinessView,
    ReplicaStats,
    ServingLoadViews,
)
from kvrelay.contract.producer import producer_key

_STATE = {0: "UNKNOWN", 1: "UNAVAILABLE", 2: "READY"}
_DATA_STATUS = {1: "COMPLETE", 2: "DEGRADED", 3: "UNAVAILABLE"}  # else UNSPECIFIED (unknown)


def _opt(v: int | None) -> int | None:
    return None if v is None else int(v)


def _gauge(v: int | None, complete: bool) -> int | None:
    """A serving-load gauge, only from a COMPLETE view: one set in any other view is a partial
    sum, which reads as lower load than there is (§10.4), so it is unknown here."""
    return None if v is None or not complete else int(v)


def role_name(r: int) -> str:
    try:
        return str(pb.WorkerRole(r).name)
    except ValueError:
        return str(int(r))


class RelayClient:
    def __init__(
        self,
        relays: Iterable[str | RelayAddress],
        *,
        ssl: _ssl.SSLContext | None = None,
        config: ClientConfig | None = None,
        pool_filter: PoolFilter | None = None,
    ) -> None:
        self.config = config or ClientConfig()
        addrs = [r if isinstance(r, RelayAddress) else RelayAddress.parse(r) for r in relays]
        if not addrs:
            raise ValueError("at least one relay address is required")
        if len(set(addrs)) != len(addrs):
            raise ValueError("relay addresses must be unique")
        #: Replica drops by reason, over every relay and pool.
        self.drops: Counter[str] = Counter()
        self.connections = [
            RelayConnection(a, self.config, ssl=ssl, pool_filter=pool_filter, drops=self.drops)
            for a in addrs
        ]
        self._started = False
        #: (connection, plane) → the window whose bad entries were last counted: a window is read
        #: again at every call, and its entries are counted once
        self._counted: dict[tuple[int, str], object] = {}

    def _first_read(self, c: RelayConnection, plane: str, window: object) -> bool:
        """Whether this call is the first to read ``window`` (``plane``'s newest from ``c``):
        a bad entry is counted then, not again at every later call that reads the same window."""
        key = (id(c), plane)
        first = self._counted.get(key) is not window
        self._counted[key] = window
        return first

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        for c in self.connections:
            c.start()

    async def close(self) -> None:
        for c in self.connections:
            await c.close()

    async def __aenter__(self) -> RelayClient:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_for(self, predicate: object, timeout: float) -> bool:
        """Wait until ``predicate()`` is true (re-checked on every state change or 50 ms)."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waits = [asyncio.ensure_future(c.changed.wait()) for c in self.connections]
            for c in self.connections:
                c.changed.clear()
            _done, pending = await asyncio.wait(waits, timeout=min(left, 0.05),
                                               return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        return True

    async def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until every relay delivered a catalog and every catalog pool has a replica."""

        def ready() -> bool:
            return all(
                c.catalog_revision is not None
                and all(s.installed is not None or s.quarantined for s in c.slots.values())
                for c in self.connections
            )

        return await self.wait_for(ready, timeout)

    # ------------------------------------------------------------------ views
    def _slots(self) -> Iterable[tuple[RelayConnection, PoolSlot]]:
        for c in self.connections:
            for s in c.slots.values():
                yield c, s

    def pools(self) -> dict[PoolKey, pb.KvPoolDescriptor]:
        """Current catalog entries (after the pool filter), over every relay."""
        return {s.key: s.descriptor for _, s in self._slots()}

    def readiness(self) -> list[ReadinessView]:
        out: list[ReadinessView] = []
        for c in self.connections:
            upd = c.readiness
            if upd is None:
                continue
            for e in upd.entries:
                out.append(
                    ReadinessView(
                        relay=c.name,
                        namespace=e.namespace,
                        model=e.canonical_model_id,
                        state=_STATE.get(int(e.state), "UNKNOWN"),
                        present_roles=tuple(role_name(r) for r in e.present_roles),
                        missing_roles=tuple(role_name(r) for r in e.missing_roles),
                        members=tuple(
                            f"{m.endpoint.namespace}/{m.endpoint.component}/{m.endpoint.endpoint}"
                            for m in e.members if m.endpoint is not None
                        ),
                        adapters={
                            a.canonical_model_id: _STATE.get(int(a.state), "UNKNOWN")
                            for a in e.adapters
                        },
                        revision=int(upd.revision),
                    )
                )
        return out

    def _routable(self, conn: RelayConnection, slot: PoolSlot, plan: QueryPlan) -> bool:
        """READY topology entry for the pool's base model (and adapter) listing this pool: a
        member with the pool's ``pool_id``, or, for a member that names none, its endpoint. A
        member naming another pool at the same endpoint is that other pool (an endpoint
        re-registered by another worker), never this one."""
        upd = conn.readiness
        if upd is None:
            return False
        pool_id = slot.descriptor.producer.pool_id if slot.descriptor.producer else None
        want = bytes(pool_id) if pool_id is not None else None
        ep = slot.descriptor.serving_endpoint
        for e in upd.entries:
            if e.canonical_model_id != plan.base_model or e.namespace != slot.key.namespace:
                continue
            member = any(
                bytes(m.pool_id) == want if m.pool_id is not None else m.endpoint == ep
                for m in e.members
            )
            if not member or int(e.state) != pb.ServingReadinessState.READY:
                continue
            if plan.lora_model is None:
                return True
            return any(
                a.canonical_model_id == plan.lora_model
                and int(a.state) == pb.ServingReadinessState.READY
                for a in e.adapters
            )
        return False

    def load(self) -> dict[PoolKey, LoadView]:
        out: dict[PoolKey, LoadView] = {}
        for c in self.connections:
            upd = c.load
            if upd is None:
                continue
            by_producer = {s.producer: s.key for s in c.slots.values()}
            count = int(self._first_read(c, "load", upd))
            for entry in upd.pools:
                try:
                    key = by_producer.get(producer_key(entry.producer))
                except Exception:  # invalid identity in a load entry: ignore, count (once)
                    c.counters["load_entry_invalid"] += count
                    continue
                if key is None:
                    continue
                out[key] = LoadView(
                    int(entry.kv_used_blocks), int(entry.total_kv_blocks),
                    int(entry.kv_observed_ranks), int(entry.kv_expected_ranks),
                    int(upd.window_sequence), int(upd.observed_ms),
                )  # fmt: skip
        return out

    def serving_load(self) -> ServingLoadViews:
        """The newest serving-load window of every relay (Dynamo 1.7): pools listed in the
        catalog, and every (namespace, model). Empty for a relay whose stream is down; relays
        that do not implement the RPC are named in ``unsupported``."""
        pools: dict[PoolKey, PoolServingView] = {}
        models: list[ModelServingView] = []
        for c in self.connections:
            upd = c.serving_load
            if upd is None:
                continue
            seq = int(upd.window_sequence)
            incarnation = 0 if upd.relay is None else int(upd.relay.relay_incarnation)
            by_producer = {s.producer: s.key for s in c.slots.values()}
            by_pool_id = {
                bytes(s.descriptor.producer.pool_id): s.key
                for s in c.slots.values()
                if s.descriptor.producer is not None and s.descriptor.producer.pool_id is not None
            }
            count = int(self._first_read(c, "serving_load", upd))
            for p in upd.pools:
                try:
                    key = by_producer.get(producer_key(p.producer))
                except Exception:  # invalid identity in an entry: ignore, count (once)
                    c.counters["serving_load_entry_invalid"] += count
                    continue
                if key is None or p.load is None:
                    continue
                tokens = p.load.tokens or pb.TokenLoadStats()
                dep = p.deployment
                status = _DATA_STATUS.get(int(p.load.status), "UNSPECIFIED")
                complete = status == "COMPLETE"
                pools[key] = PoolServingView(
                    status=status,
                    active_decode_blocks=_gauge(tokens.active_decode_blocks, complete),
                    active_prefill_tokens=_gauge(tokens.active_prefill_tokens, complete),
                    live_workers=None if dep is None else _opt(dep.live_workers),
                    max_concurrency=None if dep is None else _opt(dep.max_concurrency),
                    source_observed_ms=int(p.load.source_observed_ms),
                    window_sequence=seq,
                )  # fmt: skip
            for m in upd.models:
                if m.load is None:
                    continue
                r = m.load.requests
                if r is None:  # its counters are always set (§10.4): unknown, never zeros
                    c.counters["serving_load_entry_invalid"] += count
                    continue
                t = m.load.tokens or pb.TokenLoadStats()
                d = m.deployment or pb.ModelDeploymentStatus()
                status = _DATA_STATUS.get(int(m.load.status), "UNSPECIFIED")
                complete = status == "COMPLETE"
                models.append(
                    ModelServingView(
                        relay=c.name, namespace=m.namespace, model=m.canonical_model_id,
                        status=status,
                        requests_started_total=int(r.requests_started_total),
                        requests_completed_total=int(r.requests_completed_total),
                        requests_failed_total=int(r.requests_failed_total),
                        requests_cancelled_total=int(r.requests_cancelled_total),
                        requests_awaiting_first_token=_gauge(
                            r.requests_awaiting_first_token, complete),
                        requests_generating=_gauge(r.requests_generating, complete),
                        input_tokens_total=_opt(t.input_tokens_total),
                        output_tokens_total=_opt(t.output_tokens_total),
                        inflight_input_tokens=_gauge(t.inflight_input_tokens, complete),
                        awaiting_first_token_input_tokens=_gauge(
                            t.awaiting_first_token_input_tokens, complete),
                        expected_frontends=int(d.expected_frontends),
                        observed_frontends=int(d.observed_frontends),
                        ready_frontends=int(d.ready_frontends),
                        serving_pools=tuple(
                            by_pool_id[k] for k in map(bytes, d.serving_pools) if k in by_pool_id
                        ),
                        source_observed_ms=int(m.load.source_observed_ms),
                        window_sequence=seq, relay_incarnation=incarnation,
                    )
                )  # fmt: skip
        unsupported = tuple(c.name for c in self.connections if c.serving_load_unsupported)
        return ServingLoadViews(pools, models, unsupported)

    def replica_stats(self) -> dict[PoolKey, ReplicaStats]:
        now = time.monotonic()
        out: dict[PoolKey, ReplicaStats] = {}
        for _, s in self._slots():
            r = s.installed
            out[s.key] = ReplicaStats(
                pool=s.key,
                installed=r is not None,
                layout_generation=s.producer.layout_generation,
                bucket_count=s.producer.bucket_count,
                sequence=None if r is None else r.sequence,
                occupancy=0 if r is None else r.occupancy(),
                staleness_s=None if s.last_frame is None else now - s.last_frame,
                frames=dict(s.frames),
                drops=dict(s.drops),
                subscribes=s.subscribes,
                quarantined=s.quarantined,
            )
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Per relay: its stream counters and its channels' (``RelayConnection.counter_values``)."""
        return {c.name: c.counter_values() for c in self.connections}

    # ------------------------------------------------------------------ queries
    def contains(self, hashes: npt.ArrayLike) -> dict[PoolKey, npt.NDArray[np.bool_]]:
        """Membership of canonical block hashes (u64) in every installed replica, for callers
        that hash themselves; ``overlap()`` is the prompt-level query. Pools without an
        installed replica are absent (unknown, never "not cached")."""
        keys = np.asarray(hashes, dtype=np.uint64)
        return {s.key: s.installed.contains(keys) for _, s in self._slots()
                if s.installed is not None}  # fmt: skip

    def overlap(
        self,
        tokens: Sequence[int] | np.ndarray,
        model: str,
        lora: str | None = None,
        cache_salt: str | None = None,
        *,
        routable_only: bool = True,
        window: int | None = None,
    ) -> dict[PoolKey, int]:
        """Cached prefix depth (in blocks of each pool's own block size) for every installed pool
        serving ``model``: the longest prefix whose blocks are all present. With
        ``routable_only`` (default) pools whose topology is not READY (UNKNOWN, UNAVAILABLE, or
        no readiness stream) are left out.

        Every block is probed, so the depth is exact for the filter: a sampled search
        (``prefix_depth``) would read past a block the relay removed while its children stay.
        ``window`` is accepted for callers written for the sampled search and has no effect."""
        if window is not None:
            warnings.warn(
                "overlap(window=...) has no effect: every block is probed",
                DeprecationWarning, stacklevel=2,
            )  # fmt: skip
        hashes = HashCache(tokens)
        out: dict[PoolKey, int] = {}
        for conn, slot in self._slots():
            replica = slot.installed
            if replica is None or replica.table is None:
                continue
            plan = plan_for(slot.descriptor, model, lora)
            if plan is None:
                continue
            if routable_only and not self._routable(conn, slot, plan):
                continue
            seq = hashes.get(plan.block_size, plan.eagle, plan.salt(cache_salt))
            # One vectorized probe of every block (a few ns per key in numba) is cheaper from
            # Python than one kernel call per searched position, and its first miss is exact.
            out[slot.key] = first_miss(contains(replica.table, replica.seed, seq))
        return out
