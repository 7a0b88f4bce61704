"""grpclib KvEventRelay server: the six v1 RPCs with contract error trailers.

Handlers are mapped by hand (`__mapping__`) so every stream can end with
`send_trailing_metadata(status, message, {"kv-relay-error-reason": NAME})`. The unary RPC raises
`GRPCError` and a `SendTrailingMetadata` listener adds the trailer from a contextvar.
Plane messages are encoded once per version and the same bytes go to every subscriber (a plane
that already holds bytes, as a mirror's does, passes them through). The relay identity is read
from the view at each `GetRelayInfo`, so a mirror answers with its upstream's current identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar, cast

from grpclib.config import Configuration
from grpclib.const import Cardinality, Handler
from grpclib.events import SendTrailingMetadata, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from kvrelay._aio import NextTime, drop
from kvrelay._grpc import closed_streams_bound
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import PermitCounter, RelayLimits
from kvrelay.contract.producer import producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION, TRAILER_KEY
from kvrelay.logging import get_logger
from kvrelay.publication.catalog import CatalogPlane
from kvrelay.publication.hub import Subscription
from kvrelay.publication.plane import Plane, PlaneClosed, PlaneEnded, PlaneUnsupported
from kvrelay.publication.readiness import ReadinessPlane
from kvrelay.publication.window import WindowPlane
from kvrelay.service.authz import Authorization, ClientIdentity, not_visible, revoked
from kvrelay.service.codec import PassThroughCodec
from kvrelay.service.generic_drain import GenericDrain
from kvrelay.service.h2.closing import ClosingServer, TlsSource
from kvrelay.service.h2.guard import ConnectionCaps, H2Budgets, H2Counters
from kvrelay.service.h2.request import (
    INBOUND_WINDOW_BYTES,
    REQUEST_TIMEOUT_S,
    BoundedRequests,
    recv_within,
)
from kvrelay.service.h2.request_guards import RequestGuards
from kvrelay.service.h2.tls_gate import TLS_HANDSHAKE_TIMEOUT_S
from kvrelay.service.h2.writer import StreamWriter, send_unless, stream_resetter
from kvrelay.service.health import MAX_HEALTH_WATCHERS, RelayHealth
from kvrelay.service.peercred import SameUserOnly
from kvrelay.service.reflection import MAX_REFLECTION_STREAMS, reflection_services
from kvrelay.service.shares import StreamShares, StreamTicket, peer_addr
from kvrelay.service.spacing import SpacingService
from kvrelay.service.status import (
    UNSUPPORTED_RPC,
    certificate_revoked,
    status_of,
    trailers_of,
)
from kvrelay.service.validation import check_marker, validate_stream_request
from kvrelay.service.view import RelayView

SERVICE = "/dynamo.kvrelay.v1.KvEventRelay/"
_log = get_logger(__name__)
#: How long the close waits at most (and no longer than the grace), after the drain's grace,
#: for the calls it refused to write their status: HEADERS, not flow-controlled, so at once
#: unless a client reads nothing at all.
REFUSAL_WRITE_S = 1.0
#: The least a connection closed at shutdown is given to be gone (``close``: a quarter of the
#: grace otherwise, never more than ``CLOSE_WAIT_S``).
CLOSE_WAIT_FLOOR_S = 0.05
#: How long a pool stream that ends with an error waits at most for every catalog stream to
#: hand the current catalog revision to its transport first (``_catalog_first``): a fenced or
#: withdrawn generation's streams end after the catalog without it, yet a catalog client that
#: reads nothing cannot hold their end.
CATALOG_FIRST_S = 1.0
#: ``guard_stats``' key for the pool stream ends that stopped waiting after ``CATALOG_FIRST_S``.
CATALOG_FIRST_KIND = "catalog_first"
#: Under ``[[authorization]]``, how long a pool request waits at most for a catalog that trails
#: its source (a mirror's, a fan-out worker's: the view's ``catalog_trails``) to list a pool it
#: does not list yet, before answering it as absent (``_may_see_listed``).
CATALOG_LAG_S = 1.0
#: Accept backlog of the relay's TCP listener (grpclib's default is 100): connections wait here
#: while every worker is busy or restarting, or while a hot upgrade's successor starts.
LISTEN_BACKLOG = 1024
_UNARY_REASON: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kv_relay_unary_reason", default=None
)
T = TypeVar("T")
_Body = Callable[[Stream[Any, Any]], Awaitable[None]]


#: Planes that lay their newest message's wire bytes out from pieces they keep encoded.
_WIRED = (WindowPlane, CatalogPlane, ReadinessPlane)


class _EncodedPlane:
    """Caches the encoding of a plane's newest message (one encode per version)."""

    __slots__ = ("_cache", "plane")

    def __init__(self, plane: Plane[Any]) -> None:
        self.plane = plane
        self._cache: tuple[int, bytes] | None = None

    def encode(self, version: int, message: Any) -> bytes:
        if isinstance(message, bytes):
            return message  # already the wire bytes (a mirror's plane): nothing to cache
        cached = self._cache
        if cached is not None and cached[0] == version:
            return cached[1]
        plane = self.plane
        data = plane.wire(version) if isinstance(plane, _WIRED) else None
        if data is None:  # no cached pieces, or a message no longer the newest
            data = bytes(message)
        if cached is None or version > cached[0]:
            self._cache = (version, data)
        return data


class KvEventRelayService:
    """The six RPCs over a RelayView. Counters are plain ints for the metrics layer."""

    def __init__(self, view: RelayView, limits: RelayLimits | None = None) -> None:
        self.view = view
        self.limits = limits = limits or RelayLimits()
        self.catalog_permits = PermitCounter("catalog", limits.max_catalog_subscribers)
        self.pool_permits = PermitCounter("pool streams", limits.max_pool_streams_total)
        self.readiness_permits = PermitCounter("readiness", limits.max_readiness_subscribers)
        self.load_permits = PermitCounter("load", limits.max_load_subscribers)
        # Dynamo 1.7's serving-load plane: its own count, under the same bound as load's.
        self.serving_load_permits = PermitCounter("serving load", limits.max_load_subscribers)
        self._catalog = _EncodedPlane(view.catalog)
        self._readiness = _EncodedPlane(view.readiness)
        self._load = _EncodedPlane(view.load)
        self._serving_load = _EncodedPlane(view.serving_load)
        self._info: tuple[bytes, bytes] | None = None  # (identity bytes, RelayInfo bytes)
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        self._subscriptions: set[Subscription] = set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.errors: dict[str, int] = {}
        self.shares = StreamShares(
            limits.stream_share_per_connection_percent, limits.stream_share_per_peer_percent
        )
        #: stream kind → plane streams reset because their client did not read a message for
        #: ``stalled_stream_reset_s``.
        self.stalled_resets: dict[str, int] = {}
        #: connections closed for breaking an HTTP/2 budget (``service/h2/guard.py``)
        self.h2_counters = H2Counters()
        self._listed_keys: tuple[int, frozenset[Any]] | None = None  # catalog version, pools
        #: a stream whose request message has not arrived after this long is ended
        self.request_timeout_s = REQUEST_TIMEOUT_S
        #: the bytes of larger requests being read, and the streams waiting for their request,
        #: on every service of the port
        self.request_guards = RequestGuards.of(limits, self.h2_counters)
        self.unsupported = 0  # streams ended UNIMPLEMENTED: the source lacks the plane
        #: ``[[authorization]]`` rules (None: every client sees every pool); set_authorization
        self.authorization: Authorization | None = None
        self._rules_changed = NextTime()
        #: open pool streams → (their client, their pool), to end those a rules reload forbids
        self._pool_clients: dict[Subscription, tuple[ClientIdentity, pb.ProducerIdentity]] = {}
        #: rpc → requests answered POOL_NOT_FOUND because the client may not see the pool
        self.authz_denials: dict[str, int] = {}
        #: pool streams ended because a rules reload took their pool away
        self.authz_revoked = 0
        #: open catalog streams → the catalog revision each last handed to its transport (-1:
        #: none yet); a pool stream that ends with an error waits for them (``_catalog_first``)
        self._catalog_written: dict[object, int] = {}
        self._catalog_moved = NextTime()
        #: pool stream ends that stopped waiting for a catalog stream after ``CATALOG_FIRST_S``
        self.catalog_first_timeouts = 0
        #: how long a pool request waits for a trailing catalog to list its pool (rules only)
        self.catalog_lag_s = CATALOG_LAG_S

    # --- authorization ---
    def set_authorization(self, authorization: Authorization | None) -> None:
        """Apply a rule set (a reload): plane streams re-send their current message filtered
        anew, pool streams whose pool is no longer visible end as a withdrawn pool's do."""
        self.authorization = authorization
        self._rules_changed.fire()
        if authorization is None:
            return
        catalog = self._catalog_now()
        for sub, (who, producer) in tuple(self._pool_clients.items()):
            if not authorization.may_see(authorization.rights(who), producer, catalog):
                self.authz_revoked += 1
                sub.fail(revoked())

    def may_see(self, stream: Stream[Any, Any], producer: pb.ProducerIdentity) -> bool:
        """Whether this stream's client may see ``producer``'s pool under the current rules."""
        auth = self.authorization
        if auth is None:
            return True
        who = ClientIdentity.from_cert(stream.peer.cert())
        return auth.may_see(auth.rights(who), producer, self._catalog_now())

    async def _may_see_listed(
        self, stream: Stream[Any, Any], producer: pb.ProducerIdentity
    ) -> bool:
        """``may_see``, also for a pool the served catalog does not list yet. A mirror's (a
        fan-out worker's) catalog trails its upstream's by a stream's delivery: a router that
        read the pool from the upstream, or from a sibling worker, may ask first, and must not
        hear POOL_NOT_FOUND for a pool that exists. While the view says its catalog may still
        list the key (``catalog_trails``; a relay's catalog is its own and trails nothing), the
        pool is checked again each time the catalog moves, for at most ``catalog_lag_s``. A pool
        the catalog lists but hides from the client is never admitted, and its answer waits out
        the same moment, and so does one the catalog withdrew (``catalog_trails`` says it will
        not be listed again): a refusal at once would tell a hidden or withdrawn pool from an
        absent one by its time alone (the client could guess pool ids and time the answers)."""
        trails = getattr(self.view, "catalog_trails", None)
        who = ClientIdentity.from_cert(stream.peer.cert())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.catalog_lag_s
        while True:
            auth = self.authorization  # (a reload may change the rules while it waits)
            if auth is None:
                return True
            catalog = self._catalog_now()
            if auth.may_see(auth.rights(who), producer, catalog):
                return True
            remaining = deadline - loop.time()
            if catalog is None or remaining <= 0 or self._closing or trails is None:
                return False
            if not trails(producer):
                # a key this catalog will never list (withdrawn from it): refused when an absent
                # key's wait is over too; at once, the time alone told a pool that was listed
                # from one that never was
                await asyncio.wait([self._closed_future()], timeout=remaining)
                return False
            wakes: list[asyncio.Future[Any]] = [self._closed_future(), self._rules_future()]
            if not auth.hides(producer, catalog):  # (a hidden pool: only a reload changes it)
                wakes.append(asyncio.ensure_future(self.view.catalog.wait_newer(catalog[0])))
            try:
                await asyncio.wait(wakes, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if len(wakes) > 2:
                    drop(wakes[2])

    def may_space(self, stream: Stream[Any, Any]) -> bool:
        """Whether this stream's client may ask for publication spacing (no rules: anyone);
        a refusal is counted."""
        auth = self.authorization
        if auth is None:
            return True
        if auth.may_space(auth.rights(ClientIdentity.from_cert(stream.peer.cert()))):
            return True
        self.authz_denials["HoldPublication"] = self.authz_denials.get("HoldPublication", 0) + 1
        return False

    def deny(self, rpc: str, producer: pb.ProducerIdentity) -> RelayError:
        """The error for a pool this client may not see: an absent pool's; counted when the
        pool exists (a request for a truly absent pool is no refusal). Without a catalog to
        check against (a mirror without its upstream) nothing can be seen: UNAVAILABLE, as
        the mirror answers everyone then, not an absent pool's NOT_FOUND."""
        auth = self.authorization
        catalog = self._catalog_now()
        if catalog is None:
            return RelayError.publication_unavailable("no catalog to check the pool against")
        if auth is not None and auth.hides(producer, catalog):
            self.authz_denials[rpc] = self.authz_denials.get(rpc, 0) + 1
        return not_visible()

    def authz_stats(self) -> tuple[dict[str, int], int]:
        """(rpc → requests refused for an invisible pool, pool streams ended by a reload)."""
        return dict(self.authz_denials), self.authz_revoked

    def _catalog_now(self) -> tuple[int, Any] | None:
        try:
            return self.view.catalog.current()
        except (RelayError, PlaneUnsupported):
            return None

    def _readiness_now(self) -> tuple[int, Any] | None:
        """The readiness plane's (version, message): a serving-load model's every configured
        pool, published or withdrawn, is among its topology's members."""
        try:
            return self.view.readiness.current()
        except (RelayError, PlaneUnsupported):
            return None

    def _rules_future(self) -> asyncio.Future[None]:
        return self._rules_changed.next()

    def _encode_for(
        self, plane: _EncodedPlane, kind: str, version: int, message: Any, who: ClientIdentity
    ) -> bytes:
        """The plane message as this client may see it (the shared bytes without rules). One
        larger than ``max_message_bytes`` ends the stream RESOURCE_EXHAUSTED / RESOURCE_LIMIT,
        counted, as a request over it is refused: the codec's own refusal had no reason
        trailer and was counted nowhere."""
        auth = self.authorization
        data = plane.encode(version, message)
        if auth is not None:
            catalog = None if kind == "catalog" else self._catalog_now()
            topology = self._readiness_now() if kind == "serving_load" else None
            data = auth.filtered(kind, version, data, auth.rights(who), catalog, topology)
        limit = self.limits.max_message_bytes
        if len(data) > limit:
            raise RelayError.resource_limit(
                f"{kind} message {version} of {len(data)} bytes exceeds max_message_bytes ({limit})"
            )
        return data

    # --- grpclib plumbing ---
    def __mapping__(self) -> dict[str, Handler]:
        def stream(rpc: str, body: _Body, req: type, rep: type) -> Handler:
            async def run(s: Stream[Any, Any]) -> None:
                await self._run_stream(s, body, rpc)

            return Handler(run, Cardinality.UNARY_STREAM, req, rep)

        return {
            SERVICE + "GetRelayInfo": Handler(
                self._get_relay_info, Cardinality.UNARY_UNARY, pb.RelayInfoRequest, pb.RelayInfo
            ),
            SERVICE + "WatchKvPoolCatalog": stream(
                "WatchKvPoolCatalog",
                self._watch_catalog,
                pb.WatchKvPoolCatalogRequest,
                pb.KvPoolCatalogUpdate,
            ),
            SERVICE + "SubscribeKvPool": stream(
                "SubscribeKvPool",
                self._subscribe_pool,
                pb.SubscribeKvPoolRequest,
                pb.FilterUpdate,
            ),
            SERVICE + "SubscribeServingReadiness": stream(
                "SubscribeServingReadiness",
                self._subscribe_readiness,
                pb.SubscribeServingReadinessRequest,
                pb.ServingReadinessUpdate,
            ),
            SERVICE + "SubscribeKvPoolLoad": stream(
                "SubscribeKvPoolLoad",
                self._subscribe_load,
                pb.SubscribeKvPoolLoadRequest,
                pb.KvPoolLoadUpdate,
            ),
            SERVICE + "SubscribeServingLoad": stream(
                "SubscribeServingLoad",
                self._subscribe_serving_load,
                pb.SubscribeServingLoadRequest,
                pb.ServingLoadUpdate,
            ),
        }

    def stats(self) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """(stream kind → (open streams, limit), error reason → count), for metrics."""
        permits = {
            "catalog": self.catalog_permits,
            "pool": self.pool_permits,
            "readiness": self.readiness_permits,
            "load": self.load_permits,
            "serving_load": self.serving_load_permits,
        }
        return {k: (p.in_use, p.capacity) for k, p in permits.items()}, dict(self.errors)

    def guard_stats(
        self,
    ) -> tuple[dict[tuple[str, str], int], dict[str, int], dict[str, int]]:
        """((kind, scope) → streams refused by a share, kind → stalled plane streams reset
        (and ``catalog_first``: pool stream ends that stopped waiting for a catalog client
        that reads nothing, ``_catalog_first``), reason → connections closed for an HTTP/2
        budget or a request that never came)."""
        stalled = dict(self.stalled_resets)
        if self.catalog_first_timeouts:
            stalled[CATALOG_FIRST_KIND] = self.catalog_first_timeouts
        return dict(self.shares.refusals), stalled, dict(self.h2_counters.closed)

    def _admit(
        self,
        stream: Stream[Any, Any],
        kind: str,
        permits: PermitCounter,
        admissible: Callable[[], bool] | None = None,
    ) -> StreamTicket:
        """Take a relay-wide permit, making room by preemption when the kind is full
        (``service/shares.py``); raises RESOURCE_LIMIT when it cannot."""
        return self.shares.admit(kind, permits, peer_addr(stream.peer.addr()), admissible)

    def _listed(self, expected: pb.ProducerIdentity) -> bool:
        """Whether the current catalog lists exactly ``expected`` (parsed once per version)."""
        catalog = self._catalog_now()
        if catalog is None:
            return False
        version, message = catalog
        if self._listed_keys is None or self._listed_keys[0] != version:
            data = message if isinstance(message, bytes) else bytes(message)
            update = pb.KvPoolCatalogUpdate.parse(data)
            pools = update.snapshot.pools if update.snapshot is not None else []
            keys = frozenset(producer_key(d.producer) for d in pools if d.producer is not None)
            self._listed_keys = (version, keys)
        return producer_key(expected) in self._listed_keys[1]

    def preemption_stats(self) -> dict[tuple[str, str], int]:
        """(kind, scope) → streams ended to make room for a client below its share."""
        return dict(self.shares.preemptions)

    async def _send_plane(
        self,
        stream: Stream[Any, Any],
        kind: str,
        data: bytes,
        ends: tuple[asyncio.Future[Any], ...] = (),
    ) -> bool:
        """Send one plane message; False when one of ``ends`` (a drain, a preemption, a lag,
        the plane's source lost) completed while it had written nothing of the message, and it
        was given up (``send_unless``): the stream ends with its status at once. A client that
        does not take it within ``stalled_stream_reset_s`` is a stalled one: with nothing of the
        message written it is given up the same way and the stream ends ``SUBSCRIBER_LAGGED``
        (raised here); with part of it written (trailers would read as its rest) the stream is
        reset (RST_STREAM needs no flow-control window) and this handler cancelled, as a stalled
        pool stream's pump is: the send will never complete. Both are counted in
        ``stalled_resets``. A timer, not ``wait_for``: the send starts in this task at once, so
        plane messages keep their order with respect to pool stream ends."""
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        reset = stream_resetter(stream)
        stalled: asyncio.Future[None] = loop.create_future()
        sending = True  # (a send that completed as the timer fired is no stall)

        def unless_given_up() -> None:
            # (after ``send_unless``'s own callback on ``stalled``: it cancelled the task if
            # nothing of the message was written, and the status goes out instead)
            if not sending or task.done() or task.cancelling():
                return
            if reset is not None:
                reset()
            task.cancel()

        def stall() -> None:
            self.stalled_resets[kind] = self.stalled_resets.get(kind, 0) + 1
            stalled.set_result(None)
            loop.call_soon(unless_given_up)

        handle = loop.call_later(self.limits.stalled_stream_reset_s, stall)
        try:
            sent = await send_unless(stream, stream.send_message(data), (*ends, stalled),
                                     size=5 + len(data))  # fmt: skip
        finally:
            sending = False
            handle.cancel()
        if not sent and stalled.done() and not any(e.done() for e in ends):
            s = self.limits.stalled_stream_reset_s
            raise RelayError.subscriber_lagged(f"took no message for {s:g} s")
        return sent

    def _count(self, err: RelayError) -> None:
        self.errors[err.trailer_value] = self.errors.get(err.trailer_value, 0) + 1

    def internal_error(self, rpc: str, exc: Exception) -> RelayError:
        """What a bug in a handler (or below it) ends its call with: INTERNAL with the reason
        trailer; logged here with its traceback, counted where the call ends. The relay keeps
        serving."""
        _log.error("rpc_failed", rpc=rpc, error=repr(exc), exc_info=exc)
        return RelayError.internal(f"internal error: {type(exc).__name__}")

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """A call the drain waits for (up to its grace) before the close cancels what is left."""
        self._active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def _run_stream(self, stream: Stream[Any, Any], body: _Body, rpc: str) -> None:
        with self._held():
            try:
                await body(stream)
            except RelayError as err:
                self._count(err)
                await stream.send_trailing_metadata(
                    status=status_of(err), status_message=err.message, metadata=trailers_of(err)
                )
            except PlaneUnsupported as exc:
                self.unsupported += 1
                await stream.send_trailing_metadata(status=UNSUPPORTED_RPC, status_message=str(exc))
            except (asyncio.CancelledError, GRPCError):
                raise
            except Exception as exc:  # a bug: report INTERNAL with the trailer, keep serving
                internal = self.internal_error(rpc, exc)
                self._count(internal)
                await stream.send_trailing_metadata(
                    status=status_of(internal),
                    status_message=internal.message,
                    metadata=trailers_of(internal),
                )

    async def _get_relay_info(self, stream: Stream[Any, Any]) -> None:
        try:
            request = await self._recv(stream)  # an undecodable body is INVALID_REQUEST too
            check_marker(request.contract_marker)
            info = self._relay_info()
        except RelayError as err:
            self.refuse(err)
        except (asyncio.CancelledError, GRPCError):
            raise
        except Exception as exc:  # a bug: INTERNAL with the trailer, not grpclib's bare UNKNOWN
            self.refuse(self.internal_error("GetRelayInfo", exc))
        # a reply never taken ends as a stalled plane stream does; one waiting for a window when
        # the drain starts is refused as a call during the drain is (held till then: the close
        # cuts without a status)
        with self._held():
            try:
                if await self._send_plane(stream, "relay_info", info, (self._closed_future(),)):
                    return
                end = RelayError.publication_unavailable("the relay is shutting down")
            except RelayError as stalled:
                end = stalled
            self._count(end)
            await stream.send_trailing_metadata(
                status=status_of(end), status_message=end.message, metadata=trailers_of(end)
            )

    def refuse(self, err: RelayError) -> NoReturn:
        """End a call that has sent nothing yet with ``err``: counted, its status and the
        reason trailer."""
        self._count(err)
        _UNARY_REASON.set(err.trailer_value)
        raise GRPCError(status_of(err), err.message) from None

    def _relay_info(self) -> bytes:
        """RelayInfo for the view's identity now (encoded once per identity); the view raises
        RelayError when it has none to vouch for (a mirror whose upstream is unreachable)."""
        relay = self.view.relay_identity
        key = bytes(relay)
        cached = self._info
        if cached is None or cached[0] != key:
            info = pb.RelayInfo(
                protocol_version=PROTOCOL_VERSION, relay=relay, contract_marker=CONTRACT_MARKER
            )
            cached = (key, bytes(info))
            self._info = cached
        return cached[1]

    # --- helpers ---
    async def _recv(self, stream: Stream[Any, Any]) -> Any:
        return await recv_within(
            stream, self.limits.max_message_bytes, self.request_timeout_s, self.request_guards
        )

    async def _until_newer(
        self,
        pending: asyncio.Future[T],
        timeout: float | None = None,
        preempted: asyncio.Future[None] | None = None,
        rules: asyncio.Future[None] | None = None,
    ) -> bool:
        """Wait for `pending`, server close, `preempted` or (given) a rules change; False if
        the server is closing."""
        assert self._closed is not None
        waits: tuple[asyncio.Future[Any], ...] = (pending, self._closed)
        for extra in (preempted, rules):
            if extra is not None:
                waits += (extra,)
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return not self._closing

    def _refuse_if_closing(self) -> None:
        """A stream that starts while the relay drains is refused UNAVAILABLE: given the old
        relay's data and an OK EOF, a client that reopens on OK would loop until the close."""
        if self._closing:
            raise RelayError.publication_unavailable("the relay is shutting down")

    def _closed_future(self) -> asyncio.Future[None]:
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_future()
        return self._closed

    async def _plane_stream(
        self,
        stream: Stream[Any, Any],
        plane: _EncodedPlane,
        permits: PermitCounter,
        kind: str,
        *,
        resend_every: float | None = None,
        max_gap: int | None = None,
    ) -> None:
        _unless_unsupported(plane.plane)  # before the request, as a source without the RPC does
        request = await self._recv(stream)
        validate_stream_request(request.contract_marker, request.subscriber_id)
        self._refuse_if_closing()
        ticket = self._admit(stream, kind, permits)
        self._closed_future()
        who = ClientIdentity.from_cert(stream.peer.cert())
        rules = self._rules_future()
        pending: asyncio.Future[tuple[int, Any]] | None = None
        loop = asyncio.get_running_loop()
        preempted: asyncio.Future[None] = loop.create_future()

        def wake(_err: RelayError) -> None:
            if not preempted.done():
                preempted.set_result(None)

        ticket.on_preempt = wake
        token = object()  # this stream among the catalog streams (``_catalog_first``)
        if kind == "catalog":
            self._catalog_written[token] = -1
        try:
            version, message = plane.plane.current()
            first = self._encode_for(plane, kind, version, message, who)
            if not await self._send_version(stream, plane, kind, version, first, ticket,
                                            preempted, max_gap):  # fmt: skip
                ticket.check()  # preempted: RESOURCE_LIMIT; else it ends OK
                return
            self._wrote(token, version)
            ticket.check()
            next_tick = loop.time() + resend_every if resend_every is not None else None
            while not self._closing:
                if pending is None:
                    pending = asyncio.ensure_future(plane.plane.wait_newer(version))
                timeout = None if next_tick is None else max(0.0, next_tick - loop.time())
                if not await self._until_newer(pending, timeout, preempted, rules):
                    return
                ticket.check()  # preempted: end with RESOURCE_LIMIT (the status path below)
                refiltered = rules.done()  # a rules reload: re-send what this client may see
                if refiltered:
                    rules = self._rules_future()
                if pending.done():
                    try:
                        new_version, message = pending.result()
                    except PlaneClosed:
                        raise RelayError.publication_unavailable("publisher closed") from None
                    except PlaneEnded:
                        return  # the source shut down: end with status OK, like it did
                    pending = None
                    if max_gap is not None and new_version - version > max_gap:
                        raise _lagged(new_version - version, max_gap)
                    version = new_version
                elif not refiltered and (next_tick is None or loop.time() < next_tick):
                    continue
                data = self._encode_for(plane, kind, version, message, who)
                if not await self._send_version(stream, plane, kind, version, data, ticket,
                                                preempted, max_gap):  # fmt: skip
                    ticket.check()
                    return
                self._wrote(token, version)
                if next_tick is not None:
                    now = loop.time()
                    while next_tick <= now:
                        next_tick += resend_every  # type: ignore[operator]
                await asyncio.sleep(0)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
            if self._catalog_written.pop(token, None) is not None:
                self._catalog_moved.fire()
            ticket.release()

    def _wrote(self, token: object, version: int) -> None:
        """A catalog stream handed revision ``version`` to its transport (else: not one)."""
        if token in self._catalog_written:
            self._catalog_written[token] = version
            self._catalog_moved.fire()

    async def _catalog_first(self) -> None:
        """Wait until every open catalog stream has handed the current catalog revision to
        its transport (or ended), for at most ``CATALOG_FIRST_S``: a pool stream ending with
        an error calls it before its status goes out. A fence or withdrawal publishes the
        catalog without the pool before it ends the pool's streams; this makes that order
        reach the wire, on every connection, not only the event loop: a router sees the pool
        withdrawn before its stream ends, and does not resubscribe to a pool that is gone. No
        catalog stream behind: returns without yielding."""
        if not self._catalog_written:
            return
        try:
            revision = self._catalog.plane.current()[0]  # (the plane the streams send)
        except (RelayError, PlaneUnsupported):
            return  # (a mirror that lost its source: no catalog to vouch for)
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        while not self._closing and any(v < revision for v in self._catalog_written.values()):
            now = loop.time()
            if deadline is None:
                deadline = now + CATALOG_FIRST_S
            elif now >= deadline:
                self.catalog_first_timeouts += 1
                return
            # (asyncio.wait: the shared future is never cancelled with this task)
            await asyncio.wait((self._catalog_moved.next(),), timeout=deadline - now)

    async def _send_version(
        self,
        stream: Stream[Any, Any],
        plane: _EncodedPlane,
        kind: str,
        version: int,
        data: bytes,
        ticket: StreamTicket,
        preempted: asyncio.Future[None],
        max_gap: int | None,
    ) -> bool:
        """Send ``data`` (the plane's message ``version``) unless the stream ends first: while
        it waits for a flow-control window with nothing of it written, the drain, a preemption,
        the plane running more than ``max_gap`` versions past it or losing its source give it up
        and the stream ends with its status at once. False: the stream ends (the drain, a
        preemption, the source ended cleanly); raises the plane's error. An end that comes once
        part of the message is written waits for the send, then applies; the stream's permit
        is given back when the end comes, not when a slow client finally reads (as a pool
        stream's is, §4.6)."""
        watch = asyncio.ensure_future(_outrun(plane.plane, version, max_gap))
        ends = (self._closed_future(), preempted, watch)
        sending, ended = True, False

        def end_decided(f: asyncio.Future[Any]) -> None:
            nonlocal ended
            if sending and not ended and not f.cancelled():
                ended = True
                ticket.release()

        for f in ends:
            f.add_done_callback(end_decided)
        try:
            sent = await self._send_plane(stream, kind, data, ends)
        finally:
            sending = False
            for f in ends:
                f.remove_done_callback(end_decided)
            if not watch.done():
                watch.cancel()
            elif not watch.cancelled():
                watch.exception()  # (retrieved: a send cancelled by a stall reset ignores it)
        if sent and not ended:
            return True
        if watch.done() and not watch.cancelled():
            end = watch.exception()
            if isinstance(end, PlaneEnded):
                return False  # the source shut down: end with status OK, like it did
            if isinstance(end, PlaneClosed):
                raise RelayError.publication_unavailable("publisher closed") from None
            if end is not None:
                raise end
        return False  # the drain, or a preemption (the caller's ticket raises it)

    # --- RPC bodies ---
    async def _watch_catalog(self, stream: Stream[Any, Any]) -> None:
        await self._plane_stream(stream, self._catalog, self.catalog_permits, "catalog")

    async def _subscribe_readiness(self, stream: Stream[Any, Any]) -> None:
        await self._plane_stream(
            stream,
            self._readiness,
            self.readiness_permits,
            "readiness",
            resend_every=self.limits.readiness_heartbeat_s,
        )

    async def _subscribe_load(self, stream: Stream[Any, Any]) -> None:
        await self._plane_stream(
            stream, self._load, self.load_permits, "load",
            max_gap=self.limits.load_fanout_capacity,
        )

    async def _subscribe_serving_load(self, stream: Stream[Any, Any]) -> None:
        await self._plane_stream(
            stream,
            self._serving_load,
            self.serving_load_permits,
            "serving_load",
            max_gap=self.limits.load_fanout_capacity,
        )

    async def _subscribe_pool(self, stream: Stream[Any, Any]) -> None:
        request: pb.SubscribeKvPoolRequest = await self._recv(stream)
        validate_stream_request(request.contract_marker, request.subscriber_id)
        expected = request.expected_producer
        producer_key(expected)  # malformed identities fail before a permit is taken, as Dynamo's
        assert expected is not None
        self._refuse_if_closing()
        ticket = self._admit(
            stream,
            "pool",
            self.pool_permits,
            lambda: self.may_see(stream, expected) and self._listed(expected),
        )
        release = ticket.release  # at the first of: subscription failed/ended, handler done
        sub: Subscription | None = None
        writer: StreamWriter | None = None
        try:
            if not await self._may_see_listed(stream, expected):
                if self._closing:
                    return  # the drain started while it waited: a clean end, as an admission's
                raise self.deny("SubscribeKvPool", expected)  # exactly an absent pool's answer
            sub = await self._open_pool(expected, release)
            if sub is None:
                return  # the drain (its own, or its source's) started while it was admitted
            self._subscriptions.add(sub)
            self._pool_clients[sub] = (ClientIdentity.from_cert(stream.peer.cert()), expected)
            if self._closing:
                return
            if not self.may_see(stream, expected):  # the rules changed while it opened
                raise self.deny("SubscribeKvPool", expected)
            ticket.check()  # preempted while it opened
            ticket.on_preempt = sub.fail  # ends like a lagged subscriber: the pump raises it
            writer = StreamWriter(stream, self.limits.max_message_bytes)
            try:
                await sub.pump(
                    stream.send_message,
                    writer.send_batch,
                    writer.reset,
                    writer.bulk,
                    send_now=writer.send_now,
                    turn=None if writer.bulk is None else writer.bulk.acquire,
                    written=writer.written,
                )
            except RelayError:
                await self._catalog_first()  # a fence's withdrawal reaches the wire first
                raise
            except asyncio.CancelledError:
                if sub.reset_for is not None:  # ended, its status never read: reset, counted
                    self._count(sub.reset_for)
                raise
        finally:
            if writer is not None:
                writer.close()
            if sub is not None:
                self._subscriptions.discard(sub)
                self._pool_clients.pop(sub, None)
                sub.close()
            release()

    async def _open_pool(
        self, expected: pb.ProducerIdentity, release: Callable[[], None]
    ) -> Subscription | None:
        """``view.open_pool``, or None when the drain starts first. An admission may wait long
        (a mirror waits up to ``sync_wait_s`` for a pool it is still synchronizing): held past
        the drain's grace, the stream would be cut by the close without a status. None too
        when the view's source drained meanwhile (``PlaneEnded``: a mirror's upstream ended
        its sync cleanly): its admissions ended OK, and so does this one."""
        closed = self._closed_future()
        opening = asyncio.ensure_future(self.view.open_pool(expected, on_release=release))
        try:
            await asyncio.wait((opening, closed), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            _abandon(opening)
            raise
        if opening.done():
            try:
                return opening.result()
            except PlaneEnded:
                return None
        _abandon(opening)
        return None

    # --- shutdown ---
    async def shutdown(self, grace_s: float = 5.0) -> None:
        """End every stream with a clean EOF (waits up to `grace_s` for handlers)."""
        self._closing = True
        closed = self._closed_future()
        if not closed.done():
            closed.set_result(None)
        for sub in tuple(self._subscriptions):
            sub.shutdown()
        if self._active:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)


def _unless_unsupported(plane: Plane[Any]) -> None:
    """Raise ``PlaneUnsupported`` if the plane's source lacks its RPC (a mirror of a relay that
    predates it), whatever the request: that relay answers every call ``UNIMPLEMENTED`` without
    reading it. Any other state of the plane is the stream's to report, after the request's
    checks."""
    with contextlib.suppress(RelayError):
        plane.current()


def _lagged(gap: int, max_gap: int) -> RelayError:
    return RelayError.subscriber_lagged(f"fell {gap} windows behind (max {max_gap})")


async def _outrun(plane: Plane[Any], version: int, max_gap: int | None) -> NoReturn:
    """Follow ``plane`` while its message ``version`` is being sent; raise once the stream must
    end: the plane's end, as ``wait_newer`` raises it, or (with ``max_gap``) a version more than
    ``max_gap`` past the one being sent (SUBSCRIBER_LAGGED, the rule the loop applies after)."""
    newest = version
    while True:
        newest, _ = await plane.wait_newer(newest)
        if max_gap is not None and newest - version > max_gap:
            raise _lagged(newest - version, max_gap)


def _abandon(opening: asyncio.Future[Subscription]) -> None:
    """Give up an admission: cancelled; a subscription it makes all the same is closed."""
    opening.cancel()
    opening.add_done_callback(_close_opened)


def _close_opened(opening: asyncio.Future[Subscription]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


async def _add_reason_trailer(event: SendTrailingMetadata) -> None:
    reason = _UNARY_REASON.get()
    if reason is not None:
        event.metadata[TRAILER_KEY] = reason


def streams_per_connection(limits: RelayLimits) -> int:
    """The streams one connection may hold open at once: every stream the limits allow a single
    client (alone it may hold a whole limit), the generic services' included. The limits, not
    HTTP/2, decide how many streams a client gets."""
    return max(100, limits.max_pool_streams_total + limits.max_catalog_subscribers
               + limits.max_readiness_subscribers + 2 * limits.max_load_subscribers
               + MAX_HEALTH_WATCHERS + MAX_REFLECTION_STREAMS)  # fmt: skip


class RelayServer:
    """The gRPC endpoint: KvEventRelay + grpc.health.v1 + server reflection (v1, v1alpha)."""

    def __init__(self, view: RelayView, limits: RelayLimits | None = None) -> None:
        self.limits = limits or RelayLimits()
        self.service = KvEventRelayService(view, self.limits)
        #: ends the health and reflection streams on the drain (``health.py``)
        self.generic_drain = GenericDrain()
        self.health = RelayHealth(self.service, self.generic_drain)
        self.spacing = SpacingService(
            view, self.service._relay_info, self.service, self.limits.max_message_bytes
        )
        # the spacing service is kvrelay's own (not Dynamo's contract): not listed by reflection
        # grpclib's health and reflection services read requests through the relay's reader
        listed: list[Any] = [self.service, self.health.service]
        reflection = [self.generic_drain.ending(r, self.service.refuse)
                      for r in reflection_services(listed)]  # fmt: skip
        self.reflection_streams = PermitCounter("reflection", MAX_REFLECTION_STREAMS)
        # (a bug in them ends INTERNAL, logged and counted, as in the relay's own handlers)
        foreign = [BoundedRequests(h, self.limits.max_message_bytes, REQUEST_TIMEOUT_S,
                                   self.service.refuse, self.service.request_guards,
                                   None if h is self.health.service else self.reflection_streams,
                                   self.service.internal_error)
                   for h in (self.health.service, *reflection)]  # fmt: skip
        handlers = [self.service, *foreign, self.spacing]
        config = Configuration(
            _keepalive_time=self.limits.keepalive_interval_s,
            _keepalive_timeout=self.limits.keepalive_timeout_s,
            _keepalive_permit_without_calls=True,
            # grpclib's defaults ping at most every 300 s and twice without data: a peer gone
            # silent would be noticed minutes late. Every interval, also with no call open.
            _http2_max_pings_without_data=0,
            # (0.9: uvloop's timers may fire a hair before the interval, and grpclib would then
            # skip that ping)
            _http2_min_sent_ping_interval_without_data=0.9 * self.limits.keepalive_interval_s,
            http2_connection_window_size=INBOUND_WINDOW_BYTES,
            http2_stream_window_size=INBOUND_WINDOW_BYTES,
        )
        self._server = ClosingServer(
            handlers, codec=PassThroughCodec(self.limits.max_message_bytes), config=config
        )
        listen(self._server, SendTrailingMetadata, _add_reason_trailer)
        per_connection = streams_per_connection(self.limits)
        # every stream a connection may hold, cancelled, reopened and cancelled again in one
        # budget window, is no rapid reset (``h2/guard.py``)
        held_resets = max(H2Budgets().max_held_resets, 2 * per_connection)
        # and a client may resize the window of every stream it holds at once, a few times in
        # one window (grpcio does on each estimate of the link's bandwidth-delay product)
        updates = max(H2Budgets().max_window_updates, 4 * per_connection)
        self._server.h2_guard = (
            H2Budgets(max_held_resets=held_resets, max_open_streams=max(1024, per_connection),
                      max_window_updates=updates),
            self.service.h2_counters,
        )  # fmt: skip
        self._server.max_concurrent_streams = per_connection
        # how the streams closed lately closed, for late frames on them: every stream a
        # connection may hold, closed and reopened once (h2 keeps 65,536 per connection)
        # (the SDK's and the mirror's channels keep theirs by the same rule; about 120 bytes each)
        self._server.closed_streams_kept = closed_streams_bound(per_connection)
        self._server.connection_caps = ConnectionCaps(
            self.limits.max_connections_per_address, self.limits.max_connections,
            self.service.h2_counters,
        )  # fmt: skip
        self._port: int | None = None
        self.peer_check: SameUserOnly | None = None  # set on a UNIX listener

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def serving(self) -> bool:
        """What health reports: True from listening until the drain starts."""
        return self.health.serving

    async def start(
        self,
        host: str,
        port: int,
        ssl: TlsSource | None = None,
        *,
        sock: socket.socket | None = None,
        tls_handshake_timeout_s: float = TLS_HANDSHAKE_TIMEOUT_S,
    ) -> None:
        """Listen on TCP; ``sock``: accept on this socket instead (the one a daemon's fan-out
        workers share, bound and made listening by the first of them, or a hot upgrade's
        inherited listener). ``ssl``: a context, or what gives the one in use now (each
        handshake asks: ``h2/tls_gate.py``). The backlog is ``LISTEN_BACKLOG`` either way: the
        server's ``listen(2)`` on a shared socket sets it for every process that has it."""
        self._server.tls_handshake_timeout_s = tls_handshake_timeout_s
        if sock is not None:
            await self._server.start(sock=sock, ssl=ssl, backlog=LISTEN_BACKLOG)
        else:
            await self._server.start(host, port, ssl=ssl, backlog=LISTEN_BACKLOG)
        listener: Any = self._server._server
        sockets = listener.sockets if listener is not None else ()
        self._port = int(sockets[0].getsockname()[1]) if sockets else port
        self.health.set_serving(True)

    def revoke(self, is_revoked: Callable[[bytes], bool]) -> int:
        """Client certificates (DER) ``is_revoked`` says are revoked are refused when their
        handshake ends, and their open connections ended now, every call UNAUTHENTICATED
        before the close (``ClosingServer.revoke``): how many were."""
        return self._server.revoke(is_revoked, certificate_revoked)

    def listening_socket(self) -> socket.socket:
        """The TCP listener (a hot upgrade hands its descriptor to the successor)."""
        listener: Any = self._server._server
        if listener is None or not listener.sockets:
            raise RuntimeError("server not listening")
        return cast(socket.socket, listener.sockets[0])

    async def start_unix(self, path: str) -> None:
        """Listen on a UNIX socket (the daemon's internal transport to its workers); peers that
        are neither this user nor root are refused (``service/peercred.py``)."""
        self._server.peer_check = self.peer_check = SameUserOnly()
        await self._server.start(path=path)
        self._port = 0

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop accepting, end open streams with a clean EOF, then close connections."""
        server = self._server._server
        if server is None:
            return  # never started
        self.health.set_serving(False)  # first: probes on open connections see the drain
        server.close()  # stop listening; existing connections stay up for the EOFs
        self._server.announce_drain()  # new calls on new connections (GOAWAY, h2/drain.py)
        # health watchers send NOT_SERVING, then they and reflection streams end OK, as the
        # relay's streams do: Server.close() cancels handlers, which then write no trailers
        await asyncio.gather(self.service.shutdown(grace_s), self.generic_drain.drain(grace_s))
        # calls still waiting for their request message when the grace ran out (on every
        # service) are refused as a call started during the drain is, before the close
        ending = self.service.request_guards.pending.end_all(
            RelayError.publication_unavailable("the relay is shutting down")
        )
        if ending:
            await asyncio.wait(ending, timeout=min(REFUSAL_WRITE_S, grace_s))
        self._server.close()
        # a connection closed by halves (or a TLS one) waits for its client's close: at most a
        # quarter of the grace, so a client that never closes cannot stretch a stop past its
        # budget (``shutdown_timeout_s``: exit 1, no state file, or a worker killed)
        srv = self._server
        srv.close_wait_s = min(srv.close_wait_s, max(CLOSE_WAIT_FLOOR_S, grace_s / 4))
        await srv.wait_closed()  # the requests ended, then the connections closed
