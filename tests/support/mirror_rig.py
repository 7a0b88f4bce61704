"""Serving the in-memory relay through a mirror, for the service contract tests.

``start_served`` puts a real ``Mirror`` (gRPC over loopback, or over a UNIX socket the way a
``workers = N`` daemon's fan-out workers read their ingest process) in front of a
``MemRelayView``: the tests talk to the mirror's server and drive the upstream view. The
upstream gets generous limits (the mirror must never be the one that lags); the limits a test
asks for are the mirror's own, applied to its own subscribers.

A few tests look inside the serving relay (its hub, its limits) or need the mirror to have
caught up with a change made upstream: ``served_hub``, ``set_limits`` and ``settle`` do that in
every mode (``settle`` is a no-op when the relay is served directly). ``start_worker`` runs the
fan-out worker's own code (``run_worker`` and its JSON spec) in this process, and
``restart_source`` restarts the relay a mode serves (the mirror's upstream when mirrored).

An upstream view publishes no window by itself: a mirror drops an upstream load or serving-load
stream silent for three stated periods (3 s at ``window_ms = 1000``), and is out of session (it
refuses every RPC, as its health says) until it has opened it again, so the upstream views here
state a longer period (``QUIET_WINDOW_MS``), and so does any long-lived rig of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from ssl import SSLContext
from typing import Any

from grpclib.client import Channel

from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.mirror import Mirror
from kvrelay.mirror.settings import MirrorSettings, UpstreamAddress
from kvrelay.ops.front import internal_limits
from kvrelay.ops.report_pipe import ReportPipe
from kvrelay.ops.supervisor import shared_listener
from kvrelay.ops.tls import ServerTlsFiles
from kvrelay.ops.worker import WorkerControl, WorkerSpec, rules_json, run_worker
from kvrelay.publication.hub import PublicationHub
from kvrelay.service.authz import Authorization, AuthorizationRule
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import Generation, MemRelayView
from tests.support.timing import scaled

#: Upstream limits in mirror modes: one mirror stream per pool must never lag.
UPSTREAM_LIMITS = RelayLimits(publication_queue_capacity=1024, publication_queue_bytes=64 << 20)
#: The window period an upstream view states in mirror modes (``MemRelayView(window_ms=…)``):
#: it publishes no window by itself, and its mirror must not call it silent mid-test.
QUIET_WINDOW_MS = 600_000


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
    mode: str,
    limits: RelayLimits | None,
    cleanup: list[Any],
    *,
    ssl: SSLContext | None = None,
    authorization: Authorization | None = None,
) -> tuple[MemRelayView, RelayServer]:
    """``direct``: the view's own server. ``mirror``: a mirror over TCP. ``workers``: a mirror
    over a UNIX socket, accepting on a listener opened for it (``shared_listener``), the worker
    topology of a daemon. ``ssl`` and ``authorization`` are the serving server's (a mirror's
    upstream has neither, as a worker's ingest process has none on its internal socket)."""
    if mode == "direct":
        view = MemRelayView(limits)
        server = RelayServer(view, limits)
        server.service.set_authorization(authorization)
        await server.start("127.0.0.1", 0, ssl=ssl)
        cleanup.append(server)
        return view, server
    view = MemRelayView(UPSTREAM_LIMITS, window_ms=QUIET_WINDOW_MS)
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
    server.service.set_authorization(authorization)
    shared = shared_listener("127.0.0.1", 0) if mode == "workers" else None
    await server.start("127.0.0.1", 0, ssl=ssl, sock=shared)
    cleanup.extend([server, mirror, upstream])
    if mode == "workers":
        cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
    await asyncio.wait_for(mirror.synced.wait(), scaled(10))
    return view, server


class _Worker:
    """A fan-out worker run in this process (``run_worker``), and what it was given."""

    def __init__(self, task: asyncio.Task[int], stop: asyncio.Event, pipe: tuple[int, int],
                 out: ReportPipe) -> None:  # fmt: skip
        self.task, self._stop, self._pipe, self._out = task, stop, pipe, out

    async def stop(self) -> None:
        self._stop.set()
        try:
            await asyncio.wait_for(self.task, scaled(10))
        finally:
            self._out.close(timeout_s=0.5)
            for fd in self._pipe:
                os.close(fd)


async def start_worker(
    limits: RelayLimits,
    cleanup: list[Any],
    *,
    tls: ServerTlsFiles | None = None,
    rules: tuple[AuthorizationRule, ...] | None = None,
) -> tuple[MemRelayView, RelayServer]:
    """A ``workers = 2`` daemon's topology with the worker's own code: the view served on a
    UNIX socket under ``internal_limits`` (the ingest process), and ``run_worker`` given the
    JSON ``WorkerSpec`` the supervisor writes (limits, TLS files, rules), accepting on a shared
    listener. Returns the view and the worker's server."""
    view = MemRelayView(UPSTREAM_LIMITS, window_ms=QUIET_WINDOW_MS)
    ingest = RelayServer(view, internal_limits(limits, 2))
    folder = tempfile.mkdtemp(prefix="kvrelay-test-")
    path = os.path.join(folder, "ingest.sock")
    await ingest.start_unix(path)
    cleanup.extend([ingest, lambda: shutil.rmtree(folder, ignore_errors=True)])
    return view, await start_worker_of(f"unix:{path}", limits, cleanup, tls=tls, rules=rules)


async def start_worker_of(
    upstream: str,
    limits: RelayLimits,
    cleanup: list[Any],
    *,
    tls: ServerTlsFiles | None = None,
    rules: tuple[AuthorizationRule, ...] | None = None,
) -> RelayServer:
    """``run_worker`` of ``upstream`` (``unix:/path`` or ``HOST:PORT``: any relay this
    process serves), as ``start_worker`` runs it; returns the worker's server once it listens."""
    listener = shared_listener("127.0.0.1", 0)
    spec = WorkerSpec(
        index=1, upstream=upstream, host="127.0.0.1", port=0,
        listen_fd=os.dup(listener.fileno()), limits=dataclasses.asdict(limits),
        tls=None if tls is None else tls.as_json(), authorization=rules_json(rules),
        shutdown_timeout_s=2.0, stats_interval_s=60.0,
    )  # fmt: skip
    listener.close()
    spec = WorkerSpec.from_json(spec.to_json())  # as it crosses the pipe
    pipe = os.pipe()
    out = ReportPipe(pipe[1])
    control = WorkerControl(spec.authorization)
    stop = asyncio.Event()
    worker = _Worker(asyncio.ensure_future(run_worker(spec, stop, out, control)), stop, pipe, out)
    cleanup.insert(0, worker)  # stopped before its ingest process

    async with asyncio.timeout(scaled(15)):
        while control.server is None or control.server._port in (None, 0):
            if worker.task.done():
                worker.task.result()
                raise AssertionError("the worker exited")
            await asyncio.sleep(0.01)
    server: RelayServer = control.server
    return server


async def restart_source(
    server: RelayServer, cleanup: list[Any], incarnation: int
) -> tuple[MemRelayView, RelayServer]:
    """Restart what ``server`` serves, as a relay restarts: the relay itself when served
    directly (drained, then a new one on the same port), else the mirror's upstream (on the
    same address, without TLS or rules); the new relay has an empty view of ``incarnation``.
    Returns it and the server routers now reach."""
    mirror = mirror_of(server)
    old = server if mirror is None else next(
        s for s in cleanup if isinstance(s, RelayServer) and s is not server
    )  # fmt: skip
    port, limits = old.port, old.service.limits
    await old.close(grace_s=1.0)
    window_ms = 1000 if mirror is None else QUIET_WINDOW_MS
    view = MemRelayView(limits, incarnation, window_ms=window_ms)
    new = RelayServer(view, limits)
    cleanup[cleanup.index(old)] = new
    if mirror is not None and mirror.settings.upstream.path is not None:
        await new.start_unix(mirror.settings.upstream.path)
    else:
        await new.start("127.0.0.1", port)
    return view, new if mirror is None else server


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
