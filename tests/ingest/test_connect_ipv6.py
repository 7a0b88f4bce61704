"""Connect mode over IPv6 (IPv6-only clusters exist): real ZMQ publishers over ``tcp://[::1]``,
and IPv4 publishers on a dual-stack ``tcp://[::]`` bind, where libzmq names them
``::ffff:a.b.c.d``. The oracle is what each publisher sent."""

from __future__ import annotations

import socket

import zmq
import zmq.asyncio

from kvrelay.ingest.connect import ConnectSource, ConnectSpec
from kvrelay.ingest.topic_pattern import TopicPattern
from kvrelay.relay.settings import ConnectConfig
from tests.ingest.test_connect import Pub, Sink, ctx  # noqa: F401 (fixture)
from tests.support.connect import ConnectRig, connect_rig
from tests.support.fleet import eventually, ground_truth
from tests.support.ipv6 import NEEDS_IPV6
from tests.support.rig import subscribe, verify
from tests.support.timing import scaled
from tests.support.vllm_publisher import until

pytestmark = NEEDS_IPV6


async def _source(
    ctx: zmq.asyncio.Context, sink: Sink, *bind: str, allow: tuple[str, ...]  # noqa: F811
) -> ConnectSource:
    spec = ConnectSpec(
        bind=bind, pattern=TopicPattern("kv@{engine}@{model}"), kv_block_size=4, model="m",
        allow=allow,
    )  # fmt: skip
    src = ConnectSource(spec, sink, context=ctx)
    await src.start()
    return src


async def _pub(ctx: zmq.asyncio.Context, endpoint: str, topic: bytes) -> Pub:  # noqa: F811
    """A publisher that can connect over IPv6 (vLLM's sets ZMQ_IPV6 for such an endpoint)."""
    p = Pub.__new__(Pub)
    p.topic, p.seq = topic, 0
    p.sock = ctx.socket(zmq.XPUB)
    p.sock.setsockopt(zmq.LINGER, 0)
    p.sock.setsockopt(zmq.IPV6, 1)
    p.sock.connect(endpoint)
    await p.ready()
    return p


def _port(endpoint: str) -> str:
    return endpoint.rpartition(":")[2]


async def test_an_ipv6_bind_takes_publishers_over_ipv6(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """``bind = "tcp://[::1]:5557"`` passed ``check-config`` and the start failed ("No such
    device": the SUB never set ZMQ_IPV6). ``allow`` and the address binding apply over IPv6 as
    over IPv4."""
    sink = Sink()
    src = await _source(ctx, sink, "tcp://[::1]:0", allow=("::1",))
    try:
        assert src.endpoints[0].startswith("tcp://[::1]:")
        real = await _pub(ctx, src.endpoints[0], b"kv@pod-a@m")
        await real.send()
        await real.send()
        await until(lambda: src.counters.messages >= 2)
        assert sink.batches() == [("pod-a", 0, 0), ("pod-a", 0, 1)]
        c = src.counters
        assert (c.connections_refused, c.peer_refused, c.address_mismatch) == (0, 0, 0)
        assert src.connections == 1
    finally:
        await src.stop()


async def test_an_ipv4_publisher_is_one_address_on_ipv4_and_dual_stack_binds(
    ctx: zmq.asyncio.Context,  # noqa: F811
) -> None:
    """A pool binding ``tcp://127.0.0.1`` and ``tcp://[::]`` (one port per DP rank): an engine
    at 127.0.0.1 whose rank 0 reaches the first and rank 1 the second is ``127.0.0.1`` on one
    and ``::ffff:127.0.0.1`` on the other. Both are one address: ``allow = ["127.0.0.1"]``
    admits both, and the engine's second rank is not taken for another peer claiming its
    name (it was dropped as an address mismatch). A peer outside ``allow`` is still refused."""
    sink = Sink()
    src = await _source(ctx, sink, "tcp://127.0.0.1:0", "tcp://[::]:0", allow=("127.0.0.1",))
    try:
        v4, dual = src.endpoints
        assert dual.startswith("tcp://[::]:")
        rank0 = await _pub(ctx, v4, b"kv@pod-a@m")
        rank1 = await _pub(ctx, f"tcp://127.0.0.1:{_port(dual)}", b"kv@pod-a@m")
        stranger = Pub(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{_port(dual)}", b"kv@pod-a@m")
        await rank0.send(dp=0)
        await rank1.send(dp=1)
        await rank0.send(dp=0)
        await rank1.send(dp=1)
        await until(lambda: src.counters.messages >= 4)
        await until(lambda: src.counters.connections_refused >= 1)
        assert sorted(sink.batches()) == [
            ("pod-a", 0, 0), ("pod-a", 0, 1), ("pod-a", 1, 0), ("pod-a", 1, 1),
        ]  # fmt: skip
        c = src.counters
        assert (c.peer_refused, c.address_mismatch) == (0, 0)
        assert src._owners == {"pod-a": "127.0.0.1"}
        assert src.connections == 2  # the refused stranger does not count
        stranger.sock.close(linger=0)
    finally:
        await src.stop()


async def test_the_simulator_publishes_into_an_ipv6_connect_bind() -> None:
    """``kvrelay sim --connect tcp://[::1]:P``: the simulator's PUB never set ZMQ_IPV6, so it
    never connected to a pool bound on an IPv6 literal (and said nothing). End to end: the
    relay's filter for the engine equals the simulator's ground truth."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    bind = f"tcp://[::1]:{port}"
    connect = ConnectConfig(bind=(bind,), topic_pattern="kv@{engine}@{model}")
    async with connect_rig(connect=connect) as c, c.rig.channel() as ch:
        v6 = ConnectRig(c.rig, bind, c.flavor)
        eng = v6.engine("pod-6", 61)
        await eng.start()
        await eng.wait_subscribed(timeout=scaled(10))
        await eng.step(1)
        r = c.rig
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        for _ in range(10):
            await eng.step(1)
        await verify(r, consumer, truth=ground_truth([eng]), probes=2_000)
        assert [n for _k, n, _c in r.pool.connected.source.members()] == ["pod-6"]
        await consumer.stop()
