"""Compressed requests, byte by byte (``kvrelay/service/h2/request.py``): ``gzip`` and
``deflate`` are inflated on the relay's RPCs and on grpclib's health and reflection services;
what inflates past the request limit, or does not inflate, is refused without more work than
the limit; another encoding is UNIMPLEMENTED; the flag without an encoding stays
INVALID_REQUEST."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any, NoReturn

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.h2.request import MAX_REQUEST_BYTES
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client, RawStream, plane_request
from tests.support.mem_relay import MemRelayView

INFO = bytes(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))
_SERVICE = b"dynamo.kvrelay.v1.KvEventRelay"
HEALTH_CHECK = b"\n" + bytes([len(_SERVICE)]) + _SERVICE  # HealthCheckRequest{service}
REFLECT = b"\x3a\x00"  # ServerReflectionRequest{list_services: ""}
METHODS = [
    ("WatchKvPoolCatalog", plane_request()),
    ("GetRelayInfo", INFO),
    ("/grpc.health.v1.Health/Check", HEALTH_CHECK),
    ("/grpc.health.v1.Health/Watch", HEALTH_CHECK),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", REFLECT),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", REFLECT),
]
IDS = ["catalog", "info", "health-check", "health-watch", "reflection", "reflection-v1alpha"]


def gzip(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def framed(body: bytes, compressed: bool) -> bytes:
    return (b"\x01" if compressed else b"\x00") + len(body).to_bytes(4, "big") + body


def bomb(inflated: int) -> bytes:
    """gzip of ``inflated`` zero bytes, made without holding them."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    out = b"".join(c.compress(chunk) for _ in range(inflated >> 20))
    return out + c.flush()


async def first_reply(st: RawStream) -> bytes | None:
    """The first reply message of ``st``, or None when it ended without one."""
    for _ in range(1000):
        data = bytes(st.data)
        if len(data) >= 5 and len(data) >= 5 + int.from_bytes(data[1:5], "big"):
            return data[5 : 5 + int.from_bytes(data[1:5], "big")]
        if st.ended.is_set():
            return None
        await asyncio.sleep(0.01)
    raise AssertionError("no reply and no end")


async def _call(
    port: int, method: str, raw: bytes, headers: tuple[tuple[str, str], ...]
) -> tuple[RawStream, bytes | None]:
    c = await RawH2Client.connect(port, "127.0.0.2")
    try:
        st = c.open(method, b"", raw=raw, headers=headers)
        return st, await first_reply(st)
    finally:
        await c.close()


@pytest.mark.parametrize(("method", "body"), METHODS, ids=IDS)
async def test_gzip_and_deflate_requests_are_served_like_plain_ones(
    method: str, body: bytes
) -> None:
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    try:
        plain, expected = await _call(server.port, method, framed(body, False), ())
        assert expected is not None and plain.status in (None, "0")
        for encoding, packed in (("gzip", gzip(body)), ("deflate", zlib.compress(body))):
            st, reply = await _call(
                server.port, method, framed(packed, True), (("grpc-encoding", encoding),)
            )
            assert reply == expected, (encoding, st.status, st.message)
            assert st.status in (None, "0")
    finally:
        await server.close(grace_s=0.5)


@pytest.mark.parametrize(("method", "body"), METHODS, ids=IDS)
async def test_compressed_requests_that_cannot_be_read_are_refused(
    method: str, body: bytes
) -> None:
    """Another encoding: UNIMPLEMENTED (plain gRPC, no reason trailer) after response headers
    with ``grpc-accept-encoding``. The flag without an encoding, or with ``identity``:
    INVALID_REQUEST, as before. Data that does not inflate
    (not gzip, cut short, bytes after its end, gzip sent as ``deflate``): INVALID_REQUEST. A
    gzip of 12 KiB that inflates to 12 MiB: refused as a request over 1 MiB is. The encoding
    alone refuses nothing: an uncompressed message under ``br`` is served."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    gz = gzip(body)
    big = bomb(12 << 20)
    assert len(big) < 16_000
    invalid = "RELAY_ERROR_REASON_INVALID_REQUEST"
    cases: list[tuple[bytes, tuple[tuple[str, str], ...], str, str | None]] = [
        (framed(gz, True), (("grpc-encoding", "br"),), "12", None),
        (framed(gz, True), (("grpc-encoding", "gzip"), ("grpc-encoding", "br")), "12", None),
        (framed(gz, True), (("grpc-encoding", "identity"),), "3", invalid),
        (framed(gz, True), (), "3", invalid),
        (framed(b"not gzip at all", True), (("grpc-encoding", "gzip"),), "3", invalid),
        (framed(gz[:-6], True), (("grpc-encoding", "gzip"),), "3", invalid),
        (framed(gz + b"x", True), (("grpc-encoding", "gzip"),), "3", invalid),
        (framed(gz, True), (("grpc-encoding", "deflate"),), "3", invalid),
        (framed(big, True), (("grpc-encoding", "gzip"),), "3", invalid),
    ]
    try:
        for raw, headers, status, reason in cases:
            st, reply = await _call(server.port, method, raw, headers)
            assert reply is None, (headers, raw[:20])
            assert (st.status, st.reason) == (status, reason), (headers, raw[:20], st.message)
            # an encoding it cannot read: the response says which it can (gRPC's compression
            # spec); it said nothing, and a client could not know what to retry with
            accepts = st.headers.get("grpc-accept-encoding")
            assert accepts == ("identity,gzip,deflate" if status == "12" else None), headers
        upper = (("grpc-encoding", "GZIP"),)
        st, reply = await _call(server.port, method, framed(big, True), upper)
        assert f"inflates to over {MAX_REQUEST_BYTES} bytes" in (st.message or "")
        br = (("grpc-encoding", "br"),)
        st, reply = await _call(server.port, method, framed(body, False), br)
        assert reply is not None and st.status in (None, "0")
        assert not any("INTERNAL" in str(k) for k in server.service.errors), server.service.errors
    finally:
        await server.close(grace_s=0.5)


def test_a_decompression_bomb_is_inflated_no_further_than_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 MiB of zeros in a quarter MiB of gzip: zlib is asked for one byte past the limit,
    no more, and the request is refused with the limit's error."""
    from kvrelay.service.h2.request import inflate_bounded

    asked: list[int] = []
    made = zlib.decompressobj

    class Spy:
        def __init__(self, wbits: int) -> None:
            self._d = made(wbits)

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self._d.decompress(data, max_length)
            asked.append(len(out))
            assert max_length > 0, "an unbounded inflate"
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self._d, name)

    monkeypatch.setattr(zlib, "decompressobj", Spy)

    def too_large(size: int) -> NoReturn:
        raise RelayError.invalid_request(f"over: {size}")

    big = bomb(256 << 20)
    with pytest.raises(RelayError, match=f"over: {MAX_REQUEST_BYTES + 1}"):
        inflate_bounded(big, "gzip", MAX_REQUEST_BYTES, too_large)
    assert sum(asked) == MAX_REQUEST_BYTES + 1
    assert inflate_bounded(zlib.compress(b"x" * 100), "deflate", 100, too_large) == b"x" * 100
    with pytest.raises(RelayError, match="over: 100"):
        inflate_bounded(zlib.compress(b"x" * 100), "deflate", 99, too_large)


async def test_a_later_reflection_request_inflating_past_its_smaller_limit_is_resource_limit() -> (
    None
):
    """A reflection stream's later requests may be 16 KiB at most (``BoundedRequests``): one
    whose gzip inflates past that gets the message limit's error, RESOURCE_LIMIT."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    method = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    raw = framed(gzip(REFLECT), True) + framed(bomb(1 << 20), True)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        st = c.open(method, b"", raw=raw, headers=(("grpc-encoding", "gzip"),))
        await asyncio.wait_for(st.ended.wait(), 10)
        assert await first_reply(st) is not None
        assert (st.status, st.reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT"), st.message
        assert "inflates to over 16384 bytes" in (st.message or "")
    finally:
        await c.close()
        await server.close(grace_s=0.5)
