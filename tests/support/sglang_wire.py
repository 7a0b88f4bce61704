"""Test-local SGLang wire encoder (independent of kvrelay.sim and kvrelay.ingest): plain positional
msgpack arrays in the layouts SGLang's revisions publish (docs/sglang.md, contract §21).

Revisions, as ``rev``:

* ``"old"``: stores ``[tag, hashes, parent, tokens, block_size, lora_id]`` (no medium), removes
  ``[tag, hashes]``, envelope without a rank;
* ``"vllm"``: vLLM's positions up to ``lora_name`` (slot 7);
* ``"salt7"``: the salt map ``{"cache_salt": …}`` in slot 7 (so no LoRA name);
* ``"new"``: 14 store slots (vLLM's through ``ownership``) plus the salt map at slot 14, removes
  ``hashes, medium, group_idx, kv_cache_spec_kind, window, locality, ownership``, clears with one
  ``ownership`` slot;
* ``"map"`` (releases 0.5.20-0.5.21): tagged maps ``{"type": tag, ...}``, the fields SGLang
  gives a default (``medium``, ``cache_salt``, ``session_id``) left out when unset;
* ``"map_lora"`` (0.5.22 on): as ``"map"``, plus ``lora_name`` (left out when unset).

``REVISIONS`` are the positional ones (what the audit's SGLang cases draw from by default);
``MAP_REVISIONS`` the map ones.
"""

from __future__ import annotations

from typing import Any

import msgspec

REVISIONS = ("old", "vllm", "salt7", "new")
MAP_REVISIONS = ("map", "map_lora")


def _set(out: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """``out`` with each of ``fields`` that is set (a defaulted field left out when unset)."""
    out.update({k: v for k, v in fields.items() if v is not None})
    return out


def stored(
    rev: str, ev: dict[str, Any], hashes: list[Any], parent: Any, session: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """The store ``ev`` in revision ``rev``, and the fields of it that layout carries
    (``session``: the map layouts' ``session_id``, which no consumer reads)."""
    head = [hashes, parent, ev["token_ids"], ev["block_size"], ev.get("lora_id")]
    keep = {"kind", "block_hashes", "parent_block_hash", "token_ids", "block_size"}
    salt = ev.get("cache_salt")
    if rev in MAP_REVISIONS:
        m = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": ev["token_ids"], "block_size": ev["block_size"],
             "lora_id": ev.get("lora_id")}  # fmt: skip
        _set(m, medium=ev.get("medium"), cache_salt=salt, session_id=session)
        keep |= {"medium", "cache_salt"}
        if rev == "map_lora":
            _set(m, lora_name=ev.get("lora_name"))
            keep.add("lora_name")
        return m, {k: v for k, v in ev.items() if k in keep}
    if rev == "old":
        out = ["BlockStored", *head]
    elif rev == "vllm":
        out = ["BlockStored", *head, ev.get("medium"), ev.get("lora_name")]
        keep |= {"medium", "lora_name"}
    elif rev == "salt7":
        out = ["BlockStored", *head, ev.get("medium"), {"cache_salt": salt}]
        keep |= {"medium", "cache_salt"}
    else:
        ek = ev.get("extra_keys")
        if salt and ek is not None:  # SGLang's own copy in extra keys (the map wins)
            ek = [[*(x or []), f"dynamo-cache-salt:{salt}"] for x in ek]
        out = ["BlockStored", *head, ev.get("medium"), ev.get("lora_name"), ek,
               ev.get("group_idx"), ev.get("kv_cache_spec_kind"), None, ev.get("locality"),
               None, {"cache_salt": salt} if salt else None]  # fmt: skip
        keep |= {"medium", "lora_name", "group_idx", "kv_cache_spec_kind", "locality"}
        keep |= {"cache_salt"}
        seen = {k: v for k, v in ev.items() if k in keep}
        if ek is not None:
            seen["extra_keys"] = ek
        return out, seen
    return out, {k: v for k, v in ev.items() if k in keep}


def removed(rev: str, ev: dict[str, Any], hashes: list[Any]) -> tuple[Any, dict[str, Any]]:
    if rev in MAP_REVISIONS:
        m = _set({"type": "BlockRemoved", "block_hashes": hashes}, medium=ev.get("medium"))
        return m, {k: v for k, v in ev.items() if k in ("kind", "block_hashes", "medium")}
    if rev == "old":
        return ["BlockRemoved", hashes], {"kind": "remove", "block_hashes": ev["block_hashes"]}
    if rev in ("vllm", "salt7"):
        out = ["BlockRemoved", hashes, ev.get("medium")]
        return out, {k: v for k, v in ev.items() if k in ("kind", "block_hashes", "medium")}
    out = ["BlockRemoved", hashes, ev.get("medium"), ev.get("group_idx"), "sliding_window", None,
           ev.get("locality"), None]  # fmt: skip
    return out, ev


def cleared(rev: str) -> Any:
    if rev in MAP_REVISIONS:
        return {"type": "AllBlocksCleared"}
    return ["AllBlocksCleared", None] if rev == "new" else ["AllBlocksCleared"]


def batch(events: list[Any], *, dp: int | None, ts: float, short: bool = False) -> bytes:
    """``[ts, events, rank]``, or ``[ts, events]`` (the oldest revisions) when ``short``."""
    return msgspec.msgpack.encode([ts, events] if short else [ts, events, dp])
