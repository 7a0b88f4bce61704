"""A mirror's pool stream started on the upstream channel the mirror replaces as it connects,
over real loopback gRPC against a real ``RelayServer``.

A pool stream whose upstream connection dropped resubscribes at once (it lived
``rpc.LIVE_RESUBSCRIBE_S``) on the channel it ran on, often just before the catalog stream's end
makes the mirror replace (and close) that channel. The closed channel refuses the call
(``RelayChannel``: it ran on a connection nobody owned, one more per drop); the pool stream is
made again at once on the current channel, never a failed attempt with its backoff."""

from __future__ import annotations

import asyncio

from kvrelay.client import rpc
from kvrelay.mirror.settings import UpstreamAddress
from kvrelay.mirror.upstream import Upstream
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import MemRelayView
from tests.support.mirror_rig import UPSTREAM_LIMITS, mirror_settings


async def test_a_pool_stream_whose_channel_is_replaced_as_it_connects_follows_at_once() -> None:
    view = MemRelayView(UPSTREAM_LIMITS)
    gen = view.add_pool("p0", 64)
    server = RelayServer(view, UPSTREAM_LIMITS)
    await server.start("127.0.0.1", 0)
    up = Upstream(mirror_settings(UpstreamAddress(host="127.0.0.1", port=server.port), None))
    first = asyncio.Event()
    try:
        old = up.channel
        request = rpc.pool_request("t", gen.producer)
        stream = asyncio.create_task(up.stream(
            "SubscribeKvPool", request, lambda _frame: first.set(), follow=True
        ))  # fmt: skip
        await asyncio.sleep(0)  # the stream's call is connecting on ``old``
        up.reset()  # (the catalog stream ended: a fresh channel, ``old`` closed)
        came = asyncio.create_task(first.wait())
        await asyncio.wait({came, stream}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert first.is_set(), stream.result() if stream.done() else "no snapshot in 10 s"
        came.cancel()  # its snapshot came, on the current channel:
        assert up.followed == 1
        assert old._protocol is None, "the replaced channel made no connection"
        assert up.channel._protocol is not None
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
    finally:
        up.close()
        await server.close(grace_s=0.5)
