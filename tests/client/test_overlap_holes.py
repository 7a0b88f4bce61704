"""``RelayClient.overlap`` against a filter with a hole: a block removed while its children stay.

vLLM may evict a block whose descendants it still holds, and the relay removes exactly that block
(its children stay published). The cached depth is the longest prefix whose blocks are all
present, so a prompt through such a chain hits only up to the hole. A sampled search (probe 0, 1,
2, 4, 8, …, then binary search) never looks at the hole and reads the whole chain as cached.
A real relay on loopback, a crafted vLLM publisher, the SDK's replica; the expectation comes
from the ``xxhash`` package's hashes of the prompt, not from the SDK.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq.asyncio

from kvrelay.client import ClientConfig, RelayClient, prefix_depth
from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.ingest.kinds import EngineKind
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.hashing import dynamo_sequence_hashes
from tests.support import vllm_wire as W
from tests.support.timing import scaled
from tests.support.vllm_publisher import TestPublisher

B = 4
MODEL = "hole-model"
BLOCKS = 16
HOLE = 3


async def test_a_removed_block_ends_the_cached_prefix_its_children_stay() -> None:
    ctx = zmq.asyncio.Context()
    pub = TestPublisher(ctx, topic=b"kv-events")
    assert pub.replay_endpoint is not None
    engine = EngineSpec(name="hole-e", kind=EngineKind.VLLM, static=StaticSourceConfig(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, dp_ranks=(0,),
        topic="kv-events"))  # fmt: skip
    spec = PoolSpec(namespace="ns", component="backend", endpoint="generate", engines=(engine,),
                    expected_blocks=2048, model=MODEL, kv_block_size=B)  # fmt: skip
    relay = Relay(RelaySettings(dc_name="dc-hole", pools=(spec,), discovery_interval_s=0.1))
    await relay.start()
    server = RelayServer(relay, relay.settings.limits)
    await server.start("127.0.0.1", 0)
    try:
        await pub.wait_subscribed(timeout=20)
        tokens = list(range(1000, 1000 + BLOCKS * B))
        ext = list(range(501, 501 + BLOCKS))  # the engine's own block ids
        await pub.publish(W.batch([W.stored("map", block_hashes=ext, token_ids=tokens,
                                            block_size=B)]))  # fmt: skip
        await pub.publish(W.batch([W.removed("map", [ext[HOLE]])]))
        canonical = np.array(dynamo_sequence_hashes(tokens, B), dtype=np.uint64)
        config = ClientConfig(subscriber_id="hole-test")
        async with RelayClient([f"127.0.0.1:{server.port}"], config=config) as client:
            assert await client.wait_ready(timeout=scaled(20))
            want = np.ones(BLOCKS, dtype=bool)
            want[HOLE] = False
            deadline = time.monotonic() + scaled(20)
            while True:  # until the replica holds both batches
                present = next(iter(client.contains(canonical).values()), None)
                if present is not None and np.array_equal(present, want):
                    break
                assert time.monotonic() < deadline, f"replica never showed the hole: {present}"
                await asyncio.sleep(0.02)
            # the sampled search reads past the hole; the SDK's depth stops at it
            assert prefix_depth(BLOCKS, present.tolist().__getitem__, 2) == BLOCKS
            assert list(client.overlap(tokens, MODEL, routable_only=False).values()) == [HOLE]
            with pytest.warns(DeprecationWarning, match="no effect"):
                depths = client.overlap(tokens, MODEL, routable_only=False, window=8)
            assert list(depths.values()) == [HOLE]
            # a prompt that ends before the hole is wholly cached
            short = tokens[: HOLE * B]
            assert list(client.overlap(short, MODEL, routable_only=False).values()) == [HOLE]
    finally:
        await server.close(grace_s=1.0)
        await asyncio.wait_for(relay.stop(), scaled(30))
        await pub.close()
        ctx.destroy(linger=0)
