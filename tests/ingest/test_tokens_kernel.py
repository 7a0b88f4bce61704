"""numba token kernel vs its pure-Python twin on random arrays (flat and bigram, bad values)."""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.ingest.tokens_kernel import fill_tokens, fill_tokens_py

elem = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(0, 300),
    st.integers(-(2**63), 2**64 - 1),
    st.just(True),
    st.just(1.5),
    st.just("x"),
)
flat = st.lists(elem, max_size=40)
pairs = st.lists(
    st.one_of(st.tuples(elem, elem).map(list), st.lists(st.integers(0, 9), max_size=3)),
    min_size=1,
    max_size=20,
)


def header(raw: bytes) -> tuple[int, int, bool]:
    b0 = raw[0]
    if 0x90 <= b0 <= 0x9F:
        n, h = b0 & 0xF, 1
    elif b0 == 0xDC:
        n, h = int.from_bytes(raw[1:3], "big"), 3
    else:
        n, h = int.from_bytes(raw[1:5], "big"), 5
    big = n > 0 and (0x90 <= raw[h] <= 0x9F or raw[h] in (0xDC, 0xDD))
    return n, h, big


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(flat, pairs), st.integers(0, 45)), min_size=1, max_size=6))
def test_kernel_matches_twin(segs: list[tuple[list[object], int]]) -> None:
    raws = [msgspec.msgpack.encode(v) for v, _ in segs]
    needs = [n for _, n in segs]
    hdrs = [header(r) for r in raws]
    lens = np.array([len(r) for r in raws], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    need = np.array(needs, dtype=np.int64)
    out_off = np.concatenate([[0], np.cumsum(need)[:-1]]).astype(np.int64)
    out = np.full(int(need.sum()), 0xDEADBEEF, dtype=np.uint32)
    status = np.zeros(len(raws), dtype=np.int8)
    bad = fill_tokens(
        np.frombuffer(b"".join(raws), dtype=np.uint8),
        starts + np.array([h for _, h, _ in hdrs], dtype=np.int64),
        starts + lens,
        np.array([n for n, _, _ in hdrs], dtype=np.int64),
        np.array([b for _, _, b in hdrs], dtype=np.bool_),
        need,
        out_off,
        out,
        status,
    )
    want, want_status = fill_tokens_py(raws, needs)
    assert status.tolist() == want_status
    assert bad == sum(want_status)
    for i, toks in enumerate(want):
        if want_status[i] == 0:
            assert out[out_off[i] : out_off[i] + need[i]].tolist() == toks
