"""A raw ZMQ PUB impersonating a pre-gRPC vLLM engine (static source) that can publish crafted
bytes, plus a detached simulator scheduler that supplies valid batches with known ground truth."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.relay.settings import EngineSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.render import render_event
from kvrelay.sim.scheduler import Stored
from kvrelay.sim.wire import Era, HashMode, encode_batch

BLOCK_SIZE = 16
MODES = (HashMode.U64, HashMode.I64, HashMode.BYTES)


class RawPublisher:
    """PUB socket on an ephemeral loopback port; ``send`` takes arbitrary frames."""

    def __init__(self, topic: bytes = b"") -> None:
        self.topic = topic
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.bind("tcp://127.0.0.1:0")
        last = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(last, bytes)
        self.endpoint = last.decode()
        self.seq = 0

    def spec(self, name: str = "raw") -> EngineSpec:
        return EngineSpec(
            name=name, static=StaticSourceConfig(endpoint=self.endpoint, topic=self.topic.decode())
        )

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def announce_until(self, seen: Callable[[], bool], tries: int = 500) -> None:
        """ZMQ slow joiner: publish empty batches until the relay's SUB has seen one."""
        for _ in range(tries):
            if seen():
                return
            await self.send_payload(encode_batch(time.time(), [], 0))
            await asyncio.sleep(0.01)
        raise AssertionError("the relay never received the static source's messages")

    async def send_payload(self, payload: bytes) -> int:
        """A well-framed live message with the next sequence number."""
        seq = self.seq
        self.seq += 1
        await self.send([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Oracle:
    """A simulator rank driven without sockets: its events become payloads we publish ourselves.
    ``truth()`` is the simulator's ground truth for what those payloads stored."""

    def __init__(self, seed: int = 31, capacity_blocks: int = 96) -> None:
        self.engine = SimEngine(
            SimConfig(name="oracle", seed=seed, capacity_blocks=capacity_blocks, grpc_port=None)
        )
        self.rng = random.Random(seed)

    def next_payload(self, mixed_hashes: bool = False) -> bytes | None:
        """One scheduler step as a msgpack batch (None if the step emitted nothing). With
        ``mixed_hashes`` every hash independently takes the int, negative-int or 32-byte form."""
        events = self.engine.schedulers[0].step([])
        if not events:
            return None
        wire: list[Any] = []
        for ev in events:
            mode = self.rng.choice(MODES) if mixed_hashes else HashMode.U64
            w = render_event(ev, Era.MAP, mode, BLOCK_SIZE, {}, "GPU")
            if mixed_hashes and isinstance(ev, Stored):
                forms = [self.rng.choice(MODES) for _ in ev.blocks]
                w.block_hashes = [_form(b.digest, m) for b, m in zip(ev.blocks, forms, strict=True)]
            wire.append(w)
        return encode_batch(time.time(), wire, 0)

    def next_nonempty(self, mixed_hashes: bool = False, max_steps: int = 1000) -> bytes:
        for _ in range(max_steps):
            payload = self.next_payload(mixed_hashes)
            if payload is not None:
                return payload
        raise AssertionError("the simulator emitted no event in 1000 steps")

    def truth(self) -> set[int]:
        return self.engine.ground_truth(0)


def _form(digest: bytes, mode: HashMode) -> int | bytes:
    if mode is HashMode.BYTES:
        return digest
    u = int.from_bytes(digest[-8:], "big")
    if mode is HashMode.I64 and u >= 1 << 63:
        return u - (1 << 64)
    return u


_ENC = msgspec.msgpack.Encoder()


def envelope(events: list[Any], dp_rank: int = 0) -> bytes:
    return _ENC.encode([time.time(), events, dp_rank])
