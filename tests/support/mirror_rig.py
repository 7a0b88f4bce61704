"""Serving the in-memory relay through a mirror, for the service contract tests.

``start_served`` puts a real ``Mirror`` (gRPC over loopback, or over a UNIX socket the way a
``workers = N`` daemon's fan-out workers read their ingest process) in front of a
``MemRelayView``: the tests talk to the mirror's server and drive the upstream view. The
upstream gets generous limits (the mirror must never be the one that lags); the limits a test
asks for are the mirror's own, applied to its own subscribers.

A few tests look inside the serving relay (its hub, its limits) or need the mirror to have
caught up with a change made upstream: ``served_hub``, ``set_limits`` and ``settle`` do that in
every mode (``settle`` is a no-op when the relay is served directly).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

from grpclib.client import Channel

from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.mirror import Mirror
from kvrelay.mirror.settings import MirrorSettings, UpstreamAddress
from kvrelay.ops.supervisor import shared_listener
from kvrelay.publication.hub import PublicationHub
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import Generation, MemRelayView
from tests.support.timing import scaled

#: Upstream limits in mirror modes: one mirror stream per pool must never lag.
UPSTREAM_LIMITS = RelayLimits(publication_queue_capacity=1024, publication_queue_bytes=64 << 20)


def mirror_settings(upstream: UpstreamAddress, limits: RelayLimits | None) -> MirrorSettings:
    return MirrorSettings(
        upstream=upstream,
        limits=limits or RelayLimits(),
        subscriber_id="test-mirror",
        sync_wait_s=5.0,
        backoff_initial_s=0.02,
        backoff_max_s=0.5,
    )


async def start_served(
    mode: str, limits: RelayLimits | None, cleanup: list[Any]
) -> tuple[MemRelayView, RelayServer]:
    """``direct``: the view's own server. ``mirror``: a mirror over TCP. ``workers``: a mirror
    over a UNIX socket, accepting on a listener opened for it (``shared_listener``), the worker
    topology of a daemon."""
    if mode == "direct":
        view = MemRelayView(limits)
        server = RelayServer(view, limits)
        await server.start("127.0.0.1", 0)
        cleanup.append(server)
        return view, server
    view = MemRelayView(UPSTREAM_LIMITS)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    if mode == "workers":
        folder = tempfile.mkdtemp(prefix="kvrelay-test-")
        path = os.path.join(folder, "ingest.sock")
        await upstream.start_unix(path)
        address = UpstreamAddress(path=path)
    else:
        await upstream.start("127.0.0.1", 0)
        address = UpstreamAddress(host="127.0.0.1", port=upstream.port)
    mirror = Mirror(mirror_settings(address, limits))
    mirror.start()
    server = RelayServer(mirror, limits)
    shared = shared_listener("127.0.0.1", 0) if mode == "workers" else None
    await server.start("127.0.0.1", 0, sock=shared)
    cleanup.extend([server, mirror, upstream])
    if mode == "workers":
        cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
    await asyncio.wait_for(mirror.synced.wait(), scaled(10))
    return view, server


async def close_served(cleanup: list[Any]) -> None:
    for item in cleanup:
        if isinstance(item, RelayServer):
            await item.close(grace_s=1.0)
        elif callable(item):
            item()
        else:
            await item.stop()


def mirror_of(server: RelayServer) -> Mirror | None:
    view = server.service.view
    return view if isinstance(view, Mirror) else None


def is_direct(server: RelayServer) -> bool:
    return mirror_of(server) is None


def served_hub(server: RelayServer, gen: Generation) -> PublicationHub | None:
    """The hub that serves this server's subscribers of ``gen``."""
    mirror = mirror_of(server)
    return gen.hub_or_none if mirror is None else mirror.hub_for(gen.producer)


def set_limits(view: MemRelayView, server: RelayServer, limits: RelayLimits) -> None:
    """Change the serving relay's hub limits mid-test."""
    view.limits = limits
    mirror = mirror_of(server)
    if mirror is not None:
        mirror.limits = limits


async def settle(view: MemRelayView, server: RelayServer, timeout: float = 5.0) -> None:
    """Wait until the mirror holds what the upstream view holds now: plane versions, and every
    live generation at its sequence (no-op when served directly)."""
    mirror = mirror_of(server)
    if mirror is None:
        return

    def caught_up() -> bool:
        for plane, mine in (
            (view.catalog, mirror.catalog),
            (view.readiness, mirror.readiness),
            (view.load, mirror.load),
            (view.serving_load, mirror.serving_load),
        ):
            if mine.upstream_version != plane.current()[0]:
                return False
        for gen in view.pools.values():
            if gen.retired:
                continue
            hub = mirror.hub_for(gen.producer)
            if hub is None or hub.sequence != gen.sequence:
                return False
        return True

    async with asyncio.timeout(scaled(timeout)):
        while not caught_up():
            await asyncio.sleep(0.005)


class Mirrored:
    """A mirror of the relay at ``upstream`` and its gRPC server on loopback."""

    def __init__(self, mirror: Mirror, server: RelayServer) -> None:
        self.mirror = mirror
        self.server = server

    @property
    def port(self) -> int:
        return self.server.port

    def channel(self) -> Channel:
        return Channel("127.0.0.1", self.port)

    async def close(self) -> None:
        await self.server.close(grace_s=1.0)
        await self.mirror.stop()


async def start_mirror(
    upstream: UpstreamAddress | int, *, port: int = 0, limits: RelayLimits | None = None,
    sync: bool = True, **settings: Any,
) -> Mirrored:  # fmt: skip
    """Mirror ``upstream`` (an address, or a loopback port) and serve it on ``port``."""
    address = (
        UpstreamAddress(host="127.0.0.1", port=upstream) if isinstance(upstream, int) else upstream
    )
    base = mirror_settings(address, limits)
    mirror = Mirror(dataclasses.replace(base, **settings))
    mirror.start()
    server = RelayServer(mirror, base.limits)
    await server.start("127.0.0.1", port)
    if sync:
        await asyncio.wait_for(mirror.synced.wait(), scaled(15))
    return Mirrored(mirror, server)


@contextlib.asynccontextmanager
async def mirrored(upstream: UpstreamAddress | int, **kw: Any) -> AsyncIterator[Mirrored]:
    m = await start_mirror(upstream, **kw)
    try:
        yield m
    finally:
        await m.close()
