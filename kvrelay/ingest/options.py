"""Per-pool decoding options (both off by default, matching Dynamo 1.6.1's observed behaviour)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """``cache_salt_namespacing``: vLLM's ``cache_salt`` (bare string in block 0's extra keys)
    becomes the cache namespace of the root store (inherited down the chain, as an explicit
    salt's is with the option on or off).
    ``multimodal_hashing``: ``(identifier, offset)`` extra keys become per-block mm hashes (§7.2).
    ``drop_self_reference``: pre-drop stores whose hashes repeat (incl. the parent); the pool would
    reject them anyway."""

    cache_salt_namespacing: bool = False
    multimodal_hashing: bool = False
    drop_self_reference: bool = True
