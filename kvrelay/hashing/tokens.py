"""Token → block → sequence hashes (§7): DYNAMO_STANDARD_V1 and DYNAMO_EAGLE_V1.

The batch kernels run in numba over whole token arrays without copying (the u32 token buffer is
viewed as bytes), because the relay recomputes Dynamo's rolling sequence hash for every stored
block it ingests. ``kvrelay.hashing._reference`` is the pure-Python twin used as the test oracle.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba import njit

from kvrelay.hashing.xxh3 import xxh3_64_bytes, xxh3_64_tokens, xxh3_64_u64x2

BASE_SEED = 1337
"""XXH3_SEED: start of every salt, and the constant seed of the sequence chain (§7.3)."""
CHAIN_SEED = np.uint64(BASE_SEED)
_MASK64 = (1 << 64) - 1


class HashFormat(IntEnum):
    """``KvQueryHashFormat`` values; also the identity_version mixed into cache_semantics."""

    STANDARD = 1
    EAGLE = 2


class TokenHashError(ValueError):
    """Invalid hashing input (token out of u32 range, bad block size or salt)."""


def _xxh3_str(s: str, seed: int) -> int:
    raw = np.frombuffer(s.encode("utf-8"), dtype=np.uint8)
    return int(xxh3_64_bytes(raw, 0, raw.size, np.uint64(seed)))


def namespace_part(cache_namespace: str | None) -> int:
    """The cache_namespace term of the salt (XXH3-64 seed 1), 0 when absent or empty."""
    return _xxh3_str(cache_namespace, 1) if cache_namespace else 0


def lora_part(lora_name: str | None) -> int:
    """The LoRA term of the salt (XXH3-64 seed 0 of the canonical adapter name), 0 when absent."""
    return _xxh3_str(lora_name, 0) if lora_name else 0


def request_salt(lora_name: str | None, cache_namespace: str | None) -> int:
    """Request-wide block-hash seed: 1337 + lora term + namespace term, mod 2^64 (§7.1)."""
    return (BASE_SEED + lora_part(lora_name) + namespace_part(cache_namespace)) & _MASK64


def block_count(n_tokens: int, block_size: int, eagle: bool) -> int:
    """Number of complete windows: floor(n/B) standard, floor((n-1)/B) Eagle (never negative)."""
    if eagle:
        return max(0, (n_tokens - 1) // block_size) if n_tokens > 0 else 0
    return n_tokens // block_size


@njit(cache=True)  # type: ignore[misc]
def block_hashes_kernel(
    tokens: np.ndarray, block_size: int, window: int, n_blocks: int, salt: np.uint64
) -> np.ndarray:
    """Hash ``n_blocks`` windows of ``window`` tokens at stride ``block_size`` (u32-LE bytes)."""
    out = np.empty(n_blocks, dtype=np.uint64)
    for i in range(n_blocks):
        out[i] = xxh3_64_tokens(tokens, i * block_size, window, salt)
    return out


@njit(cache=True)  # type: ignore[misc]
def sequence_hashes_kernel(block_hashes: np.ndarray) -> np.ndarray:
    """Rolling chain: seq[0] = bh[0]; seq[i] = XXH3(le(seq[i-1]) ‖ le(bh[i]), seed 1337)."""
    n = block_hashes.size
    out = np.empty(n, dtype=np.uint64)
    if n == 0:
        return out
    prev = np.uint64(block_hashes[0])
    out[0] = prev
    for i in range(1, n):
        prev = xxh3_64_u64x2(prev, np.uint64(block_hashes[i]), CHAIN_SEED)
        out[i] = prev
    return out


def as_token_array(tokens: object) -> np.ndarray:
    """Contiguous uint32 view/copy of ``tokens``; raises TokenHashError if any id is not a u32."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TokenHashError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return np.ascontiguousarray(arr)
    if arr.size == 0:
        return np.empty(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise TokenHashError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise TokenHashError("token id outside the u32 range")
    return arr.astype(np.uint32)


def block_hashes(tokens: object, block_size: int, salt: int, eagle: bool = False) -> np.ndarray:
    """Local block hashes of every complete window (standard: B tokens; Eagle: B+1, stride B)."""
    if not isinstance(block_size, int | np.integer) or block_size < 1:
        raise TokenHashError(f"block_size must be a positive integer, got {block_size!r}")
    if not 0 <= int(salt) <= _MASK64:
        raise TokenHashError("salt must be a u64")
    arr = as_token_array(tokens)
    bs = int(block_size)
    n = block_count(arr.size, bs, eagle)
    window = bs + 1 if eagle else bs
    result: np.ndarray = block_hashes_kernel(arr, bs, window, n, np.uint64(salt))
    return result


def sequence_hashes(block_hashes: object) -> np.ndarray:
    """Sequence (chain) hashes of a block-hash array; the chain seed is always 1337 (§7.3)."""
    arr = np.ascontiguousarray(np.asarray(block_hashes, dtype=np.uint64))
    if arr.ndim != 1:
        raise TokenHashError(f"block_hashes must be 1-D, got shape {arr.shape}")
    result: np.ndarray = sequence_hashes_kernel(arr)
    return result
