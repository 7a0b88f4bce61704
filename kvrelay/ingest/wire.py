"""msgspec structs for vLLM KV events in both encodings.

Fast path: the whole payload decodes in one C call with *strict* structs (unknown fields rejected,
hashes typed ``int``), which is exact for the common case. Anything else (unknown tag or field,
bytes hashes, mixed eras) raises ``ValidationError`` and the decoder falls back to per-event
decoding with the *tolerant* variants. ``token_ids`` and ``extra_keys`` stay ``msgspec.Raw``
(parsed later by the numba kernel / only when an option needs them); fields kvrelay never uses
stay raw too so they cost nothing and never fail validation.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
from msgspec import Raw, Struct

STORE, REMOVE, CLEAR = 0, 1, 2
NO_RAW = Raw(b"")

Hash = int
LooseHash = int | bytes


# ---- map era (vLLM >= 0.24): {"type": tag, ...}, defaults omitted -------------------------------
class MapStored(Struct, tag="BlockStored", tag_field="type", forbid_unknown_fields=True):
    KIND: ClassVar[int] = STORE
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: Raw = NO_RAW
    block_size: int | None = None
    lora_id: Raw = NO_RAW
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Raw = NO_RAW
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: Raw = NO_RAW
    locality: str | None = None
    ownership: Raw = NO_RAW
    session_id: Raw = NO_RAW
    lookahead_token_ids: Raw = NO_RAW
    cache_salt: str | None = None
    #: ``NEW`` (newly cached blocks) or ``REUSED`` (a report of cached ones): proposed to vLLM,
    #: relied on by llm-d; tells physical copies from reports (contract §8.2.1)
    origin: str | None = None


class MapRemoved(Struct, tag="BlockRemoved", tag_field="type", forbid_unknown_fields=True):
    KIND: ClassVar[int] = REMOVE
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: Raw = NO_RAW


class MapCleared(Struct, tag="AllBlocksCleared", tag_field="type", forbid_unknown_fields=True):
    KIND: ClassVar[int] = CLEAR
    #: vLLM's clear names no medium (its GPU prefix cache); a publisher that clears one tier
    #: (ROCm ATOM) names it, and a clear of another tier leaves the GPU blocks held
    medium: str | None = None


# ---- array era (vLLM <= 0.23): [tag, field1, field2, ...] by declaration position --------------
class ArrStored(Struct, tag="BlockStored", array_like=True, forbid_unknown_fields=True):
    KIND: ClassVar[int] = STORE
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: Raw
    block_size: int | None
    lora_id: Raw = NO_RAW
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Raw = NO_RAW
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: Raw = NO_RAW
    locality: str | None = None
    ownership: Raw = NO_RAW
    session_id: Raw = NO_RAW
    lookahead_token_ids: Raw = NO_RAW

    cache_salt: ClassVar[None] = None


class ArrRemoved(Struct, tag="BlockRemoved", array_like=True, forbid_unknown_fields=True):
    KIND: ClassVar[int] = REMOVE
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: Raw = NO_RAW


class ArrCleared(Struct, tag="AllBlocksCleared", array_like=True, forbid_unknown_fields=True):
    KIND: ClassVar[int] = CLEAR
    medium: str | None = None  # position 1: ATOM's positional form (vLLM sends none)


# ---- tolerant variants: unknown fields ignored (counted separately), hashes may be bytes -------
class TMapStored(MapStored, tag="BlockStored", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]
    parent_block_hash: LooseHash | None = None  # type: ignore[assignment]


class TMapRemoved(MapRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]


class TMapCleared(MapCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


class TArrStored(ArrStored, tag="BlockStored", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]
    parent_block_hash: LooseHash | None  # type: ignore[assignment]


class TArrRemoved(ArrRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]


class TArrCleared(ArrCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
MAP_FIELDS: dict[str, frozenset[str]] = {
    "BlockStored": frozenset(MapStored.__struct_fields__) | {"type"},
    "BlockRemoved": frozenset(MapRemoved.__struct_fields__) | {"type"},
    "AllBlocksCleared": frozenset(MapCleared.__struct_fields__) | {"type"},
}
ARR_LEN: dict[str, int] = {
    "BlockStored": 1 + len(ArrStored.__struct_fields__),
    "BlockRemoved": 1 + len(ArrRemoved.__struct_fields__),
    "AllBlocksCleared": 1 + len(ArrCleared.__struct_fields__),
}


# ---- envelopes: [ts, events, dp_rank?] (extra trailing elements ignored) ----------------------
class MapEnvelope(Struct, array_like=True):
    ts: float
    events: list[MapStored | MapRemoved | MapCleared]
    dp_rank: int | None = None


class ArrEnvelope(Struct, array_like=True):
    ts: float
    events: list[ArrStored | ArrRemoved | ArrCleared]
    dp_rank: int | None = None


class RawEnvelope(Struct, array_like=True):
    ts: float
    events: list[Raw]
    dp_rank: int | None = None


MAP_ENVELOPE = msgspec.msgpack.Decoder(MapEnvelope)
ARR_ENVELOPE = msgspec.msgpack.Decoder(ArrEnvelope)
RAW_ENVELOPE = msgspec.msgpack.Decoder(RawEnvelope)
MAP_EVENT = msgspec.msgpack.Decoder(TMapStored | TMapRemoved | TMapCleared)
ARR_EVENT = msgspec.msgpack.Decoder(TArrStored | TArrRemoved | TArrCleared)
MAP_KEYS = msgspec.msgpack.Decoder(dict[str, Raw])
ARR_ITEMS = msgspec.msgpack.Decoder(list[Raw])
STR = msgspec.msgpack.Decoder(str)
