"""One relay session: catalog, readiness and load watches plus one task per pool replica.

Rules enforced here (§4, §9, §10):

* The relay identity is constant per session. The catalog fixes it; any plane message with
  another identity means the relay restarted: every replica of this relay is dropped
  (``relay_restarted``), readiness/load are forgotten and the catalog is re-read.
* A pool replica is dropped, alone, on lag, EOF, any relay error, any consumer violation or its
  withdrawal from the catalog; it then resubscribes with jittered exponential backoff. Relay
  reasons that retrying cannot fix (CONTRACT_MISMATCH, UNSUPPORTED_FEATURE, INVALID_REQUEST) and
  lanes above ``max_bucket_count`` quarantine the pool until the catalog lists another producer.
* PRODUCER_CHANGED / POOL_NOT_FOUND also re-read the catalog (a fresh watch), after the
  catalog's own backoff; the requests of many pools while one waits are one.
* Every loop (pool, catalog, planes) backs off by one rule (``rpc.Backoff``): its attempts start
  over only after a stream that stayed live ``rpc.LIVE_RESUBSCRIBE_S``.
* Readiness and load are "unknown" (None) whenever their stream is down.
* A plane's version (catalog or readiness revision, load window sequence) never goes backwards
  on one stream (``plane_rules.plane_version``, the mirror's rule too): a lower one ends the
  stream (``<plane>_end_version_backwards``) and the plane is read again; an equal one is a
  re-send and is taken.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status

from kvrelay._aio import stop_all
from kvrelay._grpc import RelayChannel
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import plane_rules, rpc
from kvrelay.client.config import ClientConfig
from kvrelay.client.replica import PoolReplica, relay_key
from kvrelay.client.views import PoolKey
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.logging import get_logger

_log = get_logger(__name__)
PoolFilter = Callable[[PoolKey, pb.KvPoolDescriptor], bool]
_REFRESH_CATALOG = frozenset({"producer_changed", "pool_not_found", "invalid_publication"})
#: The newest version one plane stream delivered, with the relay identity it came under.
Held = tuple[tuple[int, int] | None, int]


def next_version(plane: str, relay: pb.RelayIdentity, version: int, held: Held | None) -> Held:
    """A plane stream's message at ``version`` after ``held`` (``plane_rules.plane_version``,
    which raises for one that went backwards); what the stream holds then. A new relay
    identity starts its versions anew, as the mirror's new epoch does."""
    key = relay_key(relay)
    newest = held[1] if held is not None and held[0] == key else None
    plane_rules.plane_version(plane, newest, version)
    return key, version


@dataclass(slots=True)
class PoolSlot:
    """Everything the client keeps about one catalog pool (survives replica rebuilds)."""

    key: PoolKey
    descriptor: pb.KvPoolDescriptor
    producer: ProducerKey
    installed: PoolReplica | None = None  # only a fully validated replica is ever here
    pending: PoolReplica | None = None  # the replica being built by the current stream
    task: asyncio.Task[None] | None = None
    quarantined: bool = False
    frames: Counter[str] = field(default_factory=Counter)
    drops: Counter[str] = field(default_factory=Counter)
    subscribes: int = 0
    last_frame: float | None = None


class RelayConnection:
    def __init__(
        self,
        address: rpc.RelayAddress,
        config: ClientConfig,
        *,
        ssl: _ssl.SSLContext | None = None,
        pool_filter: PoolFilter | None = None,
        drops: Counter[str] | None = None,
    ) -> None:
        self.address = address
        self.name = str(address)
        self.config = config
        self.ssl = ssl
        self.pool_filter = pool_filter
        self.channel = rpc.open_channel(address, ssl, config.max_message_bytes)
        self.identity: tuple[int, int] | None = None
        self.identity_msg: pb.RelayIdentity | None = None
        self.catalog_revision: int | None = None
        #: How the last catalog stream that delivered nothing ended (``reason: message``): why
        #: there is no catalog yet. None once a catalog arrives.
        self.catalog_error: str | None = None
        self.slots: dict[PoolKey, PoolSlot] = {}
        self.readiness: pb.ServingReadinessUpdate | None = None
        self.load: pb.KvPoolLoadUpdate | None = None
        self.serving_load: pb.ServingLoadUpdate | None = None
        #: The relay answered SubscribeServingLoad UNIMPLEMENTED (until a window arrives).
        self.serving_load_unsupported = False
        self.counters: Counter[str] = Counter()
        self.drops: Counter[str] = drops if drops is not None else Counter()
        self.changed = asyncio.Event()  # set on any state change (tests, CLI wait on it)
        self._catalog_task: asyncio.Task[None] | None = None
        self._catalog_backoff = rpc.Backoff(config.backoff)  # its retries and its refreshes
        #: The catalog loop waits to open a fresh watch: a refresh asked meanwhile is that one.
        self._catalog_waiting = False
        #: Connections left as draining by channels this one replaced (``_reset_channel``).
        self._left_draining = 0
        self._plane_tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._catalog_task = asyncio.create_task(self._catalog_loop())
        if self.config.watch_readiness:
            self._plane_tasks.append(asyncio.create_task(self._readiness_loop()))
        if self.config.watch_load:
            self._plane_tasks.append(asyncio.create_task(self._load_loop()))
        if self.config.watch_serving_load:
            self._plane_tasks.append(asyncio.create_task(self._serving_load_loop()))

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in (self._catalog_task, *self._plane_tasks) if t is not None]
        tasks += [s.task for s in self.slots.values() if s.task is not None]
        await stop_all(tasks)
        self.slots.clear()
        self.channel.close()

    def _notify(self) -> None:
        self.changed.set()

    # ------------------------------------------------------------------ identity
    def _check_envelope(self, msg: Any, plane: str) -> None:
        """A plane message the SDK cannot take ends its stream (ConsumerViolation): skipping it
        would keep the message before it as current, when the relay has moved on."""
        if msg.contract_marker != CONTRACT_MARKER or msg.protocol_version != PROTOCOL_VERSION:
            self.counters[f"{plane}_envelope_invalid"] += 1
            raise E.ConsumerViolation(E.ENVELOPE, f"{plane}: marker or protocol version")
        if msg.relay is None:
            self.counters[f"{plane}_relay_missing"] += 1
            raise E.ConsumerViolation(E.ENVELOPE, f"{plane}: no relay identity")

    def _observe_relay(self, relay: pb.RelayIdentity, from_catalog: bool) -> None:
        rk = relay_key(relay)
        if self.identity is None:
            self.identity, self.identity_msg = rk, relay
            return
        if rk == self.identity:
            return
        self.counters["relay_incarnation_changes"] += 1
        _log.warning("relay_identity_changed", relay=self.name, old=self.identity, new=rk)
        self.identity, self.identity_msg = rk, relay
        for key in list(self.slots):
            self._remove_slot(key, E.RELAY_RESTARTED)
        self.readiness = None
        self.load = None
        self.serving_load = None
        self.catalog_revision = None
        if not from_catalog:
            self.refresh_catalog()
        self._notify()

    # ------------------------------------------------------------------ catalog
    def refresh_catalog(self) -> None:
        """Re-read the complete catalog with a fresh watch, after the catalog's backoff (no-op
        while closing). A refresh asked while the catalog loop waits to open a fresh watch anyway
        is that watch (``catalog_refreshes_coalesced``): every pool answered POOL_NOT_FOUND or
        PRODUCER_CHANGED asks, and many pools would otherwise restart the watch once each."""
        if self._closing:
            return
        if self._catalog_waiting:
            self.counters["catalog_refreshes_coalesced"] += 1
            return
        self.counters["catalog_refreshes"] += 1
        old = self._catalog_task
        if old is not None and old is not asyncio.current_task():
            old.cancel()  # (it is in its stream: a waiting loop is never cancelled here)
        self._catalog_waiting = True  # from now: the requests of other pools are this one
        delay = self._catalog_backoff.next_delay()  # the cancelled stream ended
        self._catalog_task = asyncio.create_task(self._catalog_loop(delay))

    async def _catalog_loop(self, delay: float = 0.0) -> None:
        backoff = self._catalog_backoff
        while not self._closing:
            self._catalog_waiting = True
            await asyncio.sleep(delay)
            self._catalog_waiting = False
            got = 0
            held: Held | None = None  # this stream's newest revision

            def on(msg: pb.KvPoolCatalogUpdate) -> None:
                nonlocal got, held
                held = self._on_catalog(msg, held)  # raises for a message it cannot take
                got += 1
                backoff.live()

            channel = self.channel
            try:
                end = await rpc.run_stream(
                    channel, "WatchKvPoolCatalog",
                    rpc.catalog_request(self.config.subscriber_id), pb.KvPoolCatalogUpdate, on,
                    first_message_s=self.config.silence_s,
                )  # fmt: skip
            except E.ConsumerViolation as v:  # read the catalog again (a fresh watch)
                end = rpc.StreamEnd(v.reason, None, v.detail, got)
            self.counters[f"catalog_end_{end.reason}"] += 1
            if not got:
                self.catalog_error = f"{end.reason}: {end.message}".rstrip(": ")
                self._notify()
            if end.reason in (E.EOF, E.CONNECTION):
                # The relay is going away (or gone): reconnect from scratch rather than reuse an
                # HTTP/2 connection a stopping server may still accept streams on.
                self._reset_channel(channel, drained=end.reason == E.EOF)
            elif not got:  # before its first message: does the channel still carry?
                silence_s = self.config.silence_s
                await self._replace_if_unfit(channel, end, silence_s=silence_s, timeout_s=silence_s)
            delay = backoff.next_delay()

    async def _replace_if_unfit(
        self, channel: Channel, end: rpc.StreamEnd, *, silence_s: float | None, timeout_s: float
    ) -> None:
        """A new channel when ``rpc.channel_verdict`` says so: ``channel_silent`` (a stream
        that heartbeats, a pool's, or the catalog before its first message, ended silent and
        nothing else arrived on its channel for ``silence_s``: a black-holed path, one that died
        with TCP up; None for the planes) or ``channel_deaf`` (it still receives, but a round
        trip within ``timeout_s`` went unanswered: a path dead towards the relay only)."""
        verdict = await rpc.channel_verdict(
            channel, end, silence_s=silence_s, timeout_s=timeout_s, current=lambda: self.channel
        )
        if verdict is not None:
            self.counters["channel_silent" if verdict == "silent" else "channel_deaf"] += 1
            self._reset_channel(channel)

    def _reset_channel(self, used: Channel, *, drained: bool = False) -> None:
        """A fresh channel, unless ``used`` was already replaced (its streams all end at once:
        the first one replaces it, not each). ``drained``: the relay ended the catalog cleanly
        (a drain): the old channel is closed once the streams on it have read their own ends
        (``rpc.DRAIN_READ_S`` at most), so their drops say ``eof``, not ``connection``."""
        if used is not self.channel:
            return
        self.counters["channel_resets"] += 1
        old = self.channel
        self.channel = rpc.open_channel(self.address, self.ssl, self.config.max_message_bytes)
        self._left_draining += old.left_draining
        if drained and isinstance(old, RelayChannel):
            old.retire(rpc.DRAIN_READ_S)
        else:
            old.close()

    def counter_values(self) -> dict[str, int]:
        """``counters`` and what this relay's channels counted: ``channel_left_draining``,
        connections left for new calls because the relay refused one as draining (all channels
        of the session, as ``channel_resets``; absent while 0, as every counter)."""
        out = dict(self.counters)
        left = self._left_draining + self.channel.left_draining
        if left:
            out["channel_left_draining"] = left
        return out

    def _on_catalog(self, upd: pb.KvPoolCatalogUpdate, held: Held | None = None) -> Held:
        """Take one catalog of a stream that held ``held``; returns what it holds now."""
        self._check_envelope(upd, "catalog")
        assert upd.relay is not None
        held = next_version("catalog", upd.relay, int(upd.revision), held)
        self._observe_relay(upd.relay, from_catalog=True)
        self.counters["catalog_updates"] += 1
        self.catalog_revision = int(upd.revision)
        self.catalog_error = None
        wanted: dict[PoolKey, pb.KvPoolDescriptor] = {}
        pools = upd.snapshot.pools if upd.snapshot is not None else []
        listed: dict[PoolKey, tuple[pb.KvPoolDescriptor, ProducerKey]] = {}
        for desc in pools:
            ep = desc.serving_endpoint
            if ep is None:
                self.counters["catalog_descriptor_invalid"] += 1
                continue
            try:
                pk = producer_key(desc.producer)
            except RelayError:
                self.counters["catalog_descriptor_invalid"] += 1
                continue
            key = PoolKey(self.name, ep.namespace, ep.component, ep.endpoint)
            if key in listed:
                self.counters["catalog_duplicate_endpoint"] += 1
                continue
            listed[key] = (desc, pk)
        # One pool (``KvPoolId``) under two endpoints is fenced, never merged (contract): a relay
        # never lists one so; a catalog that does cannot say which endpoint the filter serves.
        endpoints_of = Counter(pk.pool_part for _desc, pk in listed.values())
        for key, (desc, pk) in listed.items():
            if endpoints_of[pk.pool_part] > 1:
                self.counters["catalog_duplicate_pool"] += 1
                continue
            if self.pool_filter is not None and not self.pool_filter(key, desc):
                continue
            if len(wanted) >= self.config.max_pools_per_relay:
                self.counters["pools_over_limit"] += 1
                continue
            wanted[key] = desc
        for key in [k for k in self.slots if k not in wanted]:
            self._remove_slot(key, E.WITHDRAWN)
        for key, desc in wanted.items():
            pk = producer_key(desc.producer)
            slot = self.slots.get(key)
            if slot is not None and slot.producer == pk:
                slot.descriptor = desc  # metadata-only change: same generation, keep the replica
                continue
            if slot is not None:
                self._remove_slot(key, E.CATALOG_REPLACED)
            self._add_slot(key, desc, pk)
        self._notify()
        return held

    def _add_slot(self, key: PoolKey, desc: pb.KvPoolDescriptor, pk: ProducerKey) -> None:
        slot = PoolSlot(key, desc, pk)
        self.slots[key] = slot
        if pk.bucket_count > self.config.max_bucket_count:
            slot.quarantined = True
            self._count_drop(slot, E.TOO_LARGE)
            return
        slot.task = asyncio.create_task(self._pool_loop(slot))

    def _remove_slot(self, key: PoolKey, reason: str) -> None:
        slot = self.slots.pop(key, None)
        if slot is None:
            return
        if slot.task is not None and slot.task is not asyncio.current_task():
            slot.task.cancel()
        if slot.installed is not None or slot.pending is not None:
            self._count_drop(slot, reason)
        slot.installed = slot.pending = None

    def _count_drop(self, slot: PoolSlot, reason: str) -> None:
        slot.drops[reason] += 1
        self.drops[reason] += 1

    # ------------------------------------------------------------------ pool replicas
    async def _pool_loop(self, slot: PoolSlot) -> None:
        backoff = rpc.Backoff(self.config.backoff)
        try:
            while not self._closing and self.slots.get(slot.key) is slot:
                replica = PoolReplica(slot.descriptor.producer, self.identity_msg)
                slot.pending = replica
                slot.subscribes += 1

                def on(fu: pb.FilterUpdate, replica: PoolReplica = replica) -> None:
                    info = replica.feed(fu)
                    slot.frames[info.kind] += 1
                    slot.last_frame = replica.counters.last_frame
                    if info.installed:
                        slot.installed = replica
                        backoff.live()  # live from its install
                        self._notify()

                channel = self.channel
                try:
                    end = await rpc.run_stream(
                        channel, "SubscribeKvPool",
                        rpc.pool_request(self.config.subscriber_id, slot.descriptor.producer),
                        pb.FilterUpdate, on, silence_s=self.config.silence_s,
                    )  # fmt: skip
                    reason = end.reason
                except E.ConsumerViolation as v:
                    reason = v.reason
                    end = None
                    _log.warning("replica_violation", pool=str(slot.key), reason=v.reason,
                                 detail=v.detail)
                if self.slots.get(slot.key) is not slot:
                    return  # removed meanwhile (withdrawal/restart already counted)
                self._count_drop(slot, reason)
                slot.installed = slot.pending = None
                self._notify()
                # its heartbeats stopped and nothing else came on the channel either: the
                # connection died with TCP up (streams opened on it again went silent in turn
                # until grpclib's keepalive closed it: minutes); or only the channel's other
                # streams deliver: was this one's request heard? (after the drop: never held)
                if end is not None:
                    silence_s = self.config.silence_s
                    await self._replace_if_unfit(
                        channel, end, silence_s=silence_s, timeout_s=silence_s
                    )
                if reason in E.QUARANTINE:
                    slot.quarantined = True
                    return
                if reason in _REFRESH_CATALOG:
                    self.refresh_catalog()
                await asyncio.sleep(backoff.next_delay())
        finally:
            if self.slots.get(slot.key) is slot:
                slot.pending = None

    # ------------------------------------------------------------------ readiness & load
    async def _plane_loop(
        self,
        plane: str,
        method: str,
        request: Any,
        reply: type,
        store: Callable[[Any], None],
        version: Callable[[Any], int],
        silence_s: float | None = None,
    ) -> None:
        """``version(msg)``: the message's revision or window sequence (``next_version``)."""
        backoff = rpc.Backoff(self.config.backoff)
        window_s = 0.0  # a window plane's period, as its updates say (``window_ms``)
        while not self._closing:
            held: Held | None = None  # this stream's newest version

            def on(msg: Any) -> None:
                nonlocal window_s, held
                self._check_envelope(msg, plane)
                held = next_version(plane, msg.relay, int(version(msg)), held)
                backoff.live()
                window_s = rpc.window_period_s(window_s, getattr(msg, "window_ms", 0) or 0)
                self._observe_relay(msg.relay, from_catalog=False)
                self.counters[f"{plane}_updates"] += 1
                if plane == "serving_load":
                    self.serving_load_unsupported = False
                store(msg)
                self._notify()

            def quiet(base: float = silence_s or 0.0) -> float:
                return max(base, 3 * window_s)  # long windows: as their updates say, at once

            channel = self.channel
            try:
                end = await rpc.run_stream(
                    channel, method, request, reply, on,
                    silence_s=None if silence_s is None else quiet,
                )  # fmt: skip
            except E.ConsumerViolation as v:
                end = rpc.StreamEnd(v.reason, None, v.detail)
            self.counters[f"{plane}_end_{end.reason}"] += 1
            if plane == "serving_load":
                self.serving_load_unsupported = end.status == Status.UNIMPLEMENTED
            store(None)  # unknown while disconnected: never routable on stale data
            self._notify()
            # never the dead rule here (long windows); a violation is not silent
            await self._replace_if_unfit(channel, end, silence_s=None, timeout_s=quiet())
            await asyncio.sleep(backoff.next_delay())

    async def _readiness_loop(self) -> None:
        def store(m: pb.ServingReadinessUpdate | None) -> None:
            self.readiness = m

        await self._plane_loop(
            "readiness", "SubscribeServingReadiness",
            rpc.readiness_request(self.config.subscriber_id), pb.ServingReadinessUpdate, store,
            lambda m: m.revision, silence_s=self.config.silence_s,
        )  # fmt: skip

    async def _load_loop(self) -> None:
        def store(m: pb.KvPoolLoadUpdate | None) -> None:
            self.load = m

        await self._plane_loop(
            "load", "SubscribeKvPoolLoad",
            rpc.load_request(self.config.subscriber_id), pb.KvPoolLoadUpdate, store,
            lambda m: m.window_sequence,
            silence_s=self.config.silence_s,  # windows come every second or so
        )  # fmt: skip

    async def _serving_load_loop(self) -> None:
        def store(m: pb.ServingLoadUpdate | None) -> None:
            self.serving_load = m

        await self._plane_loop(
            "serving_load", "SubscribeServingLoad",
            rpc.serving_load_request(self.config.subscriber_id), pb.ServingLoadUpdate, store,
            lambda m: m.window_sequence, silence_s=self.config.silence_s,
        )  # fmt: skip
