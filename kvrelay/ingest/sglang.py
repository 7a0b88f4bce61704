"""SGLang's KV-event stream where it differs from vLLM's (``docs/contract.md`` §21).

SGLang publishes vLLM's framing and event vocabulary; up to 0.5.19 in the positional (array)
form, whose field positions moved between releases, so an SGLang source decodes arrays with these
structs instead of vLLM's array-era ones. From 0.5.20 events are tagged maps with vLLM's key
names, which decode as vLLM's:

* ``BlockStored``: positions 1–6 as vLLM (hashes, parent, tokens, block_size, lora_id, medium —
  medium absent before 0.5.9). Position 7 is vLLM's ``lora_name`` slot; 0.5.18–0.5.19 put a
  ``{"cache_salt": …}`` map there instead. Positions 8–13 follow vLLM (extra_keys … ownership) in
  a development revision, which parks the salt map at position 14.
* ``BlockRemoved``: ``hashes, medium, group_idx, kv_cache_spec_kind, window, locality,
  ownership`` — from position 4 on, *not* vLLM's order (vLLM: ``locality`` at 4).
* ``AllBlocksCleared``: may carry one trailing ``ownership`` slot.

Hashes are signed i64 (from 0.5.6 the first 8 bytes of a SHA-256 digest); the normal u64
normalization (two's complement) applies. The topic frame of a publisher with a snapshot endpoint
(a development revision) carries its *epoch* (a per-publisher incarnation token) after a NUL
marker, and snapshot barriers add another marker; ``split_topic`` reads both.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
from msgspec import Raw, Struct

from kvrelay.ingest.wire import CLEAR, NO_RAW, REMOVE, STORE, Hash, LooseHash
from kvrelay.ingest.wire import MapEnvelope as _VllmMapEnvelope

EPOCH_MARKER = b"\x00sgl-kv-epoch="
SNAPSHOT_MARKER = b"\x00sgl-kv-snapshot="
#: Longest epoch / barrier id accepted (SGLang uses 32 hex digits); longer is a topic mismatch.
MAX_TOKEN_BYTES = 128


def split_topic(frame: bytes, topic: bytes) -> tuple[bytes | None, bool] | None:
    """``(epoch, is_barrier)`` when ``frame`` is ``topic`` or an SGLang decoration of it, else
    ``None``. Forms: ``topic``; ``topic ␀sgl-kv-epoch=E``; ``topic ␀sgl-kv-epoch=E ␀sgl-kv-
    snapshot=B`` (a snapshot barrier: an empty batch that still consumes a sequence number)."""
    if frame == topic:
        return None, False
    if not frame.startswith(topic + EPOCH_MARKER):
        return None
    rest = frame[len(topic) + len(EPOCH_MARKER) :]
    epoch, sep, barrier = rest.partition(SNAPSHOT_MARKER)
    if not _token_ok(epoch) or (sep and not _token_ok(barrier)):
        return None
    return epoch, bool(sep)


def _token_ok(tok: bytes) -> bool:
    return 0 < len(tok) <= MAX_TOKEN_BYTES and b"\x00" not in tok


class SglMeta(Struct, forbid_unknown_fields=False):
    """``BlockStoredMetadata``: request metadata riding on a store (only ``cache_salt`` so far)."""

    cache_salt: str | None = None


class _SglStoredView:
    """The attributes the decoder reads, derived from SGLang's slots."""

    __slots__ = ()
    slot7: str | SglMeta | None
    metadata: Raw

    @property
    def lora_name(self) -> str | None:
        return self.slot7 if isinstance(self.slot7, str) else None

    @property
    def cache_salt(self) -> str | None:
        """The salt map's ``cache_salt`` (slot 7 of one revision, else slot 14). Slot 14 is read
        leniently: anything but a map with a string salt there means no salt."""
        if isinstance(self.slot7, SglMeta) and self.slot7.cache_salt:
            return self.slot7.cache_salt
        if len(self.metadata):
            try:
                meta = _META.decode(self.metadata)
            except msgspec.DecodeError:
                return None
            if meta is not None and meta.cache_salt:
                return meta.cache_salt
        return None


# ---- strict (fast msgspec path): every slot known, int hashes ----------------------------------
class SArrStored(
    _SglStoredView, Struct, tag="BlockStored", array_like=True, forbid_unknown_fields=True
):
    KIND: ClassVar[int] = STORE
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: Raw
    block_size: int | None
    lora_id: Raw = NO_RAW
    medium: str | None = None
    slot7: str | SglMeta | None = None  # lora_name, or the salt map of one revision
    extra_keys: Raw = NO_RAW
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: Raw = NO_RAW
    locality: str | None = None
    ownership: Raw = NO_RAW
    metadata: Raw = NO_RAW  # the salt map (newest revision)


class SArrRemoved(Struct, tag="BlockRemoved", array_like=True, forbid_unknown_fields=True):
    KIND: ClassVar[int] = REMOVE
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: Raw = NO_RAW
    kv_cache_spec_sliding_window: Raw = NO_RAW
    locality: str | None = None
    ownership: Raw = NO_RAW


class SArrCleared(Struct, tag="AllBlocksCleared", array_like=True, forbid_unknown_fields=True):
    KIND: ClassVar[int] = CLEAR
    ownership: Raw = NO_RAW


# ---- tolerant (per-event slow path): extra trailing slots ignored, hashes may be bytes ---------
class TSArrStored(SArrStored, tag="BlockStored", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]
    parent_block_hash: LooseHash | None  # type: ignore[assignment]


class TSArrRemoved(SArrRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    block_hashes: list[LooseHash]  # type: ignore[assignment]


class TSArrCleared(SArrCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


_META = msgspec.msgpack.Decoder(SglMeta | None)

ARR_LEN: dict[str, int] = {
    "BlockStored": 1 + len(SArrStored.__struct_fields__),
    "BlockRemoved": 1 + len(SArrRemoved.__struct_fields__),
    "AllBlocksCleared": 1 + len(SArrCleared.__struct_fields__),
}


class ArrEnvelope(Struct, array_like=True):
    ts: float
    events: list[SArrStored | SArrRemoved | SArrCleared]
    dp_rank: int | None = None


ARR_ENVELOPE = msgspec.msgpack.Decoder(ArrEnvelope)
ARR_EVENT = msgspec.msgpack.Decoder(TSArrStored | TSArrRemoved | TSArrCleared)
MAP_ENVELOPE = msgspec.msgpack.Decoder(_VllmMapEnvelope)

__all__ = [
    "ARR_ENVELOPE",
    "ARR_EVENT",
    "ARR_LEN",
    "EPOCH_MARKER",
    "MAP_ENVELOPE",
    "SNAPSHOT_MARKER",
    "SglMeta",
    "split_topic",
]
