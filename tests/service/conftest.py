"""Fixtures: a real RelayServer on loopback over the in-memory RelayView, and a grpcio client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import ModuleType

import pytest

from kvrelay.contract.limits import RelayLimits
from kvrelay.service.server import RelayServer
from tests.support.identities import pool_id, producer, relay
from tests.support.mem_relay import GrpcioClient, MemRelayView, StartRelay

__all__ = ["pool_id", "producer", "relay"]  # identity-builder fixtures for the plane wire tests


@pytest.fixture
async def start_relay() -> AsyncIterator[StartRelay]:
    servers: list[RelayServer] = []

    async def start(limits: RelayLimits | None = None) -> tuple[MemRelayView, RelayServer]:
        view = MemRelayView(limits)
        server = RelayServer(view, limits)
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return view, server

    yield start
    for s in servers:
        await s.close(grace_s=1.0)


@pytest.fixture
async def grpcio_client(
    official_pb2: dict[str, ModuleType],
) -> AsyncIterator[Callable[[int], GrpcioClient]]:
    clients: list[GrpcioClient] = []

    def make(port: int) -> GrpcioClient:
        c = GrpcioClient(official_pb2, port)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()
