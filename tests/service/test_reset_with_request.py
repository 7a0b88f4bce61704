"""A client that sends its request and resets the stream in one write.

Why: the relay reads a call's request under a deadline (``h2/request.py``), and Python 3.11's
``wait_for`` returns the inner read's result when the read and the caller's cancellation
complete in the same loop turn, dropping the cancellation. grpclib cancels a handler whose
client reset its stream; with the request's DATA and the RST_STREAM in one TCP read, the read
completes and the reset cancels the handler in that turn. The handler went on to a stream
already gone, failed its status (or its first send) with h2's ``StreamClosedError``, and
grpclib logged "Failed to handle cancellation" at ERROR with a traceback (a seeded reload audit
met it when its SDK client dropped a stream just opened for a pool a second reload rebuilt). A
reset is a client's normal cancel: no ERROR may be logged, every call's permits come back, and
the relay keeps answering. Served directly and through a mirror (the same server over a
``Mirror`` view, which also serves the spacing RPC).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h2.errors
import pytest
from grpclib.health.v1.health_pb2 import HealthCheckRequest
from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.server import RelayServer
from kvrelay.service.spacing import HOLD_HEADER, HOLD_METHOD
from tests.support.fleet import eventually
from tests.support.h2_client import RawH2Client, plane_request
from tests.support.mem_relay import MemRelayView, sub_request
from tests.support.mirror_rig import close_served, mirror_of, start_served

_PLANES = ("WatchKvPoolCatalog", "SubscribeServingReadiness", "SubscribeKvPoolLoad",
           "SubscribeServingLoad")  # fmt: skip
_INFO = bytes(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))


def _calls(
    view: MemRelayView, mirrored: bool
) -> tuple[pb.ProducerIdentity, list[tuple[str, bytes, tuple[Any, ...]]]]:
    """A listed pool's producer, and (method, request, extra headers) for every RPC the port
    serves (a pool stream to that pool, and to one no longer listed)."""
    listed = view.add_pool("reset-listed", 1 << 10)
    absent = view.add_pool("reset-absent", 1 << 10)
    view.remove(absent)
    calls: list[tuple[str, bytes, tuple[Any, ...]]] = [("GetRelayInfo", _INFO, ())]
    calls += [(m, plane_request(), ()) for m in _PLANES]
    calls += [
        ("SubscribeKvPool", bytes(sub_request(listed.producer, "reset")), ()),
        ("SubscribeKvPool", bytes(sub_request(absent.producer, "reset")), ()),
        ("/grpc.health.v1.Health/Check", HealthCheckRequest().SerializeToString(), ()),
        ("/grpc.health.v1.Health/Watch", HealthCheckRequest().SerializeToString(), ()),
        ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
         ServerReflectionRequest(list_services="").SerializeToString(), ()),
    ]  # fmt: skip
    if mirrored:  # the spacing RPC: served where the view can hold a pool (a mirror here)
        hold = bytes(sub_request(listed.producer, "reset"))
        calls.append((HOLD_METHOD, hold, ((HOLD_HEADER, "5"),)))
    return listed.producer, calls


async def _reset_with_request(
    server: RelayServer, method: str, request: bytes, headers: tuple[Any, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Open ``method`` with its headers alone; once the relay waits for the request, send the
    request and RST_STREAM in one write; wait for grpclib's word on the call's end."""
    client = await RawH2Client.connect(server.port)
    try:
        pending = server.service.request_guards.pending
        before = len(caplog.records)
        sid = client.h2.get_next_available_stream_id()
        client.open(method, b"", end=False, headers=headers)
        await eventually(lambda: len(pending) == 1, what=f"{method} waiting for its request")
        framed = b"\x00" + len(request).to_bytes(4, "big") + request
        client.h2.send_data(sid, framed, end_stream=True)
        client.h2.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        client.flush()  # one write: one read on the relay's side

        def ended() -> bool:
            return any(r.name == "grpclib.server" for r in caplog.records[before:])

        await eventually(ended, what=f"grpclib's log of {method}'s end")
    finally:
        await client.close()


@pytest.mark.parametrize("mode", ["direct", "mirror"])
async def test_a_reset_sent_with_the_request_logs_no_error(
    mode: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grpclib's "Request was cancelled" record, the oracle here: a test that configured kvrelay's
    # logging earlier left its filter on grpclib's server logger, which drops that record
    monkeypatch.setattr(logging.getLogger("grpclib.server"), "filters", [])
    caplog.set_level(logging.INFO, logger="grpclib")
    cleanup: list[Any] = []
    try:
        view, server = await start_served(mode, RelayLimits(), cleanup)
        producer, calls = _calls(view, mirror_of(server) is not None)
        await eventually(lambda: server.service._listed(producer), what="the pool listed")
        for method, request, headers in calls:
            await _reset_with_request(server, method, request, headers, caplog)
        errors = [(r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors
        cancelled = [r for r in caplog.records if r.getMessage().startswith("Request was cancel")]
        assert len(cancelled) == len(calls)  # each call ended as a cancelled one
        service = server.service
        await eventually(lambda: service._active == 0, what="every call over")
        permits = (service.pool_permits, service.catalog_permits, service.readiness_permits,
                   service.load_permits, service.serving_load_permits)  # fmt: skip
        assert all(p.in_use == 0 for p in permits)
        assert not service.errors, service.errors  # no status: nothing counted as a stream end
        assert len(service.request_guards.pending) == 0
        # the relay still answers on the same port
        probe = await RawH2Client.connect(server.port)
        try:
            info = probe.open("GetRelayInfo", _INFO)
            await asyncio.wait_for(info.ended.wait(), 10)
            assert info.status == "0"
        finally:
            await probe.close()
    finally:
        await close_served(cleanup)
