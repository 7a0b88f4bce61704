"""Simulator wire format, checked by an independent raw reader (zmq SUB/DEALER + msgspec)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvrelay.sim import Era, HashMode, SimConfig, SimEngine, TrafficConfig
from kvrelay.sim.ports import free_port_block
from tests.support.simwire_reader import (
    MASK,
    REMOVED_ARRAY_FIELDS,
    STORED_ARRAY_FIELDS,
    STORED_MAP_REQUIRED,
    RefModel,
    decode,
    fields_of,
    recv_all,
    recv_frames,
    replay,
    subscribe,
    wait_live,
)

TRAFFIC = TrafficConfig(
    arrivals_per_step=1.5,
    lora_fraction=0.5,
    salt_fraction=0.3,
    system_len=(16, 80),
    user_len=(4, 40),
    max_new_tokens=(4, 40),
    max_prompt_tokens=256,
)
BASE = SimConfig(
    capacity_blocks=64, max_running=6, grpc_port=None, metrics_port=None, traffic=TRAFFIC
)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def run_and_capture(
    cfg: SimConfig, zctx: zmq.asyncio.Context, steps: int, lora: bool = True
) -> tuple[SimEngine, list[list]]:
    """Start an engine, subscribe to every rank, run ``steps``; returns messages per rank."""
    eng = SimEngine(cfg)
    await eng.start()
    if lora:
        eng.load_lora("adapter-a")
    subs = [await subscribe(zctx, p, cfg.topic.encode()) for p in eng.publishers]
    await eng.step(steps)
    msgs = [await recv_all(s, p) for s, p in zip(subs, eng.publishers, strict=True)]
    for s in subs:
        s.close(linger=0)
    return eng, msgs


@pytest.mark.parametrize("era", [Era.MAP, Era.ARRAY])
async def test_stream_shape_and_reference_model(era: Era, zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, era=era, topic="kv-events")
    eng, (msgs,) = await run_and_capture(cfg, zctx, 80)
    try:
        assert len(msgs) == eng.publishers[0].seq > 20
        assert [m.seq for m in msgs] == list(range(len(msgs)))
        ref = RefModel()
        tags: set[str] = set()
        for m in msgs:
            assert m.topic == b"kv-events" and m.dp_rank == 0
            for ev in m.events:
                tag, f = fields_of(ev)
                tags.add(tag)
                if era is Era.MAP:
                    assert isinstance(ev, dict)
                    assert "locality" not in ev and "lookahead_token_ids" not in ev
                    if tag == "BlockStored":
                        assert all(k in ev for k in STORED_MAP_REQUIRED)  # even when nil
                else:
                    assert isinstance(ev, list) and ev[0] == tag
                    want = {
                        "BlockStored": STORED_ARRAY_FIELDS,
                        "BlockRemoved": REMOVED_ARRAY_FIELDS,
                    }[tag]
                    assert len(ev) == 1 + want
                for h in f["block_hashes"]:
                    assert isinstance(h, int) and 0 <= h <= MASK
            ref.apply(m.events, cfg.block_size)
        assert tags == {"BlockStored", "BlockRemoved"}
        # the event stream reproduces exactly what the engine holds, and its canonical hashes
        assert ref.held == set(eng.held_blocks(0))
        assert ref.canonical_set() == eng.ground_truth(0)
        ns = RefModel(ns=True)
        for m in msgs:
            ns.apply(m.events, cfg.block_size)
        assert ns.canonical_set() == eng.ground_truth(0, cache_salt_namespacing=True)
        assert eng.ground_truth(0) != eng.ground_truth(0, cache_salt_namespacing=True)
    finally:
        await eng.stop()


async def test_prefill_parent_and_decode_stores(zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, traffic=replace(TRAFFIC, arrivals_per_step=0.0), capacity_blocks=64)
    eng = SimEngine(cfg)
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        prompt = list(range(1000, 1000 + 40))  # 2 full blocks + 8 tokens
        eng.submit(0, prompt, max_new_tokens=30)
        await eng.step(1)
        (first,) = await recv_all(sub, pub)
        (ev,) = first.events
        assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
        assert ev["token_ids"] == prompt[:32] and len(ev["block_hashes"]) == 2
        # second request shares the 2-block prefix: only its new block is stored, parented
        eng.submit(0, prompt[:32] + list(range(5000, 5016)), max_new_tokens=1)
        await eng.step(1)
        (second,) = await recv_all(sub, pub)
        (ev2,) = [e for e in second.events if e["type"] == "BlockStored"]
        assert ev2["parent_block_hash"] == ev["block_hashes"][1]
        assert ev2["token_ids"] == list(range(5000, 5016))
        # decode: 8 more tokens fill block 2 of the first request -> one-block store
        await eng.step(8)
        decode_stores = [
            e for m in await recv_all(sub, pub) for e in m.events if e["type"] == "BlockStored"
        ]
        assert len(decode_stores) == 1 and len(decode_stores[0]["block_hashes"]) == 1
        assert decode_stores[0]["parent_block_hash"] == ev["block_hashes"][1]
        assert decode_stores[0]["token_ids"][:8] == prompt[32:]
        sub.close(linger=0)
    finally:
        await eng.stop()


async def test_lora_and_salt_fields(zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, traffic=replace(TRAFFIC, arrivals_per_step=0.0))
    eng = SimEngine(cfg)
    await eng.start()
    try:
        li = eng.load_lora("adapter-a")
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        eng.submit(0, list(range(2000, 2048)), lora_name="adapter-a", cache_salt="tenant-x")
        eng.submit(0, list(range(2000, 2048)))
        await eng.step(1)
        (m,) = await recv_all(sub, pub)
        lo, base = m.events
        assert lo["lora_name"] == "adapter-a" and lo["lora_id"] == li.lora_id
        assert lo["extra_keys"] == [["adapter-a", "tenant-x"], ["adapter-a"], ["adapter-a"]]
        assert base["lora_name"] is None and base["lora_id"] is None
        assert "extra_keys" not in base  # default nil omitted in the map era
        assert set(lo["block_hashes"]).isdisjoint(base["block_hashes"])
        sub.close(linger=0)
    finally:
        await eng.stop()


async def test_eviction_emits_single_hash_removes(zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, capacity_blocks=40)
    eng, (msgs,) = await run_and_capture(cfg, zctx, 60)
    try:
        removes = [e for m in msgs for e in m.events if e["type"] == "BlockRemoved"]
        assert len(removes) > 10
        assert all(len(e["block_hashes"]) == 1 and e["medium"] == "GPU" for e in removes)
        assert len(eng.held_blocks(0)) <= 40
    finally:
        await eng.stop()


@pytest.mark.parametrize("mode", [HashMode.BYTES, HashMode.I64])
async def test_hash_modes_match_int_form(mode: HashMode, zctx: zmq.asyncio.Context) -> None:
    ref_eng, (ref_msgs,) = await run_and_capture(BASE, zctx, 30)
    eng, (msgs,) = await run_and_capture(replace(BASE, hash_mode=mode), zctx, 30)
    try:
        assert len(msgs) == len(ref_msgs) > 5
        saw_negative = False
        for a, b in zip(msgs, ref_msgs, strict=True):
            assert len(a.events) == len(b.events)
            for ea, eb in zip(a.events, b.events, strict=True):
                for ha, hb in zip(ea["block_hashes"], eb["block_hashes"], strict=True):
                    if mode is HashMode.BYTES:
                        assert isinstance(ha, bytes) and len(ha) == 32
                        assert int.from_bytes(ha[-8:], "big") == hb
                    else:
                        assert -(1 << 63) <= ha < (1 << 63) and ha & MASK == hb
                        saw_negative |= ha < 0
                pa, pb = ea.get("parent_block_hash"), eb.get("parent_block_hash")
                if pb is not None:
                    assert (
                        int.from_bytes(pa[-8:], "big") if mode is HashMode.BYTES else pa & MASK
                    ) == pb
        if mode is HashMode.I64:
            assert saw_negative  # ~half of u64 hashes are >= 2^63
        assert set(eng.held_blocks(0)) == set(ref_eng.held_blocks(0))
    finally:
        await eng.stop()
        await ref_eng.stop()


async def test_dp_port_offsets_and_per_rank_sequences(zctx: zmq.asyncio.Context) -> None:
    base = free_port_block(7)
    cfg = replace(BASE, dp_size=3, pub_port=base, replay_port=base + 4)
    eng, per_rank = await run_and_capture(cfg, zctx, 25)
    try:
        for r, p in enumerate(eng.publishers):
            assert p.endpoint == f"tcp://*:{base + r}"
            assert p.replay_endpoint == f"tcp://*:{base + 4 + r}"
            msgs = per_rank[r]
            assert msgs and [m.seq for m in msgs] == list(range(len(msgs)))
            assert {m.dp_rank for m in msgs} == {r}
            ref = RefModel()
            for m in msgs:
                ref.apply(m.events, cfg.block_size)
            assert ref.canonical_set() == eng.ground_truth(r)
    finally:
        await eng.stop()


@pytest.mark.parametrize("frames", [3, 4])
async def test_replay_shapes_end_marker_and_missing_history(
    frames: int, zctx: zmq.asyncio.Context
) -> None:
    cfg = replace(BASE, buffer_steps=3, replay_frames=frames, topic="t")
    eng = SimEngine(cfg)
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        while eng.publishers[0].seq < 5:
            await eng.step(1)
        live = {m.seq: m.payload for m in await recv_all(sub, pub)}
        ep = eng.publishers[0].replay_endpoint
        assert ep.startswith("tcp://127.0.0.1:")
        reply = await replay(zctx, ep, 0)
        assert all(len(r) == frames for r in reply)
        seqs = [int.from_bytes(r[-2], "big") for r in reply[:-1]]
        assert seqs == [2, 3, 4]  # oldest retained, no error: caller sees lost history
        for r in reply[:-1]:
            assert r[0] == b""
            if frames == 4:
                assert r[1] == b"t"
            assert r[-1] == live[int.from_bytes(r[-2], "big")]
        end = reply[-1]
        assert end == ([b"", b"", b"\xff" * 8, b""] if frames == 4 else [b"", b"\xff" * 8, b""])
        # start beyond the newest: END only
        assert len(await replay(zctx, ep, 99)) == 1
        # invalid request (no delimiter) gets no reply; the socket keeps serving afterwards
        d = zctx.socket(zmq.DEALER)
        d.connect(ep)
        await d.send_multipart([(0).to_bytes(8, "big")])
        assert not await d.poll(300)
        d.close(linger=0)
        assert eng.publishers[0].stats.invalid_replay_requests == 1
        assert len(await replay(zctx, ep, 4)) == 2
        sub.close(linger=0)
    finally:
        await eng.stop()


async def test_drops_keep_or_lose_history(zctx: zmq.asyncio.Context) -> None:
    eng = SimEngine(replace(BASE, traffic=replace(TRAFFIC, arrivals_per_step=2.0)))
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        while pub.seq < 2:
            await eng.step(1)
        eng.drop_next(2, keep_in_replay=True)
        while pub.seq < 5:
            await eng.step(1)
        eng.drop_next(1, keep_in_replay=False)
        while pub.seq < 7:
            await eng.step(1)
        seen = [m.seq for m in await recv_all(sub, pub)]
        assert seen == [0, 1, 4, 6]
        got = [int.from_bytes(r[-2], "big") for r in (await replay(zctx, pub.replay_endpoint, 2))]
        assert got[:-1] == [2, 3, 4, 6]  # 5 is gone for good
        assert pub.stats.dropped_live == 3 and pub.stats.lost == 1
        sub.close(linger=0)
    finally:
        await eng.stop()


@pytest.mark.parametrize("rebind", [False, True])
async def test_restart_resets_sequence_and_state(rebind: bool, zctx: zmq.asyncio.Context) -> None:
    base = free_port_block(2)
    eng = SimEngine(replace(BASE, pub_port=base, replay_port=base + 1))
    await eng.start()
    try:
        sub = await subscribe(zctx, eng.publishers[0], endpoint=f"tcp://127.0.0.1:{base}")
        await eng.step(10)
        before = await recv_all(sub, eng.publishers[0])
        old_id = eng.instance_id
        assert eng.held_blocks(0)
        await eng.restart(rebind=rebind)
        assert eng.instance_id != old_id
        assert eng.held_blocks(0) == {} and eng.ground_truth(0) == set()
        pub = eng.publishers[0]
        assert pub.seq == 0
        assert len(await replay(zctx, f"tcp://127.0.0.1:{base + 1}", 0)) == 1  # history gone
        if rebind:
            await wait_live(sub, pub)  # the SUB reconnects to the re-bound PUB
        await eng.step(3)
        after = await recv_all(sub, pub)
        assert before[0].seq == 0 and after[0].seq == 0
        ref = RefModel()
        for m in after:
            ref.apply(m.events, 16)
        assert ref.held == set(eng.held_blocks(0))
        sub.close(linger=0)
    finally:
        await eng.stop()


async def test_reset_prefix_cache_and_sleep(zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, dp_size=2)
    eng = SimEngine(cfg)
    await eng.start()
    try:
        pubs = eng.publishers
        subs = [await subscribe(zctx, p) for p in pubs]
        await eng.step(5)
        for s, p in zip(subs, pubs, strict=True):
            await recv_all(s, p)
        eng.reset_prefix_cache()
        for r, (s, p) in enumerate(zip(subs, pubs, strict=True)):
            (m,) = await recv_all(s, p)
            assert m.events == [{"type": "AllBlocksCleared"}] and m.dp_rank == r
            assert eng.ground_truth(r) == set()
        await eng.step(3)
        assert eng.held_blocks(0)
        for s, p in zip(subs, pubs, strict=True):
            await recv_all(s, p)
        eng.sleep()
        assert await eng.step(5) == 0
        cleared = [await recv_all(s, p) for s, p in zip(subs, pubs, strict=True)]  # cleared only
        assert [[m.events for m in c] for c in cleared] == [[[{"type": "AllBlocksCleared"}]]] * 2
        eng.wake()
        eng.pause()
        assert await eng.step(2) == 0
        eng.resume()
        assert await eng.step(2) > 0
        for s in subs:
            s.close(linger=0)
    finally:
        await eng.stop()


async def test_array_era_all_blocks_cleared_bytes(zctx: zmq.asyncio.Context) -> None:
    eng = SimEngine(replace(BASE, era=Era.ARRAY))
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        eng.reset_prefix_cache()
        (frames,) = await recv_frames(sub, pub)
        raw = frames[2]
        assert raw[0] == 0x93 and raw[1] == 0xCB  # array(3), float64 ts
        assert msgspec.msgpack.decode(raw)[1:] == [[["AllBlocksCleared"]], 0]
        assert decode(frames).seq == 0
        sub.close(linger=0)
    finally:
        await eng.stop()


async def test_determinism_same_seed_same_stream() -> None:
    a, b = SimEngine(BASE), SimEngine(BASE)
    for e in (a, b):
        await e.start()
        e.load_lora("adapter-a")
        await e.step(40)
    try:
        assert list(a.publishers[0].buffer)[-1][0] == list(b.publishers[0].buffer)[-1][0]
        pa = [msgspec.msgpack.decode(p)[1] for _, p in a.publishers[0].buffer]
        pb = [msgspec.msgpack.decode(p)[1] for _, p in b.publishers[0].buffer]
        assert pa == pb
        assert a.ground_truth(0) == b.ground_truth(0)
    finally:
        await a.stop()
        await b.stop()


async def test_report_reused_emits_idempotent_duplicate_stores(zctx: zmq.asyncio.Context) -> None:
    cfg = replace(BASE, report_reused=True, traffic=replace(TRAFFIC, arrivals_per_step=0.0))
    eng = SimEngine(cfg)
    await eng.start()
    try:
        pub = eng.publishers[0]
        sub = await subscribe(zctx, pub)
        prompt = list(range(3000, 3048))
        eng.submit(0, prompt, max_new_tokens=1)
        await eng.step(1)
        eng.submit(0, [*prompt[:32], *range(7000, 7020)], max_new_tokens=1)
        await eng.step(1)
        first, second = await recv_all(sub, pub)
        dup, new = second.events
        assert dup["parent_block_hash"] is None
        assert dup["block_hashes"] == first.events[0]["block_hashes"][:2]
        assert new["parent_block_hash"] == dup["block_hashes"][-1]
        ref = RefModel()
        for m in (first, second):
            ref.apply(m.events, 16)
        assert ref.canonical_set() == eng.ground_truth(0)
        sub.close(linger=0)
    finally:
        await eng.stop()
