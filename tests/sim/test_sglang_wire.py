"""The simulator's SGLang mode, read back with raw ZMQ sockets and msgspec's generic decoder.

Checks the shapes §21 documents for each layout: positional events up to 0.5.19, slot counts,
signed hashes (first 8 digest bytes), the envelope rank, one store per page (coalesced when
aligned), bigram pages with EAGLE, the epoch in the topic frame, 3-frame replay replies, and a PUB
that connects to a bound SUB; the map layouts (0.5.20 on) byte for byte against the release
encoder of ``tests/ingest/test_sglang_conformance.py``, with salts, adapter names and the
topic-framed replay of 0.5.22.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvrelay.sim import SimConfig, SimEngine, TrafficConfig
from kvrelay.sim.cli import build_parser, configs_from_args
from kvrelay.sim.sglang_wire import SglLayout, sglang_hash
from tests.ingest import test_sglang_conformance as release
from tests.support.simwire_reader import recv_frames, replay, subscribe
from tests.support.timing import scaled

TRAFFIC = TrafficConfig(salt_fraction=0.5, system_len=(16, 64), max_prompt_tokens=256)
STORE_SLOTS = {SglLayout.NO_MEDIUM: {6}, SglLayout.MEDIUM: {7}, SglLayout.METADATA: {7, 8},
               SglLayout.ALIGNED: {14, 15}}  # fmt: skip
REMOVE_SLOTS = {SglLayout.NO_MEDIUM: 2, SglLayout.MEDIUM: 3, SglLayout.METADATA: 3,
                SglLayout.ALIGNED: 8}  # fmt: skip


def cfg(**kw: Any) -> SimConfig:
    base: dict[str, Any] = {"flavor": "sglang", "grpc_port": None, "metrics_port": None,
                            "capacity_blocks": 32, "block_size": 4, "traffic": TRAFFIC}
    base.update(kw)
    return SimConfig(**base)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def capture(eng: SimEngine, sub: zmq.asyncio.Socket, steps: int) -> list[list[bytes]]:
    await eng.step(steps)
    return await recv_frames(sub, eng.publishers[0])


POSITIONAL = [x for x in SglLayout if not x.is_map]


@pytest.mark.parametrize("layout", POSITIONAL)
async def test_layout_shapes(layout: SglLayout, zctx: zmq.asyncio.Context) -> None:
    rank_field = layout is not SglLayout.NO_MEDIUM
    eng = SimEngine(cfg(sglang_layout=layout, sglang_rank_in_envelope=rank_field))
    await eng.start()
    try:
        sub = await subscribe(zctx, eng.publishers[0])
        msgs = await capture(eng, sub, 80)
    finally:
        await eng.stop()
    assert msgs
    seen: dict[str, int] = {}
    negative = salted = 0
    for frames in msgs:
        env = msgspec.msgpack.decode(frames[2])
        assert len(env) == (3 if rank_field else 2) and (not rank_field or env[2] == 0)
        for ev in env[1]:
            assert isinstance(ev, list)  # SGLang never sends map-form events
            seen[ev[0]] = seen.get(ev[0], 0) + 1
            if ev[0] == "BlockStored":
                assert len(ev) in STORE_SLOTS[layout]
                hashes, tokens, bs = ev[1], ev[3], ev[4]
                assert bs == 4 and len(tokens) == 4 * len(hashes)
                if layout is not SglLayout.ALIGNED:
                    assert len(hashes) == 1  # one store per page
                negative += sum(h < 0 for h in hashes)
                if len(ev) in (8, 15):
                    assert ev[-1] == {"cache_salt": ev[-1]["cache_salt"]}
                    salted += 1
                    if layout is SglLayout.ALIGNED:
                        assert ev[8] == [["dynamo-cache-salt:" + ev[-1]["cache_salt"]]]
            elif ev[0] == "BlockRemoved":
                assert len(ev) == REMOVE_SLOTS[layout] and len(ev[1]) == 1
    assert seen.get("BlockStored", 0) > 10 and seen.get("BlockRemoved", 0) > 0
    assert negative > 0  # signed hashes
    assert (salted > 0) == (layout in (SglLayout.METADATA, SglLayout.ALIGNED))


@pytest.mark.parametrize(
    ("layout", "version"), [(SglLayout.MAP, (0, 5, 20)), (SglLayout.MAP_LORA, (0, 5, 22))],
    ids=["map", "map_lora"],
)  # fmt: skip
async def test_map_layouts_are_the_releases_bytes(
    layout: SglLayout, version: release.Version, zctx: zmq.asyncio.Context
) -> None:
    """Every event is exactly what that release's structs write for its values (tagged map,
    unset defaults left out); a salted request's stores each carry ``cache_salt`` and, from
    0.5.22, an adapter request's its ``lora_name``; replies as that release frames them."""
    eng = SimEngine(cfg(topic="kv", sglang_layout=layout,
                        traffic=TrafficConfig(salt_fraction=0.5, lora_fraction=0.5,
                                              system_len=(16, 64), max_prompt_tokens=256)))
    await eng.start()
    try:
        if layout.names_adapters:
            eng.load_lora("adapter-a")
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub, b"kv")
        msgs = await capture(eng, sub, 80)
        replies = await replay(zctx, pub.replay_endpoint.replace("*", "127.0.0.1"), 0)
    finally:
        await eng.stop()
    kinds: dict[str, int] = {}
    salted: set[str] = set()
    adapters = multi = 0
    for frames in msgs:
        env = tuple[float, list[msgspec.Raw], int]  # [ts, events, attn_dp_rank]
        _ts, events, rank = msgspec.msgpack.decode(frames[2], type=env)
        assert rank == 0
        for raw in events:
            ev = msgspec.msgpack.decode(raw)
            assert isinstance(ev, dict)
            tag = ev.pop("type")
            kinds[tag] = kinds.get(tag, 0) + 1
            if tag == "BlockStored":
                want = release._event(version, tag, release.STORE_FIELDS, ev)
                if ev.get("cache_salt") and ev["parent_block_hash"] is not None:
                    salted.add(ev["cache_salt"])  # the salt rides on children too
                adapters += "lora_name" in ev
                multi += len(ev["block_hashes"]) > 1
                assert ev["lora_id"] is None and ev["medium"] == "GPU"
            elif tag == "BlockRemoved":
                want = release._remove(version, ev["block_hashes"])
            else:
                want = release._clear(version)
            assert bytes(raw) == want, ev
    assert kinds.get("BlockStored", 0) > 10 and kinds.get("BlockRemoved", 0) > 0
    assert salted and multi > 0  # salts below the root; coalesced pages
    assert (adapters > 0) == layout.names_adapters
    topic = version >= release.TOPIC_IN_REPLAY
    assert replies[-1] == ([b"", b""] if topic else [b""]) + [b"\xff" * 8, b""]
    assert [r[-2:] for r in replies[:-1]] == [f[1:] for f in msgs]
    assert all(r[:-2] == ([b"", b"kv"] if topic else [b""]) for r in replies[:-1])


def test_hash_is_the_digest_prefix_signed() -> None:
    d = bytes.fromhex("ff" * 8 + "00" * 24)
    assert sglang_hash(d) == -1
    assert sglang_hash(bytes.fromhex("7f" + "ff" * 7) + b"\0" * 24) == 2**63 - 1


async def test_eagle_pages_are_bigrams(zctx: zmq.asyncio.Context) -> None:
    eng = SimEngine(cfg(eagle=True, sglang_layout=SglLayout.MEDIUM))
    await eng.start()
    try:
        sub = await subscribe(zctx, eng.publishers[0])
        msgs = await capture(eng, sub, 30)
    finally:
        await eng.stop()
    pages = [ev for f in msgs for ev in msgspec.msgpack.decode(f[2])[1] if ev[0] == "BlockStored"]
    assert pages
    for ev in pages:
        pairs = ev[3]
        assert ev[4] == 4 and len(pairs) == 4 and all(len(p) == 2 for p in pairs)
        assert all(pairs[j][1] == pairs[j + 1][0] for j in range(3))  # overlapping windows


async def test_epoch_topic_and_three_frame_replay(zctx: zmq.asyncio.Context) -> None:
    eng = SimEngine(cfg(topic="kv", sglang_epoch=True))
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub, b"kv")
        msgs = await capture(eng, sub, 10)
        topics = {f[0] for f in msgs}
        assert len(topics) == 1
        (topic,) = topics
        assert topic.startswith(b"kv\x00sgl-kv-epoch=") and len(topic) == 2 + 14 + 32
        replies = await replay(zctx, pub.replay_endpoint.replace("*", "127.0.0.1"), 0)
        assert all(len(r) == 3 and r[0] == b"" for r in replies)  # [b"", seq, payload]
        assert [r[2] for r in replies[:-1]] == [f[2] for f in msgs]
        await eng.restart(rebind=False)
        again = await capture(eng, sub, 10)
        assert again and {f[0] for f in again} != topics  # a new incarnation, a new epoch
        assert int.from_bytes(again[0][1], "big") == 0
    finally:
        await eng.stop()


async def test_pub_connects_to_a_bound_sub(zctx: zmq.asyncio.Context) -> None:
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    engines = [
        SimEngine(cfg(name=f"p{i}", seed=i, topic=f"kv@p{i}@m", pub_connect=f"tcp://127.0.0.1:{port}"))
        for i in range(2)
    ]
    try:
        for e in engines:
            await e.start()
            assert e.publishers[0].endpoint == f"tcp://127.0.0.1:{port}"
        # A bound SUB attaches a new connection (and sends it the subscription) only when its
        # owner calls into it: keep polling while the publishers connect, until each publisher
        # has seen the subscription.
        waits = [asyncio.create_task(e.publishers[0].wait_subscribed(scaled(10)))
                 for e in engines]
        while not all(w.done() for w in waits):
            assert not await sub.poll(20)
        for w in waits:
            w.result()
        msgs = []
        for e in engines:
            msgs += await capture(e, sub, 5)
        assert {f[0] for f in msgs} == {b"kv@p0@m", b"kv@p1@m"}
        for t in (b"kv@p0@m", b"kv@p1@m"):  # each publisher has its own sequence space from 0
            seqs = [int.from_bytes(f[1], "big") for f in msgs if f[0] == t]
            assert seqs == list(range(len(seqs)))
    finally:
        for e in engines:
            await e.stop()
        sub.close(linger=0)


def test_sglang_refuses_loras_before_it_names_them() -> None:
    for layout in SglLayout:
        if not layout.names_adapters:
            with pytest.raises(ValueError, match="LoRA"):
                SimEngine(cfg(sglang_layout=layout)).load_lora("a")
    assert SimEngine(cfg(sglang_layout=SglLayout.MAP_LORA)).load_lora("a").name == "a"
    with pytest.raises(ValueError, match="SGLang"):
        SimConfig(eagle=True)


def test_cli_names_the_map_layouts() -> None:
    p = build_parser()
    assert "map_lora (0.5.22 on" in " ".join(p.format_help().split())
    args = p.parse_args(["--flavor", "sglang", "--sglang-layout", "map_lora"])
    (c,) = configs_from_args(args)
    assert c.sglang_layout is SglLayout.MAP_LORA and c.sglang_layout.replay_frames == 4
