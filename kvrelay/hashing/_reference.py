"""Pure-Python twins of the hashing kernels, built on the C ``xxhash`` package.

Used as the independent oracle in tests (and handy for one-off debugging); never on a hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

_MASK64 = (1 << 64) - 1


def ref_salt(lora_name: str | None, cache_namespace: str | None) -> int:
    s = 1337
    if lora_name:
        s += xxhash.xxh3_64_intdigest(lora_name.encode("utf-8"), 0)
    if cache_namespace:
        s += xxhash.xxh3_64_intdigest(cache_namespace.encode("utf-8"), 1)
    return s & _MASK64


def _le32(tokens: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little") for t in tokens)


def ref_block_hash(tokens: Sequence[int], salt: int, mm: Sequence[int] = ()) -> int:
    data = _le32(tokens) + b"".join(int(v).to_bytes(8, "little") for v in sorted(mm))
    return int(xxhash.xxh3_64_intdigest(data, salt))


def ref_block_hashes(tokens: Sequence[int], block_size: int, salt: int, eagle: bool) -> list[int]:
    window = block_size + 1 if eagle else block_size
    out = []
    off = 0
    while off + window <= len(tokens):
        out.append(ref_block_hash(tokens[off : off + window], salt))
        off += block_size
    return out


def ref_sequence_hashes(block_hashes: Sequence[int]) -> list[int]:
    out: list[int] = []
    for bh in block_hashes:
        if not out:
            out.append(int(bh))
        else:
            data = out[-1].to_bytes(8, "little") + int(bh).to_bytes(8, "little")
            out.append(int(xxhash.xxh3_64_intdigest(data, 1337)))
    return out
