"""Independent test-side reader for the simulator's wire output.

Uses only pyzmq, msgspec's *generic* msgpack decoder and the ``xxhash`` package: no kvrelay code,
so it is an oracle for both the wire format and the simulator's ground truth.

No fixed waits: ``subscribe`` returns once the subscription has reached the publisher, and
``recv_all`` once everything the publisher sent before it was called has arrived. Both send a
probe through the simulator's own PUB socket (so it queues behind every batch it published) and
wait for it to come out of the SUB; probes never reach the caller.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import xxhash
import zmq
import zmq.asyncio

from tests.support.timing import scaled

if TYPE_CHECKING:
    from kvrelay.sim.publisher import RankPublisher

MASK = (1 << 64) - 1
STORED_MAP_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
STORED_ARRAY_FIELDS = 11  # 0.22/0.23 field set: block_hashes .. kv_cache_spec_sliding_window
REMOVED_ARRAY_FIELDS = 3  # block_hashes, medium, group_idx


@dataclass
class Msg:
    topic: bytes
    seq: int
    payload: bytes
    ts: float
    events: list[Any]
    dp_rank: int


def decode(frames: list[bytes]) -> Msg:
    assert len(frames) == 3, frames
    assert len(frames[1]) == 8
    seq = int.from_bytes(frames[1], "big", signed=False)
    batch = msgspec.msgpack.decode(frames[2])
    assert isinstance(batch, list) and len(batch) == 3, batch
    assert isinstance(batch[0], float)
    return Msg(frames[0], seq, frames[2], batch[0], batch[1], batch[2])


PROBE = b"kvrelay-test-probe"


def is_probe(frames: list[bytes]) -> bool:
    return len(frames) == 3 and frames[1] == PROBE


async def send_probe(pub: RankPublisher) -> bytes:
    """A probe with a fresh token on ``pub``'s own socket (behind everything it published)."""
    sock = pub._pub
    assert sock is not None, "the publisher is closed"
    token = os.urandom(8)
    await sock.send_multipart([pub.live_topic, PROBE, token], flags=zmq.NOBLOCK)
    return token


async def _until_probe(sub: zmq.asyncio.Socket, token: bytes, timeout: float) -> list[list[bytes]]:
    """Frames that arrive before the probe carrying ``token`` (other probes skipped)."""
    deadline = time.monotonic() + scaled(timeout)
    out: list[list[bytes]] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the probe never arrived ({len(out)} messages before it)")
        if not await sub.poll(int(min(left, 1.0) * 1000) + 1):
            continue
        frames = await sub.recv_multipart()
        if not is_probe(frames):
            out.append(frames)
        elif frames[2] == token:
            return out


async def wait_live(sub: zmq.asyncio.Socket, pub: RankPublisher, timeout: float = 10.0) -> None:
    """Until ``sub``'s subscription has reached ``pub`` (ZeroMQ's slow joiner: a PUB drops what
    it sends before it has seen a subscription): probes until one arrives, then drains the rest."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        await send_probe(pub)
        if await sub.poll(50):
            frames = await sub.recv_multipart()
            assert is_probe(frames), f"a batch arrived before the subscription was live: {frames}"
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"no subscription from the SUB reached {pub.endpoint}")
    stray = await _until_probe(sub, await send_probe(pub), timeout)
    assert stray == [], f"batches arrived while subscribing: {stray}"


async def subscribe(
    ctx: zmq.asyncio.Context, pub: RankPublisher, topic: bytes = b"", endpoint: str | None = None
) -> zmq.asyncio.Socket:
    """A SUB on ``pub`` (or on ``endpoint``), returned once its subscription is live."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint or pub.endpoint.replace("*", "127.0.0.1"))
    await wait_live(sub, pub)
    return sub


async def recv_frames(
    sub: zmq.asyncio.Socket, pub: RankPublisher, timeout: float = 10.0
) -> list[list[bytes]]:
    """Every message ``pub`` sent to ``sub`` up to now, as raw frames, in order."""
    return await _until_probe(sub, await send_probe(pub), timeout)


async def recv_all(sub: zmq.asyncio.Socket, pub: RankPublisher, timeout: float = 10.0) -> list[Msg]:
    """Every message ``pub`` sent to ``sub`` up to now, decoded."""
    return [decode(f) for f in await recv_frames(sub, pub, timeout)]


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, timeout: float = 2.0
) -> list[list[bytes]]:
    """DEALER replay request; returns reply frame lists up to and including the END marker."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    try:
        await d.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            assert await d.poll(int(scaled(timeout) * 1000)), "replay reply timed out"
            frames = await d.recv_multipart()
            out.append(frames)
            if frames[-2] == b"\xff" * 8 and frames[-1] == b"":
                return out
    finally:
        d.close(linger=0)


def norm(h: Any) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & MASK
    assert isinstance(h, int)
    return h & MASK


def fields_of(ev: Any) -> tuple[str, dict[str, Any]]:
    """Generic view of one event in either era: (tag, {field: value})."""
    if isinstance(ev, dict):
        return ev["type"], ev
    assert isinstance(ev, list)
    tag = ev[0]
    if tag == "BlockStored":
        names = [
            *STORED_MAP_REQUIRED,
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ]
    elif tag == "BlockRemoved":
        names = ["block_hashes", "medium", "group_idx"]
    else:
        names = []
    return tag, dict(zip(names, ev[1:], strict=False))


# ---- Dynamo canonical hashing, written independently of kvrelay ----


def salt(lora: str | None, cache_salt: str | None, ns: bool) -> int:
    s = 1337
    if lora:
        s = (s + xxhash.xxh3_64_intdigest(lora.encode("utf-8"), seed=0)) % (1 << 64)
    if ns and cache_salt:
        s = (s + xxhash.xxh3_64_intdigest(cache_salt.encode("utf-8"), seed=1)) % (1 << 64)
    return s


def block_hash(tokens: list[int], seed: int) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in tokens), seed=seed)


def chain(prev: int | None, b: int) -> int:
    if prev is None:
        return b
    return xxhash.xxh3_64_intdigest(struct.pack("<Q", prev) + struct.pack("<Q", b), seed=1337)


@dataclass
class RefModel:
    """Pure-Python consumer: applies events; tracks held hashes and canonical hashes."""

    ns: bool = False
    held: set[int] = field(default_factory=set)
    canon: dict[int, int] = field(default_factory=dict)  # vllm hash -> canonical (all-time)
    salt_of: dict[int, str | None] = field(default_factory=dict)
    stores: int = 0
    removes: int = 0

    def apply(self, events: list[Any], block_size: int) -> None:
        for ev in events:
            tag, f = fields_of(ev)
            if tag == "BlockStored":
                self.stores += 1
                hs = [norm(h) for h in f["block_hashes"]]
                toks = f["token_ids"]
                assert f["block_size"] == block_size
                assert len(toks) == len(hs) * block_size
                parent = f["parent_block_hash"]
                prev = None if parent is None else self.canon[norm(parent)]
                cs = self.salt_of.get(norm(parent)) if parent is not None else None
                extra = f.get("extra_keys")
                if parent is None and extra and extra[0]:
                    keys = [k for k in extra[0] if isinstance(k, str) and k != f["lora_name"]]
                    cs = keys[0] if keys else None
                seed = salt(f["lora_name"], cs, self.ns)
                for i, h in enumerate(hs):
                    prev = chain(
                        prev, block_hash(toks[i * block_size : (i + 1) * block_size], seed)
                    )
                    self.canon[h] = prev
                    self.salt_of[h] = cs
                    self.held.add(h)
            elif tag == "BlockRemoved":
                self.removes += 1
                assert len(f["block_hashes"]) == 1
                h = norm(f["block_hashes"][0])
                assert h in self.held, "removed a hash that was not held"
                self.held.discard(h)
            elif tag == "AllBlocksCleared":
                self.held.clear()
            else:
                raise AssertionError(f"unknown tag {tag}")

    def canonical_set(self) -> set[int]:
        return {self.canon[h] for h in self.held}
