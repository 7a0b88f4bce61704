"""One rule for a mirror's upstream session: what its health says and what it answers.

A fan-out worker (a mirror) whose ingest process is frozen said NOT_SERVING and went on
answering ``GetRelayInfo`` OK and a new ``WatchKvPoolCatalog`` with the stale catalog: RPC
admission needed only the identity and the catalog, and a catalog stream has no silence bound
once it delivered, while the health followed the readiness and load planes too. docs/scaling.md
("Health follows the upstream") says every RPC is refused meanwhile.

The upstream is a scripted relay whose load plane sends a window every 0.2 s until it is frozen
(its stream stays open, silent, as a stopped process's); the mirror under test is the fan-out
worker's own code (``run_worker``) and an external mirror whose health follows its session as
the daemon's does (``follow_session``). Oracles: ``grpc.health.v1`` and each RPC's status and
reason trailer on the mirror's port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.mirror import Mirror, follow_session
from kvrelay.service.server import RelayServer
from tests.support import scripted_relay as S
from tests.support.health import health, health_becomes
from tests.support.mem_relay import StreamResult, grpclib_collect, sub_request
from tests.support.mirror_rig import (
    Mirrored,
    close_served,
    mirror_of,
    start_mirror,
    start_worker_of,
)
from tests.support.rig import MARKER, SVC
from tests.support.timing import scaled

K = "kv-relay-error-reason"
REFUSED = (Status.UNAVAILABLE, "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE")
WINDOW_S = 0.2


class _Freezable(S.ScriptedRelay):
    """A relay whose load plane sends a window every ``WINDOW_S`` while it runs; ``freeze``
    stops it (every load stream stays open and says nothing, as a stopped process's), ``thaw``
    lets it go on. Its catalog stream stays open and delivers on change."""

    def __init__(self) -> None:
        super().__init__()
        self.running = asyncio.Event()
        self.running.set()
        self.window = 0

    def freeze(self) -> None:
        self.running.clear()

    def thaw(self) -> None:
        self.running.set()

    async def _load(self, stream: Any) -> None:
        await stream.recv_message()
        while True:
            await self.running.wait()
            self.window += 1
            await stream.send_message(
                pb.KvPoolLoadUpdate(
                    protocol_version=1, relay=S.RELAY, window_sequence=self.window,
                    observed_ms=5, window_ms=int(WINDOW_S * 1000),
                    pools=[pb.KvPoolLoadEntry(producer=S.producer(), kv_used_blocks=30,
                                              total_kv_blocks=120, kv_observed_ranks=2,
                                              kv_expected_ranks=2)],
                    contract_marker=MARKER,
                )
            )  # fmt: skip
            await asyncio.sleep(WINDOW_S)


@contextlib.asynccontextmanager
async def _served(mode: str, relay: _Freezable) -> AsyncIterator[tuple[Mirror, RelayServer]]:
    """A mirror of ``relay`` and its server: the worker's own code (``worker``), or a mirror
    whose health follows its session as the daemon keeps it (``mirror``)."""
    upstream = await S.serve(relay)
    cleanup: list[Any] = []
    follow: asyncio.Task[None] | None = None
    mirrored: Mirrored | None = None
    try:
        if mode == "worker":
            server = await start_worker_of(f"127.0.0.1:{S.port_of(upstream)}", RelayLimits(),
                                           cleanup)  # fmt: skip
            mirror = mirror_of(server)
            assert mirror is not None
        else:
            mirrored = await start_mirror(S.port_of(upstream))
            mirror, server = mirrored.mirror, mirrored.server
            follow = asyncio.ensure_future(
                follow_session(mirror, server.health.set_serving, period_s=0.05)
            )
        yield mirror, server
    finally:
        if follow is not None:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
        if mirrored is not None:
            await mirrored.close()
        await close_served(cleanup)
        upstream.close()
        await upstream.wait_closed()


async def _calls(ch: Channel) -> dict[str, StreamResult]:
    """A new call of each RPC the mirror serves (the window planes' first message only)."""
    out = {
        "GetRelayInfo": await grpclib_collect(
            ch, "GetRelayInfo", pb.RelayInfoRequest(contract_marker=MARKER), pb.RelayInfo,
            timeout=5,
        ),
        "SubscribeKvPool": await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(S.producer()), pb.FilterUpdate, limit=1, timeout=5
        ),
    }
    for method, request, reply in (
        ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate),
        ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest,
         pb.ServingReadinessUpdate),
        ("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest, pb.KvPoolLoadUpdate),
    ):  # fmt: skip
        out[method] = await grpclib_collect(
            ch, method, request(subscriber_id="t", contract_marker=MARKER), reply, limit=1,
            timeout=5,
        )
    return out


async def _watch_catalog(ch: Channel, got: list[pb.KvPoolCatalogUpdate]) -> tuple[Any, Any]:
    """A catalog watch kept open: (status, reason trailer) once it ends."""
    async with ch.request(SVC + "WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
                          pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate) as st:  # fmt: skip
        await st.send_message(
            pb.WatchKvPoolCatalogRequest(subscriber_id="open", contract_marker=MARKER), end=True
        )
        while (upd := await st.recv_message()) is not None:
            got.append(upd)
        await st.recv_trailing_metadata()
        trailers = dict(st.trailing_metadata or {})
        return Status.OK, trailers.get(K)


@pytest.mark.parametrize("mode", ["worker", "mirror"])
async def test_a_frozen_upstream_gets_every_new_call_refused_while_health_says_not_serving(
    mode: str,
) -> None:
    """The upstream freezes (its load plane goes silent; the catalog stream stays open, having
    said everything): the health turns NOT_SERVING, and from then on every new call is refused
    ``UNAVAILABLE`` / ``PUBLICATION_UNAVAILABLE`` — ``GetRelayInfo`` and a new catalog watch
    too, which were answered from the stale state. A catalog watch open before goes on (its
    upstream stream does) and takes the next catalog. Once the upstream runs again, health and
    calls come back together."""
    relay = _Freezable()
    async with _served(mode, relay) as (mirror, server):
        ch = Channel("127.0.0.1", server.port)
        watched: list[pb.KvPoolCatalogUpdate] = []
        watch = asyncio.ensure_future(_watch_catalog(ch, watched))
        try:
            assert await health(server.port) == "SERVING"
            before = await _calls(ch)
            assert all(r.status is None and r.messages for r in before.values()), before

            relay.freeze()
            await health_becomes(server.port, "NOT_SERVING")
            assert not mirror.in_session and mirror.catalog.live  # the catalog says nothing
            frozen = await _calls(ch)
            for method, r in frozen.items():
                assert (r.status, r.trailers.get(K)) == REFUSED, (method, r)
                assert r.messages == [], method
            assert await health(server.port) == "NOT_SERVING"
            assert not watch.done() and len(watched) == 1  # open, as its upstream stream is

            relay.thaw()
            await health_becomes(server.port, "SERVING")
            after = await _calls(ch)
            assert all(r.status is None and r.messages for r in after.values()), after
            assert bytes(after["GetRelayInfo"].messages[0]) == bytes(
                before["GetRelayInfo"].messages[0]
            )
            relay.set_catalog([*relay.catalog])  # a new revision: the open watch takes it
            async with asyncio.timeout(scaled(5)):
                while len(watched) < 2:
                    await asyncio.sleep(0.02)
            assert watched[1].revision == relay.catalog_version
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            ch.close()
