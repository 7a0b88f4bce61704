"""A small but real in-memory RelayView (test fixture, not a network mock) and two gRPC clients.

The view owns numpy tables per generation, publishes deltas through real PublicationHubs, and
exposes catalog/readiness/load planes with the Plane protocol semantics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Generic, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.producer import producer_key
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.publication.hub import PublicationHub, Subscription
from kvrelay.publication.plane import PlaneClosed, PlaneEnded
from kvrelay.publication.splice import FilterUpdateEncoder
from kvrelay.service.server import RelayServer
from tests.support.timing import scaled

T = TypeVar("T")
StartRelay = Callable[..., Awaitable[tuple["MemRelayView", RelayServer]]]
MARKER = CONTRACT_MARKER
SEED = 0x5DEECE66D1B54A33
DC_ID = 356084303347317832
SVC = "/dynamo.kvrelay.v1.KvEventRelay/"


class MemPlane(Generic[T]):
    """Versioned latest-value plane: `wait_newer` wakes on publish, raises PlaneClosed on close."""

    def __init__(self, first: T, version: int = 0) -> None:
        self._version = version
        self._msg = first
        self._closed = False
        self._ended = False
        self._waiters: set[asyncio.Future[None]] = set()

    def current(self) -> tuple[int, T]:
        return self._version, self._msg

    async def wait_newer(self, version: int) -> tuple[int, T]:
        while True:
            if self._version > version:
                return self._version, self._msg
            if self._closed:
                raise PlaneClosed()
            if self._ended:
                raise PlaneEnded()
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)

    def publish(self, msg: T, version: int | None = None) -> None:
        self._version = self._version + 1 if version is None else version
        self._msg = msg
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()

    def end(self) -> None:
        """The source shut down: streams following this plane end cleanly (status OK)."""
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        for f in tuple(self._waiters):
            if not f.done():
                f.set_result(None)


def make_producer(
    name: str,
    *,
    bucket_count: int,
    layout_generation: int = 1,
    seed: int = SEED,
    incarnation: int = 0x1234_5678_9ABC_DEF,
) -> pb.ProducerIdentity:
    tag = name.encode().ljust(16, b"\0")[:16]
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=b"C" * 16, source=1),
                routing_scope=pb.DigestIdentity(digest=tag, source=1),
            ),
            dc_id=DC_ID,
        ),
        producer_incarnation=incarnation,
        layout_generation=layout_generation,
        ckf_format=pb.CkfFormat(
            format_version=1,
            seed=seed,
            bucket_count=bucket_count,
            fingerprint_bits=16,
            slots_per_bucket=4,
        ),
    )


def pool_key(p: pb.ProducerIdentity) -> tuple[Any, ...]:
    return tuple(producer_key(p)[:6])


class Generation:
    """One producer generation: the authoritative table, its sequence and its lazy hub."""

    def __init__(self, view: MemRelayView, producer: pb.ProducerIdentity) -> None:
        self.view = view
        self.producer = producer
        fmt = producer.ckf_format
        assert fmt is not None and producer.pool_id is not None
        self.bucket_count = fmt.bucket_count
        self.seed = fmt.seed
        self.dc_id = producer.pool_id.dc_id
        self.table: npt.NDArray[np.uint64] = np.zeros(self.bucket_count, dtype=np.uint64)
        self.sequence = 0
        self.retired = False
        self._hub: PublicationHub | None = None
        self.hub_inits = 0
        #: the catalog's serving endpoint (None: ns/c/e); republish the catalog after setting
        self.endpoint: pb.DynamoEndpointId | None = None

    @property
    def hub_or_none(self) -> PublicationHub | None:
        return self._hub

    def hub(self) -> PublicationHub:
        if self.retired:
            raise RelayError.publication_unavailable("generation retired")
        if self._hub is None:
            at_cap = self.view.initialized_hubs >= self.view.limits.max_initialized_pool_hubs
            if at_cap and not (self.view.evict_idle_hubs and self.view.evict_idle_hub()):
                raise RelayError.resource_limit("initialized pool hub limit reached")
            self.view.initialized_hubs += 1
            self.hub_inits += 1
            self._hub = PublicationHub(
                FilterUpdateEncoder(self.view.relay_identity, self.producer),
                seed=self.seed,
                bucket_count=self.bucket_count,
                dc_id=self.dc_id,
                table=self.table,
                sequence=self.sequence,
                limits=self.view.limits,
            )
        return self._hub

    def apply(self, buckets: npt.NDArray[np.uint32], words: npt.NDArray[np.uint64]) -> None:
        """One producer batch: mutate the table, advance the sequence, publish if a hub exists."""
        self.table[buckets] = words
        self.sequence += 1
        if self._hub is not None:
            self._hub.publish(self.sequence, buckets, words)

    def random_step(self, rng: np.random.Generator, k: int) -> None:
        buckets = rng.choice(self.bucket_count, size=k, replace=False).astype(np.uint32)
        words = rng.integers(0, 2**64, size=k, dtype=np.uint64)
        words[rng.random(k) < 0.1] = 0
        self.apply(buckets, words)

    def retire(self, error: RelayError | None) -> None:
        self.retired = True
        if self._hub is not None:
            self._hub.retire(error)


class MemRelayView:
    def __init__(
        self,
        limits: RelayLimits | None = None,
        incarnation: int = 0x1234_5678_9ABC_DEF,
        *,
        window_ms: int = 1000,
    ) -> None:
        """``incarnation``: the relay's (another one is a restarted relay). ``window_ms``: the
        period the load and serving-load windows state. The view publishes no window by itself,
        and a mirror calls a window stream silent after three stated periods: it is then out of
        session, and refuses every RPC, until its new stream delivers; a rig behind a mirror
        that lives longer than that states a longer period (``mirror_rig.QUIET_WINDOW_MS``)."""
        self.window_ms = window_ms
        self.limits = limits or RelayLimits()
        self.relay_identity = pb.RelayIdentity(drt_instance_id=77, relay_incarnation=incarnation)
        self.pools: dict[tuple[Any, ...], Generation] = {}
        self.initialized_hubs = 0
        #: at the hub limit, retire the hub idle the longest, as a relay does
        #: (``Relay._evict_idle_hub``); off: RESOURCE_LIMIT once the limit is reached
        self.evict_idle_hubs = False
        self.hubs_evicted = 0
        self.catalog: MemPlane[pb.KvPoolCatalogUpdate] = MemPlane(self._catalog_msg(0))
        self.readiness: MemPlane[pb.ServingReadinessUpdate] = MemPlane(self.readiness_msg(0, []))
        self.load: MemPlane[pb.KvPoolLoadUpdate] = MemPlane(self.load_msg(0))
        self.serving_load: MemPlane[pb.ServingLoadUpdate] = MemPlane(self.serving_load_msg(0))

    # --- planes ---
    def _catalog_msg(self, revision: int) -> pb.KvPoolCatalogUpdate:
        pools = (
            [
                pb.KvPoolDescriptor(
                    producer=g.producer,
                    serving_endpoint=g.endpoint
                    or pb.DynamoEndpointId(namespace="ns", component="c", endpoint="e"),
                    registrations=[
                        pb.ModelRegistration(
                            canonical_model_id="m",
                            target=pb.ModelTarget(base=pb.BaseModelTarget("m")),
                        )
                    ],
                    query_semantics=pb.KvQuerySemantics(kv_block_size=16, hash_format=1),
                    pool_roles=[pb.WorkerRole.AGGREGATED],
                )
                for g in self.pools.values()
            ]
            if hasattr(self, "pools")
            else []
        )
        return pb.KvPoolCatalogUpdate(
            protocol_version=1,
            relay=self.relay_identity,
            revision=revision,
            snapshot=pb.KvPoolCatalogSnapshot(pools=pools),
            contract_marker=MARKER,
        )

    def readiness_msg(
        self, revision: int, entries: Sequence[pb.TopologyEntry]
    ) -> pb.ServingReadinessUpdate:
        return pb.ServingReadinessUpdate(
            protocol_version=1,
            relay=self.relay_identity,
            revision=revision,
            entries=list(entries),
            contract_marker=MARKER,
        )

    def load_msg(self, window: int, used: int = 0) -> pb.KvPoolLoadUpdate:
        return pb.KvPoolLoadUpdate(
            protocol_version=1,
            relay=self.relay_identity,
            window_sequence=window,
            observed_ms=int(time.time() * 1000),
            window_ms=self.window_ms,
            pools=[
                pb.KvPoolLoadEntry(
                    producer=g.producer,
                    kv_used_blocks=used,
                    total_kv_blocks=1000,
                    kv_observed_ranks=1,
                    kv_expected_ranks=1,
                )
                for g in self.pools.values()
            ],
            contract_marker=MARKER,
        )

    def serving_load_msg(self, window: int, started: int = 0) -> pb.ServingLoadUpdate:
        """One window: every pool COMPLETE with 7 decode blocks; model ``m`` DEGRADED (2 of 3
        frontends) with ``started`` requests and no gauges."""
        return pb.ServingLoadUpdate(
            protocol_version=1,
            relay=self.relay_identity,
            window_sequence=window,
            observed_ms=int(time.time() * 1000),
            window_ms=self.window_ms,
            pools=[
                pb.PoolServingLoad(
                    producer=g.producer,
                    load=pb.LoadView(
                        tokens=pb.TokenLoadStats(active_decode_blocks=7),
                        status=pb.DataStatus.COMPLETE,
                        source_observed_ms=int(time.time() * 1000),
                    ),
                    deployment=pb.PoolDeploymentStatus(live_workers=1),
                )
                for g in self.pools.values()
            ],
            models=[
                pb.ModelServingLoad(
                    namespace="ns",
                    canonical_model_id="m",
                    load=pb.LoadView(
                        requests=pb.RequestLifecycleStats(requests_started_total=started),
                        tokens=pb.TokenLoadStats(),
                        status=pb.DataStatus.DEGRADED,
                    ),
                    deployment=pb.ModelDeploymentStatus(
                        expected_frontends=3, observed_frontends=2, ready_frontends=2
                    ),
                )
            ],
            contract_marker=MARKER,
        )

    def _republish_catalog(self) -> None:
        rev = self.catalog.current()[0] + 1
        self.catalog.publish(self._catalog_msg(rev), rev)

    # --- pools ---
    def add_pool(
        self, name: str, bucket_count: int, layout_generation: int = 1, **kw: Any
    ) -> Generation:
        gen = Generation(
            self,
            make_producer(
                name, bucket_count=bucket_count, layout_generation=layout_generation, **kw
            ),
        )
        self.pools[pool_key(gen.producer)] = gen
        self._republish_catalog()
        return gen

    def replace(self, gen: Generation, **kw: Any) -> Generation:
        """Fence `gen` and materialize the next layout generation of the same pool."""
        assert gen.producer.ckf_format is not None
        gen.retire(RelayError.publication_unavailable("generation fenced"))
        new = Generation(
            self,
            make_producer(
                gen.producer.pool_id.indexer_domain.routing_scope.digest.rstrip(b"\0").decode(),  # type: ignore[union-attr]
                bucket_count=kw.pop("bucket_count", gen.bucket_count),
                layout_generation=gen.producer.layout_generation + 1,
                **kw,
            ),
        )
        self.pools[pool_key(new.producer)] = new
        self._republish_catalog()
        return new

    def remove(self, gen: Generation) -> None:
        gen.retire(RelayError.publication_unavailable("pool withdrawn"))
        del self.pools[pool_key(gen.producer)]
        self._republish_catalog()

    def evict_idle_hub(self) -> bool:
        """Retire the hub without subscribers the longest and give its permit back (a relay's
        rule); False when every hub has a subscriber."""
        idle = [
            (since, g)
            for g in self.pools.values()
            if g._hub is not None and (since := g._hub.idle_since) is not None
        ]
        if not idle:
            return False
        _since, gen = min(idle, key=lambda item: item[0])
        hub, gen._hub = gen._hub, None
        assert hub is not None
        hub.retire(None)
        self.initialized_hubs -= 1
        self.hubs_evicted += 1
        return True

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        gen = self.pools.get(pool_key(expected))
        if gen is None:
            raise RelayError.pool_not_found()
        if producer_key(gen.producer) != producer_key(expected):
            raise RelayError.producer_changed()
        return await gen.hub().subscribe(on_release)


# ---------------------------------------------------------------- clients
EIGHT_MIB = 8 * 1024 * 1024


class GrpcioClient:
    """grpc.aio + official protobuf stubs (the independent peer)."""

    def __init__(
        self,
        pb2: dict[str, ModuleType],
        port: int,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.m = pb2["relay"]
        options = [
            ("grpc.max_receive_message_length", EIGHT_MIB),
            ("grpc.max_send_message_length", EIGHT_MIB),
        ]
        target = f"127.0.0.1:{port}"
        self.channel = (
            grpc.aio.insecure_channel(target, options=options)
            if credentials is None
            else grpc.aio.secure_channel(target, credentials, options=options)
        )
        self.stub = pb2["relay_grpc"].KvEventRelayStub(self.channel)

    def convert(self, request: Any) -> Any:
        """betterproto2 request → official message of the same name (via bytes)."""
        return getattr(self.m, type(request).__name__).FromString(bytes(request))

    async def collect(
        self, method: str, request: Any, *, limit: int | None = None, timeout: float = 20.0
    ) -> StreamResult:
        res = StreamResult()
        call = getattr(self.stub, method)(self.convert(request))
        try:
            async with asyncio.timeout(scaled(timeout)):
                async for msg in call:
                    res.messages.append(msg)
                    if limit is not None and len(res.messages) >= limit:
                        call.cancel()
                        return res
        except grpc.aio.AioRpcError as exc:
            res.status, res.message = exc.code(), exc.details()
            res.trailers = {k: v for k, v in (exc.trailing_metadata() or ())}
            return res
        res.status = await call.code()
        res.trailers = {k: v for k, v in (await call.trailing_metadata() or ())}
        return res

    async def unary(self, method: str, request: Any) -> tuple[Any, Any, dict[str, str]]:
        call = getattr(self.stub, method)(self.convert(request))
        try:
            reply = await call
        except grpc.aio.AioRpcError as exc:
            return None, exc.code(), {k: v for k, v in (exc.trailing_metadata() or ())}
        return reply, await call.code(), {k: v for k, v in (await call.trailing_metadata() or ())}

    async def close(self) -> None:
        await self.channel.close()


def endpoint(triple: str) -> pb.DynamoEndpointId:
    """``namespace/component/endpoint`` as the message."""
    ns, comp, ep = triple.split("/")
    return pb.DynamoEndpointId(namespace=ns, component=comp, endpoint=ep)


#: Two teams' pools, as the authorization tests name them: a1 and a2 of team A, b1 of team B.
TEAM_POOLS = (("a1", "team-a/router/generate"), ("a2", "team-a/prefill/generate"),
              ("b1", "team-b/router/generate"))  # fmt: skip


def add_team_pools(view: MemRelayView) -> dict[str, Generation]:
    """``TEAM_POOLS`` added to ``view`` (4,096 blocks each), its catalog republished."""
    pools: dict[str, Generation] = {}
    for name, triple in TEAM_POOLS:
        gen = view.add_pool(name, 4096)
        gen.endpoint = endpoint(triple)
        pools[name] = gen
    view._republish_catalog()
    return pools


def grpclib_channel(port: int, window: int | None = None) -> Channel:
    config = None
    if window is not None:
        config = Configuration(http2_connection_window_size=window, http2_stream_window_size=window)
    return Channel("127.0.0.1", port, config=config)


@dataclass
class StreamResult:
    messages: list[Any] = field(default_factory=list)
    status: Any = None  # grpclib Status (None = OK)
    message: str | None = None
    trailers: dict[str, str] = field(default_factory=dict)


def pool_call(channel: Channel) -> Any:
    """A ``SubscribeKvPool`` call on ``channel`` (``async with pool_call(ch) as st``), its
    messages parsed by betterproto2."""
    return channel.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                           pb.SubscribeKvPoolRequest, pb.FilterUpdate)  # fmt: skip


def sub_request(
    expected: pb.ProducerIdentity | None, subscriber_id: str = "t", marker: int = MARKER
) -> pb.SubscribeKvPoolRequest:
    return pb.SubscribeKvPoolRequest(
        subscriber_id=subscriber_id, expected_producer=expected, contract_marker=marker
    )


async def grpclib_collect(
    channel: Channel,
    method: str,
    request: Any,
    reply: type,
    *,
    limit: int | None = None,
    timeout: float = 20.0,
) -> StreamResult:
    """Read a server stream with grpclib + betterproto2; stop after `limit` messages."""
    res = StreamResult()
    async with asyncio.timeout(scaled(timeout)):
        st = channel.request(SVC + method, Cardinality.UNARY_STREAM, type(request), reply)
        try:
            async with st:
                await st.send_message(request, end=True)
                while limit is None or len(res.messages) < limit:
                    msg = await st.recv_message()
                    if msg is None:
                        await st.recv_trailing_metadata()
                        break
                    res.messages.append(msg)
                else:
                    await st.cancel()
        except GRPCError as exc:  # also an answer sent before the whole request was read
            res.status, res.message = exc.status, exc.message
        trailers = st.trailing_metadata
        if trailers is None:  # grpclib keeps an early answer's trailers on its h2 stream only
            inner = st._stream
            trailers = inner.trailers or inner.headers if inner is not None else None
        res.trailers = dict(trailers or {})
    return res


# ---------------------------------------------------------------- consumer replica
class ReplicaError(AssertionError):
    """The stream violated a consumer rule (§4.7)."""


class Replica:
    """A consumer replica built only from FilterUpdate frames (the rules routers enforce)."""

    def __init__(self, relay: pb.RelayIdentity, producer: pb.ProducerIdentity) -> None:
        from kvrelay.publication import cbi1

        self.cbi1 = cbi1
        self.relay = bytes(relay)
        self.producer = bytes(producer)
        fmt = producer.ckf_format
        assert fmt is not None and producer.pool_id is not None
        self.seed, self.bucket_count, self.dc_id = (
            fmt.seed,
            fmt.bucket_count,
            producer.pool_id.dc_id,
        )
        self.assembler = cbi1.SnapshotAssembler()
        self.table: npt.NDArray[np.uint64] | None = None
        self.installed: int | None = None
        self.snapshot_frames = 0
        self.deltas = 0
        self.heartbeats = 0

    def feed(self, fu: pb.FilterUpdate) -> None:
        cbi1 = self.cbi1
        if fu.contract_marker != MARKER or fu.protocol_version != 1:
            raise ReplicaError("marker/version")
        if bytes(fu.relay) != self.relay or bytes(fu.producer) != self.producer:  # type: ignore[arg-type]
            raise ReplicaError("identity drift")
        kind = int(fu.kind)
        if kind == 1:
            if self.table is not None or fu.base_sequence != fu.sequence:
                raise ReplicaError("snapshot chunk after install or base != seq")
            chunk = cbi1.decode(
                fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
            )
            if not isinstance(chunk, cbi1.SnapshotChunk) or chunk.dc_id != self.dc_id:
                raise ReplicaError("not a snapshot chunk of this dc")
            if chunk.epoch != fu.sequence:
                raise ReplicaError("chunk epoch != sequence")
            self.snapshot_frames += 1
            done = self.assembler.feed(chunk)
            if done is not None:
                self.table = np.array(done.words, dtype=np.uint64)
                self.installed = fu.sequence
        elif kind == 2:
            if self.table is None or self.installed is None:
                raise ReplicaError("delta before snapshot")
            if fu.base_sequence != self.installed or fu.sequence != fu.base_sequence + 1:
                raise ReplicaError(
                    f"gap: installed {self.installed}, got {fu.base_sequence}->{fu.sequence}"
                )
            d = cbi1.decode(
                fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
            )
            if not isinstance(d, cbi1.Delta) or d.dc_id != self.dc_id:
                raise ReplicaError("not a delta of this dc")
            if d.base_epoch != fu.base_sequence or d.epoch != fu.sequence:
                raise ReplicaError("delta epochs")
            if d.buckets.size and np.unique(d.buckets).size != d.buckets.size:
                raise ReplicaError("duplicate bucket")
            self.table[d.buckets.astype(np.int64)] = d.words
            self.installed = fu.sequence
            self.deltas += 1
        elif kind == 3:
            if self.table is None:
                raise ReplicaError("heartbeat before snapshot")
            if fu.payload or fu.base_sequence != fu.sequence or fu.sequence != self.installed:
                raise ReplicaError("bad heartbeat")
            self.heartbeats += 1
        else:
            raise ReplicaError(f"unknown kind {kind}")


async def expect_error(st: Any, on_message: Any = None) -> GRPCError:
    """Read a grpclib client stream to its end and return the GRPCError from its trailers."""
    while True:
        msg = await st.recv_message()
        if msg is None:
            break
        if on_message is None:
            raise AssertionError(f"unexpected message {type(msg).__name__}")
        on_message(msg)
    try:
        await st.recv_trailing_metadata()
    except GRPCError as exc:
        return exc
    raise AssertionError("stream ended with OK status")
