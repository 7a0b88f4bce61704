"""In-process fleet → kvrelay → loopback gRPC for the SDK tests (real sockets end to end).

The oracle is the simulator's ground truth: Dynamo sequence hashes recomputed with the ``xxhash``
package (``kvrelay.sim.hashing``) from the blocks each rank holds, independent of kvrelay's numba
hashing, CKF kernels and the SDK's search.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kvrelay.contract.limits import RelayLimits
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.hashing import dynamo_sequence_hashes
from tests.support.fleet import (
    ENGINE_DOWN_GRACE_S,
    eventually,  # noqa: F401  (the shared fleet harness; tests import it here)
)
from tests.support.timing import scaled

BLOCK = 16


async def _stop_relay(relay: Relay) -> None:
    """``relay.stop()`` must finish: a shutdown that hangs (a swallowed cancellation in a
    discovery loop once did) fails the test instead of hanging it."""
    await asyncio.wait_for(relay.stop(), timeout=scaled(20.0))


def settings_for(
    engines: list[SimEngine], limits: RelayLimits, expected_blocks: int = 4096
) -> RelaySettings:
    return RelaySettings(
        dc_name="dc-client",
        pools=(
            PoolSpec(
                namespace="ns",
                component="backend",
                endpoint="generate",
                engines=tuple(
                    EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port)
                    for e in engines
                ),
                expected_blocks=expected_blocks,
            ),
        ),
        limits=limits,
        discovery_interval_s=0.2,
        discovery_timeout_s=scaled(1.0),
        engine_down_grace_s=ENGINE_DOWN_GRACE_S,
    )


@dataclass
class Stack:
    engines: list[SimEngine]
    limits: RelayLimits
    expected_blocks: int = 4096
    relay: Relay | None = None
    server: RelayServer | None = None
    port: int = 0
    history: list[int] = field(default_factory=list)  # relay incarnations started

    async def start_relay(self) -> None:
        self.relay = Relay(settings_for(self.engines, self.limits, self.expected_blocks))
        await self.relay.start()
        self.server = RelayServer(self.relay, self.limits)
        for attempt in range(100):
            try:
                await self.server.start("127.0.0.1", self.port)
                break
            except OSError:
                if attempt == 99 or self.port == 0:
                    raise
                await asyncio.sleep(0.05)
        self.port = self.server.port
        self.history.append(self.relay.relay_incarnation)

    async def stop_relay(self) -> None:
        if self.server is not None:
            await self.server.close(grace_s=1.0)
            self.server = None
        if self.relay is not None:
            await _stop_relay(self.relay)
            self.relay = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def truth(self) -> set[int]:
        return set().union(*(e.ground_truth(r) for e in self.engines for r in range(e.cfg.dp_size)))

    def in_sync(self) -> bool:
        relay = self.relay
        if relay is None or relay.pools[0].generation is None:
            return False
        gen = relay.pools[0].generation
        resident: set[int] = set()
        for mid in gen.pool.members():
            resident |= {int(h) for h in gen.pool.resident_canonical(mid)}
        return resident == self.truth()

    def producer_table(self) -> np.ndarray | None:
        """The producer's CKF table, only when nothing is pending publication."""
        relay = self.relay
        if relay is None or relay.pools[0].generation is None:
            return None
        gen = relay.pools[0].generation
        if gen.pool.lane.pending_dirty:
            return None
        return gen.pool.table

    def producer_sequence(self) -> int | None:
        relay = self.relay
        if relay is None or relay.pools[0].generation is None:
            return None
        return int(relay.pools[0].generation.sequence)


@contextlib.asynccontextmanager
async def stack(
    configs: list[SimConfig], limits: RelayLimits | None = None, expected_blocks: int = 4096
) -> AsyncIterator[Stack]:
    engines = [SimEngine(c) for c in configs]
    for e in engines:
        await e.start()
    st = Stack(engines, limits or RelayLimits(), expected_blocks)
    await st.start_relay()
    try:
        yield st
    finally:
        await st.stop_relay()
        for e in engines:
            with contextlib.suppress(Exception):
                await e.stop()


def truth_depth(tokens: list[int], lora: str | None, held: set[int]) -> int:
    """Ground-truth cached prefix depth (blocks), hashed with the ``xxhash`` package."""
    depth = 0
    for h in dynamo_sequence_hashes(tokens, BLOCK, lora_name=lora):
        if h not in held:
            break
        depth += 1
    return depth


def served_prompts(engines: list[SimEngine]) -> list[tuple[list[int], str | None]]:
    """Token prefixes the simulator actually served: every held block whose whole parent chain is
    held, rebuilt into the token sequence from block 0 (with its LoRA)."""
    out: list[tuple[list[int], str | None]] = []
    for e in engines:
        for r in range(e.cfg.dp_size):
            held = e.held_blocks(r)
            for blk in held.values():
                chain = [blk]
                while chain[-1].parent is not None and chain[-1].parent in held:
                    chain.append(held[chain[-1].parent])
                if chain[-1].position != 0:
                    continue
                tokens = [t for b in reversed(chain) for t in b.tokens]
                out.append((tokens, blk.lora_name))
    return out


def query_set(
    engines: list[SimEngine], rng: random.Random, n: int
) -> list[tuple[list[int], str | None]]:
    """Random prompts drawn from what was served, plus extended, mutated and fresh variants."""
    served = served_prompts(engines)
    assert served, "the simulator holds no complete chains"
    out: list[tuple[list[int], str | None]] = []
    for _ in range(n):
        tokens, lora = list(served[rng.randrange(len(served))][0]), None
        tokens, lora = served[rng.randrange(len(served))]
        tokens = list(tokens)
        kind = rng.random()
        if kind < 0.4:
            tokens += [rng.randint(1000, 150000) for _ in range(rng.randint(1, 80))]
        elif kind < 0.7 and len(tokens) > 1:
            i = rng.randrange(len(tokens))
            tokens[i] = (tokens[i] + 1 + rng.randrange(1000)) % 150000
        elif kind < 0.8:
            tokens = [rng.randint(1000, 150000) for _ in range(rng.randint(16, 300))]
        out.append((tokens, lora))
    return out
