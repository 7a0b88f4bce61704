"""``Mirror``: a ``RelayView`` whose source is another KvEventRelay.

One upstream stream per plane (catalog, readiness, load, serving load) and per catalog pool, all
on one channel. An upstream that answers a plane's RPC (``SubscribeServingLoad`` on a Dynamo 1.6
relay, or readiness or load) with ``UNIMPLEMENTED`` is asked again with backoff, and meanwhile
the mirror answers that RPC ``UNIMPLEMENTED`` too; the mirror is in sync, and in session, without
it (``MirrorPlane.synced``). The catalog is needed: without it there is no session. While the
mirror waits to synchronize it logs what it still waits for (``mirror_synchronizing``, every
``SYNC_LOG_S``).

Identity: the mirror *is* its upstream to its subscribers — same relay identity,
producers, sequences, bytes. A plane message or frame with another relay identity means the
upstream restarted: every local stream ends cleanly (as the upstream's own streams did), every
mirrored pool is dropped and the mirror follows the new identity. If a plane stream that
delivered under the old identity is still open, every upstream stream starts over on a fresh
channel (that stream would say nothing of the new identity until its next change).

Admission (``open_pool``): a key the mirror holds (live, or still synchronizing) is served
locally; any other key is decided by the upstream — the mirror subscribes upstream with exactly
that key, and the upstream's answer (POOL_NOT_FOUND, PRODUCER_CHANGED, RESOURCE_LIMIT, …) is the
mirror's answer, or the stream becomes the pool's mirror. So a router whose catalog is newer
than the mirror's gets the same answer as from the upstream, without the mirror guessing.
Except a key the upstream's catalog withdrew (it listed the key, and no longer does): the mirror
answers it itself, as a relay answers a retired generation (PRODUCER_CHANGED while the catalog
lists another generation of the pool, else POOL_NOT_FOUND), and stops its pool
(``MirrorPool.withdraw``) — an upstream that kept serving it would otherwise be served on.

Bounds: at most ``max_initialized_pool_hubs`` pools are mirrored at once (listed pools in
catalog order while there is room, then on demand). A subscriber to a pool that is not mirrored
when there is no room evicts the pool idle the longest (no local subscriber, nobody being
admitted), as a relay retires its idle hubs: its upstream stream ends and its table is dropped;
the next subscriber to it waits for a fresh sync. Only when every mirrored pool is in use is the
answer RESOURCE_LIMIT, so every listed pool stays servable behind a mirror and behind
``workers = N``. With ``release_idle_s`` (an external mirror's), a pool idle that long is
*released* the same way, and mirrored again only when a local subscriber asks for it: each
upstream stream is an upstream hub with a reader, so an idle mirror that kept the pools it
mirrored ahead of demand left its upstream, at its own hub cap, refusing every other client the
other pools for ever (``_release_idle``). A fan-out worker never releases (its ingest process
admits hubs for every worker).

Session: one rule (``in_session``) for the health a server reports (``follow_session``) and for
what the mirror answers: without a session every new RPC is refused PUBLICATION_UNAVAILABLE
(``relay_identity``, ``open_pool``, the planes' ``current``). Streams already open go on as
their upstream streams do, and end with a status when those end.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from grpclib.const import Status

from kvrelay._aio import NextTime, stop_all
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.wire import WireError, parse_envelope
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.logging import get_logger
from kvrelay.mirror.checker import relay_key
from kvrelay.mirror.plane import MirrorPlane, PlaneViolation
from kvrelay.mirror.pool import HOLD_TTL_S, MirrorPool, PoolContext, PoolState, until_answering
from kvrelay.mirror.settings import MirrorSettings
from kvrelay.mirror.upstream import BEHIND, FORWARDED, Upstream, upstream_error
from kvrelay.publication.hub import PublicationHub, Subscription
from kvrelay.service.canonical import WireFormatError, canonicalize

_log = get_logger(__name__)
#: The window planes' period when their updates state none shorter: a load or serving-load
#: window comes at least this often unless its ``window_ms`` says otherwise.
WINDOW_PERIOD_S = 1.0
#: A catalog message up to this size is parsed on the event loop (tens of ms at most, even of
#: empty descriptors); a larger one in a worker thread. A catalog of a few dozen pools is taken
#: without the thread's hop, so a local reader rarely sees the catalog before it.
CATALOG_INLINE_BYTES = 16 * 1024
#: How many keys withdrawn from the upstream's catalog the mirror remembers and refuses itself
#: (the newest; an older one is decided by the upstream again).
WITHDRAWN_KEYS = 4096
#: While the mirror has not synchronized, it logs what it still waits for this often: a mirror
#: that never serves says why (an upstream plane that never delivers, a pool never installed).
SYNC_LOG_S = 10.0


class _Superseded(Exception):
    """A plane message arrived on a channel the mirror has left (it followed a new upstream
    identity): the stream ends and subscribes again on the current channel."""


def _catalog_listing(data: bytes) -> tuple[dict[ProducerKey, pb.ProducerIdentity], int]:
    """The pools a catalog lists (catalog order, first of each key) and how many descriptors
    have no valid producer key. Pure: run in a worker thread."""
    try:
        upd = pb.KvPoolCatalogUpdate.parse(data)
    except Exception as exc:  # betterproto2 raises several types on bad bytes
        raise PlaneViolation(f"undecodable catalog: {exc}") from None
    listed: dict[ProducerKey, pb.ProducerIdentity] = {}
    invalid = 0
    for d in upd.snapshot.pools if upd.snapshot is not None else []:
        try:
            key = producer_key(d.producer)
        except RelayError:
            invalid += 1
            continue
        assert d.producer is not None
        listed.setdefault(key, d.producer)
    return listed, invalid


def _same_message(cls: type) -> Callable[[bytes, bytes], bool]:
    """Canonical protobuf equality of two encodings of ``cls`` (the service's request rule:
    fields as official protobuf resolves them, deterministic order, unknown fields dropped).
    A re-send may be encoded otherwise than the first send (field order, packing)."""

    def same(held: bytes, resent: bytes) -> bool:
        try:
            return canonicalize(held, cls) == canonicalize(resent, cls)
        except WireFormatError:
            return False

    return same


class Mirror:
    """Start inside a running event loop; ``stop()`` ends everything (local streams cleanly)."""

    def __init__(self, settings: MirrorSettings) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.upstream = Upstream(settings)
        # Every plane is served only in session (``in_session``, the rule the health follows):
        # a catalog the upstream still streams while its load plane went silent (its ingest
        # process frozen) is not vouched for either. Readiness and load are in sync without a
        # stream once the upstream answers UNIMPLEMENTED, a verdict held only with the upstream
        # session that gave it, as serving load's.
        session = self._in_session
        self.catalog = MirrorPlane("catalog", same=_same_message(pb.KvPoolCatalogUpdate),
                                   session=session)  # fmt: skip
        self.readiness = MirrorPlane("readiness", same=_same_message(pb.ServingReadinessUpdate),
                                     session=session)  # fmt: skip
        self.load = MirrorPlane("load", same=_same_message(pb.KvPoolLoadUpdate),
                                session=session)  # fmt: skip
        # no "_" in the name: metrics split "<plane>_<reason>"
        self.serving_load = MirrorPlane("serving-load", same=_same_message(pb.ServingLoadUpdate),
                                        session=session)  # fmt: skip
        self._identity: pb.RelayIdentity | None = None
        self._identity_key: tuple[int, int] | None = None
        self._identity_bytes = b""
        self._listed: dict[ProducerKey, pb.ProducerIdentity] = {}
        #: keys the upstream's catalog listed and then withdrew (oldest first, bounded)
        self._withdrawn: dict[ProducerKey, None] = {}
        self._pools: dict[ProducerKey, MirrorPool] = {}
        #: listed keys released idle (``_release_idle``): mirrored again only on demand
        self._released: dict[ProducerKey, None] = {}
        #: set while a catalog message received from the upstream is parsed in a thread
        #: (``_take_catalog``): resolved once it is published or dropped
        self._catalog_parsing: asyncio.Future[None] | None = None
        #: resolved (then replaced) when a plane stream takes its first message: the upstream
        #: answers again, and the loops waiting out a backoff after a stream that got nothing
        #: (planes, pools whose attempt failed) ask again now (``until_answering``)
        self._answering = NextTime()
        self._ctx = PoolContext(
            settings=settings,
            upstream=self.upstream,
            encode_gate=asyncio.Semaphore(self.limits.publication_encoding_concurrency),
            identity=self._current_identity,
            listed=lambda key: key in self._listed,
            changed=self._pool_changed,
            catalog_taken=self._catalog_taken,
            answering=self._answering.next,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.synced = asyncio.Event()
        self.identity_changes = 0
        self.catalog_invalid = 0  # descriptors whose producer is not a valid key (not mirrored)
        self.pools_over_limit = 0  # listed pools not mirrored at the last catalog: hub cap
        self.pools_evicted = 0  # idle mirrored pools dropped to make room for another
        self.pools_released = 0  # mirrored pools dropped after ``release_idle_s`` idle
        self.plane_ends: Counter[str] = Counter()
        #: how each plane's stream last ended without delivering (cleared once it delivers):
        #: what ``mirror_synchronizing`` says the mirror waits on (an upstream that refuses the
        #: catalog, say) while no metrics page is served yet
        self._last_ends: dict[str, str] = {}
        #: the upstream identity each running plane stream last delivered under (absent until
        #: its first message): a stream that delivered under an identity the mirror leaves
        #: will not send the new one's state until something changes
        self._plane_sessions: dict[str, tuple[int, int] | None] = {}
        self.plane_violations: Counter[str] = Counter()
        self._retired: Counter[str] = Counter()  # pool counters folded in when pools go
        self.started = False

    # ------------------------------------------------------------------ RelayView
    @property
    def relay_identity(self) -> pb.RelayIdentity:
        if not self.in_session:
            raise RelayError.publication_unavailable("the mirror has no upstream session")
        assert self._identity is not None
        return self._identity

    @property
    def in_session(self) -> bool:
        """Whether the mirror holds a live upstream session: an identity, the catalog
        delivering, and the readiness and load planes delivering or answered ``UNIMPLEMENTED``
        (``MirrorPlane.synced``; serving load is optional: a Dynamo 1.6 upstream has none).
        The one rule for both what its health says (``follow_session``) and what it answers:
        without a session it refuses every RPC PUBLICATION_UNAVAILABLE. (RPCs used to need only
        the identity and the catalog, which has no silence bound once it delivered: a worker
        whose ingest process was frozen said NOT_SERVING and went on answering
        ``GetRelayInfo`` and new catalog watches with the stale catalog.)"""
        return (
            self._identity is not None
            and self.catalog.live
            and self.readiness.synced
            and self.load.synced
        )

    def _in_session(self) -> bool:
        return self.in_session

    def _current_identity(self) -> pb.RelayIdentity:
        assert self._identity is not None
        return self._identity

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        key = producer_key(expected)
        if not self.in_session:
            raise RelayError.publication_unavailable("the mirror has no upstream session")
        if key in self._withdrawn:  # a retired generation, as a relay answers it
            raise self._unlisted(key)
        pool = self._pools.get(key)
        if pool is None or pool.state is PoolState.GONE:
            if not self._room() and key not in self._listed:
                # A relay decides that the pool exists before it looks at the hub cap: with no
                # room, a key the catalog does not list (a stale generation, an unknown pool)
                # gets the listing's answer, and evicts no mirrored pool for the asking.
                raise self._unlisted(key)
            if not self._room() and not self._evict_idle():
                raise RelayError.resource_limit(
                    f"Relay initialized pool hub limit {self.limits.max_initialized_pool_hubs} "
                    "reached"
                )
            self._released.pop(key, None)  # mirrored again, on demand
            pool = self._start_pool(key, expected)  # the upstream decides this key
        deadline = asyncio.get_running_loop().time() + self.settings.sync_wait_s
        return await pool.admit(on_release, deadline)

    def catalog_trails(self, expected: pb.ProducerIdentity) -> bool:
        """Whether a pool this mirror's catalog does not list may yet be listed by a catalog on
        its way: the mirror's catalog trails its upstream's, so a router that read the pool
        there (or from a sibling fan-out worker) may ask first. The service's
        ``[[authorization]]`` check waits a moment for it (``server._may_see_listed``). Not a key
        the upstream withdrew (the mirror answers it itself), nor without a session."""
        return self.in_session and producer_key(expected) not in self._withdrawn

    def _unlisted(self, key: ProducerKey) -> RelayError:
        """What a relay answers for a key its catalog does not list: PRODUCER_CHANGED while it
        lists another generation of the pool, else POOL_NOT_FOUND."""
        if any(k.pool_part == key.pool_part for k in self._listed):
            return RelayError.producer_changed()
        return RelayError.pool_not_found()

    async def hold_pool(
        self, expected: pb.ProducerIdentity, requester: str, seconds: float
    ) -> float:
        """A mirror of this mirror asks for spacing: its local hub takes the request like a
        joiner's, and this mirror passes the need on to its own upstream (``MirrorPool``)."""
        if not self.in_session:
            raise RelayError.publication_unavailable("the mirror has no upstream session")
        pool = self._pools.get(producer_key(expected))
        hub = None if pool is None or pool.withdrawn else pool.hub
        if hub is None:
            raise self.absent_hold()
        granted = hub.request_hold(requester, seconds, HOLD_TTL_S)
        assert pool is not None
        pool._space(hub)
        return granted

    def absent_hold(self) -> RelayError:
        """``hold_pool``'s answer for a pool this mirror does not serve (also what a client
        hears for a pool ``[[authorization]]`` hides from it)."""
        return RelayError.publication_unavailable("the mirror does not serve this pool now")

    @property
    def _planes(self) -> tuple[MirrorPlane, ...]:
        return (self.catalog, self.readiness, self.load, self.serving_load)

    # ------------------------------------------------------------------ pools
    def _room(self) -> bool:
        active = sum(1 for p in self._pools.values() if p.state is not PoolState.GONE)
        return active < self.limits.max_initialized_pool_hubs

    def _evict_idle(self) -> bool:
        """Make room: stop the mirrored pool idle the longest (no local subscriber, nobody
        being admitted). False when every mirrored pool is in use."""
        idle = [
            (since, pool)
            for pool in self._pools.values()
            if pool.state is not PoolState.GONE and (since := pool.idle_since) is not None
        ]
        if not idle:
            return False
        _since, pool = min(idle, key=lambda item: item[0])
        self.pools_evicted += 1
        _log.info("mirror_pool_evicted", pool=pool.name, state=pool.state.value)
        if self.settings.release_idle_s > 0 and pool.key in self._listed:
            self._released[pool.key] = None  # (idle too: mirrored again only on demand)
        pool.stop(None, "the mirror evicted this idle pool to make room for another")
        return True

    def _release_idle(self, now: float) -> float:
        """Release every mirrored pool idle (no local subscriber, nobody being admitted) for
        ``release_idle_s`` at ``now`` (monotonic), as an eviction drops one: its upstream
        stream ends, so the upstream's hub has no reader for it and the upstream may give it to
        another client, and its table is dropped. A listed pool released is not mirrored again
        ahead of demand (``_reconcile``); its next subscriber starts it (``open_pool``). Returns
        how long until the next pool can be due."""
        after = self.settings.release_idle_s
        wait = after
        for pool in list(self._pools.values()):
            since = pool.idle_since
            if pool.state is PoolState.GONE or since is None:
                continue
            if now - since < after:
                wait = min(wait, since + after - now)
                continue
            self.pools_released += 1
            if pool.key in self._listed:
                self._released[pool.key] = None
            _log.info("mirror_pool_released", pool=pool.name, state=pool.state.value,
                      idle_s=round(now - since, 3))  # fmt: skip
            pool.stop(None, "the mirror released this pool: no local subscriber")
        return wait

    async def _release_loop(self) -> None:
        """``_release_idle`` whenever a pool can be due (a pool idle from now is due
        ``release_idle_s`` from now at the earliest)."""
        while True:
            wait = self._release_idle(time.monotonic())
            await asyncio.sleep(max(wait, 0.01))

    def _start_pool(self, key: ProducerKey, producer: pb.ProducerIdentity) -> MirrorPool:
        pool = MirrorPool(self._ctx, key, producer)
        self._pools[key] = pool
        pool.start()
        return pool

    def _pool_changed(self, pool: MirrorPool) -> None:
        if pool.state is PoolState.GONE and self._pools.get(pool.key) is pool:
            del self._pools[pool.key]
            self._fold(pool)
        self._check_synced()

    def _fold(self, pool: MirrorPool) -> None:
        _add_counts(self._retired, pool)

    def _take_listing(self, listed: dict[ProducerKey, pb.ProducerIdentity]) -> None:
        """A new catalog: the keys it no longer lists are withdrawn (their pools stopped, new
        subscriptions to them refused), then its pools are mirrored."""
        withdrawn = self._withdrawn
        for key in self._listed:
            if key not in listed:
                withdrawn[key] = None
                pool = self._pools.get(key)
                if pool is not None:
                    pool.withdraw()
        for key in listed:
            withdrawn.pop(key, None)  # listed again (an upstream's choice): served again
        while len(withdrawn) > WITHDRAWN_KEYS:
            del withdrawn[next(iter(withdrawn))]
        self._released = {k: None for k in self._released if k in listed}
        self._listed = listed
        self._reconcile()

    def _reconcile(self) -> None:
        """Mirror every listed pool (catalog order) while there is room for its hub, but those
        released idle (``_release_idle``: only a local subscriber starts them again)."""
        over = 0
        for key, producer in self._listed.items():
            pool = self._pools.get(key)
            if key in self._released or (pool is not None and pool.state is not PoolState.GONE):
                continue
            if not self._room():
                over += 1
                continue
            self._start_pool(key, producer)
        self.pools_over_limit = over
        self._check_synced()

    def _check_synced(self) -> None:
        if not self.synced.is_set() and not self.waiting_for():
            self.synced.set()

    def waiting_for(self) -> list[str]:
        """What the mirror still waits for before it is synchronized (empty once it is): the
        upstream's identity, a plane (``catalog``; ``readiness`` or ``load`` until it delivers or
        the upstream answers it ``UNIMPLEMENTED``), each listed pool's first sync (``pools``)."""
        if self.synced.is_set():
            return []
        out = [] if self._identity is not None else ["upstream identity"]
        if not self.catalog.live:
            out.append("catalog")
        out += [p.name for p in (self.readiness, self.load) if not p.synced]
        pending = sum(1 for k, p in self._pools.items() if k in self._listed and not p.first_done)
        if pending:
            out.append(f"{pending} of {len(self._listed)} pools")
        return out

    async def _report_sync(self, period_s: float = SYNC_LOG_S) -> None:
        """Log what the mirror still waits for, every ``period_s`` until it is synchronized (the
        daemon logs ``mirror_synchronizing`` once as it starts to wait)."""
        while not self.synced.is_set():
            try:
                async with asyncio.timeout(period_s):
                    await self.synced.wait()
            except TimeoutError:
                waiting = self.waiting_for()
                ends = {p: e for p, e in self._last_ends.items() if p in waiting}
                if ends:  # refused or failing, not only slow: a warning that says how
                    _log.warning("mirror_synchronizing", upstream=str(self.settings.upstream),
                                 waiting_for=waiting, last_ends=ends)  # fmt: skip
                else:
                    _log.info("mirror_synchronizing", upstream=str(self.settings.upstream),
                              waiting_for=waiting)  # fmt: skip

    def hub_for(self, producer: pb.ProducerIdentity) -> PublicationHub | None:
        """The local hub serving ``producer`` (tests and diagnostics)."""
        pool = self._pools.get(producer_key(producer))
        return None if pool is None else pool.hub

    # ------------------------------------------------------------------ identity
    def _observe_relay(self, raw: bytes | None) -> None:
        """Adopt the upstream identity, or follow a new one (the upstream restarted)."""
        if raw is None:
            raise PlaneViolation("message without a relay identity")
        if raw == self._identity_bytes:
            return
        try:
            relay = pb.RelayIdentity.parse(raw)
        except Exception as exc:  # betterproto2 raises several types on bad bytes
            raise PlaneViolation(f"undecodable relay identity: {exc}") from None
        key = relay_key(raw)
        if not key[1]:
            raise PlaneViolation("relay identity with incarnation 0")
        if key == self._identity_key:
            return
        if self._identity is not None:
            self._follow(relay)
        self._identity, self._identity_key, self._identity_bytes = relay, key, raw
        _log.info("mirror_upstream_identity", drt_instance_id=key[0], relay_incarnation=key[1])

    def _follow(self, relay: pb.RelayIdentity) -> None:
        """End everything of the old upstream incarnation cleanly and start over."""
        self.identity_changes += 1
        _log.warning("mirror_upstream_restarted", old=self._identity_key,
                     new=(int(relay.drt_instance_id), int(relay.relay_incarnation)))  # fmt: skip
        for plane in self._planes:
            plane.end(None, "the upstream restarted")
        for pool in list(self._pools.values()):
            pool.stop(None, "the upstream restarted: refresh the catalog")
        self._pools.clear()
        self._listed = {}
        self._withdrawn = {}
        # A plane stream that delivered under the old identity stayed open across the change:
        # it would send the new incarnation's state only on the next change (a catalog is sent
        # only on change: the mirror would stay without one). Every stream then starts over
        # on a fresh channel. Streams opened since the old session was lost (an upstream
        # restart) deliver the new state anyway and are left alone.
        if self._identity_key in self._plane_sessions.values():
            self.upstream.reset()

    # ------------------------------------------------------------------ planes
    async def _take_catalog(
        self, plane: MirrorPlane, version: int, data: bytes, channel: object
    ) -> None:
        """Parse a catalog (off the event loop unless it is small), then publish it and
        mirror its pools, in order (the stream reads its next message after this).
        betterproto2 takes seconds for a catalog of many small descriptors (about 2 s per MiB):
        on the loop, every local stream would stop that long."""
        if len(data) <= CATALOG_INLINE_BYTES:
            listed, invalid = _catalog_listing(data)
        else:
            parsing = asyncio.get_running_loop().create_future()
            self._catalog_parsing = parsing
            try:
                listed, invalid = await asyncio.to_thread(_catalog_listing, data)
            finally:
                self._catalog_parsing = None
                parsing.set_result(None)  # (its waiters look again once this task went on)
        if self.upstream.channel is not channel:
            raise _Superseded  # the upstream changed meanwhile: this catalog is not current
        if plane.offer(version, data):
            self.catalog_invalid += invalid
            self._take_listing(listed)
        self._check_synced()

    async def _catalog_taken(self) -> None:
        """Return once no catalog message the upstream sent is still being parsed. A relay
        publishes a fence's or withdrawal's catalog before it ends the pool's streams, and
        writes it to the mirror's connection first; a pool whose upstream stream ended waits
        here before it ends its local streams, so the mirror's catalog watchers get the
        withdrawal first too, as a direct relay's do (the service writes the catalog before
        the status). Without this a catalog parsed in a thread came after the stream's end."""
        while (parsing := self._catalog_parsing) is not None:
            await asyncio.wait((parsing,))
            await asyncio.sleep(0)  # the catalog stream publishes it (and reads its next)

    async def _plane_loop(self, plane: MirrorPlane, method: str, request: Any) -> None:
        # the SDK's rule: attempts start over only after a stream live ``rpc.LIVE_RESUBSCRIBE_S``
        # (they started over at every message: an upstream ending each stream after its first
        # was asked again 25-60 times a second, each ended catalog stream a new connection)
        backoff = rpc.Backoff(self.settings.backoff)
        is_catalog = plane is self.catalog
        # readiness: re-sent every readiness period (or heartbeat); the window planes: a window
        # at least every second unless their updates state a longer one (``quiet``)
        base = 3 * (
            max(self.settings.upstream_heartbeat_s, self.settings.upstream_readiness_s)
            if plane is self.readiness else WINDOW_PERIOD_S
        )
        window_s = 0.0  # a window plane's period, as its updates state it (``window_ms``)

        def quiet() -> float:
            return max(base, 3 * window_s)  # at once, on the stream whose update stated it

        silence = None if is_catalog else quiet
        # a catalog comes at once, then only on change: its first message has the readiness
        # plane's bound, so a stream that never answers is opened again, not waited on for ever
        first = 3 * max(self.settings.upstream_heartbeat_s, self.settings.upstream_readiness_s)
        while True:
            delivered = False
            current = self.upstream.channel  # the stream below runs on it
            answering = self._answering.next()  # resolved once a plane's stream takes a message

            def on(data: bytes, current: object = current) -> Awaitable[None] | None:
                nonlocal delivered, window_s
                if self.upstream.channel is not current:
                    raise _Superseded  # a message of a session the mirror has left
                try:
                    env = parse_envelope(data)
                except WireError as exc:
                    raise PlaneViolation(f"{plane.name}: {exc}") from None
                if env.marker != CONTRACT_MARKER or env.protocol_version != PROTOCOL_VERSION:
                    raise PlaneViolation(f"{plane.name}: envelope marker/version")
                window_s = rpc.window_period_s(window_s, env.window_ms)
                self._observe_relay(env.relay)
                if self.upstream.channel is not current:
                    raise _Superseded  # it followed a new identity: read it afresh
                self._plane_sessions[plane.name] = self._identity_key
                if not delivered:
                    delivered = True
                    self._last_ends.pop(plane.name, None)
                    self._answering.fire()  # the upstream answers again
                backoff.live()
                if is_catalog:
                    return self._take_catalog(plane, env.version, data, current)
                plane.offer(env.version, data)
                self._check_synced()
                return None

            local: RelayError | None
            ended: tuple[Any, rpc.StreamEnd] | None = None  # (channel, end): judged once ended
            try:
                try:
                    end, channel = await self.upstream.stream(
                        method, request, on, silence_s=silence,
                        first_message_s=first if is_catalog else None,
                    )  # fmt: skip
                finally:
                    self._plane_sessions.pop(plane.name, None)
                if end.status == Status.UNIMPLEMENTED and not delivered:
                    self.plane_ends[f"{plane.name}_unimplemented"] += 1
                    plane.mark_unsupported("the upstream does not implement " + method)
                    self._check_synced()  # (in sync without it)
                    await asyncio.sleep(backoff.next_delay())
                    continue
            except _Superseded:
                # the mirror followed a new upstream identity (its planes already ended
                # cleanly): subscribe again on the fresh channel
                self.plane_ends[f"{plane.name}_superseded"] += 1
                # an upstream that keeps changing identity is asked with backoff
                await asyncio.sleep(backoff.next_delay())
                continue
            except PlaneViolation as v:
                self.plane_violations[plane.name] += 1
                _log.warning("mirror_plane_violation", plane=plane.name, detail=str(v))
                local = RelayError.publication_unavailable(f"the mirror refused the upstream "
                                                           f"{plane.name} stream: {v}")
                why = "upstream stream broke a rule"
            except Exception as exc:  # a bug here must not stop the plane for good
                self.plane_ends[f"{plane.name}_internal"] += 1
                _log.exception("mirror_plane_failed", plane=plane.name, error=repr(exc))
                local = RelayError.publication_unavailable(f"mirror failure: {type(exc).__name__}")
                why = "mirror failure"
            else:
                self.plane_ends[f"{plane.name}_{end.reason}"] += 1
                if not delivered:
                    said = f"{end.reason}: {end.message}" if end.message else end.reason
                    self._last_ends[plane.name] = said[:200]
                local, why = self._plane_end(end)
                if is_catalog and end.reason in (E.EOF, E.CONNECTION):
                    # the session's stream: a relay shutting down may still accept streams on
                    # its old connection, so every stream starts over on a fresh one
                    self.upstream.reset(channel, drained=end.reason == E.EOF)
                elif not delivered:
                    ended = channel, end
            plane.end(local, why)
            if ended is not None:
                # the catalog: did nothing come on the channel, on any stream, for as long (a
                # black-holed path keeps TCP up, and streams opened on it again went silent in
                # turn until grpclib's keepalive closed it: a ping 20 s in, then one per 300 s)?
                # Every plane: the channel receives, but was this stream's request heard? (The
                # dead rule is the catalog's only: long windows keep a healthy channel quiet.)
                await self.upstream.replace_if_unfit(
                    *ended, silence_s=first if is_catalog else None,
                    timeout_s=first if is_catalog else quiet(),
                )  # fmt: skip
            delay = backoff.next_delay()
            if delivered:
                await asyncio.sleep(delay)
            else:  # (got nothing: another plane's stream that takes a message ends the wait)
                await until_answering(answering, delay)

    @staticmethod
    def _plane_end(end: rpc.StreamEnd) -> tuple[RelayError | None, str]:
        if end.reason == E.EOF:
            return None, "the upstream ended the stream (shutdown)"
        answer = upstream_error(end)
        if answer is not None:
            if int(answer.reason) in BEHIND:
                return RelayError.publication_unavailable(
                    f"the mirror fell behind its upstream ({answer.trailer_value})"
                ), "fell behind"
            if int(answer.reason) in FORWARDED:  # the same status and message (§4.9)
                return answer, "upstream plane unavailable"
            return RelayError.publication_unavailable(
                f"upstream ended the stream: {answer.trailer_value}: {answer.message}"
            ), "upstream error"
        return RelayError.publication_unavailable(
            f"upstream connection lost ({end.reason}: {end.message})"
        ), "upstream unreachable"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.started = True
        sid = self.settings.subscriber_id
        loop = asyncio.get_running_loop()
        for plane, method, request in (
            (self.catalog, "WatchKvPoolCatalog", rpc.catalog_request(sid)),
            (self.readiness, "SubscribeServingReadiness", rpc.readiness_request(sid)),
            (self.load, "SubscribeKvPoolLoad", rpc.load_request(sid)),
            (self.serving_load, "SubscribeServingLoad", rpc.serving_load_request(sid)),
        ):
            task = loop.create_task(
                self._plane_loop(plane, method, request), name=f"kvrelay-mirror-{plane.name}"
            )
            self._tasks.append(task)
        self._tasks.append(loop.create_task(self._report_sync(), name="kvrelay-mirror-sync-log"))
        if self.settings.release_idle_s > 0:
            self._tasks.append(loop.create_task(self._release_loop(),
                                                name="kvrelay-mirror-release"))  # fmt: skip

    async def stop(self) -> None:
        await stop_all(self._tasks)
        self._tasks.clear()
        for pool in list(self._pools.values()):
            pool.stop(None)  # (GONE: ``_pool_changed`` folds its counters into the totals)
        self._pools.clear()
        for plane in self._planes:
            plane.end(None, "the mirror is shutting down")
        self.upstream.close()

    def stats(self) -> dict[str, Any]:
        """Plain counters and gauges (for logs, metrics and the benchmarks)."""
        totals = Counter(self._retired)
        pools = {}
        for key, pool in self._pools.items():
            pools[f"{key.routing_scope_digest.hex()[:8]}/{key.layout_generation}"] = pool.stats()
            _add_counts(totals, pool)
        return {
            "upstream": str(self.settings.upstream),
            "identity": self._identity_key,
            "identity_changes": self.identity_changes,
            "synced": self.synced.is_set(),
            "planes": {
                p.name: {"live": p.live, "epochs": p.epochs, "version": p.upstream_version,
                         "equivalent_resends": p.equivalent_resends, "replaced": p.replaced,
                         "unsupported": p.unsupported}
                for p in self._planes
            },
            "plane_ends": dict(self.plane_ends),
            "plane_violations": dict(self.plane_violations),
            "catalog_invalid": self.catalog_invalid,
            "pools_over_limit": self.pools_over_limit,
            "pools_evicted": self.pools_evicted,
            "pools_released": self.pools_released,
            "channel_resets": self.upstream.resets,
            "channel_deaf": self.upstream.deaf,
            "channel_left_draining": self.upstream.left_draining,
            "upstream_spacing": self.upstream.spacing,
            "hold_failures": self.upstream.hold_failures,
            "hold_denied": self.upstream.hold_denied,
            "pool_totals": dict(totals),
            "pools": pools,
        }


#: How often ``follow_session`` looks at the mirror's session.
SESSION_POLL_S = 0.25


async def follow_session(
    mirror: Mirror, set_serving: Callable[[bool], None], period_s: float = SESSION_POLL_S
) -> None:
    """Keep a server's health (``RelayHealth.set_serving``) on the mirror's upstream session:
    NOT_SERVING while it has none (its upstream frozen, dead or gone, a ``workers = N`` ingest
    process stopped), SERVING again once it has. A mirror without a session refuses every RPC;
    before, its health said SERVING all along, so a readiness probe kept sending routers to it.
    Assumes SERVING at the start (the server just started listening); cancel it before the
    server's drain, which sets NOT_SERVING for good."""
    serving = True
    while True:
        now = mirror.in_session
        if now != serving:
            serving = now
            set_serving(now)
            _log.warning("mirror_health", serving=now, planes={
                p.name: "unimplemented" if p.unsupported else p.live
                for p in mirror._planes})  # fmt: skip
        await asyncio.sleep(period_s)


def _add_counts(totals: Counter[str], pool: MirrorPool) -> None:
    """Add one pool's counters to the mirror's ``totals`` (live pools and folded ones alike)."""
    for name in ("attempts", "installs", "deltas", "lagged", "holds_sent"):
        totals[name] += int(getattr(pool, name))
    for k, v in pool.ends.items():
        totals[f"end_{k}"] += v
    for k, v in pool.violations.items():
        totals[f"violation_{k}"] += v
