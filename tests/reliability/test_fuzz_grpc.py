"""Hypothesis-generated requests against a real RelayServer (a sim engine behind it).

The client is the official ``grpcio`` stack with requests built by the official ``protobuf``
runtime (independent of the server's grpclib + betterproto2). The oracle is a reference model of
§3.1/§3.3: for every request it computes the set of contract violations present; the relay must
answer with the status of one of them and the matching ``kv-relay-error-reason`` trailer, or
succeed when there is none.
"""

from __future__ import annotations

import asyncio
import threading
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.relay import Relay
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.rig import (
    MARKER,
    REASON,
    SVC,
    catalog_producer,
    make_settings,
    start_relay,
    stop_relay,
    wait_live,
)
from tests.support.timing import scaled

P = "RELAY_ERROR_REASON_"
STATUS = {
    "CONTRACT_MISMATCH": grpc.StatusCode.FAILED_PRECONDITION,
    "INVALID_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,
    "UNSUPPORTED_FEATURE": grpc.StatusCode.FAILED_PRECONDITION,
    "POOL_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "PRODUCER_CHANGED": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_LIMIT": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SUBSCRIBER_LAGGED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "SNAPSHOT_PROGRESS_TIMEOUT": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "PUBLICATION_UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "INVALID_PUBLICATION": grpc.StatusCode.FAILED_PRECONDITION,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}
STREAMS = (
    "WatchKvPoolCatalog",
    "SubscribeKvPool",
    "SubscribeServingReadiness",
    "SubscribeKvPoolLoad",
)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class Live:
    port: int
    producer: bytes  # the real producer identity, serialized
    relay: Relay
    server: RelayServer


@pytest.fixture(scope="module")
def live_relay() -> Iterator[Live]:
    """A sim engine + relay + server on a background event loop for the whole module."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def up() -> tuple[SimEngine, Relay, RelayServer, bytes]:
        eng = SimEngine(SimConfig(name="fz", seed=41, capacity_blocks=64))
        await eng.start()
        relay, server = await start_relay(make_settings([eng]))
        await wait_live(relay, 1)
        await eng.step(5)
        from grpclib.client import Channel

        async with Channel("127.0.0.1", server.port) as ch:
            producer = await catalog_producer(ch)
        return eng, relay, server, bytes(producer)

    eng, relay, server, producer = run(up())
    try:
        yield Live(server.port, producer, relay, server)
    finally:

        async def down() -> None:
            await server.close(grace_s=1.0)
            await stop_relay(relay)
            await eng.stop()

        run(down())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture(scope="module")
def channel(live_relay: Live) -> Iterator[grpc.Channel]:
    opts = [("grpc.max_receive_message_length", 8 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{live_relay.port}", options=opts) as ch:
        yield ch


# ---------------------------------------------------------------- reference model (§3.1, §3.3)


def id_problems(sid: str) -> set[str]:
    if not sid or len(sid.encode()) > 128 or any(unicodedata.category(c) == "Cc" for c in sid):
        return {"INVALID_REQUEST"}
    return set()


def producer_problems(req: Any) -> set[str]:
    """Every §3.3 violation in ``expected_producer`` (INVALID_REQUEST / UNSUPPORTED_FEATURE)."""
    if not req.HasField("expected_producer"):
        return {"INVALID_REQUEST"}
    p = req.expected_producer
    if not p.HasField("pool_id"):
        return {"INVALID_REQUEST"}
    out: set[str] = set()
    iv = p.pool_id.identity_version
    if iv == 0:
        out.add("INVALID_REQUEST")
    elif iv != 1:
        out.add("UNSUPPORTED_FEATURE")
    if not p.pool_id.HasField("indexer_domain"):
        out.add("INVALID_REQUEST")
    else:
        dom = p.pool_id.indexer_domain
        for name in ("cache_semantics", "routing_scope"):
            if not dom.HasField(name):
                out.add("INVALID_REQUEST")
                continue
            d = getattr(dom, name)
            if len(d.digest) != 16 or d.source == 0:
                out.add("INVALID_REQUEST")
            if d.source not in (0, 1, 2):
                out.add("UNSUPPORTED_FEATURE")
    if p.layout_generation == 0:
        out.add("INVALID_REQUEST")
    if not p.HasField("ckf_format"):
        out.add("INVALID_REQUEST")
    else:
        f = p.ckf_format
        vals = (f.format_version, f.bucket_count, f.fingerprint_bits, f.slots_per_bucket)
        if 0 in vals:
            out.add("INVALID_REQUEST")
        if (f.format_version, f.fingerprint_bits, f.slots_per_bucket) != (1, 16, 4):
            out.add("UNSUPPORTED_FEATURE")
        bc = f.bucket_count
        if bc > 1 << 24:
            out.add("UNSUPPORTED_FEATURE")
        if bc < 2 or bc & (bc - 1):
            out.add("INVALID_REQUEST")
    return out


def expected(method: str, req: Any, real_producer: Any) -> set[str]:
    """Acceptable outcomes: reason names, or {"OK"}."""
    if req.contract_marker != MARKER:
        return {"CONTRACT_MISMATCH"}
    if method == "GetRelayInfo":
        return {"OK"}
    bad = id_problems(req.subscriber_id)
    if bad:
        return bad
    if method != "SubscribeKvPool":
        return {"OK"}
    bad = producer_problems(req)
    if bad:
        return bad
    p = req.expected_producer
    if p.SerializeToString(deterministic=True) == real_producer.SerializeToString(
        deterministic=True
    ):
        return {"OK"}
    same_pool = (
        p.pool_id.identity_version == real_producer.pool_id.identity_version
        and p.pool_id.indexer_domain == real_producer.pool_id.indexer_domain
        and p.pool_id.dc_id == real_producer.pool_id.dc_id
    )
    return {"PRODUCER_CHANGED"} if same_pool else {"POOL_NOT_FOUND"}


# ---------------------------------------------------------------- calling


def call(ch: grpc.Channel, method: str, body: bytes) -> tuple[str, Any]:
    """Returns ("OK", None) or (reason-or-status, (code, trailers))."""
    path = SVC + method
    try:
        if method == "GetRelayInfo":
            ch.unary_unary(path)(body, timeout=10)
            return "OK", None
        it = ch.unary_stream(path)(body, timeout=10)
        next(it)  # the first message of a healthy stream (snapshot chunk / plane snapshot)
        it.cancel()
        return "OK", None
    except grpc.RpcError as exc:
        trailers = dict(exc.trailing_metadata() or ())
        reason = trailers.get(REASON, "")
        return reason.removeprefix(P) if reason else f"<no trailer: {exc.code()}>", (
            exc.code(),
            trailers,
        )


def check(ch: grpc.Channel, method: str, req: Any, real: Any) -> None:
    want = expected(method, req, real)
    got, detail = call(ch, method, req.SerializeToString())
    assert got in want, f"{method}: got {got} {detail}, want one of {want}"
    if detail is not None:
        assert detail[0] == STATUS[got], f"{got} came with status {detail[0]}"


# ---------------------------------------------------------------- strategies

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
markers = st.one_of(st.just(MARKER), st.just(MARKER), u32)
text_ids = st.one_of(
    st.text(min_size=1, max_size=20),
    st.text(alphabet=st.characters(categories=["Cc"]), min_size=1, max_size=3),
    st.text(max_size=300),
    st.builds(lambda n, c: c * n, st.integers(100, 200_000), st.sampled_from("aé€𝄞")),
    st.just(""),
)


@st.composite
def producers(draw: st.DrawFn, pb2: ModuleType, real: Any) -> Any:
    """The real producer with a random subset of fields broken, removed or replaced."""
    p = pb2.ProducerIdentity()
    p.CopyFrom(real)
    if draw(st.booleans()):
        p.pool_id.identity_version = draw(st.sampled_from([0, 1, 2]) | u32)
    dom = p.pool_id.indexer_domain
    for d in (dom.cache_semantics, dom.routing_scope):
        if draw(st.booleans()):
            d.digest = draw(st.binary(min_size=0, max_size=40))
        if draw(st.booleans()):
            d.source = draw(st.sampled_from([0, 1, 2, 3]) | st.integers(0, 2**31 - 1))
    if draw(st.booleans()):
        p.pool_id.dc_id = draw(u64)
    if draw(st.booleans()):
        p.producer_incarnation = draw(u64)
    if draw(st.booleans()):
        p.layout_generation = draw(st.sampled_from([0, 1, 2]) | u64)
    f = p.ckf_format
    if draw(st.booleans()):
        f.format_version = draw(st.sampled_from([0, 1, 2]) | u32)
    if draw(st.booleans()):
        f.bucket_count = draw(
            st.sampled_from([0, 1, 3, 1 << 24, (1 << 24) + 1, 1 << 25, 2**64 - 1])
            | st.integers(0, 40).map(lambda k: 1 << k if k < 64 else 0)
            | u64
        )
    if draw(st.booleans()):
        f.fingerprint_bits = draw(st.sampled_from([0, 8, 16, 32]) | u32)
    if draw(st.booleans()):
        f.slots_per_bucket = draw(st.sampled_from([0, 2, 4, 8]) | u32)
    if draw(st.booleans()):
        f.seed = draw(u64)
    for field, owner in (
        ("pool_id", p),
        ("indexer_domain", p.pool_id),
        ("cache_semantics", p.pool_id.indexer_domain),
        ("routing_scope", p.pool_id.indexer_domain),
        ("ckf_format", p),
    ):
        if draw(st.integers(0, 9)) == 0:
            owner.ClearField(field)
    return p


@given(data=st.data())
@FUZZ
def test_fuzzed_requests_get_documented_statuses(
    live_relay: Live, channel: grpc.Channel, official_pb2: dict[str, ModuleType], data: Any
) -> None:
    m = official_pb2["relay"]
    real = m.ProducerIdentity.FromString(live_relay.producer)
    method = data.draw(st.sampled_from(["GetRelayInfo", *STREAMS, "SubscribeKvPool"]))
    marker = data.draw(markers)
    if method == "GetRelayInfo":
        req = m.RelayInfoRequest(contract_marker=marker)
    else:
        cls = {
            "WatchKvPoolCatalog": m.WatchKvPoolCatalogRequest,
            "SubscribeKvPool": m.SubscribeKvPoolRequest,
            "SubscribeServingReadiness": m.SubscribeServingReadinessRequest,
            "SubscribeKvPoolLoad": m.SubscribeKvPoolLoadRequest,
        }[method]
        req = cls(subscriber_id=data.draw(text_ids), contract_marker=marker)
        if method == "SubscribeKvPool" and data.draw(st.integers(0, 9)) > 0:
            req.expected_producer.CopyFrom(data.draw(producers(m, real)))
    check(channel, method, req, real)


@given(method=st.sampled_from(["GetRelayInfo", *STREAMS]), body=st.binary(max_size=512))
@FUZZ
def test_random_bytes_as_request_body(
    live_relay: Live, channel: grpc.Channel, official_pb2: dict[str, ModuleType], method: str,
    body: bytes,
) -> None:
    """Whatever the bytes, the relay decodes them as official protobuf does: INVALID_REQUEST
    exactly when the official parser rejects them, otherwise the outcome the reference model
    predicts (a mismatched wire type or a repeated sub-message once got INVALID_REQUEST here)."""
    m = official_pb2["relay"]
    real = m.ProducerIdentity.FromString(live_relay.producer)
    cls = {
        "GetRelayInfo": m.RelayInfoRequest,
        "WatchKvPoolCatalog": m.WatchKvPoolCatalogRequest,
        "SubscribeKvPool": m.SubscribeKvPoolRequest,
        "SubscribeServingReadiness": m.SubscribeServingReadinessRequest,
        "SubscribeKvPoolLoad": m.SubscribeKvPoolLoadRequest,
    }[method]
    try:
        req = cls.FromString(body)
    except Exception:  # not a valid encoding of the request message
        got, detail = call(channel, method, body)
        assert got == "INVALID_REQUEST", f"undecodable body: got {got} {detail}"
        assert detail is not None and detail[0] == STATUS[got]
        return
    check(channel, method, req, real)


@pytest.mark.parametrize("body", [b"\x00", b"\x08", b"\xfa\x07"])
def test_undecodable_get_relay_info_body(channel: grpc.Channel, body: bytes) -> None:
    got, detail = call(channel, "GetRelayInfo", body)
    assert got == "INVALID_REQUEST", f"got {got} {detail}"
    assert detail is not None and detail[0] == STATUS[got]


def test_relay_still_serves_after_fuzzing(live_relay: Live, channel: grpc.Channel) -> None:
    """Runs last in this module: the fuzzed relay answers, holds no leaked permits."""
    got, _ = call(channel, "GetRelayInfo", pb.RelayInfoRequest(contract_marker=MARKER).__bytes__())
    assert got == "OK"
    svc = live_relay.server.service
    deadline = time.monotonic() + scaled(10)
    permits = (svc.pool_permits, svc.catalog_permits, svc.readiness_permits, svc.load_permits)
    while any(p.in_use for p in permits) and time.monotonic() < deadline:
        time.sleep(0.05)  # cancelled streams are released by the server's loop
    assert all(p.in_use == 0 for p in permits), "fuzzed streams leaked subscriber permits"
    assert sum(svc.errors.values()) > 0
