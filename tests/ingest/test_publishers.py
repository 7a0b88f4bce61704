"""The other publishers of vLLM's event format (docs/contract.md §8.2.2), as they shape their
messages: each payload is written here by hand in that publisher's layout, decoded by kvrelay's
decoder and applied to the pool and to the pure-Python reference model, which must agree; the
record must be what the publisher's engine holds on its GPU tier."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest

from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import FrameCountError
from kvrelay.ingest.frames import check_live
from kvrelay.pool.pool import Pool
from tests.support.pool_model import RefPool

SEED = 0x5DEECE66D1B54A33
B = 4
TOK = list(range(100, 100 + 4 * B))
M = 0  # the one member each test's pool holds
enc = msgspec.msgpack.encode


def _rig() -> tuple[Decoder, Pool, RefPool, int]:
    pool = Pool(1024, SEED, B, 1)
    m = pool.add_member(1, 0)
    return Decoder(kv_block_size=B, dp_rank=0), pool, RefPool(1024, SEED, B, 1, 500), m


def _apply(d: Decoder, pool: Pool, model: RefPool, payload: bytes) -> Any:
    res = d.decode(payload)
    got = pool.apply(M, res.batch)
    exp = model.apply(0, res.batch)
    assert (got.events_applied, got.events_rejected) == (exp.applied, exp.rejected)
    assert got.unknown_removals == exp.unknown
    assert pool.lineage(M) == model.lineage[0]
    assert np.array_equal(pool.table, model.ckf.words())
    return res, got


def _stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: Any) -> Any:
    """A map-form store as the map-era publishers write it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": B,
        **kw,
    }


def _held(pool: Pool) -> set[int]:
    return set(pool.lineage(M))


def test_lmcache_tier_events_never_reach_the_gpu_record() -> None:
    """LMCache hands its chunk events to vLLM's publisher, in the engine's own batches, with a
    host or storage medium (`CPU`, `STORAGE`; vLLM's Mooncake store connector writes `cpu`):
    only vLLM's GPU events count."""
    d, pool, model, m = _rig()
    assert m == M
    gpu = _stored([11, 12], None, TOK[: 2 * B], medium="GPU")
    lm = [
        _stored([h], p, TOK[i * B : (i + 1) * B], lora_id=None, medium=medium, lora_name=None)
        for medium in ("cpu", "CPU", "STORAGE")
        for i, (h, p) in enumerate(((21, None), (22, 21), (23, 22)))
    ]
    res, _ = _apply(d, pool, model, enc([time.time(), [gpu, *lm], 0]))
    assert _held(pool) == {11, 12}
    assert res.stats.drops == {"medium_host_pinned": 6, "medium_disk": 3}
    # the tier's removes (and a withdrawal of every announced chunk) change nothing either
    gone = [
        {"type": "BlockRemoved", "block_hashes": [h], "medium": tier}
        for tier in ("cpu", "STORAGE")
        for h in (11, 12, 21)
    ]
    _apply(d, pool, model, enc([time.time(), gone, 0]))
    assert _held(pool) == {11, 12}


def test_trtllm_through_dynamo_one_event_per_message_signed_hashes() -> None:
    """Dynamo's TensorRT-LLM publisher: map events one per message, hashes as signed i64, only a
    `lora_id`, no medium, a `block_mm_infos` key; removes of the full blocks it cut off after a
    partial block were never stored: unknown removals, nothing rejected."""
    d, pool, model, m = _rig()
    assert m == M
    big = [(1 << 64) - 5, (1 << 63) + 9, 77]  # u64 values the engine hashed
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in big]
    store = _stored(signed[:2], None, TOK[: 2 * B], lora_id=None, block_mm_infos=[None, None])
    _apply(d, pool, model, enc([time.time(), [store], 0]))
    child = _stored([signed[2]], signed[1], TOK[2 * B : 3 * B], lora_id=3)
    _apply(d, pool, model, enc([time.time(), [child], 0]))
    assert _held(pool) == set(big)
    never = {"type": "BlockRemoved", "block_hashes": [-123456789]}
    _, got = _apply(d, pool, model, enc([time.time(), [never], 0]))
    assert got.unknown_removals == 1 and got.events_rejected == 0 and _held(pool) == set(big)
    rm = {"type": "BlockRemoved", "block_hashes": [signed[2]]}
    _apply(d, pool, model, enc([time.time(), [rm], 0]))
    assert _held(pool) == set(big[:2])


def test_llmd_simulator_map_format_nil_parent_is_exact() -> None:
    """llm-d's simulator with its map format: a root store's parent is nil; each block stored
    once and removed once (its cache is a set)."""
    d, pool, model, m = _rig()
    assert m == M
    s = _stored([5, 6], None, TOK[: 2 * B], medium="GPU", lora_name=None)
    t = _stored([7], 6, TOK[2 * B : 3 * B], medium="GPU")
    _apply(d, pool, model, enc([time.time(), [s, t], 0]))
    assert _held(pool) == {5, 6, 7}
    rm = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    _apply(d, pool, model, enc([time.time(), [rm], 0]))
    assert _held(pool) == {5, 6} and pool.copies(M) == {}


def test_llmd_simulator_array_format_root_parent_zero_is_no_parent() -> None:
    """Its default positional format writes a root store's parent as 0 (llm-d's empty hash), not
    nil: kvrelay reads a parent of 0 as none, on the fast walker and on the msgspec path alike,
    so the chain applies (before, the root store and its whole chain were rejected)."""
    for fast in (True, False):
        pool = Pool(1024, SEED, B, 1)
        m = pool.add_member(1, 0)
        assert m == M
        d, model = Decoder(kv_block_size=B, dp_rank=0, fast=fast), RefPool(1024, SEED, B, 1, 500)
        root = ["BlockStored", [5, 6], 0, TOK[: 2 * B], B, None, "GPU", None, None]
        child = ["BlockStored", [7], 6, TOK[2 * B : 3 * B], B, None, "GPU", None, None]
        res, got = _apply(d, pool, model, enc([time.time(), [root, child], 0]))
        assert res.stats.slow_path == (0 if fast else 1)  # each decode path was exercised
        assert got.events_rejected == 0 and _held(pool) == {5, 6, 7}
        assert not bool(res.batch.has_parent[0]) and bool(res.batch.has_parent[1])
        # the same chain sent with a nil parent lands on the same canonical hashes
        twin = Pool(1024, SEED, B, 1)
        tm = twin.add_member(1, 0)
        nil = enc([time.time(), [_stored([5, 6], None, TOK[: 2 * B]), child], 0])
        twin.apply(tm, Decoder(kv_block_size=B, dp_rank=0).decode(nil).batch)
        assert np.array_equal(twin.table, pool.table) and twin.table.any()


@pytest.mark.parametrize("frames", [[b"payload"], [b"topic", b"payload"]])
def test_atom_frames_without_a_sequence_are_refused(frames: list[bytes]) -> None:
    """ROCm ATOM sends the payload alone, or `[topic, payload]`: no sequence frame, so kvrelay
    refuses the message before decoding (its record of an ATOM engine stays empty)."""
    with pytest.raises(FrameCountError):
        check_live(frames, b"")
