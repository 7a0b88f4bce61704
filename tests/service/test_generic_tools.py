"""Generic gRPC tools work against the relay: reflection describes every listed service (health
included) and health answers for the relay's service name.

The independent peer is grpcio with official protobuf messages: it reads the server's reflection
answers into its own descriptor pool, as ``grpcurl describe`` and ``buf curl --list-methods`` do.
With ``buf`` on the machine (npm package ``@bufbuild/buf``) the documented commands run too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest, ServerReflectionResponse

from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer

RELAY = "dynamo.kvrelay.v1.KvEventRelay"
HEALTH = "grpc.health.v1.Health"
MARKER = 0x4B565231


@pytest.fixture
async def server() -> AsyncIterator[RelayServer]:
    relay = Relay(RelaySettings(dc_name="dc-tools"))
    await relay.start()
    srv = RelayServer(relay)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.close(grace_s=0.5)
    await relay.stop()


async def _reflect(port: int, requests: list[ServerReflectionRequest]) -> list[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=ServerReflectionRequest.SerializeToString,
            response_deserializer=ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(requests))]


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        check = ch.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString,
        )
        reply = await check(HealthCheckRequest(service=service), timeout=10)
        return int(reply.status)


async def test_reflection_describes_every_listed_service(server: RelayServer) -> None:
    (listing,) = await _reflect(server.port, [ServerReflectionRequest(list_services="")])
    names = sorted(s.name for s in listing.list_services_response.service)
    assert names == [RELAY, HEALTH]
    replies = await _reflect(
        server.port, [ServerReflectionRequest(file_containing_symbol=n) for n in names]
    )
    pool = descriptor_pool.DescriptorPool()  # the client's own, built from the answers only
    for reply in replies:
        assert not reply.HasField("error_response"), reply.error_response
        for raw in reply.file_descriptor_response.file_descriptor_proto:
            pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    health = pool.FindServiceByName(HEALTH)
    assert [m.name for m in health.methods] == ["Check", "Watch"]
    assert health.methods_by_name["Check"].output_type.fields_by_name["status"].enum_type
    relay = pool.FindServiceByName(RELAY)
    assert [m.name for m in relay.methods] == [
        "GetRelayInfo", "WatchKvPoolCatalog", "SubscribeKvPool", "SubscribeServingReadiness",
        "SubscribeKvPoolLoad", "SubscribeServingLoad",
    ]  # fmt: skip
    (missing,) = await _reflect(
        server.port, [ServerReflectionRequest(file_containing_symbol="no.such.Service")]
    )
    assert missing.HasField("error_response")


async def test_a_reflection_only_client_reads_serving_load_windows(server: RelayServer) -> None:
    """A generic client (no stubs, no .proto: what grpcurl does) builds the messages of
    SubscribeServingLoad from reflection alone, calls it and decodes consecutive windows."""
    symbol = RELAY  # what grpcurl asks for before it calls a method of the service
    (reply,) = await _reflect(server.port, [ServerReflectionRequest(file_containing_symbol=symbol)])
    pool = descriptor_pool.DescriptorPool()
    for raw in reply.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    method = pool.FindServiceByName(RELAY).methods_by_name["SubscribeServingLoad"]
    assert method.server_streaming and not method.client_streaming
    request_cls = message_factory.GetMessageClass(method.input_type)
    reply_cls = message_factory.GetMessageClass(method.output_type)
    status = pool.FindEnumTypeByName("dynamo.kvrelay.v1.DataStatus")
    assert [v.name for v in status.values] == [
        "DATA_STATUS_UNSPECIFIED", "DATA_STATUS_COMPLETE", "DATA_STATUS_DEGRADED",
        "DATA_STATUS_UNAVAILABLE",
    ]  # fmt: skip
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.unary_stream(
            f"/{RELAY}/SubscribeServingLoad",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply_cls.FromString,
        )(request_cls(subscriber_id="grpcurl", contract_marker=MARKER))
        windows = []
        async with asyncio.timeout(20):
            async for w in call:
                windows.append(w)
                if len(windows) == 2:
                    break
        call.cancel()
    assert [w.contract_marker for w in windows] == [MARKER, MARKER]
    assert windows[1].window_sequence == windows[0].window_sequence + 1
    assert windows[0].window_ms == 1000 and windows[0].protocol_version == 1
    assert list(windows[1].pools) == [] and list(windows[1].models) == []  # a relay of no pools


async def test_health_answers_for_the_relay_service_and_the_server(server: RelayServer) -> None:
    assert server.serving
    for name in (RELAY, ""):
        assert await _health(server.port, name) == HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _health(server.port, "no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_buf_curl_lists_methods_and_calls_when_installed(server: RelayServer) -> None:
    """The documented `buf curl` lines (docs/operations.md); the grpcio tests above stand in
    for them where buf is not installed."""
    buf = shutil.which("buf")
    if buf is None:
        return
    url = f"http://127.0.0.1:{server.port}"
    base = [buf, "curl", "--protocol", "grpc", "--http2-prior-knowledge"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)

    listed = await asyncio.to_thread(run, "--list-methods", url)
    assert listed.returncode == 0, listed.stderr
    assert f"{RELAY}/SubscribeKvPool" in listed.stdout.split()
    assert f"{HEALTH}/Check" in listed.stdout.split()
    info = await asyncio.to_thread(
        run, "-d", json.dumps({"contract_marker": MARKER}), f"{url}/{RELAY}/GetRelayInfo"
    )
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["contractMarker"] == MARKER
    health = await asyncio.to_thread(
        run, "-d", json.dumps({"service": RELAY}), f"{url}/{HEALTH}/Check"
    )
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}
