"""Render encoding-neutral simulator events as vLLM wire structs (era + hash mode)."""

from __future__ import annotations

from typing import Any

from kvrelay.sim.scheduler import Cleared, Removed, SimEvent, Stored
from kvrelay.sim.wire import (
    ArrAllBlocksCleared,
    ArrBlockRemoved,
    ArrBlockStored,
    Era,
    HashMode,
    MapAllBlocksCleared,
    MapBlockRemoved,
    MapBlockStored,
    render_hash,
)


def render_event(
    ev: SimEvent,
    era: Era,
    mode: HashMode,
    block_size: int,
    lora_ids: dict[str, int],
    medium: str = "GPU",
) -> Any:
    """msgspec struct for one event; encoded inside a ``KVEventBatch`` by the publisher."""
    if isinstance(ev, Cleared):
        return MapAllBlocksCleared() if era is Era.MAP else ArrAllBlocksCleared()
    if isinstance(ev, Removed):
        hashes = [render_hash(ev.digest, mode)]
        if era is Era.MAP:
            return MapBlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)
        return ArrBlockRemoved(block_hashes=hashes, medium=medium, group_idx=0)
    assert isinstance(ev, Stored)
    first = ev.blocks[0]
    extra: list[Any] = []
    for b in ev.blocks:
        keys: list[str] = []
        if b.lora_name:
            keys.append(b.lora_name)
        if b.position == 0 and b.cache_salt:
            keys.append(b.cache_salt)
        extra.append(tuple(keys) if keys else None)
    extra_keys = extra if any(e is not None for e in extra) else None
    lora = first.lora_name
    kw: dict[str, Any] = {
        "block_hashes": [render_hash(b.digest, mode) for b in ev.blocks],
        "parent_block_hash": (
            render_hash(ev.parent_digest, mode) if ev.parent_digest is not None else None
        ),
        "token_ids": [t for b in ev.blocks for t in b.tokens],
        "block_size": block_size,
        "lora_id": lora_ids.get(lora) if lora else None,
        "medium": medium,
        "lora_name": lora,
        "extra_keys": extra_keys,
    }
    if era is Era.MAP:
        return MapBlockStored(**kw, group_idx=0, kv_cache_spec_kind="full_attention")
    return ArrBlockStored(**kw, group_idx=0, kv_cache_spec_kind="full_attention")
