"""vLLM KV-event wire structs for both encoding eras, hash rendering and DP endpoint offsets.

Written from the documented format (``docs/contract.md`` §15–§17), not from vLLM code. The
simulator encodes with these msgspec structs so the bytes have exactly the shape a real engine
emits: array era (<= 0.23, positional, every field present) and map era (>= 0.24, ``type`` tag,
defaults omitted).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvrelay._text import is_decimal

U64_MASK = (1 << 64) - 1
END_SEQ = b"\xff" * 8

Hash = int | bytes


class Era(enum.Enum):
    """Event encoding era: ARRAY = vLLM <= 0.23, MAP = vLLM >= 0.24."""

    ARRAY = "array"
    MAP = "map"


class HashMode(enum.Enum):
    """How block hashes go out on the wire."""

    U64 = "u64"  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (default)
    I64 = "i64"  # signed two's-complement view (SGLang style)
    BYTES = "bytes"  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw 32-byte digest


# ---- map era (>= 0.24): tagged maps, fields with a default are omitted when equal to it ----


class MapBlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, kw_only=True
):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class MapBlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, kw_only=True
):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True
):
    pass


# ---- array era (0.22-0.23 field set): positional, tag first, every field emitted ----


class ArrBlockStored(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrBlockRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class ArrAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """Envelope ``[ts, events, data_parallel_rank]`` (always positional)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def render_hash(digest: bytes, mode: HashMode) -> Hash:
    """Wire form of a 32-byte block digest; int forms equal the digest's last 8 bytes (BE)."""
    if mode is HashMode.BYTES:
        return digest
    u = int.from_bytes(digest[-8:], "big")
    if mode is HashMode.I64 and u >= 1 << 63:
        return u - (1 << 64)
    return u


def encode_batch(ts: float, events: list[Any], dp_rank: int) -> bytes:
    """msgpack bytes of one batch, exactly as vLLM's default msgspec encoder emits them."""
    return _ENCODER.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Apply vLLM's per-DP-rank endpoint rewrite (§15.2; port 0 stays 0 as in >= 0.31)."""
    if rank == 0 or not endpoint:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not is_decimal(port):
            raise ValueError(f"tcp endpoint without a numeric port: {endpoint!r}")
        p = int(port)
        return endpoint if p == 0 else f"{head}:{p + rank}"
    raise ValueError(f"unsupported endpoint for DP offset: {endpoint!r}")


def seq_bytes(seq: int) -> bytes:
    """8-byte big-endian unsigned sequence frame."""
    return seq.to_bytes(8, "big", signed=False)
