"""vLLM event-stream conformance, one row per vLLM version (docs/contract.md §17, §20).

The encoder here is written from the field tables of vLLM's published format (which field
appears in which release, which are required, the array era before 0.24 and the map era from
0.24 on), not from kvrelay's decoder nor vLLM's code: every release's shape must decode, on both
decoder paths, to the block state the format implies.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import xxhash

from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import MalformedEnvelopeError
from kvrelay.pool.batch import OP_CLEAR, OP_REMOVE, OP_STORE, as_events

B = 4
M64 = (1 << 64) - 1
enc = msgspec.msgpack.encode

# (field, first release that has it); the required ones (no default) are always sent
STORE_FIELDS = [
    ("block_hashes", (0, 9)), ("parent_block_hash", (0, 9)), ("token_ids", (0, 9)),
    ("block_size", (0, 9)), ("lora_id", (0, 9)), ("medium", (0, 11)), ("lora_name", (0, 19)),
    ("extra_keys", (0, 19)), ("group_idx", (0, 22)), ("kv_cache_spec_kind", (0, 22)),
    ("kv_cache_spec_sliding_window", (0, 22)), ("locality", (0, 26)), ("ownership", (0, 29)),
    ("session_id", (0, 30)), ("lookahead_token_ids", (0, 33)),
]  # fmt: skip
STORE_REQUIRED = 7
REMOVE_FIELDS = [
    ("block_hashes", (0, 9)), ("medium", (0, 11)), ("group_idx", (0, 22)),
    ("locality", (0, 26)), ("ownership", (0, 29)),
]  # fmt: skip
REMOVE_REQUIRED = 2
MAP_ERA = (0, 24)


def _event(version: tuple[int, int], tag: str, schema: list[Any], required: int,
           values: dict[str, Any]) -> bytes:  # fmt: skip
    """One event as that release's msgspec struct writes it: positional with every field (nil
    when unset) before 0.24; a map with the tag first and defaulted fields left out from 0.24,
    under a map16 header once the struct has more than 15 possible entries."""
    fields = [f for f, since in schema if since <= version]
    if version < MAP_ERA:
        return enc([tag, *(values.get(f) for f in fields)])
    items = [("type", tag)] + [
        (f, values.get(f))
        for i, f in enumerate(fields)
        if i < required or values.get(f) is not None
    ]
    head = bytes([0x80 | len(items)]) if len(fields) + 1 <= 15 else b"\xde" + len(items).to_bytes(
        2, "big"
    )
    return head + b"".join(enc(k) + enc(v) for k, v in items)


def _batch(version: tuple[int, int], events: list[bytes], dp: int | None = 0) -> bytes:
    """``[ts, events]`` in 0.9, ``[ts, events, data_parallel_rank]`` since 0.10."""
    n = 2 if version < (0, 10) else 3
    body = enc(1700000000.25) + b"\xdc" + len(events).to_bytes(2, "big") + b"".join(events)
    return bytes([0x90 | n]) + body + (enc(dp) if n == 3 else b"")


def _lora_salt(name: str) -> int:
    return (1337 + xxhash.xxh3_64_intdigest(name.encode(), seed=0)) & M64


VERSIONS = [(0, 9), (0, 10), (0, 11), (0, 19), (0, 22), (0, 23), (0, 24), (0, 25), (0, 26),
            (0, 29), (0, 30), (0, 33), (0, 34)]  # fmt: skip


def _store(version: tuple[int, int], **over: Any) -> bytes:
    vals: dict[str, Any] = {
        "block_hashes": [M64, 7], "parent_block_hash": 1 << 63, "token_ids": list(range(2 * B)),
        "block_size": B, "lora_id": 3, "medium": "GPU", "lora_name": "adapter-a",
        "extra_keys": [["adapter-a", ["ab" * 32, 0], "salt"], ["adapter-a"]], "group_idx": 0,
        "kv_cache_spec_kind": "full_attention", "locality": "LOCAL", "ownership": "tier-x",
        "session_id": "s-1", "lookahead_token_ids": [[2 * B], [2 * B + 1]],
    }  # fmt: skip
    vals.update(over)
    return _event(version, "BlockStored", STORE_FIELDS, STORE_REQUIRED, vals)


def _remove(version: tuple[int, int], hs: list[Any], **over: Any) -> bytes:
    vals = {"block_hashes": hs, "medium": "GPU", "group_idx": 0, **over}
    return _event(version, "BlockRemoved", REMOVE_FIELDS, REMOVE_REQUIRED, vals)


def _clear(version: tuple[int, int]) -> bytes:
    return enc(["AllBlocksCleared"]) if version < MAP_ERA else enc({"type": "AllBlocksCleared"})


def _decode(payload: bytes, fast: bool, **kw: Any) -> Any:
    return Decoder(kv_block_size=B, dp_rank=0, fast=fast, **kw).decode(payload)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("version", VERSIONS, ids=lambda v: f"{v[0]}.{v[1]}")
def test_every_release_shape_decodes_to_the_state_it_names(
    version: tuple[int, int], fast: bool
) -> None:
    payload = _batch(version, [_store(version), _remove(version, [7]), _clear(version)])
    res = _decode(payload, fast)
    b = as_events(res.batch)
    assert res.dp_rank == 0 and res.ts == 1700000000.25
    assert b.ops.tolist() == [OP_STORE, OP_REMOVE, OP_CLEAR]
    assert b.ext_hashes.tolist() == [M64, 7, 7]  # u64 max read unsigned
    assert b.parent.tolist()[0] == 1 << 63 and b.has_parent.tolist()[0]
    assert b.tokens.tolist() == list(range(2 * B))  # standard format: lookahead ignored
    # the LoRA name (0.19+) seeds the block hashes; the lora id never does
    assert b.salt.tolist()[0] == (_lora_salt("adapter-a") if version >= (0, 19) else 1337)
    assert res.stats.unknown_fields == 0 and res.stats.drops == {}


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(
    ("hashes", "parent", "want", "want_parent"),
    [
        ([-1, -(1 << 63)], -2, [M64, 1 << 63], M64 - 1),  # signed i64 (SGLang-style)
        ([bytes(range(32))], bytes(range(100, 132)),  # sha256 digests, INT_BLOCK_HASHES=0
         [int.from_bytes(bytes(range(24, 32)), "big")],
         int.from_bytes(bytes(range(124, 132)), "big")),
        ([bytes(range(16))], None, [int.from_bytes(bytes(range(8, 16)), "big")], None),  # xxh128
    ],
)  # fmt: skip
def test_hash_encodings_name_the_int_form(
    hashes: list[Any], parent: Any, want: list[int], want_parent: int | None, fast: bool
) -> None:
    """Every int is its u64 two's complement; a digest is its last 8 bytes read big-endian,
    the value an engine with int hashes publishes for the same block."""
    v = (0, 34)
    ev = _store(v, block_hashes=hashes, parent_block_hash=parent,
                token_ids=list(range(B * len(hashes))), lora_name=None)  # fmt: skip
    b = as_events(_decode(_batch(v, [ev, _remove(v, hashes[:1])]), fast).batch)
    assert b.ext_hashes.tolist() == [*want, want[0]]
    assert b.has_parent.tolist()[0] == (want_parent is not None)
    assert b.parent.tolist()[0] == (want_parent or 0)


GATED = [
    # (what, version, event bytes, drop reason)
    ("offload placeholder", (0, 34),
     lambda v: _store(v, token_ids=[], block_size=0, parent_block_hash=None, medium="CPU"),
     "medium_host_pinned"),
    ("storage tier", (0, 26), lambda v: _remove(v, [1], medium="STORAGE"), "medium_disk"),
    ("remote locality", (0, 26), lambda v: _store(v, locality="REMOTE"), "locality"),
    ("placeholder on gpu", (0, 34),
     lambda v: _store(v, token_ids=[], block_size=0, parent_block_hash=None), "placeholder"),
    ("hash-granular partial block", (0, 34),
     lambda v: _store(v, block_hashes=[9], token_ids=[1, 2], block_size=2), "block_size_mismatch"),
    ("sliding window group", (0, 22),
     lambda v: _store(v, group_idx=1, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=128), "non_full_attention"),
    ("window tokens over the hashes", (0, 23),
     lambda v: _store(v, block_hashes=[9], token_ids=list(range(3 * B))), "tokens_excess"),
]  # fmt: skip


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize(("what", "version", "make", "reason"), GATED, ids=[g[0] for g in GATED])
def test_shapes_the_format_says_to_skip_are_counted(
    what: str, version: tuple[int, int], make: Any, reason: str, fast: bool
) -> None:
    res = _decode(_batch(version, [make(version)]), fast)
    assert as_events(res.batch).ops.tolist() == []
    assert res.stats.drops == {reason: 1}


def test_envelope_rank_and_shape() -> None:
    v = (0, 34)
    ev = [_remove(v, [1])]
    assert _decode(_batch(v, ev, dp=None), True).dp_rank == 0  # nil: the socket's rank
    # released vLLM always writes the batch positionally; a map envelope is not one of its shapes
    with pytest.raises(MalformedEnvelopeError):
        _decode(enc({"ts": 1.0, "events": [], "data_parallel_rank": 0}), False)
