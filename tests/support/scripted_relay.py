"""A small scripted KvEventRelay server (grpclib) that sends crafted frames to the SDK.

Real gRPC over loopback; it only serves what each test scripts: one catalog, READY readiness, an
empty load window, and for ``SubscribeKvPool`` the next queued script of frames (then a valid
default stream that stays open). Errors end a stream with the contract trailer, like a relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from grpclib.const import Cardinality, Handler, Status
from grpclib.server import Server, Stream

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig, RelayClient
from kvrelay.client.views import PoolKey
from kvrelay.publication import cbi1

MARKER = 0x4B565231
SVC = "/dynamo.kvrelay.v1.KvEventRelay/"
SEED = 0x5DEECE66D1B54A33
BUCKETS = 1024
DC_ID = 4242
RELAY = pb.RelayIdentity(drt_instance_id=7, relay_incarnation=1001)
OTHER_RELAY = pb.RelayIdentity(drt_instance_id=7, relay_incarnation=2002)


def producer(layout_generation: int = 1, dc_id: int = DC_ID) -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=b"c" * 16, source=1),
                routing_scope=pb.DigestIdentity(digest=b"r" * 16, source=1),
            ),
            dc_id=dc_id,
        ),
        producer_incarnation=RELAY.relay_incarnation,
        layout_generation=layout_generation,
        ckf_format=pb.CkfFormat(
            format_version=1, seed=SEED, bucket_count=BUCKETS, fingerprint_bits=16,
            slots_per_bucket=4,
        ),
    )  # fmt: skip


def descriptor(prod: pb.ProducerIdentity | None = None) -> pb.KvPoolDescriptor:
    return pb.KvPoolDescriptor(
        producer=prod or producer(),
        serving_endpoint=pb.DynamoEndpointId(namespace="ns", component="be", endpoint="gen"),
        registrations=[
            pb.ModelRegistration(
                canonical_model_id="m",
                target=pb.ModelTarget(base=pb.BaseModelTarget(base_model="m")),
            )
        ],
        query_semantics=pb.KvQuerySemantics(kv_block_size=4, hash_format=1),
        pool_roles=[pb.WorkerRole.AGGREGATED],
    )


def frame(
    kind: int, base: int, seq: int, payload: bytes, *,
    relay: pb.RelayIdentity = RELAY, prod: pb.ProducerIdentity | None = None,
) -> pb.FilterUpdate:  # fmt: skip
    return pb.FilterUpdate(
        protocol_version=1, relay=relay, producer=prod or producer(), base_sequence=base,
        sequence=seq, send_ts_us=1, kind=kind, payload=payload, contract_marker=MARKER,
    )  # fmt: skip


def table(seed_words: int = 3) -> np.ndarray:
    t = np.zeros(BUCKETS, dtype=np.uint64)
    t[:seed_words] = np.arange(1, seed_words + 1, dtype=np.uint64) * 0x0001_0001
    return t


def snapshot(
    seq: int, words: np.ndarray | None = None, dc_id: int = DC_ID
) -> list[pb.FilterUpdate]:
    w = table() if words is None else words
    chunks = cbi1.encode_snapshot_chunks(
        w, seed=SEED, bucket_count=BUCKETS, dc_id=dc_id, epoch=seq
    )
    return [frame(1, seq, seq, c) for c in chunks]


def delta(base: int, seq: int, *, dc_id: int = DC_ID, cbi_base: int | None = None,
          buckets: tuple[int, ...] = (5,), words: tuple[int, ...] = (0x0009_0008_0007_0006,),
          ) -> pb.FilterUpdate:  # fmt: skip
    payload = cbi1.encode_delta(
        np.array(buckets, dtype=np.uint64), np.array(words, dtype=np.uint64), seed=SEED,
        bucket_count=BUCKETS, dc_id=dc_id,
        base_epoch=base if cbi_base is None else cbi_base, epoch=seq,
    )  # fmt: skip
    return frame(2, base, seq, payload)


def heartbeat(seq: int) -> pb.FilterUpdate:
    return frame(3, seq, seq, b"")


def corrupt_checksum(fu: pb.FilterUpdate) -> pb.FilterUpdate:
    p = bytearray(fu.payload)
    p[-1] ^= 0xFF  # body byte changed, header checksum kept
    return frame(int(fu.kind), int(fu.base_sequence), int(fu.sequence), bytes(p))


def half_chunk(seq: int, index: int) -> pb.FilterUpdate:
    """Chunk ``index`` of a hand-made 2-chunk snapshot (512 words each) of the 1024 lane."""
    body = struct.pack("<IIQ", index, 2, index * 512) + np.zeros(512, "<u8").tobytes()
    head = struct.pack(
        "<4sHHBBHQQQQI", b"CBI1", 1, 1, 16, 4, 1, SEED, BUCKETS, DC_ID, seq, cbi1.checksum(body)
    )
    return frame(1, seq, seq, head + body)


#: The period the scripted load window states (one window, then silence).
QUIET_WINDOW_MS = 600_000


@dataclass
class Script:
    frames: list[pb.FilterUpdate]
    end: tuple[Status, str] | None = None  # error to end with; None: clean EOF
    hold: bool = False  # keep the stream open after the frames
    gate: asyncio.Event | None = None  # set: wait for it after ``frames``, then send ``after``
    after: list[pb.FilterUpdate] = field(default_factory=list)


@dataclass
class ScriptedRelay:
    catalog: list[pb.KvPoolDescriptor] = field(default_factory=lambda: [descriptor()])
    scripts: deque[Script] = field(default_factory=deque)
    default: Callable[[], Script] = field(
        default_factory=lambda: lambda: Script([*snapshot(10), delta(10, 11)], hold=True)
    )
    subscriptions: int = 0
    catalog_version: int = 0
    _catalog_changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set_catalog(self, pools: list[pb.KvPoolDescriptor]) -> None:
        self.catalog = pools
        self.catalog_version += 1
        self._catalog_changed.set()

    def __mapping__(self) -> dict[str, Handler]:
        return {
            SVC + "WatchKvPoolCatalog": Handler(
                self._catalog, Cardinality.UNARY_STREAM, pb.WatchKvPoolCatalogRequest,
                pb.KvPoolCatalogUpdate,
            ),
            SVC + "SubscribeKvPool": Handler(
                self._pool, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest, pb.FilterUpdate
            ),
            SVC + "SubscribeServingReadiness": Handler(
                self._readiness, Cardinality.UNARY_STREAM, pb.SubscribeServingReadinessRequest,
                pb.ServingReadinessUpdate,
            ),
            SVC + "SubscribeKvPoolLoad": Handler(
                self._load, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolLoadRequest,
                pb.KvPoolLoadUpdate,
            ),
        }  # fmt: skip

    async def _catalog(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        while True:
            self._catalog_changed.clear()
            await stream.send_message(
                pb.KvPoolCatalogUpdate(
                    protocol_version=1, relay=RELAY, revision=self.catalog_version,
                    snapshot=pb.KvPoolCatalogSnapshot(pools=list(self.catalog)),
                    contract_marker=MARKER,
                )
            )
            await self._catalog_changed.wait()

    async def _readiness(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        members = [
            pb.TopologyMember(
                endpoint=d.serving_endpoint, roles=[pb.WorkerRole.AGGREGATED],
                pool_id=d.producer.pool_id if d.producer else None,
            )
            for d in self.catalog
        ]  # fmt: skip
        await stream.send_message(
            pb.ServingReadinessUpdate(
                protocol_version=1, relay=RELAY, revision=1,
                entries=[pb.TopologyEntry(
                    namespace="ns", canonical_model_id="m", state=2,
                    present_roles=[pb.WorkerRole.AGGREGATED], members=members,
                )],
                contract_marker=MARKER,
            )
        )
        await asyncio.Event().wait()

    async def _load(self, stream: Stream[Any, Any]) -> None:
        # one window, stating a period long enough that no consumer calls the stream silent
        # mid-test (a mirror would be out of session, refusing every RPC, until it reopened it)
        await stream.recv_message()
        await stream.send_message(
            pb.KvPoolLoadUpdate(
                protocol_version=1, relay=RELAY, window_sequence=1, observed_ms=5,
                window_ms=QUIET_WINDOW_MS,
                pools=[pb.KvPoolLoadEntry(producer=producer(), kv_used_blocks=30,
                                          total_kv_blocks=120, kv_observed_ranks=2,
                                          kv_expected_ranks=2)],
                contract_marker=MARKER,
            )
        )
        await asyncio.Event().wait()

    async def _pool(self, stream: Stream[Any, Any]) -> None:
        await stream.recv_message()
        self.subscriptions += 1
        script = self.scripts.popleft() if self.scripts else self.default()
        for fu in script.frames:
            await stream.send_message(fu)
        if script.gate is not None:
            await script.gate.wait()
            for fu in script.after:
                await stream.send_message(fu)
        if script.end is not None:
            status, reason = script.end
            await stream.send_trailing_metadata(
                status=status, status_message=reason,
                metadata={"kv-relay-error-reason": f"RELAY_ERROR_REASON_{reason}"},
            )  # fmt: skip
            return
        if script.hold:
            await asyncio.Event().wait()


async def serve(relay: ScriptedRelay) -> Server:
    server = Server([relay])
    await server.start("127.0.0.1", 0)
    return server


def port_of(server: Server) -> int:
    assert server._server is not None
    return int(server._server.sockets[0].getsockname()[1])


#: An SDK that resubscribes at once: the tests' back-off.
FAST = ClientConfig(backoff_initial_s=0.01, backoff_max_s=0.05)


@contextlib.asynccontextmanager
async def scripted(
    *scripts: Script, config: ClientConfig = FAST, relay: ScriptedRelay | None = None
) -> AsyncIterator[tuple[ScriptedRelay, RelayClient, PoolKey]]:
    """``relay`` (a default one if None) with ``scripts`` queued, served on loopback, and an SDK
    client of it: ``(relay, client, the pool's key)``."""
    relay = relay if relay is not None else ScriptedRelay()
    relay.scripts.extend(scripts)
    server = await serve(relay)
    addr = f"127.0.0.1:{port_of(server)}"
    client = RelayClient([addr], config=config)
    await client.start()
    try:
        yield relay, client, PoolKey(addr, "ns", "be", "gen")
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def installed_at(client: RelayClient, key: PoolKey, seq: int) -> bool:
    """The client holds the pool's replica installed at ``seq``."""
    st = client.replica_stats().get(key)
    return st is not None and st.installed and st.sequence == seq
