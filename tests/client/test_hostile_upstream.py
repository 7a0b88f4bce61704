"""The SDK's connection against a relay that misbehaves where a lenient reader would go on
holding stale or incomplete state: a snapshot that keeps starting over, plane messages it
cannot take or whose version goes backwards, a stream that ends without a status. Real grpclib
relay on loopback (``tests/support/scripted_relay.py``; a raw HTTP/2 one,
``tests/support/raw_relay.py``, for what grpclib never sends), the SDK's own
``RelayConnection``."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.config import ClientConfig
from kvrelay.client.connection import RelayConnection
from kvrelay.publication import cbi1
from tests.support import scripted_relay as S
from tests.support.fleet import eventually
from tests.support.raw_relay import RawRelay

TWO_CHUNKS = 1 << 20


def _two_chunk_producer() -> pb.ProducerIdentity:
    p = S.producer()
    assert p.ckf_format is not None
    p.ckf_format.bucket_count = TWO_CHUNKS
    return p


class _StartingOver(S.ScriptedRelay):
    """Its pool streams send chunk 0 of a two-chunk lane every 50 ms, never chunk 1."""

    async def _pool(self, stream: Any) -> None:
        await stream.recv_message()
        self.subscriptions += 1
        words = np.zeros(TWO_CHUNKS, dtype=np.uint64)
        payload = cbi1.encode_snapshot_chunks(
            words, seed=S.SEED, bucket_count=TWO_CHUNKS, dc_id=S.DC_ID, epoch=10
        )[0]
        chunk = S.frame(1, 10, 10, payload, prod=_two_chunk_producer())
        while True:
            await stream.send_message(chunk)
            await asyncio.sleep(0.05)


def _connect(port: int) -> RelayConnection:
    config = ClientConfig(watch_serving_load=False, backoff_initial_s=0.02, backoff_max_s=0.2)
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", port), config)
    conn.start()
    return conn


async def test_a_snapshot_that_starts_over_drops_the_pending_replica() -> None:
    """Chunk 0 again during an assembly is ``snapshot_sequence``: the pending replica is dropped
    and the pool resubscribed. It started the assembly over, and since every chunk reset the
    silence clock the replica stayed pending for ever, with nothing counted."""
    server = await S.serve(_StartingOver(catalog=[S.descriptor(_two_chunk_producer())]))
    conn = _connect(S.port_of(server))
    try:
        await eventually(lambda: conn.drops.get(E.SNAPSHOT_SEQUENCE, 0) >= 1, timeout=5,
                         what="the restarted snapshot refused")  # fmt: skip
        assert all(slot.installed is None for slot in conn.slots.values())
    finally:
        await conn.close()
        server.close()


class _Garbled(S.ScriptedRelay):
    """Each plane's first stream sends a good message, then one with a wrong envelope (the
    relay's newer state, unreadable), and stays open; a later stream sends the newest state:
    catalog revision 3 without the pool, readiness revision 3."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: dict[str, int] = {"catalog": 0, "readiness": 0}

    async def _catalog(self, stream: Any) -> None:
        await stream.recv_message()
        self.streams["catalog"] += 1

        def update(revision: int, pools: list[pb.KvPoolDescriptor]) -> pb.KvPoolCatalogUpdate:
            return pb.KvPoolCatalogUpdate(
                protocol_version=1, relay=S.RELAY, revision=revision, contract_marker=S.MARKER,
                snapshot=pb.KvPoolCatalogSnapshot(pools=pools))  # fmt: skip

        if self.streams["catalog"] == 1:
            await stream.send_message(update(1, list(self.catalog)))
            await asyncio.sleep(0.3)
            bad = update(2, [])
            bad.protocol_version = 2
            await stream.send_message(bad)
        else:
            await stream.send_message(update(3, []))
        await asyncio.Event().wait()

    async def _readiness(self, stream: Any) -> None:
        await stream.recv_message()
        self.streams["readiness"] += 1
        msg = pb.ServingReadinessUpdate(protocol_version=1, relay=S.RELAY, revision=1,
                                        contract_marker=S.MARKER)  # fmt: skip
        if self.streams["readiness"] == 1:
            await stream.send_message(msg)
            await asyncio.sleep(0.3)
            msg.revision, msg.contract_marker = 2, 0
            await stream.send_message(msg)
        else:
            msg.revision = 3
            await stream.send_message(msg)
        await asyncio.Event().wait()


async def test_a_plane_message_the_sdk_cannot_take_ends_its_stream() -> None:
    """A catalog or readiness message with a wrong envelope ends its stream and the SDK reads
    the plane again. It skipped the message and kept the one before as current for as long as
    the stream lived: a withdrawn pool's replica, a readiness revision the relay had left."""
    relay = _Garbled()
    server = await S.serve(relay)
    conn = _connect(S.port_of(server))
    try:
        await eventually(lambda: conn.catalog_revision == 3, timeout=5, what="catalog 3")
        assert conn.slots == {}  # revision 3 withdrew the pool
        await eventually(lambda: conn.readiness is not None and conn.readiness.revision == 3,
                         timeout=5, what="readiness 3")  # fmt: skip
        c = conn.counters
        assert c["catalog_end_envelope"] == 1 and c["catalog_envelope_invalid"] == 1, c
        assert c["readiness_end_envelope"] == 1 and c["readiness_envelope_invalid"] == 1, c
    finally:
        await conn.close()
        server.close()


async def test_streams_that_end_after_their_snapshot_are_resubscribed_with_backoff() -> None:
    """A relay that ends every pool stream cleanly right after its snapshot: the SDK reset its
    backoff whenever a snapshot had installed, so it took a whole snapshot every 10-20 ms. A
    stream live less than ``rpc.LIVE_RESUBSCRIBE_S`` (the mirror's rule too) now counts as a
    failed attempt, and the pool is asked with growing backoff."""
    relay = S.ScriptedRelay()
    relay.default = lambda: S.Script(S.snapshot(10))  # then a clean end
    server = await S.serve(relay)
    config = ClientConfig(watch_serving_load=False, backoff_initial_s=0.02, backoff_max_s=0.5)
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", S.port_of(server)), config)
    conn.start()
    try:
        await eventually(lambda: relay.subscriptions >= 1, what="subscribed", timeout=5)
        await asyncio.sleep(1.0)
        (slot,) = conn.slots.values()
        assert slot.subscribes >= 3  # it does resubscribe
        assert relay.subscriptions < 20, relay.subscriptions
    finally:
        await conn.close()
        server.close()


class MuteFirstCatalog(S.ScriptedRelay):
    """Its first catalog stream never answers (a relay or proxy that took the stream and
    stalled); later ones answer as a relay does."""

    def __init__(self) -> None:
        super().__init__()
        self.catalog_streams = 0

    async def _catalog(self, stream: Any) -> None:
        self.catalog_streams += 1
        if self.catalog_streams == 1:
            await stream.recv_message()
            await asyncio.Event().wait()
        await super()._catalog(stream)


async def test_a_catalog_stream_that_never_answers_is_retried() -> None:
    """A relay sends its catalog at once, then only on change: a catalog stream with no first
    message within the silence bound ends ``silent`` and the catalog is watched again. The SDK
    used to wait on it for ever, without pools."""
    relay = MuteFirstCatalog()
    server = await S.serve(relay)
    config = ClientConfig(watch_serving_load=False, backoff_initial_s=0.02, backoff_max_s=0.2,
                          heartbeat_interval_s=0.25, silence_heartbeats=2)  # fmt: skip
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", S.port_of(server)), config)
    conn.start()
    try:
        await eventually(lambda: len(conn.slots) == 1, what="the catalog read again", timeout=10)
        assert relay.catalog_streams >= 2
        assert conn.counters[f"catalog_end_{E.SILENT}"] >= 1
    finally:
        await conn.close()
        server.close()


class _Backwards(S.ScriptedRelay):
    """Each plane's first stream goes backwards after a re-send at its version: catalog revision
    10 (the pool), 11 (withdrawn), 11 again, 10 (the pool, stale); readiness revision 5, 6
    (UNAVAILABLE), 6 again, 5 (READY, stale); load window 10, 11, 11 again, 3. A later stream
    sends the newest state: catalog 11, readiness 6, load window 11."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: dict[str, int] = {"catalog": 0, "readiness": 0, "load": 0}

    async def _send(self, stream: Any, plane: str, first: list[Any], later: Any) -> None:
        await stream.recv_message()
        self.streams[plane] += 1
        for msg in first if self.streams[plane] == 1 else [later]:
            await stream.send_message(msg)
            await asyncio.sleep(0.05)
        await asyncio.Event().wait()

    async def _catalog(self, stream: Any) -> None:
        def update(revision: int, pools: list[pb.KvPoolDescriptor]) -> pb.KvPoolCatalogUpdate:
            return pb.KvPoolCatalogUpdate(
                protocol_version=1, relay=S.RELAY, revision=revision, contract_marker=S.MARKER,
                snapshot=pb.KvPoolCatalogSnapshot(pools=pools))  # fmt: skip

        pool = list(self.catalog)
        first = [update(10, pool), update(11, []), update(11, []), update(10, pool)]
        await self._send(stream, "catalog", first, update(11, []))

    async def _readiness(self, stream: Any) -> None:
        def update(revision: int, state: int) -> pb.ServingReadinessUpdate:
            entry = pb.TopologyEntry(namespace="ns", canonical_model_id="m", state=state)
            return pb.ServingReadinessUpdate(
                protocol_version=1, relay=S.RELAY, revision=revision, contract_marker=S.MARKER,
                entries=[entry])  # fmt: skip

        first = [update(5, 2), update(6, 1), update(6, 1), update(5, 2)]
        await self._send(stream, "readiness", first, update(6, 1))

    async def _load(self, stream: Any) -> None:
        def window(sequence: int) -> pb.KvPoolLoadUpdate:
            return pb.KvPoolLoadUpdate(protocol_version=1, relay=S.RELAY, contract_marker=S.MARKER,
                                       window_sequence=sequence, window_ms=60_000)  # fmt: skip

        await self._send(stream, "load", [window(10), window(11), window(11), window(3)],
                         window(11))  # fmt: skip


async def test_a_plane_version_that_goes_backwards_ends_its_stream() -> None:
    """A catalog or readiness revision or a load window below the newest its stream delivered
    ends the stream (``<plane>_end_version_backwards``, the mirror's rule:
    ``plane_rules.plane_version``) and the plane is read again; an equal one is a re-send and
    is taken. The SDK took the stale message as current: a withdrawn pool listed again, a
    revision that was READY, an old window, uncounted."""
    relay = _Backwards()
    server = await S.serve(relay)
    conn = _connect(S.port_of(server))
    seen: dict[str, list[int]] = {"catalog": [], "readiness": [], "load": []}

    async def watch() -> None:
        while True:
            for plane, now in (("catalog", conn.catalog_revision),
                               ("readiness", conn.readiness and conn.readiness.revision),
                               ("load", conn.load and conn.load.window_sequence)):  # fmt: skip
                if now is not None and seen[plane][-1:] != [now]:
                    seen[plane].append(int(now))
            await conn.changed.wait()
            conn.changed.clear()

    watcher = asyncio.ensure_future(watch())
    try:
        await eventually(lambda: all(n >= 2 for n in relay.streams.values()), timeout=5,
                         what="every plane read again")  # fmt: skip
        c = conn.counters
        # the re-sends at the held version were taken: 3 messages of each first stream, 1 later
        # (the second stream's one message comes at the held version: waited for by its count)
        await eventually(
            lambda: (c["catalog_updates"], c["readiness_updates"], c["load_updates"]) == (4, 4, 4),
            timeout=5, what="each plane's message on its second stream",
        )  # fmt: skip
        for plane in ("catalog", "readiness", "load"):
            assert c[f"{plane}_end_{E.VERSION_BACKWARDS}"] == 1, c
        assert conn.slots == {}  # revision 11 withdrew the pool; 10 never listed it again
        assert (conn.readiness.revision, conn.load.window_sequence) == (6, 11)
        assert seen == {"catalog": [10, 11], "readiness": [5, 6], "load": [10, 11]}, seen
    finally:
        watcher.cancel()
        await conn.close()
        server.close()


async def test_a_pool_stream_ended_without_a_status_is_dropped_at_once() -> None:
    """A relay ends a pool stream with END_STREAM on a DATA frame and no trailers: gRPC over
    HTTP/2 makes that an error, reported at once (``no_status``, ``_grpc.NO_STATUS``; a
    relay's own ``UNKNOWN`` is ``status_unknown``); the pool resubscribes on the same channel.
    The SDK waited for trailers that cannot come until the silence limit (30 s by default),
    held the replica as installed meanwhile, ended it ``silent`` and replaced the channel under
    the healthy catalog and plane streams."""
    relay = RawRelay(["no_status"])
    port = await relay.start()
    config = ClientConfig(watch_serving_load=False, backoff_initial_s=0.02, backoff_max_s=0.2)
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", port), config)
    conn.start()
    try:
        await eventually(lambda: conn.drops.get("no_status", 0) == 1, timeout=5,
                         what="the end without a status")  # fmt: skip
        await eventually(lambda: relay.calls["SubscribeKvPool"] == 2 and all(
            s.installed is not None for s in conn.slots.values()), timeout=5,
            what="installed again")  # fmt: skip
        assert set(conn.drops) == {"no_status"}, conn.drops
        values = conn.counter_values()
        assert "channel_resets" not in values and "channel_silent" not in values, values
        assert relay.calls["WatchKvPoolCatalog"] == 1  # its channel and streams were kept
    finally:
        await conn.close()
        await relay.close()
