"""XXH3-64 in numba, bit-exact with ``xxhash.xxh3_64_intdigest`` for every length and seed.

Why our own: the cuckoo filter and the block-hash batch kernels hash millions of keys from inside
njit loops, where calling the C extension is impossible. Implemented from the public XXH3
algorithm description (constants are the published ones); only uint64 arithmetic is used, so no
value ever promotes to float.

All entry points are cached numba functions callable both from Python and from other njit code;
the ones the relay calls from Python are ``kernel("hashing", ...)`` with declared signatures
(``kvrelay._jit``: compiled when the daemon warms up, not at import). Helpers are compiled once
each and marked ``forceinline`` (LLVM inlines them into every caller): numba's own
``inline="always"`` re-types the helper at every call site and made these kernels take ~10 s
each to compile, for the same machine code.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.extending import intrinsic, overload

from kvrelay._jit import declared, inline, kernel

if sys.byteorder != "little":  # token arrays are hashed through a zero-copy byte view
    raise ImportError("kvrelay.hashing.xxh3 requires a little-endian host")

_Idx = int | np.int64  # byte offsets/lengths (numba sees int64)
_M32 = np.uint64(0xFFFFFFFF)

PRIME32_1 = np.uint64(0x9E3779B1)
PRIME32_2 = np.uint64(0x85EBCA77)
PRIME32_3 = np.uint64(0xC2B2AE3D)
PRIME64_1 = np.uint64(0x9E3779B185EBCA87)
PRIME64_2 = np.uint64(0xC2B2AE3D27D4EB4F)
PRIME64_3 = np.uint64(0x165667B19E3779F9)
PRIME64_4 = np.uint64(0x85EBCA77C2B2AE63)
PRIME64_5 = np.uint64(0x27D4EB2F165667C5)
PRIME_MX1 = np.uint64(0x165667919E3779F9)
PRIME_MX2 = np.uint64(0x9FB21C651E98DF25)

# The 192-byte default secret (kSecret) from the XXH3 specification.
_KSECRET_HEX = (
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
KSECRET: np.ndarray = np.frombuffer(bytes.fromhex(_KSECRET_HEX), dtype=np.uint8).copy()
SECRET_SIZE = 192
STRIPE_LEN = 64
_STRIPES_PER_BLOCK = (SECRET_SIZE - STRIPE_LEN) // 8  # 16
_BLOCK_LEN = STRIPE_LEN * _STRIPES_PER_BLOCK  # 1024
# Offsets passed to helpers as int64 values: a plain constant argument is typed as a literal, and
# numba compiles a helper once per distinct literal (measured: 18 copies of ``_mix16``).
_S = tuple(np.int64(16 * i) for i in range(8))  # secret offsets of the 17..128-byte path
_I0 = cast(int, np.int64(0))
_I119 = np.int64(136 - 17)
_I121 = np.int64(SECRET_SIZE - STRIPE_LEN - 7)
_I128 = np.int64(SECRET_SIZE - STRIPE_LEN)


def _kw(off: int) -> np.uint64:
    return np.uint64(int.from_bytes(KSECRET[off : off + 8].tobytes(), "little"))


def _kw32(off: int) -> np.uint64:
    return np.uint64(int.from_bytes(KSECRET[off : off + 4].tobytes(), "little"))


# Precomputed secret words used by the short-input paths (folded at compile time).
_S0_FLIP = np.uint64(int(_kw(56)) ^ int(_kw(64)))
_S13_FLIP = np.uint64(int(_kw32(0)) ^ int(_kw32(4)))
_S48_FLIP = np.uint64(int(_kw(8)) ^ int(_kw(16)))
_S916_FLIP1 = np.uint64(int(_kw(24)) ^ int(_kw(32)))
_S916_FLIP2 = np.uint64(int(_kw(40)) ^ int(_kw(48)))


# Declared argument types: writable arrays convert to the read-only ones, so the Python entry
# points (read-only bytes) and the apply kernel (writable token buffers) share one compiled copy.
_RO_U8 = types.Array(types.uint8, 1, "C", readonly=True)
_RO_U32 = types.Array(types.uint32, 1, "C", readonly=True)
_RO_U64 = types.Array(types.uint64, 1, "C", readonly=True)
_U8 = types.Array(types.uint8, 1, "C")
_U64 = types.Array(types.uint64, 1, "C")
_I64 = types.int64
_SEED = types.uint64
_H = types.uint64  # a hash


@inline  # type: ignore[misc]
def _rotl(x: np.uint64, r: np.uint64) -> np.uint64:
    return (x << r) | (x >> (np.uint64(64) - r))


@inline  # type: ignore[misc]
def _swap32(x: np.uint64) -> np.uint64:
    x = x & _M32
    return (
        ((x & np.uint64(0xFF)) << np.uint64(24))
        | ((x & np.uint64(0xFF00)) << np.uint64(8))
        | ((x >> np.uint64(8)) & np.uint64(0xFF00))
        | (x >> np.uint64(24))
    )


@inline  # type: ignore[misc]
def _swap64(x: np.uint64) -> np.uint64:
    return (_swap32(x & _M32) << np.uint64(32)) | _swap32(x >> np.uint64(32))


@intrinsic  # type: ignore[misc]
def _mul128_fold64_ir(typingctx: Any, a: Any, b: Any) -> Any:
    """LLVM ``i128`` multiply: one 64×64→128 machine multiply instead of four 32-bit ones."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i128 = ir.IntType(64), ir.IntType(128)
        x = builder.zext(context.cast(builder, args[0], signature.args[0], types.uint64), i128)
        y = builder.zext(context.cast(builder, args[1], signature.args[1], types.uint64), i128)
        p = builder.mul(x, y)
        lo = builder.trunc(p, i64)
        hi = builder.trunc(builder.lshr(p, ir.Constant(i128, 64)), i64)
        return builder.xor(lo, hi)

    return sig, codegen


@inline  # type: ignore[misc]
def _mul128_fold64(a: np.uint64, b: np.uint64) -> np.uint64:
    """Low 64 bits XOR high 64 bits of the full 128-bit product a*b."""
    return _mul128_fold64_ir(a, b)  # type: ignore[no-any-return,call-arg]


@inline  # type: ignore[misc]
def _xxh64_avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> np.uint64(33)
    h *= PRIME64_2
    h ^= h >> np.uint64(29)
    h *= PRIME64_3
    h ^= h >> np.uint64(32)
    return h


@inline  # type: ignore[misc]
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> np.uint64(37)
    h *= PRIME_MX1
    h ^= h >> np.uint64(32)
    return h


@inline  # type: ignore[misc]
def _rrmxmx(h: np.uint64, length: np.uint64) -> np.uint64:
    h ^= _rotl(h, np.uint64(49)) ^ _rotl(h, np.uint64(24))
    h *= PRIME_MX2
    h ^= (h >> np.uint64(35)) + length
    h *= PRIME_MX2
    h ^= h >> np.uint64(28)
    return h


@inline  # type: ignore[misc]
def _r32(d: np.ndarray, p: _Idx) -> np.uint64:
    return (
        np.uint64(d[p])
        | (np.uint64(d[p + 1]) << np.uint64(8))
        | (np.uint64(d[p + 2]) << np.uint64(16))
        | (np.uint64(d[p + 3]) << np.uint64(24))
    )


def _r64(d: np.ndarray, p: _Idx) -> np.uint64:
    """Little-endian u64 at byte offset ``p`` of ``d`` (njit only; see the overload below)."""
    raise NotImplementedError("_r64 is resolved inside numba-compiled code only")


@overload(_r64, jit_options={"forceinline": True})  # type: ignore[misc]
def _r64_for(d: Any, p: Any) -> Any:
    """Byte arrays load eight bytes; u32 token arrays load two whole words (``p`` is still a
    byte offset and a multiple of 4 there), so the 17..128-byte path hashes token blocks in
    place."""
    if isinstance(d, types.Array) and d.dtype == types.uint32:

        def from_words(d: Any, p: Any) -> Any:  # numba: names and annotations as the overload
            i = p >> 2
            return np.uint64(d[i]) | (np.uint64(d[i + 1]) << np.uint64(32))

        return from_words

    def from_bytes(d: Any, p: Any) -> Any:
        return _r32(d, p) | (_r32(d, p + 4) << np.uint64(32))

    return from_bytes


@inline  # type: ignore[misc]
def _mix16(d: np.ndarray, p: _Idx, s: np.ndarray, sp: _Idx, seed: np.uint64) -> np.uint64:
    lo = _r64(d, p)
    hi = _r64(d, p + 8)
    return _mul128_fold64(lo ^ (_r64(s, sp) + seed), hi ^ (_r64(s, sp + 8) - seed))


@declared(_H(_RO_U8, _I64, _I64, _SEED))  # type: ignore[misc]
def _len_0to16(d: np.ndarray, p: _Idx, n: _Idx, seed: np.uint64) -> np.uint64:
    ln = np.uint64(n)
    if n > 8:
        flip1 = _S916_FLIP1 + seed
        flip2 = _S916_FLIP2 - seed
        lo = _r64(d, p) ^ flip1
        hi = _r64(d, p + n - 8) ^ flip2
        acc = ln + _swap64(lo) + hi + _mul128_fold64(lo, hi)
        return _avalanche(acc)
    if n >= 4:
        s2 = seed ^ (_swap32(seed & _M32) << np.uint64(32))
        in1 = _r32(d, p)
        in2 = _r32(d, p + n - 4)
        flip = _S48_FLIP - s2
        keyed = (in2 + (in1 << np.uint64(32))) ^ flip
        return _rrmxmx(keyed, ln)
    if n > 0:
        c1 = np.uint64(d[p])
        c2 = np.uint64(d[p + (n >> 1)])
        c3 = np.uint64(d[p + n - 1])
        combined = (c1 << np.uint64(16)) | (c2 << np.uint64(24)) | c3 | (ln << np.uint64(8))
        flip = _S13_FLIP + seed
        return _xxh64_avalanche(combined ^ flip)
    return _xxh64_avalanche(seed ^ _S0_FLIP)


@declared(_H(_RO_U8, _I64, _I64, _SEED), _H(_RO_U32, _I64, _I64, _SEED))  # type: ignore[misc]
def _len_17to128(d: np.ndarray, p: _Idx, n: _Idx, seed: np.uint64) -> np.uint64:
    """Also compiled for u32 token arrays: with ``p`` and ``n`` multiples of 4 every read offset
    here is one, so ``_r64`` loads whole words (the token-block hot path)."""
    s = KSECRET
    acc = np.uint64(n) * PRIME64_1
    # Secret offsets are int64 values (``_S``), not literals: ``_mix16`` compiles once.
    if n > 32:
        if n > 64:
            if n > 96:
                acc += _mix16(d, p + 48, s, _S[6], seed)
                acc += _mix16(d, p + n - 64, s, _S[7], seed)
            acc += _mix16(d, p + 32, s, _S[4], seed)
            acc += _mix16(d, p + n - 48, s, _S[5], seed)
        acc += _mix16(d, p + 16, s, _S[2], seed)
        acc += _mix16(d, p + n - 32, s, _S[3], seed)
    acc += _mix16(d, p, s, _S[0], seed)
    acc += _mix16(d, p + n - 16, s, _S[1], seed)
    return _avalanche(acc)


@declared(_H(_RO_U8, _I64, _I64, _SEED))  # type: ignore[misc]
def _len_129to240(d: np.ndarray, p: _Idx, n: _Idx, seed: np.uint64) -> np.uint64:
    s = KSECRET
    acc = np.uint64(n) * PRIME64_1
    rounds = n // 16
    for i in range(8):
        acc += _mix16(d, p + 16 * i, s, 16 * i, seed)
    acc = _avalanche(acc)
    for i in range(8, rounds):
        acc += _mix16(d, p + 16 * i, s, 16 * (i - 8) + 3, seed)
    acc += _mix16(d, p + n - 16, s, _I119, seed)
    return _avalanche(acc)


@inline  # type: ignore[misc]
def _accumulate_512(acc: np.ndarray, d: np.ndarray, p: _Idx, s: np.ndarray, sp: _Idx) -> None:
    for i in range(8):
        v = _r64(d, p + 8 * i)
        k = v ^ _r64(s, sp + 8 * i)
        acc[i ^ 1] += v
        acc[i] += (k & _M32) * (k >> np.uint64(32))


@inline  # type: ignore[misc]
def _scramble(acc: np.ndarray, s: np.ndarray, sp: _Idx) -> None:
    for i in range(8):
        a = acc[i]
        a ^= a >> np.uint64(47)
        a ^= _r64(s, sp + 8 * i)
        a *= PRIME32_1
        acc[i] = a


@declared(_H(_RO_U8, _I64, _I64, _SEED, _U8, _U64))  # type: ignore[misc]
def _hash_long_with(
    d: np.ndarray, p: _Idx, n: _Idx, seed: np.uint64, s: np.ndarray, acc: np.ndarray
) -> np.uint64:
    """The > 240-byte path using caller-owned buffers: ``s`` (secret, ≥ 192 bytes) and ``acc``
    (≥ 8 u64). Allocation-free, so kernels compiled without numba's runtime can reach it."""
    if s.size < SECRET_SIZE or acc.size < 8:
        raise ValueError("xxh3: secret/accumulator scratch too small")
    if seed == np.uint64(0):
        for i in range(SECRET_SIZE):
            s[i] = KSECRET[i]
    else:
        # Seeded custom secret: even 8-byte words + seed, odd words - seed.
        for i in range(SECRET_SIZE // 16):
            lo = _r64(KSECRET, 16 * i) + seed
            hi = _r64(KSECRET, 16 * i + 8) - seed
            for j in range(8):
                s[16 * i + j] = np.uint8((lo >> np.uint64(8 * j)) & np.uint64(0xFF))
                s[16 * i + 8 + j] = np.uint8((hi >> np.uint64(8 * j)) & np.uint64(0xFF))
    acc[0] = PRIME32_3
    acc[1] = PRIME64_1
    acc[2] = PRIME64_2
    acc[3] = PRIME64_3
    acc[4] = PRIME64_4
    acc[5] = PRIME32_2
    acc[6] = PRIME64_5
    acc[7] = PRIME32_1
    nb_blocks = (n - 1) // _BLOCK_LEN
    for b in range(nb_blocks):
        base = p + b * _BLOCK_LEN
        for st in range(_STRIPES_PER_BLOCK):
            _accumulate_512(acc, d, base + st * STRIPE_LEN, s, st * 8)
        _scramble(acc, s, _I128)
    nb_stripes = ((n - 1) - _BLOCK_LEN * nb_blocks) // STRIPE_LEN
    base = p + nb_blocks * _BLOCK_LEN
    for st in range(nb_stripes):
        _accumulate_512(acc, d, base + st * STRIPE_LEN, s, st * 8)
    _accumulate_512(acc, d, p + n - STRIPE_LEN, s, _I121)
    result = np.uint64(n) * PRIME64_1
    for i in range(4):
        result += _mul128_fold64(
            acc[2 * i] ^ _r64(s, 11 + 16 * i), acc[2 * i + 1] ^ _r64(s, 11 + 16 * i + 8)
        )
    return _avalanche(result)


@declared(_H(_RO_U8, _I64, _I64, _SEED))  # type: ignore[misc]
def _hash_long(d: np.ndarray, p: _Idx, n: _Idx, seed: np.uint64) -> np.uint64:
    s = np.empty(SECRET_SIZE, dtype=np.uint8)
    acc = np.empty(8, dtype=np.uint64)
    return _hash_long_with(d, p, n, seed, s, acc)


@kernel("hashing", types.uint64(_RO_U8, types.int64, types.int64, types.uint64))  # type: ignore[misc]
def xxh3_64_bytes(data: np.ndarray, start: int, length: int, seed: np.uint64) -> np.uint64:
    """XXH3-64 of ``data[start:start+length]``; raises ValueError if the range is out of bounds.

    (numba does not bounds-check indexing, so the one range check here keeps reads in the buffer.)
    """
    # Normalise scalar types so the length-class kernels compile once per array type only.
    p = np.int64(start)
    n = np.int64(length)
    s = np.uint64(seed)
    if p < 0 or n < 0 or p + n > data.size:
        raise ValueError("xxh3_64_bytes: range outside the buffer")
    if n <= 16:
        return _len_0to16(data, p, n, s)
    if n <= 128:
        return _len_17to128(data, p, n, s)
    if n <= 240:
        return _len_129to240(data, p, n, s)
    return _hash_long(data, p, n, s)


@declared(_H(_RO_U8, _I64, _I64, _SEED, _U8, _U64))  # type: ignore[misc]
def xxh3_64_bytes_with(
    data: np.ndarray,
    start: int,
    length: int,
    seed: np.uint64,
    secret_scratch: np.ndarray,
    acc_scratch: np.ndarray,
) -> np.uint64:
    """``xxh3_64_bytes`` that never allocates: inputs over 240 bytes use the caller's scratch
    (``secret_scratch`` ≥ 192 u8, ``acc_scratch`` ≥ 8 u64). Kernels compiled with
    ``_nrt=False`` must use this form: numba compiles callees with the caller's runtime flag."""
    p = np.int64(start)
    n = np.int64(length)
    s = np.uint64(seed)
    if p < 0 or n < 0 or p + n > data.size:
        raise ValueError("xxh3_64_bytes: range outside the buffer")
    if n <= 16:
        return _len_0to16(data, p, n, s)
    if n <= 128:
        return _len_17to128(data, p, n, s)
    if n <= 240:
        return _len_129to240(data, p, n, s)
    return _hash_long_with(data, p, n, s, secret_scratch, acc_scratch)


@kernel("hashing", types.uint64(types.uint64, types.uint64))  # type: ignore[misc]
def xxh3_64_u64(x: np.uint64, seed: np.uint64) -> np.uint64:
    """XXH3-64 of the 8-byte little-endian encoding of ``x`` (the 4..8-byte path, specialised)."""
    s2 = seed ^ (_swap32(seed & _M32) << np.uint64(32))
    flip = _S48_FLIP - s2
    keyed = ((x >> np.uint64(32)) + ((x & _M32) << np.uint64(32))) ^ flip
    return _rrmxmx(keyed, np.uint64(8))


@kernel("hashing", types.uint64(types.uint64, types.uint64))  # type: ignore[misc]
def xxh3_64_u16(x: np.uint64, seed: np.uint64) -> np.uint64:
    """XXH3-64 of the 2-byte little-endian encoding of ``x & 0xFFFF`` (the 1..3-byte path)."""
    b0 = x & np.uint64(0xFF)
    b1 = (x >> np.uint64(8)) & np.uint64(0xFF)
    combined = (b0 << np.uint64(16)) | (b1 << np.uint64(24)) | b1 | (np.uint64(2) << np.uint64(8))
    flip = _S13_FLIP + seed
    return _xxh64_avalanche(combined ^ flip)


@kernel("hashing", types.uint64(types.uint64, types.uint64, types.uint64))  # type: ignore[misc]
def xxh3_64_u64x2(a: np.uint64, b: np.uint64, seed: np.uint64) -> np.uint64:
    """XXH3-64 of the 16 bytes ``le64(a) || le64(b)`` (the sequence-hash chain step)."""
    lo = a ^ (_S916_FLIP1 + seed)
    hi = b ^ (_S916_FLIP2 - seed)
    acc = np.uint64(16) + _swap64(lo) + hi + _mul128_fold64(lo, hi)
    return _avalanche(acc)


@declared(_H(_RO_U32, _I64, _I64, _SEED))  # type: ignore[misc]
def xxh3_64_tokens(tokens: np.ndarray, start: int, count: int, seed: np.uint64) -> np.uint64:
    """XXH3-64 of the u32-LE bytes of ``tokens[start:start+count]``, hashed in place (no copy)."""
    if 5 <= count <= 32 and start >= 0 and start + count <= tokens.size:
        return _len_17to128(tokens, 4 * np.int64(start), 4 * np.int64(count), np.uint64(seed))  # type: ignore[no-any-return]
    raw = tokens.view(np.uint8)
    return xxh3_64_bytes(raw, 4 * start, 4 * count, np.uint64(seed))


@declared(_H(_RO_U32, _RO_U8, _I64, _I64, _SEED, _U8, _U64))  # type: ignore[misc]
def xxh3_64_tokens_with(
    tokens: np.ndarray,
    tok8: np.ndarray,
    start: int,
    count: int,
    seed: np.uint64,
    secret_scratch: np.ndarray,
    acc_scratch: np.ndarray,
) -> np.uint64:
    """``xxh3_64_tokens`` that never allocates (see ``xxh3_64_bytes_with``); ``tok8`` is
    ``tokens.view(np.uint8)``, made once by the caller. Blocks of 5..32 tokens (every common
    block size) take the word path."""
    if 5 <= count <= 32 and start >= 0 and start + count <= tokens.size:
        return _len_17to128(tokens, 4 * np.int64(start), 4 * np.int64(count), np.uint64(seed))  # type: ignore[no-any-return]
    return xxh3_64_bytes_with(  # type: ignore[no-any-return]
        tok8, 4 * start, 4 * count, np.uint64(seed), secret_scratch, acc_scratch
    )


@declared(  # type: ignore[misc]
    _H(_RO_U32, _I64, _I64, _RO_U64, _I64, _I64, _SEED, _U8, _U8, _U64)
)
def xxh3_64_tokens_mm_into(
    tokens: np.ndarray,
    start: int,
    count: int,
    mm: np.ndarray,
    mm_start: int,
    mm_count: int,
    seed: np.uint64,
    scratch: np.ndarray,
    secret_scratch: np.ndarray,
    acc_scratch: np.ndarray,
) -> np.uint64:
    """``xxh3_64_tokens_mm`` using the caller's buffers (no allocation), so kernels compiled
    without numba's runtime (``_nrt=False``) can call it; see ``xxh3_64_bytes_with``."""
    if start < 0 or count < 0 or start + count > tokens.size:
        raise ValueError("xxh3_64_tokens_mm: token range outside the array")
    if mm_start < 0 or mm_count < 0 or mm_start + mm_count > mm.size:
        raise ValueError("xxh3_64_tokens_mm: mm range outside the array")
    n = 4 * count + 8 * mm_count
    if n > scratch.size:
        raise ValueError("xxh3_64_tokens_mm: scratch buffer too small")
    for i in range(count):
        t = np.uint64(tokens[start + i])
        for j in range(4):
            scratch[4 * i + j] = np.uint8((t >> np.uint64(8 * j)) & np.uint64(0xFF))
    off = 4 * count
    for i in range(mm_count):
        v = np.uint64(mm[mm_start + i])
        for j in range(8):
            scratch[off + 8 * i + j] = np.uint8((v >> np.uint64(8 * j)) & np.uint64(0xFF))
    return xxh3_64_bytes_with(scratch, _I0, n, np.uint64(seed), secret_scratch, acc_scratch)


@declared(_H(_RO_U32, _I64, _I64, _RO_U64, _I64, _I64, _SEED))  # type: ignore[misc]
def xxh3_64_tokens_mm(
    tokens: np.ndarray,
    start: int,
    count: int,
    mm: np.ndarray,
    mm_start: int,
    mm_count: int,
    seed: np.uint64,
) -> np.uint64:
    """XXH3-64 of u32-LE token bytes followed by the u64-LE multimodal values (§7.2).

    The caller passes mm values already in the order to hash (§7.2 wants them sorted ascending).
    """
    scratch = np.empty(max(0, 4 * count + 8 * mm_count), dtype=np.uint8)
    sec = np.empty(SECRET_SIZE, dtype=np.uint8)
    acc = np.empty(8, dtype=np.uint64)
    return xxh3_64_tokens_mm_into(
        tokens, start, count, mm, mm_start, mm_count, seed, scratch, sec, acc
    )
