"""Shared rig for the reliability suite: sim fleet → Relay → RelayServer → consumer replica.

Oracles: the simulator's ground truth (``xxhash`` over the blocks each rank holds), the strict
consumer replica of ``tests/e2e/replica.py`` and the CKF false-positive bound of a 2-bucket,
4-slot, 16-bit-fingerprint filter (≈ 8·α / 65536 at load factor α).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.contract.limits import RelayLimits
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import (  # the shared fleet harness
    ENGINE_DOWN_GRACE_S,
    eventually,
    ground_truth,
    relay_view,
    salts_on_wire,
)
from tests.support.fleet import wait_subscribed as wait_live  # noqa: F401  (used by the fault tests)
from tests.support.replica import Replica
from tests.support.timing import scaled

MARKER = 0x4B565231
REASON = "kv-relay-error-reason"
SVC = "/dynamo.kvrelay.v1.KvEventRelay/"
FP_BITS = 16
SLOTS = 4
POOL = "ns/backend/generate"


@dataclass
class Rig:
    engines: list[SimEngine]
    relay: Relay
    server: RelayServer
    settings: RelaySettings
    _metrics: RelayMetrics | None = None

    def metric(self, name: str, **labels: str) -> float:
        """A Prometheus sample from ``kvrelay.ops.metrics`` for the current relay (0 if absent)."""
        m = self._metrics
        if m is None or m.relay is not self.relay:
            m = RelayMetrics(self.relay)
            m.attach_service(self.server.service)
            self._metrics = m
        if name.startswith(("kvrelay_pool_", "kvrelay_ingest_", "kvrelay_engine_")):
            labels.setdefault("pool", POOL)
        value = m.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)

    def stream_errors(self, reason: str) -> float:
        return self.metric("kvrelay_stream_errors_total", reason=f"RELAY_ERROR_REASON_{reason}")

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def pool(self) -> Any:
        return self.relay.pools[0]

    def channel(self, window: int | None = None) -> Channel:
        config = None
        if window is not None:
            config = Configuration(
                http2_connection_window_size=window, http2_stream_window_size=window
            )
        return Channel("127.0.0.1", self.port, config=config)


def make_settings(
    engines: list[SimEngine],
    *,
    limits: RelayLimits | None = None,
    expected_blocks: int = 8192,
    static: tuple[EngineSpec, ...] = (),
    model: str | None = None,
    kv_block_size: int | None = None,
) -> RelaySettings:
    specs = tuple(
        EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port) for e in engines
    )
    return RelaySettings(
        dc_name="dc-rel",
        pools=(
            PoolSpec(
                namespace="ns",
                component="backend",
                endpoint="generate",
                engines=specs + static,
                expected_blocks=expected_blocks,
                model=model,
                kv_block_size=kv_block_size,
            ),
        ),
        limits=limits or RelayLimits(),
        discovery_interval_s=0.1,
        discovery_timeout_s=scaled(0.5),
        engine_down_grace_s=ENGINE_DOWN_GRACE_S,
    )


async def stop_relay(relay: Relay) -> None:
    """``relay.stop()``, bounded: a teardown that hangs is a failure, not a stuck suite."""
    await asyncio.wait_for(relay.stop(), scaled(30))


async def start_relay(
    settings: RelaySettings, port: int = 0, ssl: Any = None
) -> tuple[Relay, RelayServer]:
    """A started relay and its server on loopback (``ssl``: a server context)."""
    relay = Relay(settings)
    await relay.start()
    server = RelayServer(relay, settings.limits)
    await server.start("127.0.0.1", port, ssl=ssl)
    return relay, server


@contextlib.asynccontextmanager
async def rig(
    configs: list[SimConfig],
    *,
    engines_started: list[SimEngine] | None = None,
    **kw: Any,
) -> AsyncIterator[Rig]:
    engines = engines_started if engines_started is not None else [SimEngine(c) for c in configs]
    for e in engines:
        if engines_started is None:
            await e.start()
    settings = make_settings(engines, **kw)
    relay, server = await start_relay(settings)
    r = Rig(engines, relay, server, settings)
    r.metric("kvrelay_pool_generations_total")  # start tracking from the beginning
    try:
        yield r
    finally:
        await r.server.close(grace_s=1.0)
        await stop_relay(r.relay)
        for e in r.engines:
            await e.stop()


def in_sync(engines: list[SimEngine], relay: Relay) -> bool:
    if relay.pools[0].generation is None:
        return False
    truth, view = ground_truth(engines), relay_view(relay)
    return all(view.get(k, set()) == v for k, v in truth.items())


def stored_after(engine: SimEngine, rank: int, before: set[int]) -> set[int]:
    """Canonical hashes the relay must know after losing history: held blocks whose whole chain
    (every ancestor, by vLLM hash) is held now and was not held at the loss (``before``)."""
    held = engine.held_blocks(rank)
    out: set[int] = set()
    for blk in held.values():
        b: Any = blk
        ok = True
        while b is not None:
            if b.vllm_hash in before:
                ok = False
                break
            if b.parent is None:
                break
            b = held.get(b.parent)
            if b is None:
                ok = False
        if ok:
            out.add(blk.canonical_ns if salts_on_wire(engine) else blk.canonical)
    return out


def member_resets(relay: Relay) -> int:
    return sum(relay.pools[0].counters.member_resets.values())


# ---------------------------------------------------------------- gRPC streams


@dataclass
class StreamEnd:
    """How a server stream ended: ``status`` None = clean EOF."""

    status: Status | None = None
    message: str | None = None
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def reason(self) -> str | None:
        return self.trailers.get(REASON)


class Consumer:
    """A SubscribeKvPool stream feeding a strict ``Replica``; records how the stream ended."""

    def __init__(
        self,
        channel: Channel,
        producer: pb.ProducerIdentity,
        relay_identity: pb.RelayIdentity,
        subscriber_id: str = "replica",
    ) -> None:
        self.channel = channel
        self.producer = producer
        self.replica = Replica(producer, relay_identity)
        self.subscriber_id = subscriber_id
        self.end: StreamEnd | None = None
        self.first = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Consumer:
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        end = StreamEnd()
        req = pb.SubscribeKvPoolRequest(
            subscriber_id=self.subscriber_id,
            expected_producer=self.producer,
            contract_marker=MARKER,
        )
        async with self.channel.request(
            SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest,
            pb.FilterUpdate,
        ) as st:
            await st.send_message(req, end=True)
            try:
                while True:
                    fu = await st.recv_message()
                    if fu is None:
                        await st.recv_trailing_metadata()
                        break
                    self.replica.feed(fu)
                    self.first.set()
            except GRPCError as exc:
                end.status, end.message = exc.status, exc.message
            except StreamTerminatedError as exc:
                end.status, end.message = Status.UNAVAILABLE, f"terminated: {exc}"
            end.trailers = dict(st.trailing_metadata or {})
        self.end = end

    async def wait_end(self, timeout: float = 15.0) -> StreamEnd:
        assert self.task is not None
        await asyncio.wait_for(asyncio.shield(self.task), scaled(timeout))
        assert self.end is not None
        return self.end

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def first_matching(
    channel: Channel,
    method: str,
    request: Any,
    reply: type,
    pred: Callable[[Any], bool],
    timeout: float = 15.0,
) -> Any:
    """Open a server stream and return the first message satisfying ``pred``."""
    async with asyncio.timeout(scaled(timeout)):
        async with channel.request(
            SVC + method, Cardinality.UNARY_STREAM, type(request), reply
        ) as st:
            await st.send_message(request, end=True)
            while True:
                msg = await st.recv_message()
                assert msg is not None, f"{method} ended before the expected message"
                if pred(msg):
                    await st.cancel()
                    return msg


async def collect_end(
    channel: Channel, method: str, request: Any, reply: type, timeout: float = 15.0
) -> tuple[list[Any], StreamEnd]:
    """Read a server stream to its end; returns messages and the end status + trailers."""
    msgs: list[Any] = []
    end = StreamEnd()
    async with asyncio.timeout(scaled(timeout)):
        async with channel.request(
            SVC + method, Cardinality.UNARY_STREAM, type(request), reply
        ) as st:
            await st.send_message(request, end=True)
            try:
                while True:
                    msg = await st.recv_message()
                    if msg is None:
                        await st.recv_trailing_metadata()
                        break
                    msgs.append(msg)
            except GRPCError as exc:
                end.status, end.message = exc.status, exc.message
            end.trailers = dict(st.trailing_metadata or {})
    return msgs, end


async def relay_info(channel: Channel) -> pb.RelayInfo:
    stub = pb.KvEventRelayStub(channel)
    return await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER))


async def relay_info_at(port: int, ssl: Any = None) -> pb.RelayInfo:
    """``GetRelayInfo`` on its own loopback channel (with ``ssl``, an ``SSLContext``, over TLS):
    whether a client gets through to a relay, and as whom."""
    async with Channel("127.0.0.1", port, ssl=ssl) as ch:
        return await asyncio.wait_for(
            pb.KvEventRelayStub(ch).get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER)),
            scaled(10),
        )


async def relay_info_bytes(port: int) -> bytes:
    """``GetRelayInfo``'s reply as the bytes on the wire (on its own loopback channel), for
    byte-for-byte comparisons of a relay and its mirrors."""
    ch = Channel("127.0.0.1", port, codec=RawCodec(8 << 20))
    try:
        async with ch.request(
            SVC + "GetRelayInfo", Cardinality.UNARY_UNARY, pb.RelayInfoRequest, bytes
        ) as st:
            await st.send_message(pb.RelayInfoRequest(contract_marker=MARKER), end=True)
            data = await st.recv_message()
            await st.recv_trailing_metadata()
        assert isinstance(data, bytes)
        return data
    finally:
        ch.close()


async def catalog_producer(
    channel: Channel, differs_from: pb.ProducerIdentity | None = None
) -> pb.ProducerIdentity:
    """The single pool's producer from the catalog (optionally: one different from a stale one)."""

    def ok(upd: pb.KvPoolCatalogUpdate) -> bool:
        if upd.snapshot is None or not upd.snapshot.pools:
            return False
        p = upd.snapshot.pools[0].producer
        return p is not None and (differs_from is None or bytes(p) != bytes(differs_from))

    upd = await first_matching(
        channel,
        "WatchKvPoolCatalog",
        pb.WatchKvPoolCatalogRequest(subscriber_id="catalog", contract_marker=MARKER),
        pb.KvPoolCatalogUpdate,
        ok,
    )
    producer = upd.snapshot.pools[0].producer
    assert producer is not None
    return producer


async def catalog_pool_count(channel: Channel) -> int:
    upd = await first_matching(
        channel,
        "WatchKvPoolCatalog",
        pb.WatchKvPoolCatalogRequest(subscriber_id="catalog", contract_marker=MARKER),
        pb.KvPoolCatalogUpdate,
        lambda u: u.snapshot is not None,
    )
    return len(upd.snapshot.pools)


async def readiness_until(
    channel: Channel, pred: Callable[[pb.ServingReadinessUpdate], bool], timeout: float = 15.0
) -> pb.ServingReadinessUpdate:
    msg: pb.ServingReadinessUpdate = await first_matching(
        channel,
        "SubscribeServingReadiness",
        pb.SubscribeServingReadinessRequest(subscriber_id="ready", contract_marker=MARKER),
        pb.ServingReadinessUpdate,
        pred,
        timeout,
    )
    return msg


def readiness_state(upd: pb.ServingReadinessUpdate) -> pb.ServingReadinessState | None:
    states = [e.state for e in upd.entries if e.canonical_model_id]
    return states[0] if len(states) == 1 else None


async def subscribe(rig_: Rig, channel: Channel, sid: str = "replica") -> Consumer:
    info = await relay_info(channel)
    assert info.relay is not None
    producer = await catalog_producer(channel)
    c = Consumer(channel, producer, info.relay, sid).start()
    await asyncio.wait_for(c.first.wait(), scaled(15))
    return c


# ---------------------------------------------------------------- invariants


def fp_bound(table: np.ndarray, probes: int) -> float:
    """Allowed false positives in ``probes`` random non-members: mean 8·α/2^16 plus 6 sigma."""
    words = table.astype(np.uint64)
    occupied = 0
    for s in range(SLOTS):
        occupied += int(np.count_nonzero((words >> np.uint64(FP_BITS * s)) & np.uint64(0xFFFF)))
    alpha = occupied / (SLOTS * len(words))
    mean = 2 * SLOTS * alpha / (1 << FP_BITS) * probes
    return mean + 6 * math.sqrt(mean) + 1


def assert_bounded(r: Rig) -> None:
    """Every queue and buffer sits within its configured bound."""
    limits = r.settings.limits
    svc = r.server.service
    for permits in (svc.pool_permits, svc.catalog_permits, svc.readiness_permits, svc.load_permits):
        assert 0 <= permits.in_use <= permits.capacity
    for sub in svc._subscriptions:
        assert len(sub._frames) <= limits.publication_queue_capacity
        assert sub._bytes <= limits.publication_queue_bytes
    for p in r.relay.pools:
        for s in p.subscribers.values():
            buf = s._buf
            assert len(buf) <= buf.max_messages and buf.nbytes <= buf.max_bytes


async def verify(
    r: Rig,
    consumer: Consumer,
    *,
    exact: bool = True,
    must_have: set[int] | None = None,
    probes: int = 20_000,
    seed: int = 0,
    truth: dict[tuple[str, int], set[int]] | None = None,
) -> None:
    """After a fault: nothing lost, nothing phantom, memory bounded, daemon serving.

    ``exact``: the relay's state equals the simulator's ground truth. Otherwise the relay's state
    is only a subset of it (history lost) and ``must_have`` (blocks stored after the loss) must be
    present.
    """
    relay = r.relay

    def oracle() -> dict[tuple[str, int], set[int]]:
        return truth if truth is not None else ground_truth(r.engines)

    def synced() -> bool:
        if relay.pools[0].generation is None:
            return False
        view = relay_view(relay)
        return all(view.get(k, set()) == v for k, v in oracle().items())

    if exact:
        await eventually(synced, what="relay exact state = ground truth")
    elif must_have:
        # the latest steps may still be in flight: wait for them, fail if they never arrive
        await eventually(
            lambda: must_have <= set().union(*relay_view(relay).values()),
            what="blocks stored after the loss reach the relay",
        )
    gen = relay.pools[0].generation
    assert gen is not None
    gen.flush()
    try:
        await eventually(
            lambda: consumer.replica.sequence == gen.sequence, what="replica at producer sequence"
        )
    except AssertionError as exc:  # say why: a stream that ended, or a replica that raised
        raise AssertionError(f"{exc}; consumer end={consumer.end}, task={consumer.task}") from None
    table = consumer.replica.table
    assert table is not None
    assert np.array_equal(table, gen.pool.table), "replica filter != producer table"
    expected, view = oracle(), relay_view(relay)
    for key, held in view.items():
        assert held <= expected.get(key, set()), f"phantom hashes in the relay's state for {key}"
    all_truth: set[int] = set().union(*expected.values()) if expected else set()
    required = all_truth if exact else (must_have or set())
    if required:
        assert bool(np.all(consumer.replica.contains(sorted(required)))), "lost hashes in filter"
    rng = np.random.default_rng(seed)
    cand = rng.integers(0, 2**64 - 1, size=probes, dtype=np.uint64, endpoint=True)
    known = np.fromiter(all_truth, dtype=np.uint64, count=len(all_truth))
    cand = cand[~np.isin(cand, known)]
    fps = int(np.count_nonzero(consumer.replica.contains(cand.tolist())))
    assert fps <= fp_bound(table, len(cand)), f"{fps} false positives in {len(cand)} probes"
    assert_bounded(r)
    async with r.channel() as ch:
        info = await relay_info(ch)
    assert info.relay is not None and info.relay.relay_incarnation == relay.relay_incarnation
