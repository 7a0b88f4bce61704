"""Parse msgpack ``token_ids`` arrays straight into a uint32 buffer (numba), never via Python ints.

Input is the concatenation of the raw msgpack arrays of the batch's kept stores. Segment ``i``
starts at ``seg_pos[i]`` (first element, after the array header), holds ``seg_n[i]`` elements
(ints, or ``[a, b]`` pairs when ``seg_bigram[i]``), and must yield its first ``seg_need[i]``
tokens at ``out[out_off[i]:]``. Bigram pairs flatten to all first elements plus the second of
the last pair (SGLang/Eagle style). ``status[i]`` is 0 on success, 1 if the segment is malformed
(not an int, negative, above 2^32-1, a pair that is not 2 long, or out of bounds).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit, types

from kvrelay._jit import inline, kernel

_BAD = np.int64(-1)


@inline  # type: ignore[misc]
def _be(buf: npt.NDArray[np.uint8], pos: int, k: int) -> int:
    v = 0
    for j in range(k):
        v = (v << 8) | int(buf[pos + j])
    return v


@njit(cache=True)  # type: ignore[misc]
def _read_u32(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int]:
    """Returns ``(value, next_pos)``; value -1 when the element is not a u32-range int."""
    if pos >= end:
        return -1, pos
    b = int(buf[pos])
    if b <= 0x7F:
        return b, pos + 1
    if b == 0xCC or b == 0xD0:
        if pos + 2 > end:
            return -1, pos
        v = int(buf[pos + 1])
        if b == 0xD0 and v >= 0x80:
            return -1, pos
        return v, pos + 2
    if b == 0xCD or b == 0xD1:
        if pos + 3 > end:
            return -1, pos
        v = _be(buf, pos + 1, 2)
        if b == 0xD1 and v >= 0x8000:
            return -1, pos
        return v, pos + 3
    if b == 0xCE or b == 0xD2:
        if pos + 5 > end:
            return -1, pos
        v = _be(buf, pos + 1, 4)
        if b == 0xD2 and v >= 0x8000_0000:
            return -1, pos
        return v, pos + 5
    if b == 0xCF or b == 0xD3:
        if pos + 9 > end:
            return -1, pos
        # any value >= 2^32 (or negative i64) is out of range: high 4 bytes must be zero
        if _be(buf, pos + 1, 4) != 0:
            return -1, pos
        return _be(buf, pos + 5, 4), pos + 9
    return -1, pos


@njit(cache=True)  # type: ignore[misc]
def _pair_header(buf: npt.NDArray[np.uint8], pos: int, end: int) -> int:
    """Position after a 2-element array header, or -1."""
    if pos >= end:
        return -1
    b = int(buf[pos])
    if b == 0x92:
        return pos + 1
    if b == 0xDC and pos + 3 <= end and _be(buf, pos + 1, 2) == 2:
        return pos + 3
    if b == 0xDD and pos + 5 <= end and _be(buf, pos + 1, 4) == 2:
        return pos + 5
    return -1


_I64 = types.Array(types.int64, 1, "C")
_SIG = types.int64(
    types.Array(types.uint8, 1, "C", readonly=True),  # np.frombuffer over bytes is read-only
    _I64,
    _I64,
    _I64,
    types.Array(types.boolean, 1, "C"),
    _I64,
    _I64,
    types.Array(types.uint32, 1, "C"),
    types.Array(types.int8, 1, "C"),
)


@kernel("ingest", _SIG)  # type: ignore[misc]
def fill_tokens(
    buf: npt.NDArray[np.uint8],
    seg_pos: npt.NDArray[np.int64],
    seg_end: npt.NDArray[np.int64],
    seg_n: npt.NDArray[np.int64],
    seg_bigram: npt.NDArray[np.bool_],
    seg_need: npt.NDArray[np.int64],
    out_off: npt.NDArray[np.int64],
    out: npt.NDArray[np.uint32],
    status: npt.NDArray[np.int8],
) -> int:
    """Fills ``out``; returns the number of malformed segments (their ``status`` is 1)."""
    bad = 0
    for i in range(seg_pos.shape[0]):
        pos = seg_pos[i]
        end = min(seg_end[i], buf.shape[0])
        need = seg_need[i]
        o = out_off[i]
        ok = True
        if not seg_bigram[i]:
            if need > seg_n[i] or o + need > out.shape[0]:
                ok = False
            else:
                for j in range(need):
                    v, pos = _read_u32(buf, pos, end)
                    if v < 0:
                        ok = False
                        break
                    out[o + j] = np.uint32(v)
        else:
            npairs = seg_n[i]
            if need > npairs + 1 or o + need > out.shape[0]:
                ok = False
            else:
                emitted = 0
                for p in range(npairs):
                    if emitted >= need:
                        break
                    pos = _pair_header(buf, pos, end)
                    if pos < 0:
                        ok = False
                        break
                    a, pos = _read_u32(buf, pos, end)
                    if a < 0:
                        ok = False
                        break
                    b, pos = _read_u32(buf, pos, end)
                    if b < 0:
                        ok = False
                        break
                    out[o + emitted] = np.uint32(a)
                    emitted += 1
                    if p == npairs - 1 and emitted < need:
                        out[o + emitted] = np.uint32(b)
                        emitted += 1
                if ok and emitted != need:
                    ok = False
        status[i] = 0 if ok else 1
        if not ok:
            bad += 1
    return bad


def _u32(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32


def fill_tokens_py(raws: list[bytes], seg_need: list[int]) -> tuple[list[list[int]], list[int]]:
    """Pure-Python twin (test oracle): decodes each raw array with msgspec, then walks it like
    the kernel (only the elements needed are inspected). Returns ``(tokens, status)``."""
    import msgspec

    out: list[list[int]] = []
    status: list[int] = []
    for raw, need in zip(raws, seg_need, strict=True):
        vals = msgspec.msgpack.decode(raw)
        toks: list[int] = []
        ok = isinstance(vals, list)
        bigram = ok and len(vals) > 0 and isinstance(vals[0], list)
        if ok and not bigram:
            ok = need <= len(vals) and all(_u32(x) for x in vals[:need])
            toks = [int(x) for x in vals[:need]] if ok else []
        elif ok:
            ok = need <= len(vals) + 1
            for p, pair in enumerate(vals):
                if not ok or len(toks) >= need:
                    break
                if not (isinstance(pair, list) and len(pair) == 2 and all(_u32(x) for x in pair)):
                    ok = False
                    break
                toks.append(int(pair[0]))
                if p == len(vals) - 1 and len(toks) < need:
                    toks.append(int(pair[1]))
            ok = ok and len(toks) == need
        out.append(toks if ok else [])
        status.append(0 if ok else 1)
    return out, status
