"""Generic gRPC tools work against the relay: reflection describes every listed service (health
and reflection included) and finds a method's file by its name, health answers for the relay's
service name, and a drain ends health ``Watch`` and reflection streams with a status.

The independent peer is grpcio with official protobuf messages: it reads the server's reflection
answers into its own descriptor pool, as ``grpcurl describe`` and ``buf curl --list-methods`` do.
With ``buf`` on the machine (npm package ``@bufbuild/buf``) the documented commands run too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from grpclib.reflection.v1 import reflection_pb2 as reflection_v1
from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest, ServerReflectionResponse
from grpclib.reflection.v1alpha import reflection_pb2 as reflection_v1alpha

from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client, plane_request

RELAY = "dynamo.kvrelay.v1.KvEventRelay"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1.ServerReflection"
REFLECTION_ALPHA = "grpc.reflection.v1alpha.ServerReflection"
WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION_PATH = f"/{REFLECTION}/ServerReflectionInfo"
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
    assert names == [RELAY, HEALTH, REFLECTION, REFLECTION_ALPHA]  # grpc-go lists both too
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
    for name in (REFLECTION, REFLECTION_ALPHA):
        assert [m.name for m in pool.FindServiceByName(name).methods] == ["ServerReflectionInfo"]
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


@pytest.mark.parametrize("version", [reflection_v1, reflection_v1alpha], ids=["v1", "v1alpha"])
async def test_reflection_finds_the_file_of_a_method_by_its_name(
    server: RelayServer, version: ModuleType
) -> None:
    """``grpcurl describe pkg.Service.Method`` asks for the file containing the method's full
    name, which grpc-go's reflection resolves; the descriptor pool grpclib asks indexes no
    methods, so each was NOT_FOUND. A name that is no method of that service stays NOT_FOUND."""
    symbols = {
        f"{RELAY}.SubscribeKvPool": "dynamo/kvrelay/v1/relay.proto",
        f"{HEALTH}.Watch": None,
        f"{REFLECTION}.ServerReflectionInfo": None,
        "dynamo.kvrelay.v1.FilterUpdate.payload": "dynamo/kvrelay/v1/relay.proto",  # a field
    }
    missing = [f"{RELAY}.NoSuchMethod", "no.such.Service.Method", "NoDot"]
    request, reply = version.ServerReflectionRequest, version.ServerReflectionResponse
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.stream_stream(
            f"/{version.DESCRIPTOR.package}.ServerReflection/ServerReflectionInfo",
            request_serializer=request.SerializeToString,
            response_deserializer=reply.FromString,
        )
        asked = [request(file_containing_symbol=s) for s in [*symbols, *missing]]
        replies = [r async for r in call(iter(asked))]
    assert len(replies) == len(asked)
    for (symbol, file_name), answer in zip(symbols.items(), replies, strict=False):
        assert not answer.HasField("error_response"), (symbol, answer.error_response)
        pool = descriptor_pool.DescriptorPool()  # the client's own, from the answer only
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in answer.file_descriptor_response.file_descriptor_proto]  # fmt: skip
        for fd in files:
            pool.Add(fd)
        if file_name is not None:
            assert files[0].name == file_name
        service, _, method = symbol.rpartition(".")
        if method != "payload":
            assert pool.FindMethodByName(symbol).containing_service.full_name == service
    for symbol, answer in zip(missing, replies[len(symbols):], strict=True):
        assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0], symbol


def _watch(ch: grpc.aio.Channel, service: str) -> Any:
    return ch.unary_stream(
        WATCH,
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )(HealthCheckRequest(service=service))


async def _rest(call: Any) -> tuple[list[Any], grpc.StatusCode]:
    """What a call still sends, until its end, and its status (grpcio's view)."""
    out = []
    try:
        async with asyncio.timeout(10):
            while (message := await call.read()) is not grpc.aio.EOF:
                out.append(message)
    except grpc.aio.AioRpcError as err:
        return out, err.code()
    return out, await call.code()


@pytest.mark.parametrize("plane_open", [False, True], ids=["idle", "plane_open"])
async def test_the_drain_ends_health_watches_and_reflection_streams_with_status_ok(
    plane_open: bool, official_pb2: dict[str, ModuleType]
) -> None:
    """On a drain a ``Watch`` sends NOT_SERVING, then it and an open reflection stream end with
    status OK, as the relay's own streams do (contract §4.8). They were cancelled by the
    server's close instead: no NOT_SERVING on an idle relay, no trailers, and grpcio reported
    UNAVAILABLE "Socket closed". ``plane_open``: a catalog stream is open meanwhile."""
    relay = Relay(RelaySettings(dc_name="dc-watch"))
    await relay.start()
    srv = RelayServer(relay)
    await srv.start("127.0.0.1", 0)
    closing = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            names = ("", RELAY, "no.such.Service")
            watches = [_watch(ch, name) for name in names]
            firsts = [(await w.read()).status for w in watches]
            assert firsts == [HealthCheckResponse.SERVING] * 2 + [
                HealthCheckResponse.SERVICE_UNKNOWN
            ]
            reflect = ch.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=ServerReflectionRequest.SerializeToString,
                response_deserializer=ServerReflectionResponse.FromString,
            )()
            await reflect.write(ServerReflectionRequest(list_services=""))  # never done writing
            assert (await reflect.read()).HasField("list_services_response")
            streams = [*watches, reflect]
            if plane_open:
                m = official_pb2["relay"]
                catalog = official_pb2["relay_grpc"].KvEventRelayStub(ch).WatchKvPoolCatalog(
                    m.WatchKvPoolCatalogRequest(contract_marker=MARKER, subscriber_id="held")
                )
                assert await catalog.read() is not grpc.aio.EOF
                streams.append(catalog)
            closing = asyncio.create_task(srv.close(grace_s=5.0))
            ends = await asyncio.gather(*(_rest(s) for s in streams))
        not_serving = [HealthCheckResponse.NOT_SERVING]
        assert [[m.status for m in rest] for rest, _ in ends[:3]] == [not_serving] * 2 + [[]]
        assert ends[3][0] == []  # the reflection stream: nothing more
        assert [code for _, code in ends] == [grpc.StatusCode.OK] * len(streams)
        await closing
    finally:
        if closing is not None:
            await closing
        await relay.stop()


async def test_watch_and_reflection_end_before_their_connections_goaway() -> None:
    """On the wire: the Watch's NOT_SERVING, then its trailers (``grpc-status: 0``) and the
    reflection stream's, then the graceful GOAWAY; before, the GOAWAY came and the connection
    closed with neither stream ended. The reflection stream's client has not finished its
    requests, so its trailers are followed by RST_STREAM ``NO_ERROR`` (RFC 9113 §8.1), as
    grpc-go's are: without it grpcio kept the call open for its requests, and the close a
    moment later turned the OK into UNAVAILABLE (about one drain in four here). A Watch and a
    reflection stream whose request is still on its way hold the drain, as a relay stream's
    does, and are answered before they end."""
    async with _draining("dc-watch-raw") as d:
        raw = d.raw
        watch = raw.open(WATCH, HealthCheckRequest(service="").SerializeToString())
        reflect = _open_reflection(raw)
        late_watch = raw.open(WATCH, b"", end=False)  # headers only: no request yet
        late_reflect = raw.open(REFLECTION_PATH, b"", end=False)
        await _eventually_data(watch, reflect)
        closing = d.drain(5.0)
        await asyncio.sleep(0.3)
        assert not closing.done(), "the streams waiting for their request hold the drain"
        assert (watch.status, reflect.status) == ("0", "0")
        raw.h2.send_data(5, _framed(HealthCheckRequest(service=RELAY)), end_stream=True)
        raw.h2.send_data(7, _framed(ServerReflectionRequest(list_services="")))
        raw.flush()
        await closing
        await asyncio.wait_for(raw.closed.wait(), 5)
        assert _statuses(watch.data) == [HealthCheckResponse.SERVING,
                                         HealthCheckResponse.NOT_SERVING]  # fmt: skip
        assert _statuses(late_watch.data) == [HealthCheckResponse.NOT_SERVING]
        assert late_reflect.data and ServerReflectionResponse.FromString(
            bytes(late_reflect.data[5:])
        ).HasField("list_services_response")
        assert [s.status for s in (watch, reflect, late_watch, late_reflect)] == ["0"] * 4
        for sid in (3, 7):  # the reflection streams: trailers, then RST_STREAM NO_ERROR
            assert raw.order.index(("ended", sid)) + 1 == raw.order.index(("reset", sid))
        assert (reflect.reset_code, late_reflect.reset_code) == (0, 0)  # "send no more"
        assert sorted(raw.order[:-1]) == [("ended", 1), ("ended", 3), ("ended", 5), ("ended", 7),
                                          ("reset", 3), ("reset", 7)]  # fmt: skip
        assert raw.order[-1] == ("goaway", 7)


async def test_a_watch_whose_request_is_on_its_way_holds_the_drain() -> None:
    """A Watch whose request has not arrived when the drain starts holds it, as a relay stream
    does (up to the grace): once the request comes it is sent NOT_SERVING and ends OK, before
    the GOAWAY, instead of being cut by the close."""
    async with _draining("dc-watch-wait") as d:
        raw = d.raw
        late = raw.open(WATCH, b"", end=False)  # headers only: no request yet
        await asyncio.sleep(0.2)
        closing = d.drain(5.0)
        await asyncio.sleep(0.3)
        assert not closing.done(), "the Watch waiting for its request holds the drain"
        raw.h2.send_data(1, _framed(HealthCheckRequest(service="")), end_stream=True)
        raw.flush()
        await closing
        await asyncio.wait_for(raw.closed.wait(), 5)
        assert _statuses(late.data) == [HealthCheckResponse.NOT_SERVING]
        assert late.status == "0" and raw.order == [("ended", 1), ("goaway", 1)]


async def test_during_the_drain_a_new_watch_says_not_serving_and_reflection_is_refused() -> None:
    """A connection whose relay stream holds the drain open has had no GOAWAY, so a client may
    still open streams there: a Watch is told NOT_SERVING and ends OK; a reflection stream is
    refused UNAVAILABLE with the reason trailer, as a relay stream then is (contract §4.8),
    instead of staying open until the close cuts it."""
    async with _draining("dc-watch-late", window=8) as d:
        holder = d.raw  # never reads, its message half written: the drain waits
        held = holder.open("WatchKvPoolCatalog", plane_request("held"))
        await asyncio.sleep(0.2)
        closing = d.drain(3.0)
        await asyncio.sleep(0.3)
        assert not closing.done() and not held.ended.is_set()
        watch = holder.open(WATCH, HealthCheckRequest(service=RELAY).SerializeToString())
        holder.h2.increment_flow_control_window(65_535, max(holder.streams))  # only its window
        reflect = _open_reflection(holder)
        holder.flush()
        await asyncio.wait_for(asyncio.gather(watch.ended.wait(), reflect.ended.wait()), 5)
        assert _statuses(watch.data) == [HealthCheckResponse.NOT_SERVING]
        assert watch.status == "0" and not watch.reset
        assert (reflect.status, reflect.reason) == (
            str(grpc.StatusCode.UNAVAILABLE.value[0]), "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        )
        assert not closing.done()  # the held relay stream still holds the drain


def _open_reflection(raw: RawH2Client) -> Any:
    """A v1 reflection stream asking ``list_services``, its requests never finished."""
    framed = _framed(ServerReflectionRequest(list_services=""))
    return raw.open(REFLECTION_PATH, b"", raw=framed, end=False)


def _framed(message: Any) -> bytes:
    body = message.SerializeToString()
    return b"\x00" + len(body).to_bytes(4, "big") + body


async def _eventually_data(*streams: Any) -> None:
    async with asyncio.timeout(10):
        while not all(st.data for st in streams):
            await asyncio.sleep(0.02)


def _statuses(data: bytes) -> list[int]:
    """The ``HealthCheckResponse`` statuses in a stream's gRPC messages."""
    out = []
    while data:
        size = int.from_bytes(data[1:5], "big")
        out.append(HealthCheckResponse.FromString(data[5:5 + size]).status)
        data = data[5 + size:]
    return out


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


class _Draining:
    """A relay's server on loopback and one raw HTTP/2 connection to it; ``drain`` starts the
    server's close (awaited on the way out, as every stream has ended by then)."""

    def __init__(self, srv: RelayServer, raw: RawH2Client) -> None:
        self.srv, self.raw = srv, raw
        self.closing: asyncio.Task[None] | None = None

    def drain(self, grace_s: float) -> asyncio.Task[None]:
        self.closing = asyncio.create_task(self.srv.close(grace_s=grace_s))
        return self.closing


@contextlib.asynccontextmanager
async def _draining(dc_name: str, window: int | None = None) -> AsyncIterator[_Draining]:
    relay = Relay(RelaySettings(dc_name=dc_name))
    await relay.start()
    srv = RelayServer(relay)
    await srv.start("127.0.0.1", 0)
    d = _Draining(srv, await RawH2Client.connect(srv.port, window=window))
    try:
        yield d
    finally:
        if d.closing is not None:
            await d.closing
        await d.raw.close()
        await relay.stop()
