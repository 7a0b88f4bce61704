"""Every admission error: status code AND `kv-relay-error-reason` trailer, seen by both clients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from tests.support.mem_relay import (
    MARKER,
    GrpcioClient,
    StartRelay,
    grpclib_channel,
    grpclib_collect,
    make_producer,
    sub_request,
)
from tests.support.mirror_rig import is_direct, served_hub, set_limits

BC = 1024
K = "kv-relay-error-reason"


def P(**kw: Any) -> pb.ProducerIdentity:
    return make_producer("pool-a", bucket_count=kw.pop("bucket_count", BC), **kw)


def mutate(fn: Callable[[pb.ProducerIdentity], None]) -> pb.ProducerIdentity:
    p = P()
    fn(p)
    return p


def _set(path: str, value: Any) -> Callable[[pb.ProducerIdentity], None]:
    def f(p: pb.ProducerIdentity) -> None:
        obj: Any = p
        parts = path.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part)
        setattr(obj, parts[-1], value)

    return f


INV, UNS = "RELAY_ERROR_REASON_INVALID_REQUEST", "RELAY_ERROR_REASON_UNSUPPORTED_FEATURE"
CASES: list[tuple[str, pb.SubscribeKvPoolRequest, Status, str]] = [
    (
        "bad-marker",
        sub_request(P(), marker=0),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_CONTRACT_MISMATCH",
    ),
    (
        "marker-before-id",
        sub_request(P(), "", marker=1),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_CONTRACT_MISMATCH",
    ),
    ("empty-id", sub_request(P(), ""), Status.INVALID_ARGUMENT, INV),
    ("129-bytes", sub_request(P(), "a" * 129), Status.INVALID_ARGUMENT, INV),
    ("130-bytes-utf8", sub_request(P(), "é" * 65), Status.INVALID_ARGUMENT, INV),
    ("newline", sub_request(P(), "a\nb"), Status.INVALID_ARGUMENT, INV),
    ("del", sub_request(P(), "a\x7f"), Status.INVALID_ARGUMENT, INV),
    ("nel", sub_request(P(), "a\u0085"), Status.INVALID_ARGUMENT, INV),
    ("nul", sub_request(P(), "\x00"), Status.INVALID_ARGUMENT, INV),
    ("missing-producer", sub_request(None), Status.INVALID_ARGUMENT, INV),
    ("missing-pool-id", sub_request(mutate(_set("pool_id", None))), Status.INVALID_ARGUMENT, INV),
    (
        "identity-version-0",
        sub_request(mutate(_set("pool_id.identity_version", 0))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "missing-domain",
        sub_request(mutate(_set("pool_id.indexer_domain", None))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "missing-routing",
        sub_request(mutate(_set("pool_id.indexer_domain.routing_scope", None))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "digest-15",
        sub_request(mutate(_set("pool_id.indexer_domain.cache_semantics.digest", b"x" * 15))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "digest-17",
        sub_request(mutate(_set("pool_id.indexer_domain.routing_scope.digest", b"x" * 17))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "source-0",
        sub_request(mutate(_set("pool_id.indexer_domain.routing_scope.source", 0))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    ("layout-0", sub_request(mutate(_set("layout_generation", 0))), Status.INVALID_ARGUMENT, INV),
    ("missing-format", sub_request(mutate(_set("ckf_format", None))), Status.INVALID_ARGUMENT, INV),
    ("bc-0", sub_request(mutate(_set("ckf_format.bucket_count", 0))), Status.INVALID_ARGUMENT, INV),
    ("bc-1", sub_request(mutate(_set("ckf_format.bucket_count", 1))), Status.INVALID_ARGUMENT, INV),
    ("bc-3", sub_request(mutate(_set("ckf_format.bucket_count", 3))), Status.INVALID_ARGUMENT, INV),
    (
        "fp-0",
        sub_request(mutate(_set("ckf_format.fingerprint_bits", 0))),
        Status.INVALID_ARGUMENT,
        INV,
    ),
    (
        "identity-version-2",
        sub_request(mutate(_set("pool_id.identity_version", 2))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "source-unknown",
        sub_request(mutate(_set("pool_id.indexer_domain.cache_semantics.source", 7))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "format-2",
        sub_request(mutate(_set("ckf_format.format_version", 2))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "fp-8",
        sub_request(mutate(_set("ckf_format.fingerprint_bits", 8))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "slots-8",
        sub_request(mutate(_set("ckf_format.slots_per_bucket", 8))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "bc-2^25",
        sub_request(mutate(_set("ckf_format.bucket_count", 1 << 25))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "bc-huge-not-pow2",
        sub_request(mutate(_set("ckf_format.bucket_count", (1 << 24) + 1))),
        Status.FAILED_PRECONDITION,
        UNS,
    ),
    (
        "pool-not-found",
        sub_request(make_producer("pool-zz", bucket_count=BC)),
        Status.NOT_FOUND,
        "RELAY_ERROR_REASON_POOL_NOT_FOUND",
    ),
    (
        "changed-layout",
        sub_request(P(layout_generation=2)),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_PRODUCER_CHANGED",
    ),
    (
        "changed-seed",
        sub_request(P(seed=1)),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_PRODUCER_CHANGED",
    ),
    (
        "changed-bc",
        sub_request(P(bucket_count=2048)),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_PRODUCER_CHANGED",
    ),
    (
        "changed-incarnation",
        sub_request(P(incarnation=5)),
        Status.FAILED_PRECONDITION,
        "RELAY_ERROR_REASON_PRODUCER_CHANGED",
    ),
]


async def test_subscribe_pool_error_matrix(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay()
    view.add_pool("pool-a", BC)
    gio = grpcio_client(server.port)
    ch = grpclib_channel(server.port)
    try:
        for name, req, status, reason in CASES:
            r = await grpclib_collect(ch, "SubscribeKvPool", req, pb.FilterUpdate)
            assert (r.status, r.trailers.get(K), r.messages) == (status, reason, []), name
            g = await gio.collect("SubscribeKvPool", req)
            assert g.status == getattr(grpc.StatusCode, status.name), name
            assert g.trailers.get(K) == reason and not g.messages, name
    finally:
        ch.close()
    assert server.service.pool_permits.in_use == 0
    assert server.service.errors[INV] >= 2 * 15


async def test_128_byte_utf8_subscriber_id_is_accepted(start_relay: StartRelay) -> None:
    view, server = await start_relay()
    view.add_pool("pool-a", BC)
    ch = grpclib_channel(server.port)
    try:
        r = await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(P(), "é" * 64), pb.FilterUpdate, limit=1
        )
        assert r.status is None and len(r.messages) == 1
        assert r.messages[0].kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
    finally:
        ch.close()


PLANE_RPCS = [
    ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate),
    ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest, pb.ServingReadinessUpdate),
    ("SubscribeKvPoolLoad", pb.SubscribeKvPoolLoadRequest, pb.KvPoolLoadUpdate),
    ("SubscribeServingLoad", pb.SubscribeServingLoadRequest, pb.ServingLoadUpdate),
]


@pytest.mark.parametrize("method,req_t,rep_t", PLANE_RPCS)
async def test_plane_rpc_request_errors(
    start_relay: StartRelay,
    grpcio_client: Callable[[int], GrpcioClient],
    method: str,
    req_t: type,
    rep_t: type,
) -> None:
    _view, server = await start_relay()
    gio = grpcio_client(server.port)
    ch = grpclib_channel(server.port)
    cases = [
        (
            req_t(subscriber_id="ok", contract_marker=MARKER + 1),
            Status.FAILED_PRECONDITION,
            "RELAY_ERROR_REASON_CONTRACT_MISMATCH",
        ),
        (req_t(subscriber_id="", contract_marker=MARKER), Status.INVALID_ARGUMENT, INV),
        (req_t(subscriber_id="x" * 129, contract_marker=MARKER), Status.INVALID_ARGUMENT, INV),
        (req_t(subscriber_id="tab\there", contract_marker=MARKER), Status.INVALID_ARGUMENT, INV),
    ]
    try:
        for req, status, reason in cases:
            r = await grpclib_collect(ch, method, req, rep_t)
            assert (r.status, r.trailers.get(K)) == (status, reason)
            g = await gio.collect(method, req)
            assert (g.status, g.trailers.get(K)) == (getattr(grpc.StatusCode, status.name), reason)
        ok = await grpclib_collect(
            ch, method, req_t(subscriber_id="x" * 128, contract_marker=MARKER), rep_t, limit=1
        )
        assert ok.status is None and len(ok.messages) == 1
    finally:
        ch.close()


async def test_get_relay_info_both_clients(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay()
    gio = grpcio_client(server.port)
    reply, code, trailers = await gio.unary(
        "GetRelayInfo", pb.RelayInfoRequest(contract_marker=MARKER)
    )
    assert code == grpc.StatusCode.OK and K not in trailers
    assert reply.protocol_version == 1 and reply.contract_marker == MARKER
    assert reply.relay.drt_instance_id == 77
    assert reply.relay.relay_incarnation == view.relay_identity.relay_incarnation
    reply, code, trailers = await gio.unary("GetRelayInfo", pb.RelayInfoRequest())
    assert reply is None and code == grpc.StatusCode.FAILED_PRECONDITION
    assert trailers[K] == "RELAY_ERROR_REASON_CONTRACT_MISMATCH"
    try:  # the message says which value to send, and where
        await gio.stub.GetRelayInfo(gio.convert(pb.RelayInfoRequest()))
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
    assert details.startswith("no contract_marker: send contract_marker = 1263948337 (0x4B565231")
    assert "field 127, fixed32" in details

    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    ch = grpclib_channel(server.port)
    try:
        stub = pb.KvEventRelayStub(ch)
        info = await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER))
        assert bytes(info.relay) == bytes(view.relay_identity) and info.contract_marker == MARKER
        async with ch.request(
            "/dynamo.kvrelay.v1.KvEventRelay/GetRelayInfo",
            Cardinality.UNARY_UNARY,
            pb.RelayInfoRequest,
            pb.RelayInfo,
        ) as st:
            await st.send_message(pb.RelayInfoRequest(contract_marker=5), end=True)
            with pytest.raises(GRPCError) as ei:
                await st.recv_message()
            assert ei.value.status == Status.FAILED_PRECONDITION
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_CONTRACT_MISMATCH"
    finally:
        ch.close()


async def test_stale_request_does_not_initialize_replacement_hub(start_relay: StartRelay) -> None:
    view, server = await start_relay()
    old = view.add_pool("pool-a", BC)
    stale = old.producer
    new = view.replace(old)
    ch = grpclib_channel(server.port)
    try:
        r = await grpclib_collect(ch, "SubscribeKvPool", sub_request(stale), pb.FilterUpdate)
        assert r.status == Status.FAILED_PRECONDITION
        assert r.trailers[K] == "RELAY_ERROR_REASON_PRODUCER_CHANGED"
        assert old.hub_inits == 0
        # a mirror subscribes to every listed generation itself; directly, nothing did
        assert new.hub_inits == (0 if is_direct(server) else 1)
        assert served_hub(server, old) is None
    finally:
        ch.close()


async def test_resource_limits(start_relay: StartRelay) -> None:
    view, server = await start_relay(
        RelayLimits(
            max_subscribers_per_pool=2,
            max_pool_streams_total=3,
            max_initialized_pool_hubs=1,
            max_catalog_subscribers=1,
        )
    )
    a = view.add_pool("pool-a", BC)
    b = view.add_pool("pool-b", BC)
    ch = grpclib_channel(server.port)
    reason = "RELAY_ERROR_REASON_RESOURCE_LIMIT"
    import asyncio

    from grpclib.const import Cardinality

    opened: list[Any] = []
    try:

        async def open_stream(method: str, req: Any, rep: type) -> Any:
            cm = ch.request(
                "/dynamo.kvrelay.v1.KvEventRelay/" + method,
                Cardinality.UNARY_STREAM,
                type(req),
                rep,
            )
            st = await cm.__aenter__()
            opened.append((cm, st))
            await st.send_message(req, end=True)
            assert await st.recv_message() is not None
            return st

        await open_stream("SubscribeKvPool", sub_request(a.producer, "a1"), pb.FilterUpdate)
        await open_stream("SubscribeKvPool", sub_request(a.producer, "a2"), pb.FilterUpdate)
        r = await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(a.producer, "a3"), pb.FilterUpdate
        )
        assert (r.status, r.trailers[K]) == (Status.RESOURCE_EXHAUSTED, reason)
        assert "per-pool" in (r.message or "")
        # initialized-hub cap (1): pool-b cannot get a hub
        r = await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(b.producer, "b1"), pb.FilterUpdate
        )
        assert (r.status, r.trailers[K]) == (Status.RESOURCE_EXHAUSTED, reason)
        # existence comes before the hub cap: with no hub free, an unknown pool and a stale
        # generation still get their own answers (a mirror or worker too, from its listing)
        for req, want in (
            (sub_request(make_producer("pool-zz", bucket_count=BC), "z1"),
             (Status.NOT_FOUND, "RELAY_ERROR_REASON_POOL_NOT_FOUND")),
            (sub_request(P(layout_generation=2), "a-stale"),
             (Status.FAILED_PRECONDITION, "RELAY_ERROR_REASON_PRODUCER_CHANGED")),
        ):  # fmt: skip
            r = await grpclib_collect(ch, "SubscribeKvPool", req, pb.FilterUpdate)
            assert (r.status, r.trailers[K]) == want
        set_limits(view, server, RelayLimits(max_initialized_pool_hubs=2))
        await open_stream("SubscribeKvPool", sub_request(b.producer, "b1"), pb.FilterUpdate)
        r = await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(b.producer, "b2"), pb.FilterUpdate
        )
        assert (r.status, r.trailers[K]) == (Status.RESOURCE_EXHAUSTED, reason)
        assert "total pool stream limit 3" in (r.message or "")
        await open_stream(
            "WatchKvPoolCatalog",
            pb.WatchKvPoolCatalogRequest(subscriber_id="c1", contract_marker=MARKER),
            pb.KvPoolCatalogUpdate,
        )
        r = await grpclib_collect(
            ch,
            "WatchKvPoolCatalog",
            pb.WatchKvPoolCatalogRequest(subscriber_id="c2", contract_marker=MARKER),
            pb.KvPoolCatalogUpdate,
        )
        assert (r.status, r.trailers[K]) == (Status.RESOURCE_EXHAUSTED, reason)
        assert server.service.pool_permits.in_use == 3
    finally:
        for cm, st in opened:
            await st.cancel()
            await cm.__aexit__(None, None, None)
        ch.close()
    for _ in range(100):
        if server.service.pool_permits.in_use == 0 and server.service.catalog_permits.in_use == 0:
            break
        await asyncio.sleep(0.01)
    assert server.service.pool_permits.in_use == 0
    assert server.service.catalog_permits.in_use == 0
    hub = served_hub(server, a)
    assert hub is not None and hub.subscriber_count == 0


async def test_65th_subscriber_default_limits(start_relay: StartRelay) -> None:
    """Defaults: 64 pool streams in total; the 65th gets RESOURCE_EXHAUSTED / RESOURCE_LIMIT."""
    import asyncio

    from grpclib.const import Cardinality

    view, server = await start_relay()
    gens = [view.add_pool("pool-a", BC), view.add_pool("pool-b", BC)]
    ch = grpclib_channel(server.port)
    opened: list[Any] = []
    try:
        for i in range(64):
            cm = ch.request(
                "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool",
                Cardinality.UNARY_STREAM,
                pb.SubscribeKvPoolRequest,
                pb.FilterUpdate,
            )
            st = await cm.__aenter__()
            opened.append((cm, st))
            await st.send_message(sub_request(gens[i % 2].producer, f"s{i}"), end=True)
            assert (await st.recv_message()).kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
        r = await grpclib_collect(
            ch, "SubscribeKvPool", sub_request(gens[0].producer, "s64"), pb.FilterUpdate
        )
        assert (r.status, r.trailers[K]) == (
            Status.RESOURCE_EXHAUSTED,
            "RELAY_ERROR_REASON_RESOURCE_LIMIT",
        )
        assert "64" in (r.message or "")
    finally:
        for cm, st in opened:
            await st.cancel()
            await cm.__aexit__(None, None, None)
        ch.close()
    for _ in range(200):
        if server.service.pool_permits.in_use == 0:
            break
        await asyncio.sleep(0.01)
    assert server.service.pool_permits.in_use == 0


async def test_oversized_request_gets_resource_limit_with_the_trailer(
    start_relay: StartRelay,
) -> None:
    """A request above max_message_bytes is refused like every other error: status and reason."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1024)
    req = sub_request(gen.producer, "x")
    req.subscriber_id = "x" * (9 * 1024 * 1024)  # 9 MiB > the 8 MiB bound
    ch = grpclib_channel(server.port)
    try:
        r = await grpclib_collect(ch, "SubscribeKvPool", req, pb.FilterUpdate)
        assert r.status == Status.RESOURCE_EXHAUSTED
        assert r.trailers[K] == "RELAY_ERROR_REASON_RESOURCE_LIMIT"
    finally:
        ch.close()
