"""Hypothesis strategies for hostile vLLM KV-event input: frames, msgpack envelopes, events."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lookahead_token_ids",
)  # fmt: skip

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 16, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
scalars = st.one_of(
    st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["GPU", "CPU", "DISK", "full_attention", "sliding_window"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
hash_lists = st.lists(st.one_of(ints, st.binary(min_size=32, max_size=32), values), max_size=6)


@st.composite
def events(draw: st.DrawFn) -> Any:
    """A plausible or hostile event, in map era (tagged dict) or array era (tag first)."""
    tag = draw(st.one_of(st.sampled_from(TAGS), st.text(max_size=10), ints))
    n = draw(st.integers(0, len(FIELDS)))
    body: dict[str, Any] = {}
    for name in FIELDS[:n]:
        if name == "block_hashes":
            body[name] = draw(hash_lists)
        elif name == "token_ids":
            body[name] = draw(st.lists(st.integers(-5, 2**32), max_size=70) | values)
        elif name == "block_size":
            body[name] = draw(st.sampled_from([16, 0, -16, 15, 2**40]) | values)
        else:
            body[name] = draw(values)
    if draw(st.booleans()):
        return {"type": tag, **body}
    return [tag, *body.values()]


envelopes = st.builds(
    lambda ts, evs, rank, extra: [ts, evs, rank, *extra],
    st.one_of(st.floats(), ints, values),
    st.one_of(st.lists(events(), max_size=8), values),
    st.one_of(st.sampled_from([0, None]), ints, values),
    st.lists(values, max_size=2),
)


def encode(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def mutate(payload: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (op, position, byte) edits: 0 flip, 1 insert, 2 delete, 3 truncate."""
    buf = bytearray(payload)
    for op, pos, val in edits:
        if not buf:
            break
        i = pos % len(buf)
        if op == 0:
            buf[i] ^= val or 1
        elif op == 1:
            buf.insert(i, val)
        elif op == 2:
            del buf[i]
        else:
            del buf[i:]
    return bytes(buf)


edit_lists = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6
)
seq_frames = st.one_of(
    st.integers(0, 2**64 - 1).map(lambda s: s.to_bytes(8, "big")), st.binary(max_size=12)
)
raw_messages = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=5),  # any frame count, any bytes
    st.builds(lambda s, p: [b"", s, p], seq_frames, st.binary(max_size=256)),
    st.builds(lambda s, e: [b"", s, encode(e)], seq_frames, envelopes),
)
