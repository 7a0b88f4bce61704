"""SGLang's KV-event wire shapes, written from its published format (``docs/contract.md`` §21).

SGLang encodes its events as positional (array-like) msgspec structs with every field present;
a list with the same elements encodes to the same msgpack bytes, so the shapes are built as lists
here, one function per revision of the layout:

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

Older revisions emit one store per page. Hashes are signed i64: the first 8 bytes of the block
digest (SGLang publishes the first 16 hex digits of a SHA-256), two's complement. With EAGLE the
tokens are the page's bigrams ``[t_j, t_j+1]``.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvrelay.sim.scheduler import Cleared, Removed, SimEvent, Stored

EPOCH_MARKER = b"\x00sgl-kv-epoch="
SALT_PREFIX = "dynamo-cache-salt:"
_ENCODER = msgspec.msgpack.Encoder()


class SglLayout(enum.Enum):
    NO_MEDIUM = "no_medium"
    MEDIUM = "medium"
    METADATA = "metadata"
    ALIGNED = "aligned"


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


def render_sglang(
    ev: SimEvent, layout: SglLayout, block_size: int, eagle: bool
) -> list[list[Any]]:
    """The wire events (one or several) for one simulator event."""
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
    out = []
    for b in ev.blocks:
        h = sglang_hash(b.digest)
        out.append(
            _stored([h], parent, _page_tokens(b.tokens, block_size, eagle), block_size, salt,
                    layout)
        )  # fmt: skip
        parent = h
    return out


def encode_sglang_batch(ts: float, events: list[list[Any]], rank: int | None) -> bytes:
    """``[ts, events, attn_dp_rank]``, or ``[ts, events]`` when ``rank`` is None (oldest form)."""
    env: list[Any] = [ts, events] if rank is None else [ts, events, rank]
    return _ENCODER.encode(env)
