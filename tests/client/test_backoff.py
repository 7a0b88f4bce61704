"""The SDK's retry rule for every stream loop against relays (or proxies) that end streams at
once, and the channel counters its ``counters()`` shows. Real grpclib relay on loopback
(``tests/support/scripted_relay.py``), the SDK's own ``RelayConnection`` / ``RelayClient``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpclib.const import Status

from kvrelay._grpc import DRAINING_MESSAGE
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import rpc
from kvrelay.client.client import RelayClient
from kvrelay.client.config import ClientConfig
from kvrelay.client.connection import RelayConnection
from tests.support import scripted_relay as S
from tests.support.fleet import eventually

WATCH_S = 1.0
#: Streams a loop may open in ``WATCH_S`` with the test's backoff (0.02 s doubling up to
#: 0.5 s: about six); without the rule, one per round trip plus 10-20 ms (fifty or more).
MOST = 20


class _EndsAfterOne(S.ScriptedRelay):
    """Its ``plane`` streams (catalog, readiness or load) end cleanly right after their first
    message; everything else is served as a relay does. Counts each plane's streams and the
    TCP connections the catalog streams came on."""

    def __init__(self, plane: str, pools: int = 1) -> None:
        catalog = []
        for i in range(pools):
            d = S.descriptor(S.producer(dc_id=S.DC_ID + i))
            assert d.serving_endpoint is not None
            d.serving_endpoint.endpoint = f"gen{i}"
            catalog.append(d)
        super().__init__(catalog=catalog)
        self.plane = plane
        self.streams = {"catalog": 0, "readiness": 0, "load": 0}
        self.catalog_peers: set[Any] = set()

    def _msg(self, plane: str) -> Any:
        common: dict[str, Any] = {"protocol_version": 1, "relay": S.RELAY,
                                  "contract_marker": S.MARKER}  # fmt: skip
        if plane == "catalog":
            snap = pb.KvPoolCatalogSnapshot(pools=list(self.catalog))
            return pb.KvPoolCatalogUpdate(revision=1, snapshot=snap, **common)
        if plane == "readiness":
            return pb.ServingReadinessUpdate(revision=1, **common)
        return pb.KvPoolLoadUpdate(window_sequence=1, window_ms=1000, **common)

    async def _serve(self, plane: str, stream: Any, normal: Any) -> None:
        self.streams[plane] += 1
        if plane != self.plane:
            await normal(stream)
            return
        await stream.recv_message()
        await stream.send_message(self._msg(plane))  # then a clean end (status OK)

    async def _catalog(self, stream: Any) -> None:
        self.catalog_peers.add(stream.peer.addr())
        await self._serve("catalog", stream, super()._catalog)

    async def _readiness(self, stream: Any) -> None:
        await self._serve("readiness", stream, super()._readiness)

    async def _load(self, stream: Any) -> None:
        await self._serve("load", stream, super()._load)


def _config() -> ClientConfig:
    return ClientConfig(watch_serving_load=False, backoff_initial_s=0.02, backoff_max_s=0.5)


@pytest.mark.parametrize("plane", ["catalog", "readiness", "load"])
async def test_a_plane_stream_that_ends_after_its_first_message_is_retried_with_backoff(
    plane: str,
) -> None:
    """The catalog and plane loops started their backoff over at every message taken: a relay
    that ended each stream right after its first message was asked again every 10-20 ms here
    (50-100 ms with the defaults), and each ended catalog stream also opened a new connection.
    They follow the pool loop's rule now: the attempts start over only after a stream that
    stayed live ``rpc.LIVE_RESUBSCRIBE_S``."""
    relay = _EndsAfterOne(plane)
    server = await S.serve(relay)
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", S.port_of(server)), _config())
    conn.start()
    try:
        await eventually(lambda: relay.streams[plane] >= 1, what="first stream", timeout=5)
        await asyncio.sleep(WATCH_S)
        assert relay.streams[plane] >= 3, relay.streams  # it does watch again
        assert relay.streams[plane] < MOST, relay.streams
        assert len(relay.catalog_peers) < MOST, len(relay.catalog_peers)
    finally:
        await conn.close()
        server.close()


async def test_pools_answered_pool_not_found_restart_the_catalog_with_its_backoff() -> None:
    """Each pool answered POOL_NOT_FOUND (or PRODUCER_CHANGED) re-reads the catalog: the watch
    restarted at once, without backoff, once per pool and answer (32 pools: tens of restarts a
    second). A restart now waits for the catalog's backoff, and the pools that ask meanwhile
    share it (``catalog_refreshes_coalesced``)."""
    relay = _EndsAfterOne("none", pools=32)
    relay.default = lambda: S.Script([], end=(Status.NOT_FOUND, "POOL_NOT_FOUND"))
    server = await S.serve(relay)
    conn = RelayConnection(rpc.RelayAddress("127.0.0.1", S.port_of(server)), _config())
    conn.start()
    try:
        await eventually(lambda: relay.subscriptions >= 32, what="every pool asked", timeout=5)
        before = relay.streams["catalog"]
        await asyncio.sleep(WATCH_S)
        restarts = relay.streams["catalog"] - before
        assert relay.subscriptions >= 100, relay.subscriptions  # the pools do ask again
        assert 1 <= restarts < MOST, restarts
        assert conn.counters["catalog_refreshes_coalesced"] > conn.counters["catalog_refreshes"]
        assert len(conn.slots) == 32  # the catalog still lists them all
    finally:
        await conn.close()
        server.close()


class _RefusesAsDraining(S.ScriptedRelay):
    """Refuses its first readiness calls as a draining relay does (``UNAVAILABLE``, "shutting
    down", trailers only); its first catalog stream ends cleanly once ``end_catalog`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.readiness_calls = 0
        self.catalog_streams = 0
        self.end_catalog = asyncio.Event()

    async def _readiness(self, stream: Any) -> None:
        self.readiness_calls += 1
        if self.readiness_calls <= 2:
            await stream.recv_message()
            await stream.send_trailing_metadata(
                status=Status.UNAVAILABLE, status_message=f"the relay is {DRAINING_MESSAGE}",
                metadata={"kv-relay-error-reason": "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"},
            )  # fmt: skip
            return
        await super()._readiness(stream)

    async def _catalog(self, stream: Any) -> None:
        self.catalog_streams += 1
        if self.catalog_streams > 1:
            await super()._catalog(stream)
            return
        await stream.recv_message()
        await stream.send_message(pb.KvPoolCatalogUpdate(
            protocol_version=1, relay=S.RELAY, revision=1,
            snapshot=pb.KvPoolCatalogSnapshot(pools=list(self.catalog)), contract_marker=S.MARKER,
        ))  # fmt: skip
        await self.end_catalog.wait()


async def test_connections_left_as_draining_are_in_the_client_counters() -> None:
    """The channel counts the connections it left because the relay refused a call as draining
    (``RelayChannel.left_draining``); ``client.counters()`` did not show it. It is
    ``channel_left_draining`` now, over every channel of the relay's session (an ended catalog
    stream replaces the channel)."""
    relay = _RefusesAsDraining()
    server = await S.serve(relay)
    client = RelayClient([f"127.0.0.1:{S.port_of(server)}"], config=_config())
    (conn,) = client.connections
    await client.start()
    try:
        await eventually(lambda: conn.readiness is not None, what="readiness", timeout=10)
        left = client.counters()[conn.name].get("channel_left_draining", 0)
        assert left >= 1, client.counters()
        relay.end_catalog.set()
        await eventually(lambda: conn.counters["channel_resets"] >= 1 and bool(conn.slots),
                         what="the channel replaced", timeout=10)  # fmt: skip
        assert client.counters()[conn.name]["channel_left_draining"] == left
    finally:
        await client.close()
        server.close()


async def test_a_relay_drain_drops_the_pools_as_eof_not_as_a_lost_connection() -> None:
    """The relay drains: its catalog stream ends cleanly first, and the SDK opens a fresh
    channel at that end. It closed the old one at once, before the pool streams on it had read
    their own clean ends: their drops said ``connection`` where the relay said OK (``eof``, as
    the drop table promises for a drain). The old channel is now closed once its streams have
    read their ends, 5 s at most, as the mirror's is."""
    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MemRelayView

    view = MemRelayView()
    view.add_pool("p", 4096)
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    client = RelayClient([f"127.0.0.1:{server.port}"], config=_config())
    (conn,) = client.connections
    await client.start()
    try:
        await eventually(lambda: any(s.installed is not None for s in conn.slots.values()),
                         what="the pool installed", timeout=10)  # fmt: skip
        resets = conn.counters["channel_resets"]
        view.catalog.end()  # the drain ends the catalog first, the pool streams a moment later
        await eventually(lambda: conn.counters["channel_resets"] > resets,
                         what="the channel replaced", timeout=10)  # fmt: skip
        await asyncio.sleep(0.2)  # (the old channel's pool stream was cut here)
        await server.close(grace_s=2.0)
        await eventually(lambda: sum(conn.drops.values()) >= 1, what="the pool dropped",
                         timeout=10)  # fmt: skip
        assert dict(conn.drops) == {"eof": 1}, conn.drops
    finally:
        await client.close()
        await server.close(grace_s=0.1)
