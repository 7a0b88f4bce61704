"""Request salts (``docs/contract.md`` §7.1) for ingest, cached per name.

Delegates to ``kvrelay.hashing.tokens`` (the single definition of §7.1); the caches matter because
the decoder asks once per store event and the set of LoRA names/namespaces is small.
"""

from __future__ import annotations

from functools import lru_cache

from kvrelay.hashing import tokens as _tokens


@lru_cache(maxsize=4096)
def namespace_part(cache_namespace: str) -> int:
    """``xxh3_64(utf8(ns), seed=1)``, or 0 for the empty namespace (absent)."""
    return int(_tokens.namespace_part(cache_namespace))


@lru_cache(maxsize=4096)
def request_salt(lora_name: str | None, cache_namespace: str | None) -> int:
    """``1337 + xxh3(lora, 0) + xxh3(ns, 1) mod 2^64``; empty strings count as absent."""
    return int(_tokens.request_salt(lora_name, cache_namespace))
