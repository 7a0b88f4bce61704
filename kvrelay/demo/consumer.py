"""The demo's router-side consumer: catalog, readiness and every pool stream over real gRPC.

Each pool stream feeds a ``kvrelay.client.PoolReplica`` (the SDK's strict consumer rules: snapshot
assembly, contiguous deltas, identities), and delta latency is measured as receive time minus the
frame's ``send_ts_us`` (same host, same clock). A rule break is counted in ``errors`` under the
SDK's reason name and the stream is re-opened, never asserted: a demo keeps running and reports.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvrelay._aio import stop_all
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ConsumerViolation, PoolReplica
from kvrelay.contract.wire import CONTRACT_MARKER

#: Latency samples kept per pool (a bounded ring; percentiles are over the newest ones).
LATENCY_WINDOW = 4096
RETRY_S = 0.5


def endpoint_name(e: pb.DynamoEndpointId | None) -> str:
    return "?" if e is None else f"{e.namespace}/{e.component}/{e.endpoint}"


@dataclass(slots=True)
class PoolStream:
    """What the consumer saw on one pool's stream (across re-subscriptions)."""

    name: str
    snapshots: int = 0
    deltas: int = 0
    heartbeats: int = 0
    resubscribes: int = 0
    sequence: int | None = None
    generation: int = 0
    latency_us: deque[int] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    replica: PoolReplica | None = None

    def percentiles_ms(self) -> tuple[float | None, float | None]:
        return latency_percentiles(self.latency_us)


def latency_percentiles(samples: deque[int] | list[int]) -> tuple[float | None, float | None]:
    if not samples:
        return None, None
    arr = np.fromiter(samples, dtype=np.float64)
    p50, p99 = np.percentile(arr, [50, 99])
    return float(p50) / 1000.0, float(p99) / 1000.0


class Consumer:
    """Subscribes to the catalog and readiness, and to each pool the catalog lists."""

    def __init__(self, host: str, port: int, subscriber_id: str = "kvrelay-demo") -> None:
        self.host, self.port = host, port
        self.subscriber_id = subscriber_id
        self.catalog: dict[str, pb.KvPoolDescriptor] = {}
        self.catalog_revision = 0
        self.readiness: list[pb.TopologyEntry] = []
        self.relay: pb.RelayIdentity | None = None
        self.streams: dict[str, PoolStream] = {}
        self.errors: dict[str, int] = {}
        self._channel: Channel | None = None
        self._stub: pb.KvEventRelayStub | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pool_tasks: dict[str, tuple[bytes, asyncio.Task[None]]] = {}

    def _error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    async def start(self) -> None:
        self._channel = Channel(self.host, self.port)
        self._stub = pb.KvEventRelayStub(self._channel)
        info = await self._stub.get_relay_info(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))
        self.relay = info.relay
        self._tasks = [
            asyncio.create_task(self._watch_catalog()),
            asyncio.create_task(self._watch_readiness()),
        ]

    async def stop(self) -> None:
        tasks = self._tasks + [t for _, t in self._pool_tasks.values()]
        await stop_all(tasks)
        self._pool_tasks.clear()
        if self._channel is not None:
            self._channel.close()

    # ---- planes ----------------------------------------------------------------------------------

    async def _watch_catalog(self) -> None:
        assert self._stub is not None
        while True:
            try:
                req = pb.WatchKvPoolCatalogRequest(
                    subscriber_id=self.subscriber_id, contract_marker=CONTRACT_MARKER
                )
                async for upd in self._stub.watch_kv_pool_catalog(req):
                    pools = upd.snapshot.pools if upd.snapshot is not None else []
                    self.catalog = {endpoint_name(d.serving_endpoint): d for d in pools}
                    self.catalog_revision = upd.revision
                    self.supervise()
            except (GRPCError, StreamTerminatedError, OSError):
                self._error("catalog_stream")
            await asyncio.sleep(RETRY_S)

    async def _watch_readiness(self) -> None:
        assert self._stub is not None
        while True:
            try:
                req = pb.SubscribeServingReadinessRequest(
                    subscriber_id=self.subscriber_id, contract_marker=CONTRACT_MARKER
                )
                async for upd in self._stub.subscribe_serving_readiness(req):
                    self.readiness = list(upd.entries)
            except (GRPCError, StreamTerminatedError, OSError):
                self._error("readiness_stream")
            await asyncio.sleep(RETRY_S)

    def supervise(self) -> None:
        """(Re)subscribe every listed pool whose producer changed or whose stream ended."""
        for name, desc in self.catalog.items():
            key = bytes(desc.producer) if desc.producer is not None else b""
            current = self._pool_tasks.get(name)
            if current is not None and current[0] == key and not current[1].done():
                continue
            if current is not None:
                current[1].cancel()
            stream = self.streams.setdefault(name, PoolStream(name))
            if current is not None:
                stream.resubscribes += 1
            self._pool_tasks[name] = (key, asyncio.create_task(self._follow(stream, desc)))

    # ---- pool streams ----------------------------------------------------------------------------

    async def _follow(self, st: PoolStream, desc: pb.KvPoolDescriptor) -> None:
        assert self._stub is not None
        producer = desc.producer
        if producer is None:
            self._error("descriptor_without_producer")
            return
        try:
            replica = PoolReplica(producer, self.relay)
        except Exception:  # an invalid producer identity in the catalog
            self._error("producer_identity")
            return
        st.replica, st.sequence = replica, None
        st.generation = int(producer.layout_generation)
        req = pb.SubscribeKvPoolRequest(
            subscriber_id=self.subscriber_id,
            expected_producer=producer,
            contract_marker=CONTRACT_MARKER,
        )
        try:
            async for fu in self._stub.subscribe_kv_pool(req):
                received_us = time.time_ns() // 1000
                info = replica.feed(fu)
                st.sequence = replica.sequence
                if info.kind == "snapshot_chunk":
                    st.snapshots += 1
                elif info.kind == "delta":
                    st.deltas += 1
                    st.latency_us.append(max(0, received_us - int(fu.send_ts_us)))
                else:
                    st.heartbeats += 1
        except ConsumerViolation as exc:
            self._error(exc.reason)  # the supervisor re-subscribes with a fresh replica
        except (GRPCError, StreamTerminatedError, OSError):
            self._error("pool_stream")

    # ---- views -----------------------------------------------------------------------------------

    def all_latencies(self) -> list[int]:
        return [v for s in self.streams.values() for v in s.latency_us]
