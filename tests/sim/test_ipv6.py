"""The simulator over IPv6 literals, as vLLM does it (ZMQ_IPV6 set for an IPv6 host): a PUB
bound on ``tcp://[::1]:P`` (and its replay ROUTER), read back with a raw IPv6 SUB. The
connecting PUB is checked end to end in ``tests/ingest/test_connect_ipv6.py``."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvrelay.sim import SimConfig, SimEngine
from tests.support.simwire_reader import recv_frames, wait_live
from tests.support.timing import scaled


def _ipv6_ports(n: int = 1) -> list[int] | None:
    """``n`` distinct free ports on ``::1`` (all held until the last is picked: one at a time,
    the kernel may hand the same port out twice); None without IPv6 loopback."""
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("::1", 0))
        return [int(s.getsockname()[1]) for s in held]
    except OSError:
        return None
    finally:
        for s in held:
            s.close()


pytestmark = pytest.mark.skipif(_ipv6_ports() is None, reason="no IPv6 loopback (::1)")


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_the_simulator_binds_an_ipv6_literal(zctx: zmq.asyncio.Context) -> None:
    """``bind_host = "[::1]"`` failed at start ("No such device": the PUB never set ZMQ_IPV6)."""
    ports = _ipv6_ports(2)
    assert ports is not None
    pub_port, replay_port = ports
    eng = SimEngine(SimConfig(
        name="v6", seed=3, grpc_port=None, metrics_port=None, bind_host="[::1]",
        pub_port=pub_port, replay_port=replay_port, capacity_blocks=32,
    ))  # fmt: skip
    await eng.start()
    sub = zctx.socket(zmq.SUB)
    try:
        pub = eng.publishers[0]
        assert (pub.endpoint, pub.replay_endpoint) == (
            f"tcp://[::1]:{pub_port}", f"tcp://[::1]:{replay_port}",
        )  # fmt: skip
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        await wait_live(sub, pub, timeout=scaled(10))
        await eng.step(5)
        frames = await recv_frames(sub, pub)
        assert frames and [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    finally:
        sub.close(linger=0)
        await eng.stop()
