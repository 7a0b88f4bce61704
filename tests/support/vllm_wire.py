"""Test-local vLLM wire encoder (independent of kvrelay.sim): msgspec structs in both eras.

Array era (vLLM <= 0.23): tagged ``array_like`` structs, every field emitted (nil when unset).
Map era (vLLM >= 0.24): tagged maps, fields equal to their default (None) omitted.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

Hash = int | bytes


class ArrStored(Struct, tag="BlockStored", array_like=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrRemoved(Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class ArrCleared(Struct, tag="AllBlocksCleared", array_like=True):
    pass


class ArrClearedMedium(Struct, tag="AllBlocksCleared", array_like=True):
    """ROCm ATOM's positional clear of one medium (vLLM's names none)."""

    medium: str | None


class MapStored(Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[Any]
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
    origin: str | None = None  # proposed: NEW / REUSED (not in a vLLM release)
    cache_salt: str | None = None  # an explicit salt field (§18.4)


class MapRemoved(Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapCleared(Struct, tag="AllBlocksCleared", omit_defaults=True):
    medium: str | None = None  # vLLM sends none; a clear of one tier names it


class Envelope(Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None


_ARR_STORE = set(ArrStored.__struct_fields__)
_ARR_REMOVE = set(ArrRemoved.__struct_fields__)


def stored(era: str, **kw: Any) -> Any:
    kw.setdefault("parent_block_hash", None)
    kw.setdefault("lora_id", None)
    kw.setdefault("medium", "GPU")
    kw.setdefault("lora_name", None)
    if era == "array":
        return ArrStored(**{k: v for k, v in kw.items() if k in _ARR_STORE})
    return MapStored(**kw)


def removed(era: str, hashes: list[Hash], **kw: Any) -> Any:
    kw.setdefault("medium", "GPU")
    if era == "array":
        return ArrRemoved(hashes, **{k: v for k, v in kw.items() if k in _ARR_REMOVE})
    return MapRemoved(hashes, **kw)


def cleared(era: str, medium: str | None = None) -> Any:
    if era == "array":
        return ArrCleared() if medium is None else ArrClearedMedium(medium)
    return MapCleared(medium)


def batch(events: list[Any], *, dp: int | None = 0, ts: float = 1700000000.5) -> bytes:
    return msgspec.msgpack.encode(Envelope(ts, events, dp))
