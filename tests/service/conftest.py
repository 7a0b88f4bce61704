"""Fixtures: a real RelayServer on loopback over the in-memory RelayView, and a grpcio client.

``start_relay`` runs every contract test three ways: served directly, through a mirror over
TCP, and through a mirror over a UNIX socket that accepts on a listener opened for it (a
``workers = N`` daemon's fan-out worker). ``tests/support/mirror_rig.py`` has the accessors the
tests that look inside the serving relay use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import pytest

from kvrelay.contract.limits import RelayLimits
from kvrelay.service.server import RelayServer
from tests.support.identities import pool_id, producer, relay
from tests.support.mem_relay import GrpcioClient, MemRelayView, StartRelay
from tests.support.mirror_rig import close_served, start_served

__all__ = ["pool_id", "producer", "relay"]  # identity-builder fixtures for the plane wire tests

SERVED = ("direct", "mirror", "workers")


@pytest.fixture(params=SERVED)
async def start_relay(request: pytest.FixtureRequest) -> AsyncIterator[StartRelay]:
    cleanup: list[Any] = []

    async def start(limits: RelayLimits | None = None) -> tuple[MemRelayView, RelayServer]:
        return await start_served(request.param, limits, cleanup)

    yield start
    await close_served(cleanup)


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
