"""The mirror's upstream loops against an upstream (or proxy) that ends streams at once or
refuses calls as draining: the SDK's retry rule (``rpc.Backoff``) and the channel counters in
the mirror's stats. Real grpclib upstream on loopback (``tests/support/scripted_relay.py``), the
real mirror with its server (``tests/support/mirror_rig.py``: backoff 0.02 s doubling to 0.5 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from tests.client.test_backoff import _EndsAfterOne, _RefusesAsDraining
from tests.support import scripted_relay as S
from tests.support.fleet import eventually
from tests.support.mem_relay import grpclib_collect, sub_request
from tests.support.mirror_rig import mirrored

WATCH_S = 1.0
#: Streams a loop may open in ``WATCH_S`` with the rig's backoff (about six); without the rule,
#: one per round trip plus 10-40 ms (25-60).
MOST = 20


@pytest.mark.parametrize("plane", ["catalog", "readiness", "load"])
async def test_a_plane_stream_that_ends_after_its_first_message_is_retried_with_backoff(
    plane: str,
) -> None:
    """The mirror's plane loops started their backoff over at every message taken: an upstream
    that ended each stream right after its first message was asked again 25-60 times a second,
    and each ended catalog stream also replaced the channel (a new TCP connection, and every
    plane and pool stream on the old one ended with it). The attempts now start over only after
    a stream that stayed live ``rpc.LIVE_RESUBSCRIBE_S``, as in the SDK."""
    relay = _EndsAfterOne(plane)
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: relay.streams[plane] >= 1, what="first stream", timeout=5)
            await asyncio.sleep(WATCH_S)
            assert relay.streams[plane] >= 3, relay.streams  # it does watch again
            assert relay.streams[plane] < MOST, relay.streams
            assert len(relay.catalog_peers) < MOST, len(relay.catalog_peers)
            assert m.mirror.upstream.resets < MOST, m.mirror.upstream.resets
    finally:
        server.close()


async def test_pools_answered_pool_not_found_do_not_restart_the_catalog() -> None:
    """32 listed pools all answered POOL_NOT_FOUND at once: each pool ends for good (the catalog
    brings the next generation) and the catalog watch is not restarted for them; nothing is
    asked again in a loop."""
    relay = _EndsAfterOne("none", pools=32)
    relay.default = lambda: S.Script([], end=(Status.NOT_FOUND, "POOL_NOT_FOUND"))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: relay.subscriptions >= 32, what="every pool asked", timeout=5)
            await eventually(lambda: not m.mirror._pools, what="every pool ended", timeout=5)
            await asyncio.sleep(0.5)
            assert relay.subscriptions == 32
            assert relay.streams["catalog"] == 1
            assert m.mirror.upstream.resets == 0
            assert m.mirror.stats()["pool_totals"]["end_pool_not_found"] == 32
    finally:
        server.close()


async def test_connections_left_as_draining_are_in_the_mirror_stats() -> None:
    """The upstream channel counts the connections it left because the upstream refused a call
    as draining (``RelayChannel.left_draining``); the mirror's stats did not show it. It is
    ``channel_left_draining`` now, over every channel of the mirror (an ended catalog stream
    replaces the channel)."""
    relay = _RefusesAsDraining()
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: m.mirror.readiness.live, what="readiness", timeout=10)
            left = m.mirror.stats()["channel_left_draining"]
            assert left >= 1, m.mirror.stats()
            relay.end_catalog.set()
            await eventually(lambda: m.mirror.upstream.resets >= 1 and m.mirror.catalog.live,
                             what="the channel replaced", timeout=10)  # fmt: skip
            assert m.mirror.stats()["channel_left_draining"] == left
    finally:
        server.close()


class _ComesBackPlaneByPlane(S.ScriptedRelay):
    """An upstream coming back: its first readiness and load streams are refused
    (RESOURCE_LIMIT), its first catalog stream answers only after ``CATALOG_AFTER_S``, the
    next readiness and load streams ``PLANES_AFTER_S`` after they are opened."""

    CATALOG_AFTER_S = 0.3
    PLANES_AFTER_S = 0.4

    def __init__(self) -> None:
        super().__init__()
        self.streams = {"catalog": 0, "readiness": 0, "load": 0}

    async def _first(self, plane: str, stream: Any, normal: Any) -> None:
        self.streams[plane] += 1
        if self.streams[plane] > 1:
            await asyncio.sleep(self.PLANES_AFTER_S)  # (after the pool's refusal, below)
            await normal(stream)
            return
        if plane == "catalog":
            await asyncio.sleep(self.CATALOG_AFTER_S)
            await normal(stream)
            return
        await stream.recv_message()
        await stream.send_trailing_metadata(
            status=Status.RESOURCE_EXHAUSTED, status_message="full",
            metadata={"kv-relay-error-reason": "RELAY_ERROR_REASON_RESOURCE_LIMIT"},
        )  # fmt: skip

    async def _catalog(self, stream: Any) -> None:
        await self._first("catalog", stream, super()._catalog)

    async def _readiness(self, stream: Any) -> None:
        await self._first("readiness", stream, super()._readiness)

    async def _load(self, stream: Any) -> None:
        await self._first("load", stream, super()._load)


async def test_what_got_nothing_asks_again_once_a_plane_answers() -> None:
    """A relay that comes back serves every plane and pool at once. The mirror's plane loops and
    its pools whose attempt failed each waited out their own backoff (up to ``backoff_max_s``,
    5 s by default): after an upstream outage it served the catalog and ``GetRelayInfo`` while
    it refused readers of the planes still waiting (measured: load and serving load up to 3.1 s
    after the catalog) and subscribers of a pool its catalog listed ("upstream connection lost",
    up to 1.8 s). Each now asks again as soon as a plane stream takes a message. The backoff
    here is 30-60 s: only that rule brings the refused planes and the pool back."""
    relay = _ComesBackPlaneByPlane()
    relay.scripts.append(S.Script([], end=(Status.RESOURCE_EXHAUSTED, "RESOURCE_LIMIT")))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False, backoff_initial_s=60.0,
                            backoff_max_s=60.0) as m:  # fmt: skip
            await eventually(lambda: m.mirror.catalog.live, what="catalog", timeout=2)
            await eventually(lambda: m.mirror.readiness.live and m.mirror.load.live,
                             what="the refused planes again", timeout=2)  # fmt: skip
            assert relay.streams == {"catalog": 1, "readiness": 2, "load": 2}
            await eventually(lambda: m.mirror.hub_for(S.producer()) is not None,
                             what="the refused pool mirrored", timeout=2)  # fmt: skip
            assert relay.subscriptions == 2
            async with m.channel() as ch:  # a router is served the pool
                res = await grpclib_collect(ch, "SubscribeKvPool", sub_request(S.producer()),
                                            pb.FilterUpdate, limit=1, timeout=2)  # fmt: skip
            assert res.status is None and res.messages, res
    finally:
        server.close()
