"""XXH3-64 numba kernels vs the C ``xxhash`` package (the oracle) on every length class."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from kvrelay.hashing.xxh3 import (
    xxh3_64_bytes,
    xxh3_64_tokens,
    xxh3_64_tokens_mm,
    xxh3_64_tokens_with,
    xxh3_64_u16,
    xxh3_64_u64,
    xxh3_64_u64x2,
)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SEEDS = [0, 1, 1337, 2**63, 2**64 - 1, 0x5DEECE66D1B54A33]
# Boundaries of every XXH3 path: 0, 1-3, 4-8, 9-16, 17-128, 129-240, long (stripes, blocks).
LENGTHS = [
    *range(0, 34),
    47,
    48,
    63,
    64,
    65,
    95,
    96,
    97,
    127,
    128,
    129,
    130,
    143,
    144,
    239,
    240,
    241,
    255,
    256,
    257,
    1023,
    1024,
    1025,
    1087,
    1088,
    1089,
    2047,
    2048,
    2049,
    4096,
    4097,
    10000,
]


def _u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=np.uint8).copy()


def test_golden_a1_test_data() -> None:
    assert int(xxh3_64_bytes(_u8(b"test data"), 0, 9, np.uint64(1337))) == 13226331709069118873
    assert xxhash.xxh3_64_intdigest(b"test data", 1337) == 13226331709069118873


def test_every_length_class_and_seed() -> None:
    rng = np.random.default_rng(7)
    for n in LENGTHS:
        data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        arr = _u8(data)
        for seed in SEEDS:
            got = int(xxh3_64_bytes(arr, 0, n, np.uint64(seed)))
            assert got == xxhash.xxh3_64_intdigest(data, seed), (n, seed)


def test_offset_window_and_readonly_input() -> None:
    data = bytes(range(256)) * 10
    ro = np.frombuffer(data, dtype=np.uint8)  # read-only view, no copy
    for start, n in [(0, 0), (3, 5), (7, 16), (100, 200), (5, 1500)]:
        assert int(xxh3_64_bytes(ro, start, n, np.uint64(42))) == xxhash.xxh3_64_intdigest(
            data[start : start + n], 42
        )


@settings(max_examples=150, deadline=None)
@given(data=st.binary(min_size=0, max_size=4096), seed=U64)
def test_bytes_random(data: bytes, seed: int) -> None:
    assert int(xxh3_64_bytes(_u8(data), 0, len(data), np.uint64(seed))) == (
        xxhash.xxh3_64_intdigest(data, seed)
    )


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=0, max_value=4096), seed=U64, fill=st.integers(0, 2**32 - 1))
def test_bytes_random_lengths(n: int, seed: int, fill: int) -> None:
    data = np.random.default_rng(fill).integers(0, 256, size=n, dtype=np.uint8).tobytes()
    assert int(xxh3_64_bytes(_u8(data), 0, n, np.uint64(seed))) == (
        xxhash.xxh3_64_intdigest(data, seed)
    )


@settings(max_examples=200, deadline=None)
@given(x=U64, y=U64, seed=U64)
def test_special_forms(x: int, y: int, seed: int) -> None:
    le = x.to_bytes(8, "little")
    assert int(xxh3_64_u64(x, seed)) == xxhash.xxh3_64_intdigest(le, seed)
    assert int(xxh3_64_u16(x, seed)) == xxhash.xxh3_64_intdigest(le[:2], seed)
    assert int(xxh3_64_u64x2(x, y, seed)) == xxhash.xxh3_64_intdigest(
        le + y.to_bytes(8, "little"), seed
    )


def test_special_forms_accept_numpy_scalars() -> None:
    x, s = np.uint64(2**64 - 5), np.uint64(3)
    assert int(xxh3_64_u64(x, s)) == xxhash.xxh3_64_intdigest(int(x).to_bytes(8, "little"), 3)


@settings(max_examples=100, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    mm=st.lists(U64, max_size=5),
    cut=st.integers(0, 300),
    seed=U64,
)
def test_tokens_and_tokens_mm(toks: list[int], mm: list[int], cut: int, seed: int) -> None:
    t = np.array(toks, dtype=np.uint32)
    m = np.array(mm, dtype=np.uint64)
    start = min(cut, len(toks))
    count = len(toks) - start
    packed = t[start:].astype("<u4").tobytes()
    assert int(xxh3_64_tokens(t, start, count, np.uint64(seed))) == (
        xxhash.xxh3_64_intdigest(packed, seed)
    )
    mm_packed = m.astype("<u8").tobytes()
    assert int(xxh3_64_tokens_mm(t, start, count, m, 0, len(mm), np.uint64(seed))) == (
        xxhash.xxh3_64_intdigest(packed + mm_packed, seed)
    )
    if len(mm) >= 2:
        assert int(xxh3_64_tokens_mm(t, start, count, m, 1, 1, np.uint64(seed))) == (
            xxhash.xxh3_64_intdigest(packed + mm_packed[8:16], seed)
        )


def test_token_word_path_every_count_offset_and_seed() -> None:
    """Blocks of 5..32 tokens hash from whole u32 words (and the 128-bit multiply is one LLVM
    i128 product): every count across the path's edges, odd offsets, extreme token values."""
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 2**32, size=200, dtype=np.uint64).astype(np.uint32)
    toks[:40] = 0xFFFFFFFF  # all-ones words: the multiply's carries at their largest
    tok8 = toks.view(np.uint8)
    sec = np.empty(192, dtype=np.uint8)
    acc = np.empty(8, dtype=np.uint64)
    for seed in SEEDS:
        for count in range(0, 70):
            for start in (0, 1, 3, 17, 130 - count if count < 130 else 0):
                want = xxhash.xxh3_64_intdigest(toks[start : start + count].tobytes(), seed)
                got = xxh3_64_tokens(toks, start, count, np.uint64(seed))
                got_with = xxh3_64_tokens_with(toks, tok8, start, count, np.uint64(seed), sec, acc)
                assert (int(got), int(got_with)) == (want, want), (seed, count, start)


@njit(cache=True)  # type: ignore[misc]
def _njit_caller(xs: np.ndarray, seed: np.uint64) -> np.ndarray:
    out = np.empty(xs.size, dtype=np.uint64)
    for i in range(xs.size):
        out[i] = xxh3_64_u64(xs[i], seed) ^ xxh3_64_u64x2(xs[i], seed, seed)
    return out


def test_callable_from_other_njit_code() -> None:
    xs = np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64)
    got = _njit_caller(xs, np.uint64(99))
    for x, g in zip(xs.tolist(), got.tolist(), strict=True):
        le = int(x).to_bytes(8, "little")
        exp = xxhash.xxh3_64_intdigest(le, 99) ^ xxhash.xxh3_64_intdigest(
            le + (99).to_bytes(8, "little"), 99
        )
        assert g == exp


def test_out_of_range_is_value_error_not_a_wild_read() -> None:
    buf = np.zeros(10, dtype=np.uint8)
    for start, n in [(-1, 2), (0, 11), (5, 6), (3, -1)]:
        with pytest.raises(ValueError):
            xxh3_64_bytes(buf, start, n, np.uint64(0))
    toks = np.arange(4, dtype=np.uint32)
    with pytest.raises(ValueError):
        xxh3_64_tokens(toks, 2, 3, np.uint64(0))
    mm = np.zeros(2, dtype=np.uint64)
    with pytest.raises(ValueError):
        xxh3_64_tokens_mm(toks, 0, 5, mm, 0, 1, np.uint64(0))
    with pytest.raises(ValueError):
        xxh3_64_tokens_mm(toks, 0, 4, mm, 1, 2, np.uint64(0))
