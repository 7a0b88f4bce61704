"""Hashes the simulator needs, in pure Python (an oracle independent of kvrelay's numba code).

- ``vllm_digest``: the simulator's stand-in for vLLM's block hash: a SHA-256 chain over
  (parent digest, u32-LE tokens, msgpack extra keys), rooted at a seed-derived NONE digest. vLLM
  hashes are opaque ids to consumers, so any reproducible chain is faithful enough.
- ``dynamo_*``: Dynamo's canonical XXH3 pipeline (§7), with the ``xxhash`` package.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

U64_MASK = (1 << 64) - 1
DYNAMO_SEED = 1337


def none_digest(seed: int) -> bytes:
    """Root parent digest for block 0 (vLLM's NONE_HASH analogue), reproducible from ``seed``."""
    return hashlib.sha256(f"kvrelay-sim-none-hash:{seed}".encode()).digest()


def vllm_digest(parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None) -> bytes:
    """32-byte chained block digest; its last 8 bytes (big-endian) are the published int hash."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    h.update(msgspec.msgpack.encode(list(extra_keys) if extra_keys else None))
    return h.digest()


def digest_to_u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & U64_MASK


def dynamo_salt(lora_name: str | None, cache_salt: str | None, namespacing: bool) -> int:
    """Request-wide seed: 1337 + xxh3(lora, 0) [+ xxh3(cache_salt, 1) when namespacing]."""
    s = DYNAMO_SEED
    if lora_name:
        s = (s + xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)) & U64_MASK
    if namespacing and cache_salt:
        s = (s + xxhash.xxh3_64_intdigest(cache_salt.encode(), seed=1)) & U64_MASK
    return s


def dynamo_block_hash(tokens: Sequence[int], salt: int) -> int:
    """XXH3-64 of the tokens as u32 little-endian, seeded with the request salt."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=salt)


def dynamo_chain(prev_seq: int | None, block_hash: int) -> int:
    """Chain step: seq[0] = block[0]; seq[i] = xxh3(le64(seq[i-1]) || le64(block[i]), 1337)."""
    if prev_seq is None:
        return block_hash
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev_seq, block_hash), seed=DYNAMO_SEED)


def dynamo_sequence_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    namespacing: bool = False,
) -> list[int]:
    """Canonical sequence hashes of every complete block of ``tokens`` (DYNAMO_STANDARD_V1)."""
    salt = dynamo_salt(lora_name, cache_salt, namespacing)
    out: list[int] = []
    prev: int | None = None
    for i in range(len(tokens) // block_size):
        prev = dynamo_chain(
            prev, dynamo_block_hash(tokens[i * block_size : (i + 1) * block_size], salt)
        )
        out.append(prev)
    return out
