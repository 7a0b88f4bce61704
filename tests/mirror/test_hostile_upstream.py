"""A mirror against an upstream that misbehaves in ways a frame-by-frame check alone misses.

Each upstream is a small grpclib relay on loopback (``tests/support/scripted_relay.py``; a raw
HTTP/2 one, ``tests/support/raw_relay.py``, for what grpclib never sends) and the mirror is the
real one with its gRPC server: a snapshot that keeps starting over, a relay identity that
changes on one plane while the catalog stream stays open, deltas padded with unknown fields, a
catalog of many small descriptors, a plane it does not implement, a pool stream ended without
a status. Each would leave the mirror without a status or a bound: syncing for ever, without a
catalog, holding more than its queue bound, or with its event loop stopped for seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import structlog
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.pool import PoolState
from kvrelay.publication import cbi1
from tests.client.test_hostile_upstream import MuteFirstCatalog
from tests.support import scripted_relay as S
from tests.support.fleet import eventually
from tests.support.mem_relay import grpclib_collect, sub_request
from tests.support.mirror_rig import mirrored
from tests.support.raw_relay import RawRelay
from tests.support.rig import MARKER, SVC
from tests.support.timing import scaled

TWO_CHUNKS = 1 << 20  # a lane of two snapshot chunks
K = "kv-relay-error-reason"


def two_chunk_producer() -> pb.ProducerIdentity:
    p = S.producer()
    assert p.ckf_format is not None
    p.ckf_format.bucket_count = TWO_CHUNKS
    return p


def first_chunk(seq: int) -> pb.FilterUpdate:
    words = np.zeros(TWO_CHUNKS, dtype=np.uint64)
    chunks = cbi1.encode_snapshot_chunks(
        words, seed=S.SEED, bucket_count=TWO_CHUNKS, dc_id=S.DC_ID, epoch=seq
    )
    return S.frame(1, seq, seq, chunks[0], prod=two_chunk_producer())


class _StartingOver(S.ScriptedRelay):
    """Its pool streams send chunk 0 of a two-chunk lane again and again, never chunk 1."""

    async def _pool(self, stream: Any) -> None:
        await stream.recv_message()
        self.subscriptions += 1
        chunk = first_chunk(10)
        while True:
            await stream.send_message(chunk)
            await asyncio.sleep(0.05)


async def test_a_snapshot_that_starts_over_is_a_violation() -> None:
    """Chunk 0 again while a snapshot is assembled is refused (``snapshot_sequence``). It
    restarted the assembly: each chunk reset the silence clock, so the pool stayed syncing for
    ever, every local subscriber turned away after ``sync_wait_s``, nothing counted."""
    relay = _StartingOver(catalog=[S.descriptor(two_chunk_producer())])
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False, upstream_heartbeat_s=0.5) as m:
            await eventually(lambda: bool(m.mirror._pools), what="pool mirrored", timeout=5)
            (pool,) = m.mirror._pools.values()
            await eventually(lambda: pool.violations.get("snapshot_sequence", 0) >= 1,
                             what="the restart refused", timeout=5)  # fmt: skip
            assert pool.state is not PoolState.LIVE and pool.installs == 0
            assert relay.subscriptions >= 1
    finally:
        server.close()


class _Reincarnated(S.ScriptedRelay):
    """A relay whose identity changes (``renamed``) while the mirror's catalog stream stays
    open: it sends a catalog only to a new watch, as a relay sends one only on change."""

    def __init__(self) -> None:
        super().__init__()
        self.relay = S.RELAY
        self.renamed = asyncio.Event()
        self.catalog_watches = 0

    def _producer(self) -> pb.ProducerIdentity:
        p = S.producer()
        p.producer_incarnation = self.relay.relay_incarnation
        return p

    async def _catalog(self, stream: Any) -> None:
        await stream.recv_message()
        self.catalog_watches += 1
        await stream.send_message(pb.KvPoolCatalogUpdate(
            protocol_version=1, relay=self.relay, revision=1, contract_marker=MARKER,
            snapshot=pb.KvPoolCatalogSnapshot(pools=[S.descriptor(self._producer())])))  # fmt: skip
        await asyncio.Event().wait()

    async def _readiness(self, stream: Any) -> None:
        await stream.recv_message()
        msg = pb.ServingReadinessUpdate(protocol_version=1, relay=self.relay, revision=1,
                                        contract_marker=MARKER)  # fmt: skip
        await stream.send_message(msg)
        if self.relay == S.RELAY:
            await self.renamed.wait()
            self.relay = S.OTHER_RELAY
            msg.relay, msg.revision = self.relay, 2
            await stream.send_message(msg)
        await asyncio.Event().wait()

    async def _load(self, stream: Any) -> None:
        await stream.recv_message()
        window = 1
        while True:
            await stream.send_message(pb.KvPoolLoadUpdate(
                protocol_version=1, relay=self.relay, window_sequence=window, window_ms=200,
                contract_marker=MARKER))  # fmt: skip
            window += 1
            await asyncio.sleep(0.2)

    async def _pool(self, stream: Any) -> None:
        await stream.recv_message()
        self.subscriptions += 1
        for fu in S.snapshot(10):
            fu.relay, fu.producer = self.relay, self._producer()
            await stream.send_message(fu)
        await asyncio.Event().wait()


async def test_a_new_identity_on_one_plane_restarts_every_upstream_stream() -> None:
    """The readiness stream shows a new relay identity first. The mirror ends everything of the
    old one and must read the new one's catalog: its catalog stream, still open, would deliver
    only on the next change, so every upstream stream starts over on a fresh channel. Before,
    the mirror stayed without a catalog (every RPC refused, no pool mirrored) until the
    upstream's catalog changed."""
    relay = _Reincarnated()
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=True, upstream_heartbeat_s=2.0) as m:
            assert m.mirror._identity_key == (7, S.RELAY.relay_incarnation)
            relay.renamed.set()
            await eventually(lambda: m.mirror.identity_changes == 1, what="followed", timeout=5)
            new_key = relay._producer()
            await eventually(lambda: m.mirror.catalog.live
                             and (h := m.mirror.hub_for(new_key)) is not None
                             and h.sequence == 10, what="new session mirrored",
                             timeout=5)  # fmt: skip
            assert m.mirror._identity_key == (7, S.OTHER_RELAY.relay_incarnation)
            assert relay.catalog_watches >= 2
            ch = m.channel()
            try:
                async with ch.request(SVC + "GetRelayInfo", Cardinality.UNARY_UNARY,
                                      pb.RelayInfoRequest, pb.RelayInfo) as st:  # fmt: skip
                    await st.send_message(pb.RelayInfoRequest(contract_marker=MARKER), end=True)
                    got = await st.recv_message()
                assert got is not None and got.relay == S.OTHER_RELAY
            finally:
                ch.close()
    finally:
        server.close()


PAD = 4 << 20  # bytes of an unknown field in each delta


def _padded_delta(base: int, seq: int) -> bytes:
    """A valid delta with a 4 MiB unknown field (number 50) after its known fields."""
    raw = bytes(S.delta(base, seq, buckets=(seq,), words=(seq,)))
    size, length = PAD, bytearray()
    while True:
        low, size = size & 0x7F, size >> 7
        length.append(low | (0x80 if size else 0))
        if not size:
            break
    return raw + bytes([0x92, 0x03]) + bytes(length) + bytes(PAD)


class _Padding(S.ScriptedRelay):
    """Its pool stream sends a snapshot, then (when ``go`` is set) 12 padded deltas."""

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def _pool(self, stream: Any) -> None:
        await stream.recv_message()
        self.subscriptions += 1
        for fu in S.snapshot(10):
            await stream.send_message(bytes(fu))
        await self.go.wait()
        for seq in range(11, 23):
            await stream.send_message(_padded_delta(seq - 1, seq))
        await asyncio.Event().wait()


async def test_forwarded_deltas_count_what_they_hold_in_local_queues() -> None:
    """A local queue counts a frame as its CBI1 payload + 256 bytes. The mirror forwards the
    upstream's bytes, unknown fields included: 12 deltas of 4 MiB each were counted as about
    300 bytes each, so a subscriber that does not read held 48 MiB queued against a 16 MiB
    ``publication_queue_bytes``. Counted by their size, it is ended SUBSCRIBER_LAGGED."""
    relay = _Padding()
    server = Server([relay], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    limits = RelayLimits(publication_queue_bytes=16 << 20)
    try:
        async with mirrored(S.port_of(server), limits=limits) as m:
            ch = m.channel()
            req = pb.SubscribeKvPoolRequest(subscriber_id="slow", expected_producer=S.producer(),
                                            contract_marker=MARKER)  # fmt: skip
            try:
                async with ch.request(
                    SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest,
                    pb.FilterUpdate,
                ) as st:  # fmt: skip
                    await st.send_message(req, end=True)
                    first = await st.recv_message()
                    assert first is not None and int(first.kind) == 1
                    hub = m.mirror.hub_for(S.producer())
                    assert hub is not None
                    relay.go.set()
                    await eventually(lambda: hub.sequence == 22, what="12 deltas", timeout=10)
                    for sub in hub._subs:  # (none once it lagged)
                        held = sum(len(frame) for frame, _cost, _seq in sub._frames)
                        assert held <= limits.publication_queue_bytes, held
                    assert hub.lagged == 1
                    await st.cancel()
            finally:
                ch.close()
    finally:
        server.close()


def _big_catalog(entries: int) -> bytes:
    """A catalog of the one valid pool and ``entries`` empty descriptors (2 bytes each)."""
    head = bytes(pb.KvPoolCatalogUpdate(
        protocol_version=1, relay=S.RELAY, revision=1, contract_marker=MARKER,
        snapshot=pb.KvPoolCatalogSnapshot(pools=[S.descriptor()])))  # fmt: skip
    extra = b"\x0a\x00" * entries  # snapshot.pools: empty KvPoolDescriptor
    size, length = len(extra), bytearray()
    while True:
        low, size = size & 0x7F, size >> 7
        length.append(low | (0x80 if size else 0))
        if not size:
            break
    return head + b"\x22" + bytes(length) + extra  # a second snapshot field merges into one


class _BigCatalog(S.ScriptedRelay):
    def __init__(self, catalog: bytes) -> None:
        super().__init__()
        self.raw = catalog
        self.go = asyncio.Event()

    async def _catalog(self, stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(bytes(self._catalog_update()))
        await self.go.wait()
        await stream.send_message(self.raw)
        await asyncio.Event().wait()

    def _catalog_update(self) -> pb.KvPoolCatalogUpdate:
        return pb.KvPoolCatalogUpdate(
            protocol_version=1, relay=S.RELAY, revision=0, contract_marker=MARKER,
            snapshot=pb.KvPoolCatalogSnapshot(pools=[S.descriptor()]))  # fmt: skip

    async def _readiness(self, stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(bytes(pb.ServingReadinessUpdate(
            protocol_version=1, relay=S.RELAY, revision=1, contract_marker=MARKER)))  # fmt: skip
        await asyncio.Event().wait()

    async def _load(self, stream: Any) -> None:
        await stream.recv_message()
        await stream.send_message(bytes(pb.KvPoolLoadUpdate(
            protocol_version=1, relay=S.RELAY, window_sequence=1, window_ms=60_000,
            contract_marker=MARKER)))  # fmt: skip
        await asyncio.Event().wait()

    async def _pool(self, stream: Any) -> None:
        await stream.recv_message()
        for fu in [*S.snapshot(10), S.delta(10, 11)]:
            await stream.send_message(bytes(fu))
        await asyncio.Event().wait()


async def test_a_large_catalog_is_parsed_off_the_event_loop() -> None:
    """A catalog of 250,000 empty descriptors (500 KB) takes betterproto2 over a second to
    parse. The mirror parsed it on its event loop, so every local stream (deltas, heartbeats,
    snapshots) stopped that long; now it is parsed in a thread, in order, before the mirror
    takes the next catalog message. The loop's longest stall stays a small part of the parse,
    and the catalog is taken whole (its one valid pool mirrored, the rest counted invalid)."""
    entries = 250_000
    relay = _BigCatalog(_big_catalog(entries))
    server = Server([relay], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    try:
        async with mirrored(S.port_of(server), upstream_heartbeat_s=60.0) as m:
            loop = asyncio.get_running_loop()
            stalls: list[float] = []
            done = asyncio.Event()

            async def tick() -> None:
                while not done.is_set():
                    t = loop.time()
                    await asyncio.sleep(0.01)
                    stalls.append(loop.time() - t - 0.01)

            ticker = asyncio.ensure_future(tick())
            t0 = time.monotonic()
            relay.go.set()
            await eventually(lambda: m.mirror.catalog_invalid == entries, timeout=60,
                             what="the large catalog taken")  # fmt: skip
            took = time.monotonic() - t0
            done.set()
            await ticker
            worst = max(stalls)
            assert worst < 0.25 * took, (worst, took)
            assert m.mirror.catalog.live and m.mirror.catalog.upstream_version == 1
            hub = m.mirror.hub_for(S.producer())
            assert hub is not None and hub.sequence == 11
    finally:
        server.close()



async def test_streams_that_end_after_their_snapshot_are_resubscribed_with_backoff() -> None:
    """An upstream that ends every pool stream cleanly right after its snapshot. A live stream
    that ended was resubscribed at once, so the mirror took about 800 snapshots a second from
    it (a whole lane each, up to 128 MiB). A stream that lived less than
    ``rpc.LIVE_RESUBSCRIBE_S`` now backs off like a failed attempt."""
    relay = S.ScriptedRelay()
    relay.default = lambda: S.Script(S.snapshot(10))  # then a clean end
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: relay.subscriptions >= 1, what="subscribed", timeout=5)
            await asyncio.sleep(1.0)
            (pool,) = m.mirror._pools.values()
            assert pool.installs >= 2  # it does resubscribe
            assert relay.subscriptions < 20, relay.subscriptions  # with backoff (0.5 s max here)
    finally:
        server.close()


async def test_a_catalog_stream_that_never_answers_is_opened_again() -> None:
    """The upstream's first catalog stream never answers: it ends ``silent`` after the
    readiness plane's bound and the catalog is watched again, so the mirror synchronizes. It
    used to wait on that stream for ever, refusing every RPC."""
    relay = MuteFirstCatalog()
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False, upstream_heartbeat_s=0.2,
                            upstream_readiness_s=0.2) as m:  # fmt: skip
            await asyncio.wait_for(m.mirror.synced.wait(), 10)
            assert relay.catalog_streams >= 2
            assert m.mirror.plane_ends.get("catalog_silent", 0) >= 1, m.mirror.plane_ends
    finally:
        server.close()


class _KeepsWithdrawn(S.ScriptedRelay):
    """Withdraws its pool from the catalog (``set_catalog([])``) but keeps the pool's open
    streams open, and would serve it to a new one; counts its open pool streams."""

    def __init__(self) -> None:
        super().__init__()
        self.open_streams = 0

    async def _pool(self, stream: Any) -> None:
        self.open_streams += 1
        try:
            await super()._pool(stream)
        finally:
            self.open_streams -= 1


async def _refused_as_withdrawn(ch: Any) -> None:
    r = await grpclib_collect(ch, "SubscribeKvPool", sub_request(S.producer()), pb.FilterUpdate,
                              timeout=5)  # fmt: skip
    assert (r.status, r.trailers[K]) == (Status.NOT_FOUND, "RELAY_ERROR_REASON_POOL_NOT_FOUND")


async def test_a_pool_its_upstream_withdrew_is_stopped_though_its_stream_stays_open() -> None:
    """The upstream's catalog no longer lists the pool, but its pool stream stays open. A relay
    publishes a withdrawal before it ends the pool's streams; the mirror refuses new
    subscribers at once (``POOL_NOT_FOUND``), gives the upstream ``WITHDRAWAL_GRACE_S`` to end
    its stream, then closes it: its local subscriber gets ``PUBLICATION_UNAVAILABLE`` (a
    withdrawn pool's status). The mirror used to serve the pool on, and admit to it."""
    relay = _KeepsWithdrawn()
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server)) as m:
            ch = m.channel()
            try:
                async with asyncio.timeout(scaled(5)):
                    st = ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                                    pb.SubscribeKvPoolRequest, pb.FilterUpdate)  # fmt: skip
                    with pytest.raises(GRPCError) as ended:
                        async with st:
                            await st.send_message(sub_request(S.producer()), end=True)
                            first = await st.recv_message()
                            assert first is not None and int(first.kind) == 1
                            relay.set_catalog([])
                            await eventually(lambda: m.mirror.catalog.upstream_version == 1,
                                             what="withdrawal taken", timeout=5)  # fmt: skip
                            await _refused_as_withdrawn(ch)  # while its stream still runs
                            while await st.recv_message() is not None:
                                pass
                assert ended.value.status == Status.UNAVAILABLE
                assert "withdrawn" in (ended.value.message or "")
                trailers = dict(st.trailing_metadata or {})
                assert trailers[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
                await _refused_as_withdrawn(ch)
                await eventually(lambda: relay.open_streams == 0, what="upstream stream closed",
                                 timeout=5)  # fmt: skip
                assert relay.subscriptions == 1
                assert m.mirror.stats()["pool_totals"].get("end_withdrawn") == 1
                assert m.mirror.hub_for(S.producer()) is None
            finally:
                ch.close()
    finally:
        server.close()


class _WithoutPlane(S.ScriptedRelay):
    """A relay without one plane's RPC (``missing``): grpclib answers it as a method it does
    not have, which the mirror reads as ``UNIMPLEMENTED`` (``_grpc.effective_status``)."""

    def __init__(self, missing: str) -> None:
        super().__init__()
        self.missing = missing

    def __mapping__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__mapping__().items() if k != SVC + self.missing}


@pytest.mark.parametrize(
    ("missing", "request_type", "reply_type"),
    [("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest, pb.ServingReadinessUpdate),
     ("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest, pb.KvPoolLoadUpdate)],
)  # fmt: skip
async def test_a_plane_the_upstream_does_not_implement_is_in_sync_without_it(
    missing: str, request_type: type, reply_type: type
) -> None:
    """An upstream that answers readiness or load ``UNIMPLEMENTED``: the mirror synchronizes
    and serves without it (in session, its health SERVING), answering that RPC
    ``UNIMPLEMENTED`` too. It waited for the plane to deliver and never served at all."""
    server = await S.serve(_WithoutPlane(missing))
    try:
        async with mirrored(S.port_of(server)) as m:  # (waits for the mirror's sync)
            assert m.mirror.in_session and m.mirror.waiting_for() == []
            plane = "readiness" if missing == "SubscribeServingReadiness" else "load"
            assert m.mirror.stats()["planes"][plane]["unsupported"] is True
            ch = m.channel()
            try:
                request = request_type(subscriber_id="t", contract_marker=MARKER)
                answer = await grpclib_collect(ch, missing, request, reply_type, timeout=5)
                assert answer.status == Status.UNIMPLEMENTED, answer
                pool = await grpclib_collect(ch, "SubscribeKvPool", sub_request(S.producer()),
                                             pb.FilterUpdate, limit=1, timeout=5)  # fmt: skip
                assert len(pool.messages) == 1 and int(pool.messages[0].kind) == 1
                # in session without it: every other call is answered (one rule with the health)
                info = await grpclib_collect(ch, "GetRelayInfo",
                                             pb.RelayInfoRequest(contract_marker=MARKER),
                                             pb.RelayInfo, timeout=5)  # fmt: skip
                assert info.status is None and len(info.messages) == 1, info
                catalog = await grpclib_collect(
                    ch, "WatchKvPoolCatalog",
                    pb.WatchKvPoolCatalogRequest(subscriber_id="t", contract_marker=MARKER),
                    pb.KvPoolCatalogUpdate, limit=1, timeout=5,
                )  # fmt: skip
                assert catalog.status is None and len(catalog.messages) == 1, catalog
                other, other_request, other_reply = (
                    ("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest, pb.KvPoolLoadUpdate)
                    if plane == "readiness" else
                    ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest,
                     pb.ServingReadinessUpdate)
                )  # fmt: skip
                served = await grpclib_collect(
                    ch, other, other_request(subscriber_id="t", contract_marker=MARKER),
                    other_reply, limit=1, timeout=5,
                )  # fmt: skip
                assert served.status is None and len(served.messages) == 1, served
            finally:
                ch.close()
    finally:
        server.close()


class _MuteReadiness(S.ScriptedRelay):
    """Its readiness stream never answers."""

    async def _readiness(self, stream: Any) -> None:
        await stream.recv_message()
        await asyncio.Event().wait()


async def _sync_report(mirror: Any) -> list[dict[str, Any]]:
    """The log lines of the mirror's first ``mirror_synchronizing`` report (every 50 ms)."""
    with structlog.testing.capture_logs() as logs:
        report = asyncio.ensure_future(mirror._report_sync(0.05))
        try:
            await eventually(lambda: bool(logs), timeout=5, what="a report")
        finally:
            report.cancel()
    return logs


class _RefusingCatalog(S.ScriptedRelay):
    """Its catalog stream is refused, as an authorizing proxy refuses a mirror it does not know."""

    async def _catalog(self, stream: Any) -> None:
        await stream.recv_message()
        raise GRPCError(Status.PERMISSION_DENIED, "this mirror is not allowed")


async def test_a_mirror_refused_its_catalog_says_how_it_was_refused() -> None:
    """An upstream that refuses the mirror's catalog stream (an authorizing proxy, a catalog
    over ``max_message_bytes``): the mirror retries, serves no port and no metrics page, and
    its log said only that it was synchronizing, at info. It now warns, with each awaited
    plane's last end (``last_ends``)."""
    server = await S.serve(_RefusingCatalog())
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: m.mirror.plane_ends.get("catalog_status_permission_denied",
                                                              0) >= 1,
                             timeout=5, what="a refused catalog")  # fmt: skip
            logs = await _sync_report(m.mirror)
            assert logs[0]["event"] == "mirror_synchronizing"
            assert logs[0]["log_level"] == "warning" and "catalog" in logs[0]["waiting_for"]
            assert logs[0]["last_ends"] == {
                "catalog": "status_permission_denied: this mirror is not allowed"}
    finally:
        server.close()


async def test_a_mirror_waiting_to_synchronize_says_what_it_waits_for() -> None:
    """A mirror that has not synchronized logs what it still waits for
    (``mirror_synchronizing``, ``waiting_for``), every ``SYNC_LOG_S``: an upstream plane that
    never delivers left it not serving, its log saying only that it was synchronizing."""
    server = await S.serve(_MuteReadiness())
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: m.mirror.waiting_for() == ["readiness"], timeout=5,
                             what="everything but readiness")  # fmt: skip
            logs = await _sync_report(m.mirror)
            assert logs[0]["event"] == "mirror_synchronizing"
            assert logs[0]["waiting_for"] == ["readiness"]
            assert logs[0]["upstream"] == f"127.0.0.1:{S.port_of(server)}"
            assert not m.mirror.synced.is_set()
    finally:
        server.close()


async def test_a_pool_stream_ended_without_a_status_ends_at_once() -> None:
    """The upstream ends a pool stream with END_STREAM on a DATA frame and no trailers: the
    mirror ends it at once (``no_status``) and subscribes again on the same channel. It
    waited for trailers that cannot come for three upstream heartbeat periods (30 s here) and
    then replaced the channel of every healthy stream."""
    relay = RawRelay(["no_status"])
    port = await relay.start()
    try:
        async with mirrored(port) as m:
            await eventually(
                lambda: m.mirror.stats()["pool_totals"].get("end_no_status", 0) == 1,
                timeout=5, what="the end without a status",
            )  # fmt: skip
            await eventually(lambda: relay.calls["SubscribeKvPool"] == 2 and all(
                p.state is PoolState.LIVE for p in m.mirror._pools.values()), timeout=5,
                what="live again")  # fmt: skip
            assert m.mirror.upstream.resets == 0
            assert relay.calls["WatchKvPoolCatalog"] == 1
    finally:
        await relay.close()
