"""``grpc.health.v1`` as a client on a relay's (or a mirror's, a worker's) port reads it."""

from __future__ import annotations

import asyncio

from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from tests.support.timing import scaled

SERVICE = "dynamo.kvrelay.v1.KvEventRelay"


async def health(port: int) -> str:
    """The relay service's status on ``127.0.0.1:port`` (``SERVING``, ``NOT_SERVING``, ...)."""
    async with Channel("127.0.0.1", port) as ch:
        async with asyncio.timeout(scaled(5)):
            async with ch.request("/grpc.health.v1.Health/Check", Cardinality.UNARY_UNARY,
                                  HealthCheckRequest, HealthCheckResponse) as st:  # fmt: skip
                await st.send_message(HealthCheckRequest(service=SERVICE), end=True)
                reply = await st.recv_message()
                await st.recv_trailing_metadata()
    assert reply is not None
    return str(HealthCheckResponse.ServingStatus.Name(reply.status))


async def health_becomes(
    port: int, status: str, timeout: float = 15.0, every: float = 0.05
) -> None:
    """Asks every ``every`` s until the status is ``status``; fails after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout)
    while (now := await health(port)) != status:
        assert loop.time() < deadline, f"health stayed {now}, never {status}"
        await asyncio.sleep(every)
