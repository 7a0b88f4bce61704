"""The simulator over IPv6 literals, as vLLM does it (ZMQ_IPV6 set for an IPv6 host): a PUB
bound on ``tcp://[::1]:P`` (and its replay ROUTER), read back with a raw IPv6 SUB. The
connecting PUB is checked end to end in ``tests/ingest/test_connect_ipv6.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvrelay.sim import SimConfig, SimEngine
from tests.support.ipv6 import NEEDS_IPV6
from tests.support.ports import distinct_ports
from tests.support.simwire_reader import recv_frames, wait_live
from tests.support.timing import scaled

pytestmark = NEEDS_IPV6


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_the_simulator_binds_an_ipv6_literal(zctx: zmq.asyncio.Context) -> None:
    """``bind_host = "[::1]"`` failed at start ("No such device": the PUB never set ZMQ_IPV6)."""
    pub_port, replay_port = distinct_ports(2, "::1")
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
