"""A relay drains (shuts down gracefully) while subscribers wait for their admission: its own
waiting subscribers and a mirror's subscribers waiting for the mirror's sync of that pool end
the same way, with a clean OK.

Real parts: the in-memory relay behind its gRPC server, a real ``Mirror`` over loopback, grpclib
clients. The upstream's admission of the pool waits until the test lets it go (as a relay's
waits for a snapshot slot), so the drain finds it in progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import rpc
from kvrelay.publication.hub import Subscription
from kvrelay.service.server import RelayServer
from tests.support.fleet import eventually
from tests.support.mem_relay import (
    MemRelayView,
    StreamResult,
    grpclib_channel,
    grpclib_collect,
    sub_request,
)
from tests.support.mirror_rig import UPSTREAM_LIMITS, start_mirror
from tests.support.timing import scaled


class SlowAdmission(MemRelayView):
    """Admits a pool subscriber only once ``admit`` is set; counts those waiting."""

    def __init__(self) -> None:
        super().__init__(UPSTREAM_LIMITS)
        self.admit = asyncio.Event()
        self.waiting = 0

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        self.waiting += 1
        try:
            await self.admit.wait()
        finally:
            self.waiting -= 1
        return await super().open_pool(expected, on_release)


async def _subscribe(port: int, producer: pb.ProducerIdentity, who: str) -> StreamResult:
    async with grpclib_channel(port) as ch:
        return await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(producer, who), pb.FilterUpdate, timeout=10
        )


async def test_an_upstream_drain_ends_a_mirror_admission_as_it_ends_its_own() -> None:
    """The mirror's subscriber waited for the mirror's sync, which waited for the upstream's
    admission; the upstream drains. The upstream's own waiting subscriber ends OK, with
    nothing sent (contract §4.8 in docs/contract.md); the mirror's got PUBLICATION_UNAVAILABLE
    ("upstream ended the stream before its snapshot"), which a router takes for a failure."""
    view = SlowAdmission()
    producer = view.add_pool("p", 4096).producer
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    mirrored = await start_mirror(upstream.port, sync=False)
    try:
        await eventually(lambda: mirrored.mirror.catalog.live, what="the mirror's session")
        direct = asyncio.ensure_future(_subscribe(upstream.port, producer, "direct"))
        through = asyncio.ensure_future(_subscribe(mirrored.port, producer, "through"))
        pools = mirrored.mirror._pools.values()
        await eventually(lambda: view.waiting == 2 and any(p._waiting for p in pools),
                         what="both admissions in progress")  # fmt: skip
        await upstream.close(grace_s=scaled(2))
        own, mirror = await direct, await through
        assert (own.status, own.messages) == (None, []), own
        assert (mirror.status, mirror.message, mirror.messages) == (None, None, []), mirror
    finally:
        await mirrored.close()
        await upstream.close(grace_s=0.1)


async def test_an_upstream_drain_ends_every_plane_through_the_mirror_cleanly() -> None:
    """The upstream drains: its catalog stream ends cleanly, and the mirror opens a fresh
    channel for what comes next. It closed the old one at once, before the readiness, load and
    serving-load streams on it had read their own clean ends, so those ended as a lost
    connection and the mirror's subscribers got UNAVAILABLE / PUBLICATION_UNAVAILABLE where the
    upstream's own got OK. Every plane through the mirror now ends OK, as directly."""
    view = MemRelayView(UPSTREAM_LIMITS)
    view.add_pool("p", 4096)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    mirrored = await start_mirror(upstream.port, sync=False)
    planes = (
        ("WatchKvPoolCatalog", rpc.catalog_request, pb.KvPoolCatalogUpdate),
        ("SubscribeServingReadiness", rpc.readiness_request, pb.ServingReadinessUpdate),
        ("SubscribeKvPoolLoad", rpc.load_request, pb.KvPoolLoadUpdate),
        ("SubscribeServingLoad", rpc.serving_load_request, pb.ServingLoadUpdate),
    )
    try:
        m = mirrored.mirror
        await eventually(lambda: all(p.live for p in (m.catalog, m.readiness, m.load,
                                                      m.serving_load)),
                         what="every plane of the mirror's session")  # fmt: skip

        async def read(port: int, method: str, req: Any, reply: type) -> StreamResult:
            async with grpclib_channel(port) as ch:
                return await grpclib_collect(ch, method, req(f"drain-{port}"), reply, timeout=10)

        streams = {(where, method): asyncio.ensure_future(read(port, method, req, reply))
                   for where, port in (("direct", upstream.port), ("mirror", mirrored.port))
                   for method, req, reply in planes}  # fmt: skip
        def in_use(server: RelayServer) -> list[int]:
            s = server.service
            return [p.in_use for p in (s.catalog_permits, s.readiness_permits, s.load_permits,
                                       s.serving_load_permits)]  # fmt: skip

        await eventually(lambda: min(in_use(upstream)) >= 2 and min(in_use(mirrored.server)) >= 1,
                         what="every stream open, direct and through the mirror")  # fmt: skip
        # the drain ends the catalog stream first, the others a moment later (here, the catalog
        # alone, then the drain): the mirror opens a fresh channel at the catalog's end
        resets = m.upstream.resets
        view.catalog.end()
        await eventually(lambda: m.upstream.resets > resets, what="the mirror left the channel")
        await asyncio.sleep(0.2)  # (the old channel's streams were cut here)
        await upstream.close(grace_s=scaled(2))
        ends = {k: (r.status, r.message) for k, r in
                zip(streams, await asyncio.gather(*streams.values()), strict=True)}  # fmt: skip
        assert all(v == (None, None) for v in ends.values()), ends
    finally:
        await mirrored.close()
        await upstream.close(grace_s=0.1)
