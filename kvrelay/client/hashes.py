"""Request hashing for queries (``docs/contract.md`` §7), without numba.

A router process asks a few overlap questions per request; compiling the relay's batch kernels
for that would cost it seconds of JIT and a hundred MiB of LLVM. So the SDK hashes with the C
``xxhash`` package and numpy: salts, DYNAMO_STANDARD_V1 / EAGLE_V1 block hashes of the prompt's
windows (tokens as u32 little-endian) and the rolling sequence hashes (chain seed 1337). The
relay's numba kernels and the pure-Python reference are both tested against this.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import xxhash

BASE_SEED = 1337
_MASK64 = (1 << 64) - 1
U64 = npt.NDArray[np.uint64]


class QueryHashError(ValueError):
    """Tokens or block size that cannot be hashed (not u32 ids, block size < 1, bad salt)."""


def request_salt(lora_name: str | None, cache_namespace: str | None) -> int:
    """1337 + XXH3(lora name, seed 0) + XXH3(cache namespace, seed 1), mod 2^64; empty = absent."""
    s = BASE_SEED
    if lora_name:
        s += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), 0)
    if cache_namespace:
        s += xxhash.xxh3_64_intdigest(cache_namespace.encode("utf-8"), 1)
    return s & _MASK64


def _tokens(tokens: object) -> npt.NDArray[np.uint32]:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise QueryHashError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise QueryHashError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.uint32 and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise QueryHashError("token id outside the u32 range")
    return np.ascontiguousarray(arr, dtype="<u4")


def block_hashes(tokens: object, block_size: int, salt: int, eagle: bool = False) -> U64:
    """Hashes of every complete window: B tokens (standard) or B+1 at stride B (Eagle)."""
    if not isinstance(block_size, int | np.integer) or block_size < 1:
        raise QueryHashError(f"block_size must be a positive integer, got {block_size!r}")
    if not 0 <= int(salt) <= _MASK64:
        raise QueryHashError("salt must be a u64")
    raw = _tokens(tokens).tobytes()
    bs = int(block_size)
    n_tokens = len(raw) // 4
    window = bs + 1 if eagle else bs
    n = max(0, (n_tokens - window) // bs + 1) if n_tokens >= window else 0
    out = np.empty(n, dtype=np.uint64)
    h = xxhash.xxh3_64_intdigest
    for i in range(n):
        off = 4 * i * bs
        out[i] = h(raw[off : off + 4 * window], salt)
    return out


def sequence_hashes(block_hashes: object) -> U64:
    """seq[0] = bh[0]; seq[i] = XXH3(le64(seq[i-1]) ‖ le64(bh[i]), seed 1337)."""
    bh = np.ascontiguousarray(np.asarray(block_hashes, dtype=np.uint64))
    if bh.ndim != 1:
        raise QueryHashError(f"block_hashes must be 1-D, got shape {bh.shape}")
    out = np.empty(bh.size, dtype=np.uint64)
    if bh.size == 0:
        return out
    h = xxhash.xxh3_64_intdigest
    le = bh.astype("<u8").tobytes()
    prev = le[0:8]
    out[0] = bh[0]
    for i in range(1, bh.size):
        v = h(prev + le[8 * i : 8 * i + 8], BASE_SEED)
        out[i] = v
        prev = v.to_bytes(8, "little")
    return out
