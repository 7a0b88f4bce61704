"""``SubscribeServingLoad`` (Dynamo 1.7's sixth RPC) over real loopback gRPC, checked by grpcio
with official protobuf stubs generated from the updated proto: served directly, through a mirror
and through a ``workers = N`` fan-out worker; and a mirror of a relay without the RPC."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from types import ModuleType
from typing import Any

import grpc
from grpclib.server import Server

from kvrelay._aio import server_closed
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.mirror import Mirror
from kvrelay.mirror.settings import UpstreamAddress
from kvrelay.service.codec import PassThroughCodec
from kvrelay.service.server import KvEventRelayService, RelayServer
from tests.support.faulty_proxy import FaultyProxy
from tests.support.mem_relay import MARKER, GrpcioClient, MemRelayView, StartRelay
from tests.support.mirror_rig import mirror_settings, settle
from tests.support.timing import scaled

K = "kv-relay-error-reason"


def _request(sid: str = "router-1", marker: int = MARKER) -> pb.SubscribeServingLoadRequest:
    return pb.SubscribeServingLoadRequest(subscriber_id=sid, contract_marker=marker)


async def test_windows_reach_an_official_client_byte_for_byte(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient],
    official_pb2: dict[str, ModuleType],
) -> None:  # fmt: skip
    view, server = await start_relay()
    view.add_pool("pool-a", 1024)
    view.serving_load.publish(view.serving_load_msg(1, started=5), 1)
    await settle(view, server)
    gio = grpcio_client(server.port)
    call = gio.stub.SubscribeServingLoad(gio.convert(_request()))
    first = await call.read()
    # The official parse re-encodes to the exact bytes the upstream view published.
    assert first.SerializeToString(deterministic=True) == bytes(view.serving_load.current()[1])
    assert first.window_sequence == 1 and first.contract_marker == MARKER
    R = official_pb2["relay"]
    (pool,) = first.pools
    assert pool.load.status == R.DATA_STATUS_COMPLETE
    assert pool.load.tokens.HasField("active_decode_blocks")
    assert not pool.load.tokens.HasField("active_prefill_tokens")  # unset, not zero
    assert not pool.load.HasField("requests")  # pools carry no request stats
    (model,) = first.models
    assert model.load.status == R.DATA_STATUS_DEGRADED
    assert model.load.requests.requests_started_total == 5
    assert not model.load.requests.HasField("requests_generating")
    assert (model.deployment.expected_frontends, model.deployment.observed_frontends) == (3, 2)
    for seq in (2, 3):
        view.serving_load.publish(view.serving_load_msg(seq, started=5 + seq), seq)
        nxt = await asyncio.wait_for(call.read(), scaled(10))
        assert nxt.window_sequence == seq
        assert nxt.models[0].load.requests.requests_started_total == 5 + seq
    call.cancel()


async def test_request_validation_and_lag(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay(RelayLimits(load_fanout_capacity=2))
    gio = grpcio_client(server.port)
    bad_marker = await gio.collect("SubscribeServingLoad", _request(marker=1))
    assert bad_marker.status == grpc.StatusCode.FAILED_PRECONDITION
    assert bad_marker.trailers[K] == "RELAY_ERROR_REASON_CONTRACT_MISMATCH"
    no_id = await gio.collect("SubscribeServingLoad", _request(sid=""))
    assert no_id.status == grpc.StatusCode.INVALID_ARGUMENT
    assert no_id.trailers[K] == "RELAY_ERROR_REASON_INVALID_REQUEST"
    # A reader more than load_fanout_capacity windows behind is told to resubscribe.
    call = gio.stub.SubscribeServingLoad(gio.convert(_request()))
    assert (await call.read()).window_sequence == 0
    view.serving_load.publish(view.serving_load_msg(9), 9)
    try:
        async with asyncio.timeout(scaled(10)):
            while True:
                if await call.read() is grpc.aio.EOF:
                    raise AssertionError("the stream ended cleanly")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(exc.trailing_metadata() or ())
        assert trailers[K] == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
    else:
        raise AssertionError("the lagging serving-load reader was not ended")
    # A closed plane ends its readers UNAVAILABLE / PUBLICATION_UNAVAILABLE (§4.5a).
    await settle(view, server)
    call = gio.stub.SubscribeServingLoad(gio.convert(_request()))
    assert (await call.read()).window_sequence == 9
    view.serving_load.close()
    try:
        async with asyncio.timeout(scaled(10)):
            if await call.read() is grpc.aio.EOF:
                raise AssertionError("the stream ended cleanly")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(exc.trailing_metadata() or ())
        assert trailers[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    else:
        raise AssertionError("a closed serving-load plane did not end its reader")


class _Dynamo16Service(KvEventRelayService):
    """The five RPCs of a relay from before SubscribeServingLoad (Dynamo 1.6)."""

    def __mapping__(self) -> dict[str, Any]:
        return {
            k: v for k, v in super().__mapping__().items()
            if not k.endswith("/SubscribeServingLoad")
        }  # fmt: skip


async def test_mirror_of_a_relay_without_the_rpc_answers_unimplemented(
    grpcio_client: Callable[[int], GrpcioClient],
) -> None:
    view = MemRelayView()
    upstream = Server([_Dynamo16Service(view)], codec=PassThroughCodec(8 << 20))
    with socket.socket() as probe:  # a free port for the 1.6-shaped server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    await upstream.start("127.0.0.1", port)
    proxy = await FaultyProxy("127.0.0.1", port).start()  # the path the mirror loses below
    mirror = Mirror(mirror_settings(UpstreamAddress(host="127.0.0.1", port=proxy.port), None))
    mirror.start()
    local = RelayServer(mirror)
    await local.start("127.0.0.1", 0)
    try:
        await asyncio.wait_for(mirror.synced.wait(), scaled(10))  # in sync without that plane
        direct = await grpcio_client(port).collect("SubscribeServingLoad", _request())
        assert direct.status == grpc.StatusCode.UNIMPLEMENTED

        async def unsupported_seen() -> None:
            while not mirror.serving_load.unsupported:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(unsupported_seen(), scaled(10))
        gio = grpcio_client(local.port)
        res = await gio.collect("SubscribeServingLoad", _request())
        assert res.status == grpc.StatusCode.UNIMPLEMENTED  # as its upstream answers
        assert K not in res.trailers  # plain gRPC: no relay reason for an absent RPC
        # whatever the request, as the upstream answers (it never reads it): a wrong marker and
        # an empty subscriber id were refused CONTRACT_MISMATCH and INVALID_REQUEST
        for bad in (_request(marker=MARKER + 1), _request(sid="")):
            assert (await grpcio_client(port).collect("SubscribeServingLoad", bad)).status == (
                grpc.StatusCode.UNIMPLEMENTED
            )
            odd = await gio.collect("SubscribeServingLoad", bad)
            assert (odd.status, K in odd.trailers) == (grpc.StatusCode.UNIMPLEMENTED, False)
        assert local.service.unsupported == 3
        assert mirror.plane_ends["serving-load_unimplemented"] >= 1
        # Every other plane is served as usual.
        load = await gio.collect("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest(
            subscriber_id="l", contract_marker=MARKER), limit=1)  # fmt: skip
        assert len(load.messages) == 1
        # Without an upstream session every RPC is refused PUBLICATION_UNAVAILABLE, this one
        # too: the upstream's UNIMPLEMENTED says nothing of the relay it may come back as.
        await proxy.close()

        async def session_lost() -> None:
            while mirror.catalog.live:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(session_lost(), scaled(10))
        down = await gio.collect("SubscribeServingLoad", _request())
        assert down.status == grpc.StatusCode.UNAVAILABLE
        assert down.trailers[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    finally:
        await local.close(grace_s=1.0)
        await mirror.stop()
        await proxy.close()
        upstream.close()
        await server_closed(upstream)  # (a grpcio client may hold its connection)
