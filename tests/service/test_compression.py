"""Compressed requests from a real grpcio client (official protobuf classes): a call made with
``grpc.Compression.Gzip`` or ``Deflate`` sends ``grpc-encoding`` and its messages with the
compressed flag; the relay inflates them and answers as usual (``docs/contract.md`` §3.1).

grpc-core sends a message uncompressed when compressing would not make it smaller, and every
request of the contract is a few bytes: each request here carries an unknown field of
repetitive padding (ignored by the relay, §3.1) so that it really goes compressed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.service.h2.request import MAX_REQUEST_BYTES
from tests.support.mem_relay import MARKER, GrpcioClient, StartRelay
from tests.support.mirror_rig import settle

K = "kv-relay-error-reason"
_PAD_FIELD = 999  # no field of any request has this number
COMPRESSIONS = [grpc.Compression.Gzip, grpc.Compression.Deflate]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _padded(gio: GrpcioClient, request: Any, pad: int = 4096) -> Any:
    """``request`` as the official message, with an unknown length-delimited field of ``pad``
    bytes: large and compressible, so grpc-core sends it compressed."""
    raw = bytes(request) + _varint(_PAD_FIELD << 3 | 2) + _varint(pad) + b"kvrelay " * (pad // 8)
    msg = getattr(gio.m, type(request).__name__).FromString(raw)
    assert len(msg.SerializeToString()) == len(raw)  # the unknown field is kept and sent
    assert len(zlib.compress(raw)) < len(raw) // 10
    return msg


@pytest.mark.parametrize("compression", COMPRESSIONS, ids=["gzip", "deflate"])
async def test_get_relay_info_and_a_stream_with_compressed_requests(
    start_relay: StartRelay,
    grpcio_client: Callable[[int], GrpcioClient],
    compression: grpc.Compression,
) -> None:
    view, server = await start_relay()
    view.add_pool("pool-a", 1024)
    await settle(view, server)
    gio = grpcio_client(server.port)
    plain = await gio.stub.GetRelayInfo(gio.convert(pb.RelayInfoRequest(contract_marker=MARKER)))
    info = await gio.stub.GetRelayInfo(
        _padded(gio, pb.RelayInfoRequest(contract_marker=MARKER)), compression=compression
    )
    assert info.contract_marker == MARKER and info.protocol_version == 1
    assert info.SerializeToString() == plain.SerializeToString()
    req = pb.WatchKvPoolCatalogRequest(subscriber_id="c" * 128, contract_marker=MARKER)
    call = gio.stub.WatchKvPoolCatalog(_padded(gio, req), compression=compression)
    first = await call.read()
    assert first.revision == 1 and len(first.snapshot.pools) == 1
    assert first.contract_marker == MARKER
    call.cancel()
    # the checks after the inflating are the usual ones: a wrong marker, compressed
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gio.stub.GetRelayInfo(
            _padded(gio, pb.RelayInfoRequest(contract_marker=MARKER + 1)), compression=compression
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(err.value.trailing_metadata())[K] == "RELAY_ERROR_REASON_CONTRACT_MISMATCH"


async def test_a_compressed_request_that_inflates_past_the_limit_is_refused(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    """A few KiB of gzip that would inflate to 6 MiB: refused as a request of that size would
    be (INVALID_REQUEST: over 1 MiB), after inflating no more than the limit."""
    _, server = await start_relay()
    gio = grpcio_client(server.port)
    bomb = _padded(gio, pb.RelayInfoRequest(contract_marker=MARKER), 6 << 20)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await gio.stub.GetRelayInfo(bomb, compression=grpc.Compression.Gzip)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())[K] == "RELAY_ERROR_REASON_INVALID_REQUEST"
    assert f"over {MAX_REQUEST_BYTES} bytes" in (err.value.details() or "")
