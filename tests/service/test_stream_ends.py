"""Every stream the relay ends, it ends with a status: the less obvious ways a stream ends.

A router must always be able to tell why its stream ended (contract §3.2, §4.6, §4.8): a bug in
a handler is ``INTERNAL`` with the reason trailer (and the operator gets its traceback); a drain
whose grace runs out refuses the calls still waiting for their request instead of the close
cutting them; a pool stream still being admitted when the drain starts (a mirror waits for a
pool it is synchronizing) ends OK at once. Independent peers: grpcio with the official stubs,
and a raw HTTP/2 client for calls whose request never comes.
"""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import grpc
import pytest
import structlog
from grpclib.health.v1.health_pb2 import HealthCheckRequest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.publication.splice import FilterUpdateEncoder
from kvrelay.service.h2.request_guards import PendingRequests
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client
from tests.support.mem_relay import MARKER, GrpcioClient, MemRelayView
from tests.support.mirror_rig import UPSTREAM_LIMITS, mirrored
from tests.support.timing import scaled

REASON = "kv-relay-error-reason"
INTERNAL = "RELAY_ERROR_REASON_INTERNAL"
UNAVAILABLE = "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"


async def test_a_bug_in_a_live_stream_ends_it_internal_counted_and_logged(
    official_pb2: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler raising while its stream is live (a plane that fails after its first message,
    a pool stream's pump failing at its first heartbeat) and the unary call raising: grpcio sees
    INTERNAL with its message and the reason trailer, each is counted, and each is logged
    ``rpc_failed`` with the RPC and the traceback (it was counted only: the operator had no
    trace of the bug). The relay keeps serving."""
    view = MemRelayView(RelayLimits(pool_heartbeat_s=0.2))
    gen = view.add_pool("p", 1024)
    boom = asyncio.Event()

    async def broken_plane(_version: int) -> Any:
        await boom.wait()
        raise RuntimeError("injected plane fault")

    def broken_heartbeat(self: Any, sequence: int) -> bytes:
        raise ValueError("injected encoder fault")

    def broken_info() -> bytes:
        raise KeyError("injected info fault")

    view.readiness.wait_newer = broken_plane  # type: ignore[method-assign]
    monkeypatch.setattr(FilterUpdateEncoder, "heartbeat", broken_heartbeat)
    server = RelayServer(view, view.limits)
    await server.start("127.0.0.1", 0)
    client = GrpcioClient(official_pb2, server.port)
    try:
        with structlog.testing.capture_logs() as logs:
            readiness = asyncio.ensure_future(client.collect(
                "SubscribeServingReadiness",
                pb.SubscribeServingReadinessRequest(subscriber_id="r", contract_marker=MARKER),
                timeout=5,
            ))  # fmt: skip
            pool = await client.collect(
                "SubscribeKvPool",
                pb.SubscribeKvPoolRequest(
                    subscriber_id="p", contract_marker=MARKER, expected_producer=gen.producer
                ),
                timeout=5,
            )
            boom.set()
            plane = await readiness
            server.service._relay_info = broken_info  # type: ignore[method-assign]
            _reply, code, trailers = await client.unary(
                "GetRelayInfo", pb.RelayInfoRequest(contract_marker=MARKER)
            )
        assert len(pool.messages) == 1  # the snapshot, then the failing heartbeat
        assert len(plane.messages) == 1
        for end, what in ((plane, "RuntimeError"), (pool, "ValueError")):
            assert end.status == grpc.StatusCode.INTERNAL
            assert end.message == f"internal error: {what}"
            assert end.trailers[REASON] == INTERNAL
        assert (code, trailers[REASON]) == (grpc.StatusCode.INTERNAL, INTERNAL)
        assert server.service.errors[INTERNAL] == 3
        failed = sorted((e["rpc"], e["error"].split("(")[0]) for e in logs
                        if e["event"] == "rpc_failed")  # fmt: skip
        assert failed == [("GetRelayInfo", "KeyError"), ("SubscribeKvPool", "ValueError"),
                          ("SubscribeServingReadiness", "RuntimeError")]  # fmt: skip
        assert all(e.get("exc_info") for e in logs if e["event"] == "rpc_failed")
        del server.service._relay_info  # the relay keeps serving
        reply, code, _ = await client.unary(
            "GetRelayInfo", pb.RelayInfoRequest(contract_marker=MARKER)
        )
        assert code == grpc.StatusCode.OK and reply.relay.drt_instance_id == 77
    finally:
        await client.close()
        await server.close(grace_s=0.5)


REFLECTION = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
WATCH = "/grpc.health.v1.Health/Watch"
HOLD = "/kvrelay.v1.Spacing/HoldPublication"


async def test_calls_still_waiting_for_their_request_when_the_grace_runs_out_are_refused() -> None:
    """Calls whose request has not come when the drain starts hold it (their request may be on
    its way), up to the grace. Those still waiting then, on every service (a relay stream, the
    unary call, a health Watch, a reflection stream, a spacing request), are refused UNAVAILABLE
    / PUBLICATION_UNAVAILABLE, as a call started during the drain is, and the GOAWAY follows their
    trailers. They were cut by the close without a status (and the GOAWAY named them as
    processed, so a client could not even retry them elsewhere)."""
    view = MemRelayView()
    view.hold_pool = _no_hold  # type: ignore[attr-defined]  # answers spacing requests
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    raw = await RawH2Client.connect(server.port)
    try:
        waiting = {path: raw.open(path, b"", end=False) for path in (
            "WatchKvPoolCatalog", "SubscribeKvPool", "GetRelayInfo", WATCH, REFLECTION, HOLD,
        )}  # fmt: skip
        answered = raw.open(WATCH, HealthCheckRequest(service="").SerializeToString())
        await asyncio.sleep(0.2)
        assert server.service.request_guards.pending and not answered.ended.is_set()
        started = time.monotonic()
        await server.close(grace_s=0.5)
        took = time.monotonic() - started
        await asyncio.wait_for(raw.closed.wait(), scaled(5))
        for path, st in waiting.items():
            assert (st.status, st.reason) == ("14", UNAVAILABLE), path
            assert st.message == "the relay is shutting down", path
        assert answered.status == "0"  # the drain's own end: NOT_SERVING, then OK
        assert raw.order[-1][0] == "goaway" and raw.goaway is not None
        assert raw.goaway.error_code == 0
        assert 0.5 <= took < 0.5 + scaled(1.0)
        assert server.service.errors[UNAVAILABLE] == len(waiting)  # each counted
        assert not server.service.request_guards.pending
    finally:
        await raw.close()


async def _no_hold(*_args: Any) -> float:
    return 0.0


async def test_a_pool_stream_being_admitted_when_the_drain_starts_ends_ok_at_once(
    official_pb2: dict[str, ModuleType],
) -> None:
    """A mirror's (a fan-out worker's) subscriber to a pool the mirror is still synchronizing
    waits for it up to ``sync_wait_s``; the drain starts meanwhile. Its stream ends OK at once,
    as every open stream of a drain does, and the drain does not wait for it; it was held until
    the grace ran out, then cut by the close without a status."""
    view = MemRelayView(UPSTREAM_LIMITS)
    view.add_pool("p", 1024)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    released = asyncio.Event()
    opened = view.open_pool

    async def never_answered(expected: Any, on_release: Any = None) -> Any:
        await released.wait()  # the upstream does not answer this pool's subscription
        return await opened(expected, on_release)

    try:
        async with mirrored(upstream.port, sync_wait_s=30.0) as m:
            view.open_pool = never_answered  # type: ignore[method-assign]
            late = view.add_pool("q", 1024)  # listed: the mirror starts synchronizing it
            client = GrpcioClient(official_pb2, m.port)
            try:
                end = asyncio.ensure_future(client.collect(
                    "SubscribeKvPool",
                    pb.SubscribeKvPoolRequest(subscriber_id="s", contract_marker=MARKER,
                                              expected_producer=late.producer),
                    timeout=10,
                ))  # fmt: skip
                await asyncio.sleep(0.5)
                assert not end.done()  # waiting for the pool's synchronization
                started = time.monotonic()
                await m.server.close(grace_s=5.0)
                took = time.monotonic() - started
                result = await end
            finally:
                await client.close()
            assert (result.status, result.messages) == (grpc.StatusCode.OK, [])
            assert took < scaled(1.0)
            assert m.server.service.pool_permits.in_use == 0
    finally:
        released.set()
        await upstream.close(grace_s=0.5)


async def test_each_stream_past_the_pending_bound_can_itself_be_ended_to_make_room() -> None:
    """Past ``max_pending_requests`` each new waiting stream ends the oldest one with
    RESOURCE_LIMIT, and takes its place: a place that holds its own read, so that it can be
    ended in its turn. It held the read of the stream it had just ended (already over), was
    dropped as over, and its stream waited outside the bound."""
    loop = asyncio.get_running_loop()
    pending = PendingRequests(2, grace_s=0.0)
    reads = [loop.create_future() for _ in range(4)]
    places = []
    for read in reads:
        place, _ended = pending.enter(read)
        places.append(place)
    assert [p.read for p in places] == reads
    assert [p.ending is not None for p in places] == [True, True, False, False]
    assert [r.cancelled() for r in reads] == [True, True, False, False]
    assert len(pending) == 2
    pending.enter(loop.create_future())
    assert reads[2].cancelled()  # the third stream, in its turn
    assert places[2].ending is not None and "no request message" in places[2].ending.message


async def test_a_plane_message_over_the_message_limit_ends_the_stream_resource_limit(
    official_pb2: dict[str, ModuleType],
) -> None:
    """A catalog grown past ``max_message_bytes`` (descriptors with many long registrations)
    cannot be sent: its watchers' streams end RESOURCE_EXHAUSTED / RESOURCE_LIMIT with the reason
    trailer, counted, as a request over the limit is refused (§3.1). grpclib's codec refused it
    with no trailer, counted nowhere; a smaller catalog is served again afterwards."""
    view = MemRelayView()
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    client = GrpcioClient(official_pb2, server.port)
    request = pb.WatchKvPoolCatalogRequest(subscriber_id="w", contract_marker=MARKER)
    try:
        watch = asyncio.ensure_future(client.collect("WatchKvPoolCatalog", request, timeout=5))
        await asyncio.sleep(0.2)
        huge = view._catalog_msg(1)
        assert huge.snapshot is not None
        huge.snapshot.pools.append(pb.KvPoolDescriptor(registrations=[
            pb.ModelRegistration(canonical_model_id="m" * (server.limits.max_message_bytes + 1))
        ]))  # fmt: skip
        view.catalog.publish(huge, 1)
        end = await watch
        assert len(end.messages) == 1  # the catalog before it
        assert end.status == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert end.trailers[REASON] == "RELAY_ERROR_REASON_RESOURCE_LIMIT"
        assert "exceeds max_message_bytes" in (end.message or "")
        assert server.service.errors["RELAY_ERROR_REASON_RESOURCE_LIMIT"] == 1
        view.catalog.publish(view._catalog_msg(2), 2)
        again = await client.collect("WatchKvPoolCatalog", request, limit=1, timeout=5)
        assert [m.revision for m in again.messages] == [2]
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def test_a_bug_in_a_spacing_request_is_internal_with_the_trailer() -> None:
    """kvrelay's own ``HoldPublication`` ends a bug as the relay's calls do: INTERNAL with the
    reason trailer, counted, logged ``rpc_failed``; it was grpclib's bare UNKNOWN "Internal
    Server Error", counted nowhere."""
    view = MemRelayView()
    gen = view.add_pool("p", 1024)

    async def broken(*_args: Any) -> float:
        raise RuntimeError("injected spacing fault")

    view.hold_pool = broken  # type: ignore[attr-defined]
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    raw = await RawH2Client.connect(server.port)
    try:
        request = pb.SubscribeKvPoolRequest(
            subscriber_id="m", contract_marker=MARKER, expected_producer=gen.producer
        )
        with structlog.testing.capture_logs() as logs:
            st = raw.open(HOLD, bytes(request), headers=(("kvrelay-hold-ms", "100"),))
            await asyncio.wait_for(st.ended.wait(), scaled(5))
        assert (st.status, st.reason) == ("13", INTERNAL)
        assert st.message == "internal error: RuntimeError"
        assert server.service.errors[INTERNAL] == 1
        assert [(e["event"], e["rpc"]) for e in logs] == [("rpc_failed", "HoldPublication")]
    finally:
        await raw.close()
        await server.close(grace_s=0.5)


_BROKEN_GENERIC = [
    ("/grpc.health.v1.Health/Check", b""),
    ("/grpc.health.v1.Health/Watch", b""),
    ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", b"\x22\x01x"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", b"\x22\x01x"),
]


@pytest.mark.parametrize(("path", "request_bytes"), _BROKEN_GENERIC,
                         ids=["check", "watch", "reflection", "reflection-v1alpha"])  # fmt: skip
async def test_a_bug_in_health_or_reflection_is_internal_with_the_trailer(
    path: str, request_bytes: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpclib's health and reflection services end a bug as the relay's calls do: INTERNAL
    with the reason trailer, counted, logged ``rpc_failed``; they ended with grpclib's bare
    UNKNOWN "Internal Server Error", counted nowhere and logged only by grpclib."""
    from kvrelay.service.reflection import _MethodSymbols

    def broken(*_args: Any) -> Any:
        raise RuntimeError("injected fault")

    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    # health reads its status here (Check through grpclib, Watch through the relay's own loop);
    # reflection looks a symbol up here (a file_containing_symbol request, "x")
    monkeypatch.setattr(server.health._status, "__status__", broken)
    monkeypatch.setattr(_MethodSymbols, "FindFileContainingSymbol", broken)
    raw = await RawH2Client.connect(server.port)
    try:
        with structlog.testing.capture_logs() as logs:
            framed = b"\x00" + len(request_bytes).to_bytes(4, "big") + request_bytes
            # (reflection is a bidirectional stream: its request, the stream left open)
            st = raw.open(path, b"", raw=framed, end="Health" in path)
            await asyncio.wait_for(st.ended.wait(), scaled(5))
        assert (st.status, st.reason) == ("13", INTERNAL), (st.status, st.message)
        assert st.message == "internal error: RuntimeError"
        assert server.service.errors[INTERNAL] == 1
        assert [(e["event"], e["rpc"]) for e in logs] == [("rpc_failed", path.lstrip("/"))]
    finally:
        monkeypatch.undo()
        await raw.close()
        await server.close(grace_s=0.5)
