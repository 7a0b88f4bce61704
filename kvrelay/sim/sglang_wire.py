"""SGLang's KV-event wire shapes, written from its published format (``docs/contract.md`` §21).

Up to 0.5.19 SGLang encodes its events as positional (array-like) msgspec structs; a list with
the same elements encodes to the same msgpack bytes, so those shapes are built as lists here. From
0.5.20 they are tagged maps, built with msgspec structs as vLLM's map era is. The layouts:

* ``NO_MEDIUM``: stores ``[tag, hashes, parent, tokens, block_size, lora_id]``, removes
  ``[tag, hashes]`` (the earliest revision; often with a 2-element envelope).
* ``MEDIUM``: + ``medium`` on both.
* ``METADATA``: as ``MEDIUM``; a store of a salted request appends ``{"cache_salt": …}`` right
  after ``medium`` (vLLM's ``lora_name`` slot).
* ``ALIGNED``: Dynamo's positional layout: stores with 14 slots (salt as a prefixed string in
  ``extra_keys`` and the map parked at slot 14), removes with 8 slots (``group_idx``,
  ``kv_cache_spec_kind``, window, ``locality``, ``ownership`` after ``medium``), and
  ``AllBlocksCleared`` with one trailing ``ownership`` slot. Contiguous pages coalesce into one
  multi-hash store.
* ``MAP`` (releases 0.5.20-0.5.21): tagged maps like vLLM's map era (``{"type": tag, ...}``,
  unset defaulted fields left out); a salted request's stores carry the key ``cache_salt``.
* ``MAP_LORA`` (0.5.22 on): as ``MAP``, plus the adapter's public name as ``lora_name`` (so the
  engine can serve LoRA adapters), and replay replies carry the topic frame (4 frames).

Both map layouts coalesce contiguous pages like ``ALIGNED``; the positional ones before it emit
one store per page. Hashes are signed i64: the first 8 bytes of the block
digest (SGLang publishes the first 16 hex digits of a SHA-256), two's complement. With EAGLE the
tokens are the page's bigrams ``[t_j, t_j+1]``.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvrelay.sim.scheduler import Cleared, Removed, SimEvent, Stored
from kvrelay.sim.wire import MapAllBlocksCleared

EPOCH_MARKER = b"\x00sgl-kv-epoch="
SALT_PREFIX = "dynamo-cache-salt:"
_ENCODER = msgspec.msgpack.Encoder()


class SglLayout(enum.Enum):
    NO_MEDIUM = "no_medium"
    MEDIUM = "medium"
    METADATA = "metadata"
    ALIGNED = "aligned"
    MAP = "map"
    MAP_LORA = "map_lora"

    @property
    def is_map(self) -> bool:
        return self in (SglLayout.MAP, SglLayout.MAP_LORA)

    @property
    def carries_salt(self) -> bool:
        """Whether a salted request's stores name the salt (0.5.18 on; the development
        revision too): a consumer namespaces them by default."""
        return self not in (SglLayout.NO_MEDIUM, SglLayout.MEDIUM)

    @property
    def names_adapters(self) -> bool:
        """Whether stores name the LoRA adapter (0.5.22 on); before, adapter blocks cannot be
        told from base-model ones, so the simulator serves no adapters in those layouts."""
        return self is SglLayout.MAP_LORA

    @property
    def replay_frames(self) -> int:
        """Replay reply frames: ``[b"", seq, payload]``, or from 0.5.22 with the topic."""
        return 4 if self is SglLayout.MAP_LORA else 3


# ---- map layouts (0.5.20 on): msgspec tagged structs, defaulted fields omitted when unset ----


class SglMapBlockStored(
    msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, kw_only=True
):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]  # token ids, or ``[a, b]`` bigram pairs with EAGLE
    block_size: int
    lora_id: int | None  # always nil: SGLang never published its adapter ids
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None  # 0.5.22 on


class SglMapBlockRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, kw_only=True
):
    block_hashes: list[int]
    medium: str | None = None


def sglang_hash(digest: bytes) -> int:
    """SGLang's event hash of a digest: its first 8 bytes as a signed big-endian i64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _page_tokens(window: tuple[int, ...], block_size: int, eagle: bool) -> list[Any]:
    if eagle:  # B bigram keys over the B + 1 tokens of the window
        return [[window[j], window[j + 1]] for j in range(block_size)]
    return list(window)


def _stored(
    hashes: list[int],
    parent: int | None,
    tokens: list[Any],
    block_size: int,
    salt: str | None,
    layout: SglLayout,
) -> list[Any]:
    ev: list[Any] = ["BlockStored", hashes, parent, tokens, block_size, None]
    if layout is SglLayout.NO_MEDIUM:
        return ev
    ev.append("GPU")
    if layout is SglLayout.METADATA:
        if salt:
            ev.append({"cache_salt": salt})
        return ev
    if layout is SglLayout.ALIGNED:
        extra = [[SALT_PREFIX + salt]] if salt else None
        ev += [None, extra, None, None, None, None, None]  # lora_name .. ownership
        if salt:
            ev.append({"cache_salt": salt})
    return ev


def _render_map(ev: SimEvent, layout: SglLayout, block_size: int, eagle: bool) -> Any:
    if isinstance(ev, Cleared):
        return MapAllBlocksCleared()  # the same bytes as vLLM's: ``{"type": tag}``
    if isinstance(ev, Removed):
        return SglMapBlockRemoved(block_hashes=[sglang_hash(ev.digest)], medium="GPU")
    assert isinstance(ev, Stored)
    first = ev.blocks[0]
    tokens: list[Any] = []
    for b in ev.blocks:
        tokens += _page_tokens(b.tokens, block_size, eagle)
    return SglMapBlockStored(
        block_hashes=[sglang_hash(b.digest) for b in ev.blocks],
        parent_block_hash=None if ev.parent_digest is None else sglang_hash(ev.parent_digest),
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        cache_salt=first.cache_salt or None,
        lora_name=(first.lora_name or None) if layout.names_adapters else None,
    )


def render_sglang(ev: SimEvent, layout: SglLayout, block_size: int, eagle: bool) -> list[Any]:
    """The wire events (one or several) for one simulator event: positional lists, or msgspec
    structs in the map layouts."""
    if layout.is_map:
        return [_render_map(ev, layout, block_size, eagle)]
    if isinstance(ev, Cleared):
        return [["AllBlocksCleared", None] if layout is SglLayout.ALIGNED else ["AllBlocksCleared"]]
    if isinstance(ev, Removed):
        rm: list[Any] = ["BlockRemoved", [sglang_hash(ev.digest)]]
        if layout is not SglLayout.NO_MEDIUM:
            rm.append("GPU")
        if layout is SglLayout.ALIGNED:
            rm += [None, None, None, None, None]
        return [rm]
    assert isinstance(ev, Stored)
    parent = None if ev.parent_digest is None else sglang_hash(ev.parent_digest)
    salt = ev.blocks[0].cache_salt
    if layout is SglLayout.ALIGNED:
        hashes = [sglang_hash(b.digest) for b in ev.blocks]
        tokens: list[Any] = []
        for b in ev.blocks:
            tokens += _page_tokens(b.tokens, block_size, eagle)
        return [_stored(hashes, parent, tokens, block_size, salt, layout)]
    out: list[Any] = []
    for b in ev.blocks:
        h = sglang_hash(b.digest)
        out.append(
            _stored([h], parent, _page_tokens(b.tokens, block_size, eagle), block_size, salt,
                    layout)
        )  # fmt: skip
        parent = h
    return out


def encode_sglang_batch(ts: float, events: list[Any], rank: int | None) -> bytes:
    """``[ts, events, attn_dp_rank]``, or ``[ts, events]`` when ``rank`` is None (oldest form)."""
    env: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return _ENCODER.encode(env)
