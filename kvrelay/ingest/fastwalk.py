"""Single-pass numba walker: msgpack payload → EventBatch arrays, for the common clean case.

Python-level decoding costs ~0.3-1 µs per event, which caps one-hash removes far below the
ingest budget. This kernel walks the raw bytes once and fills every array directly. It accepts
only input whose meaning is unambiguous (int hashes, known keys/tags/strings, fixstr map keys,
``type`` first, no duplicate keys, 2-3 element envelope) and returns ``FALLBACK`` for anything
else; the tolerant msgspec path then decodes the message and produces the typed rejection or
counters. Results are identical to that path (property-tested in tests/ingest).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import numpy.typing as npt
from numba import njit, types

from kvrelay._jit import inline, kernel
from kvrelay.ingest.tokens_kernel import _pair_header, _read_u32

OK = 0
FALLBACK = 1
SMALL = 2  # the workspace is smaller than ``layout``'s total: nothing written

# stats slots
ST_STORED, ST_REMOVED, ST_CLEARED, ST_TRUNCATED, ST_EAGLE, ST_MALFORMED = 0, 1, 2, 3, 4, 5
DROP_BASE = 6
DROP_REASONS = (
    "medium_host_pinned",
    "medium_disk",
    "medium_external",
    "locality",
    "non_full_attention",
    "group",
    "placeholder",
    "block_size_mismatch",
    "tokens_short",
    "empty",
    "self_reference",
    "malformed_event",
    "tokens_excess",
)
N_STATS = DROP_BASE + len(DROP_REASONS)
_D_HOST, _D_DISK, _D_EXT, _D_LOC, _D_NONFULL, _D_GROUP = 6, 7, 8, 9, 10, 11
_D_PLACEHOLDER, _D_BS, _D_SHORT, _D_EMPTY, _D_SELF, _D_MALF, _D_EXCESS = 12, 13, 14, 15, 16, 17, 18
MAX_GROUPS = 64
#: a group's kind in ``groups`` not known after a restore that did not keep the kinds learned
#: before: its removes apply (``Decoder.assume_unsure_groups``); -1 unknown, 0/1 learned
UNSURE = 2
# int64 / bool values, not literals, for the counters below (see ``_walk``); typed for mypy.
_I0 = cast(int, np.int64(0))
_NO = cast(bool, np.bool_(False))

# ---- string tables (exact bytes; anything else falls back) ------------------------------------
# medium → 0 device, 1 host_pinned, 2 disk, 3 external
_MEDIA = {
    b"GPU": 0, b"DEVICE": 0, b"": 0,
    b"CPU": 1, b"CPU_PINNED": 1, b"CPU_TIER1": 1,
    b"CPU_TIER2": 2, b"DISK": 2, b"NVME": 2, b"STORAGE": 2,
    b"EXTERNAL": 3, b"NETWORK": 3, b"REMOTE": 3, b"SHARED": 3,
}  # fmt: skip
# kv_cache_spec_kind → 1 full attention, 0 other (all kinds vLLM defines; as decoder.py's)
_KINDS = {
    b"full_attention": 1, b"mla_attention": 1, b"sink_full_attention": 1,
    b"sliding_window": 0, b"sliding_window_mla": 0, b"mamba": 0,
    b"chunked_local_attention": 0, b"encoder_only_attention": 0,
    b"cross_attention": 0, b"unknown": 0,
}  # fmt: skip
_LOCALITY = {b"LOCAL": 1, b"": 1, b"REMOTE": 0}
_TAGS = {b"BlockStored": 0, b"BlockRemoved": 1, b"AllBlocksCleared": 2}
# map keys → field id
(K_TYPE, K_HASHES, K_PARENT, K_TOKENS, K_BS, K_LORA_ID, K_MEDIUM, K_LORA, K_EXTRA, K_GROUP,
 K_KIND, K_WINDOW, K_LOCALITY, K_OWNERSHIP, K_SESSION, K_LOOKAHEAD,
 K_CACHE_SALT, K_ORIGIN) = range(18)  # fmt: skip
_KEYS = {
    b"type": K_TYPE, b"block_hashes": K_HASHES, b"parent_block_hash": K_PARENT,
    b"token_ids": K_TOKENS, b"block_size": K_BS, b"lora_id": K_LORA_ID, b"medium": K_MEDIUM,
    b"lora_name": K_LORA, b"extra_keys": K_EXTRA, b"group_idx": K_GROUP,
    b"kv_cache_spec_kind": K_KIND, b"kv_cache_spec_sliding_window": K_WINDOW,
    b"locality": K_LOCALITY, b"ownership": K_OWNERSHIP, b"session_id": K_SESSION,
    b"lookahead_token_ids": K_LOOKAHEAD, b"cache_salt": K_CACHE_SALT, b"origin": K_ORIGIN,
}  # fmt: skip
# fields allowed per tag in map form (bit set of key ids)
_STORE_KEYS = sum(1 << k for k in range(18))
_REMOVE_KEYS = sum(1 << k for k in (K_TYPE, K_HASHES, K_MEDIUM, K_GROUP, K_LOCALITY, K_OWNERSHIP))
# array-era positions → key ids (index = position)
_ARR_STORE = (K_TYPE, K_HASHES, K_PARENT, K_TOKENS, K_BS, K_LORA_ID, K_MEDIUM, K_LORA,
              K_EXTRA, K_GROUP, K_KIND, K_WINDOW, K_LOCALITY, K_OWNERSHIP, K_SESSION,
              K_LOOKAHEAD)  # fmt: skip
_ARR_REMOVE = (K_TYPE, K_HASHES, K_MEDIUM, K_GROUP, K_LOCALITY, K_OWNERSHIP)



def _positions(store: tuple[int, ...], remove: tuple[int, ...], clear: tuple[int, ...]) -> Any:
    """``(ids, lens)``: key id per array position, per tag (stored, removed, cleared); more
    positions than ``lens[tag]`` make the walker fall back (the msgspec path counts them)."""
    ids = np.full((3, len(_ARR_STORE)), -1, dtype=np.int64)
    for row, keys in enumerate((store, remove, clear)):
        ids[row, : len(keys)] = keys
    lens = np.array([len(store), len(remove), len(clear)], dtype=np.int64)
    ids.flags.writeable = lens.flags.writeable = False
    return ids, lens


ARR_IDS, ARR_LEN = _positions(_ARR_STORE, _ARR_REMOVE, (K_TYPE,))
#: SGLang sources (§21): stores share vLLM's positions 1–13 and carry the salt map at 14 (a map
#: there, like a non-empty map-form ``cache_salt``, falls back: the msgspec path reads it); a map
#: in vLLM's lora_name slot (one revision) falls back. Removes: medium, group, then kind and window
#: (ignored), locality, ownership. Cleared: one trailing ownership slot.
SGL_IDS, SGL_LEN = _positions(
    _ARR_STORE[:15],
    (K_TYPE, K_HASHES, K_MEDIUM, K_GROUP, K_LORA_ID, K_WINDOW, K_LOCALITY, K_OWNERSHIP),
    (K_TYPE, K_OWNERSHIP),
)


@inline  # type: ignore[misc]
def _words(buf: npt.NDArray[np.uint8], pos: int, n: int) -> tuple[np.uint64, np.uint64]:
    """First 8 and last 8 bytes (big-endian words; together they cover strings <= 16 bytes)."""
    w1 = np.uint64(0)
    w2 = np.uint64(0)
    m = n if n < 8 else 8
    for j in range(m):
        w1 = (w1 << np.uint64(8)) | np.uint64(buf[pos + j])
    if n > 8:
        s = pos + n - 8
        for j in range(8):
            w2 = (w2 << np.uint64(8)) | np.uint64(buf[s + j])
    return w1, w2


def _gen_lookup(name: str, table: dict[bytes, int]) -> Any:
    """Exact string → value matcher compiled from constants (an if-chain of word compares).

    Array-backed tables with byte loops measured ~50 ns per lookup inside the walker; constant
    word compares take ~3 ns, and the walker does 4-10 lookups per event.
    """
    lines = [f"def {name}(buf, pos, n):", "    w1, w2 = _words(buf, pos, n)"]
    for key, val in table.items():
        n = len(key)
        w1 = int.from_bytes(key[:8], "big") if n else 0
        w2 = int.from_bytes(key[n - 8 :], "big") if n > 8 else 0
        cond = f"n == {n} and w1 == np.uint64({w1}) and w2 == np.uint64({w2})"
        for j in range(8, n - 8):  # middle bytes of strings longer than 16
            cond += f" and buf[pos + {j}] == {key[j]}"
        lines.append(f"    if {cond}:\n        return {val}")
    lines.append("    return -1")
    ns: dict[str, Any] = {"np": np, "_words": _words}
    exec("\n".join(lines), ns)
    return inline(ns[name])


_lk_media = _gen_lookup("_lk_media", _MEDIA)
_lk_kinds = _gen_lookup("_lk_kinds", _KINDS)
_lk_loc = _gen_lookup("_lk_loc", _LOCALITY)
_lk_tags = _gen_lookup("_lk_tags", _TAGS)
_lk_keys = _gen_lookup("_lk_keys", _KEYS)


@inline  # type: ignore[misc]
def _be_u64(buf: npt.NDArray[np.uint8], pos: int, k: int) -> np.uint64:
    v = np.uint64(0)
    for j in range(k):
        v = (v << np.uint64(8)) | np.uint64(buf[pos + j])
    return v


@inline  # type: ignore[misc]
def _int(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, np.uint64, bool]:
    """msgpack int → (next_pos or -1, u64 two's complement bits, negative?)."""
    if pos >= end:
        return -1, np.uint64(0), False
    b = int(buf[pos])
    if b <= 0x7F:
        return pos + 1, np.uint64(b), False
    if b >= 0xE0:
        return pos + 1, np.uint64(b) | ~np.uint64(0xFF), True
    w = 0
    signed = False
    if b == 0xCC:
        w = 1
    elif b == 0xCD:
        w = 2
    elif b == 0xCE:
        w = 4
    elif b == 0xCF:
        w = 8
    elif b == 0xD0:
        w, signed = 1, True
    elif b == 0xD1:
        w, signed = 2, True
    elif b == 0xD2:
        w, signed = 4, True
    elif b == 0xD3:
        w, signed = 8, True
    else:
        return -1, np.uint64(0), False
    if pos + 1 + w > end:
        return -1, np.uint64(0), False
    v = _be_u64(buf, pos + 1, w)
    neg = False
    if signed and (int(buf[pos + 1]) & 0x80) != 0:
        neg = True
        if w < 8:
            v = v | (~np.uint64(0) << np.uint64(8 * w))
    return pos + 1 + w, v, neg


@inline  # type: ignore[misc]
def _str(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int, int]:
    """msgpack str → (next_pos or -1, data_pos, length)."""
    if pos >= end:
        return -1, 0, 0
    b = int(buf[pos])
    if 0xA0 <= b <= 0xBF:
        n, h = b & 0x1F, 1
    elif b == 0xD9 and pos + 2 <= end:
        n, h = int(buf[pos + 1]), 2
    elif b == 0xDA and pos + 3 <= end:
        n, h = int(np.int64(_be_u64(buf, pos + 1, 2))), 3
    elif b == 0xDB and pos + 5 <= end:
        n, h = int(np.int64(_be_u64(buf, pos + 1, 4))), 5
    else:
        return -1, 0, 0
    if pos + h + n > end:
        return -1, 0, 0
    return pos + h + n, pos + h, n


@inline  # type: ignore[misc]
def _arr(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int]:
    """array header → (next_pos or -1, n)."""
    if pos >= end:
        return -1, 0
    b = int(buf[pos])
    if 0x90 <= b <= 0x9F:
        return pos + 1, b & 0x0F
    if b == 0xDC and pos + 3 <= end:
        return pos + 3, int(np.int64(_be_u64(buf, pos + 1, 2)))
    if b == 0xDD and pos + 5 <= end:
        return pos + 5, int(np.int64(_be_u64(buf, pos + 1, 4)))
    return -1, 0


@inline  # type: ignore[misc]
def _map(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int]:
    if pos >= end:
        return -1, 0
    b = int(buf[pos])
    if 0x80 <= b <= 0x8F:
        return pos + 1, b & 0x0F
    if b == 0xDE and pos + 3 <= end:
        return pos + 3, int(np.int64(_be_u64(buf, pos + 1, 2)))
    if b == 0xDF and pos + 5 <= end:
        return pos + 5, int(np.int64(_be_u64(buf, pos + 1, 4)))
    return -1, 0


@inline  # type: ignore[misc]
def _step(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int]:
    """One msgpack header (or a whole scalar) → (position after it or -1, items it contains:
    0 for a scalar, n for an array, 2n for a map). A position past ``end`` is the caller's to
    refuse (a string cut short)."""
    if pos >= end:
        return -1, 0
    b = int(buf[pos])
    if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
        return pos + 1, 0
    if b <= 0x8F:
        return pos + 1, 2 * (b & 0x0F)
    if b <= 0x9F:
        return pos + 1, b & 0x0F
    if b <= 0xBF:
        return pos + 1 + (b & 0x1F), 0
    if b == 0xC1:
        return -1, 0
    # length-prefixed and fixed-width types
    if b == 0xC4 or b == 0xD9 or b == 0xC7:
        h, lw = 2, 1
    elif b == 0xC5 or b == 0xDA or b == 0xC8:
        h, lw = 3, 2
    elif b == 0xC6 or b == 0xDB or b == 0xC9:
        h, lw = 5, 4
    elif b == 0xDC or b == 0xDE:
        h, lw = 3, 2
    elif b == 0xDD or b == 0xDF:
        h, lw = 5, 4
    else:
        h, lw = 1, 0
    if pos + h > end:
        return -1, 0
    n = int(np.int64(_be_u64(buf, pos + 1, lw))) if lw > 0 else 0
    if b == 0xDC or b == 0xDD:
        return pos + h, n
    if b == 0xDE or b == 0xDF:
        return pos + h, 2 * n
    if b == 0xC7 or b == 0xC8 or b == 0xC9:
        return pos + h + 1 + n, 0  # ext: type byte then data
    if lw > 0:
        return pos + h + n, 0
    if b == 0xCA:
        return pos + 5, 0
    if b == 0xCB:
        return pos + 9, 0
    if b == 0xCC or b == 0xD0:
        return pos + 2, 0
    if b == 0xCD or b == 0xD1:
        return pos + 3, 0
    if b == 0xCE or b == 0xD2:
        return pos + 5, 0
    if b == 0xCF or b == 0xD3:
        return pos + 9, 0
    if b == 0xD4:
        return pos + 3, 0
    if b == 0xD5:
        return pos + 4, 0
    if b == 0xD6:
        return pos + 6, 0
    if b == 0xD7:
        return pos + 10, 0
    if b == 0xD8:
        return pos + 18, 0
    return -1, 0


#: Containers nested deeper than this inside one skipped value make the walker fall back. The
#: msgspec path reads nesting recursively and refuses it past Python's recursion limit (about
#: 1,000 levels) as a malformed payload; falling back far below that keeps both paths' results
#: identical for every depth (no engine nests a field more than 3 deep).
MAX_DEPTH = 64


@njit(cache=True)  # type: ignore[misc]
def skip(buf: npt.NDArray[np.uint8], pos: int, end: int) -> int:
    """Position after one complete msgpack value, or -1 (truncated, 0xC1, or containers nested
    more than ``MAX_DEPTH`` deep). A scalar costs no allocation; a container keeps the items
    still to read of each enclosing level on a small stack."""
    pos, n = _step(buf, pos, end)
    if pos < 0 or pos > end:
        return -1
    if n == 0:
        return pos
    stack = np.empty(MAX_DEPTH, dtype=np.int64)
    depth = 0
    remaining = n
    while True:
        while remaining == 0:
            if depth == 0:
                return pos if pos <= end else -1
            depth -= 1
            remaining = stack[depth]
        pos, n = _step(buf, pos, end)
        if pos < 0:
            return -1
        remaining -= 1
        if n > 0:
            if depth == MAX_DEPTH:
                return -1
            stack[depth] = remaining
            depth += 1
            remaining = n


@njit(cache=True)  # type: ignore[misc]
def _utf8_ok(buf: npt.NDArray[np.uint8], pos: int, n: int) -> bool:
    """Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF), as msgspec requires for str."""
    i = pos
    end = pos + n
    while i < end:
        c = int(buf[i])
        if c < 0x80:
            i += 1
            continue
        if 0xC2 <= c <= 0xDF:
            k = 1
            lo, hi = 0x80, 0xBF
        elif 0xE0 <= c <= 0xEF:
            k = 2
            lo = 0xA0 if c == 0xE0 else 0x80
            hi = 0x9F if c == 0xED else 0xBF
        elif 0xF0 <= c <= 0xF4:
            k = 3
            lo = 0x90 if c == 0xF0 else 0x80
            hi = 0x8F if c == 0xF4 else 0xBF
        else:
            return False
        if i + k >= end:
            return False
        c1 = int(buf[i + 1])
        if c1 < lo or c1 > hi:
            return False
        for j in range(2, k + 1):
            cj = int(buf[i + j])
            if cj < 0x80 or cj > 0xBF:
                return False
        i += k + 1
    return True


@inline  # type: ignore[misc]
def _tok_hdr(buf: npt.NDArray[np.uint8], pos: int, end: int) -> tuple[int, int, bool]:
    """token_ids value → (data_pos or -1, n, bigram); nil = empty."""
    if pos < end and buf[pos] == 0xC0:
        return pos + 1, 0, False
    p, n = _arr(buf, pos, end)
    if p < 0:
        return -1, 0, False
    big = False
    if n > 0 and p < end:
        c = int(buf[p])
        big = (0x90 <= c <= 0x9F) or c == 0xDC or c == 0xDD
    return p, n, big


@njit(cache=True)  # type: ignore[misc]
def _parse_tokens(
    buf: npt.NDArray[np.uint8],
    pos: int,
    end: int,
    n: int,
    big: bool,
    out: npt.NDArray[np.uint32],
    o: int,
) -> tuple[int, int]:
    """Parses all ``n`` elements into ``out[o:]`` → (end position or -1, first bad index).

    The first bad index is in token positions: element ``j`` (flat) or pair ``j`` (bigram, which
    yields tokens ``j`` and, for the last pair, ``n``). A bad index below the tokens needed makes
    the event malformed, exactly like ``tokens_kernel.fill_tokens``; later junk is only skipped.
    """
    first_bad = 1 << 62
    if o + n + 1 > out.shape[0]:
        return -1, 0
    for j in range(n):
        if first_bad == 1 << 62:
            if not big:
                v, p2 = _read_u32(buf, pos, end)
                if v >= 0:
                    out[o + j] = np.uint32(v)
                    pos = p2
                    continue
            else:
                p2 = _pair_header(buf, pos, end)
                if p2 >= 0:
                    a, p3 = _read_u32(buf, p2, end)
                    if a >= 0:
                        c, p4 = _read_u32(buf, p3, end)
                        if c >= 0:
                            out[o + j] = np.uint32(a)
                            if j == n - 1:
                                out[o + n] = np.uint32(c)
                            pos = p4
                            continue
            first_bad = j
        pos = skip(buf, pos, end)
        if pos < 0:
            return -1, 0
    return pos, first_bad


@njit(cache=True)  # type: ignore[misc]
def _has_dup(ext: npt.NDArray[np.uint64], start: int, k: int, parent: np.uint64, hp: bool) -> bool:
    """A hash repeated among ``ext[start:start + k]``, or the parent among them. Pairwise up to
    32 hashes; past that a sorted copy (O(k log k) whatever the hashes: a long store, or one
    built to collide, never holds the loop for seconds)."""
    if hp:
        for i in range(k):
            if ext[start + i] == parent:
                return True
    if k <= 32:
        for i in range(k):
            h = ext[start + i]
            for j in range(i + 1, k):
                if ext[start + j] == h:
                    return True
        return False
    s = np.sort(ext[start : start + k])
    return bool(np.any(s[1:] == s[:-1]))


#: After the stats: n_events, dp (-1 = nil), events with a lora name, block hashes, then where
#: the arrays are (``layout``'s e, ops, has_parent, w64, i64 and tokens), so the caller reads the
#: walk's whole outcome, time stamp included, with one ``struct.unpack_from`` and no layout call.
N_META = 10
META = N_STATS


def layout(n: int) -> tuple[int, int, int, int, int, int, int, int, int, int]:
    """Byte offsets inside the one workspace buffer for a payload of ``n - 1`` bytes.

    ``(stats, ts, groups, ops, has_parent, w64, i64, tokens, total, e)``: one allocation and one
    array argument instead of ten (numba unboxes each array argument at ~0.2 µs). Capacities:
    ``e = n // 8 + 2`` events (the smallest event the walker accepts is 18 bytes), ``n`` blocks
    and ``n`` tokens (each takes at least one payload byte): ~17 workspace bytes per payload byte.
    ``w64`` = parent[e] | salt[e] | ext[n]; ``i64`` = blk_off[e+1] | tok_off[e+1] |
    lora_pos[e] | lora_len[e].
    """
    e = n // 8 + 2
    e8 = (e + 7) & ~7
    o_stats = 0
    o_ts = o_stats + 8 * (N_STATS + N_META)
    o_groups = o_ts + 8
    o_ops = o_groups + MAX_GROUPS
    o_hp = o_ops + e8
    o_w64 = o_hp + e8
    o_i64 = o_w64 + 8 * (2 * e + n)
    o_tok = o_i64 + 8 * (4 * e + 2)
    total = o_tok + 4 * n
    return o_stats, o_ts, o_groups, o_ops, o_hp, o_w64, o_i64, o_tok, total, e


_layout_nb = njit(cache=True)(layout)


@njit(cache=True)  # type: ignore[misc]
def _walk(  # type: ignore[no-untyped-def]
    buf, bsz, extra, drop_self, groups, ops, w64, i64, has_parent, tokens, stats, ts_out,
    arr_ids, arr_len,
):  # fmt: skip
    """Fills the outputs; returns ``OK`` or ``FALLBACK`` (then nothing is meaningful)."""
    e = ops.shape[0]
    parent = w64[0:e]
    salt = w64[e : 2 * e]
    ext = w64[2 * e :]
    blk_off = i64[0 : e + 1]
    tok_off = i64[e + 1 : 2 * e + 2]
    lpos_out = i64[2 * e + 2 : 3 * e + 2]
    llen_out = i64[3 * e + 2 : 4 * e + 2]
    n_lora = 0
    end = buf.shape[0]
    pos, n_env = _arr(buf, 0, end)
    if pos < 0 or n_env < 2 or n_env > 3:
        return FALLBACK
    # ts: float64 / float32 / int
    if pos >= end:
        return FALLBACK
    b = int(buf[pos])
    if b == 0xCB and pos + 9 <= end:
        t64 = np.empty(1, dtype=np.uint64)
        t64[0] = _be_u64(buf, pos + 1, 8)
        ts_out[0] = t64.view(np.float64)[0]
        pos += 9
    elif b == 0xCA and pos + 5 <= end:
        t32 = np.empty(1, dtype=np.uint32)
        t32[0] = np.uint32(_be_u64(buf, pos + 1, 4))
        ts_out[0] = np.float64(t32.view(np.float32)[0])
        pos += 5
    else:
        p2, v, neg = _int(buf, pos, end)
        if p2 < 0:
            return FALLBACK
        ts_out[0] = np.float64(np.int64(v)) if neg else np.float64(v)
        pos = p2
    pos, n_ev_in = _arr(buf, pos, end)
    if pos < 0:
        return FALLBACK
    # Counters start as int64 values, not literals: numba types a call as soon as its argument
    # types are known, so a literal first value compiles the callee once more for the literal.
    ne = 0  # output events
    nb = _I0  # output blocks
    nt = _I0  # output tokens
    blk_off[0] = 0
    tok_off[0] = 0
    for _ in range(n_ev_in):
        if pos >= end or ne >= e:
            return FALLBACK
        # ---- read one event into locals -------------------------------------------------------
        tag = -1
        is_map = False
        nfields = 0
        p2, nfields = _map(buf, pos, end)
        if p2 >= 0:
            is_map = True
        else:
            p2, nfields = _arr(buf, pos, end)
            if p2 < 0 or nfields < 1:
                return FALLBACK
        pos = p2
        h_start = nb  # hashes written tentatively at ext[nb:]
        nh = 0
        have_hashes = False
        par = np.uint64(0)
        hp = _NO
        tok_bad = 1 << 62
        tok_n = 0
        tok_big = False
        have_tokens = False
        bs = -2  # nil / negative / huge → mismatch
        have_bs = False
        medium = 0
        loc_ok = True
        group = -1
        kind = -1  # -1 absent, 1 full, 0 other
        lpos = 0
        llen = 0
        seen = 0
        allowed = 0
        for f in range(nfields):
            if is_map:
                p2, kp, kn = _str(buf, pos, end)
                if p2 < 0 or int(buf[pos]) > 0xBF:  # keys: fixstr only
                    return FALLBACK
                key = _lk_keys(buf, kp, kn)
                if key < 0:
                    return FALLBACK
                pos = p2
                if f == 0 and key != 0:
                    return FALLBACK  # msgspec writes the tag first
            elif tag < 0:
                key = 0
            else:
                if f >= arr_len[tag]:
                    return FALLBACK
                key = arr_ids[tag, f]
            bit = 1 << key
            if seen & bit:
                return FALLBACK
            seen |= bit
            if key == 0:
                p2, sp, sn = _str(buf, pos, end)
                if p2 < 0:
                    return FALLBACK
                tag = _lk_tags(buf, sp, sn)
                if tag < 0:
                    return FALLBACK
                allowed = _STORE_KEYS if tag == 0 else (_REMOVE_KEYS if tag == 1 else 1)
                pos = p2
                continue
            if is_map and (allowed & bit) == 0:
                return FALLBACK
            if pos >= end:
                return FALLBACK
            c = int(buf[pos])
            if key == 1:  # block_hashes
                p2, cnt = _arr(buf, pos, end)
                if p2 < 0 or nb + cnt > ext.shape[0]:
                    return FALLBACK
                pos = p2
                for j in range(cnt):
                    p2, v, neg = _int(buf, pos, end)
                    if p2 < 0:
                        return FALLBACK
                    ext[h_start + j] = v
                    pos = p2
                nh = cnt
                have_hashes = True
                continue
            if key == 2:  # parent_block_hash
                if c == 0xC0:
                    pos += 1
                else:
                    p2, v, neg = _int(buf, pos, end)
                    if p2 < 0:
                        return FALLBACK
                    par = v
                    hp = v != 0  # a parent of 0 is no parent (llm-d's positional format)
                    pos = p2
                continue
            if key == 3:  # token_ids: parsed now into tokens[nt:], kept later if needed
                tp, tn, tbig = _tok_hdr(buf, pos, end)
                if tp < 0:
                    return FALLBACK
                p2, tok_bad = _parse_tokens(buf, tp, end, tn, tbig, tokens, nt)
                if p2 < 0:
                    return FALLBACK
                tok_n, tok_big, have_tokens = tn, tbig, True
                pos = p2
                continue
            if key == 4 or key == 9:  # block_size / group_idx: int or nil
                if c == 0xC0:
                    pos += 1
                    if key == 4:
                        have_bs = True
                    continue
                p2, v, neg = _int(buf, pos, end)
                if p2 < 0:
                    return FALLBACK
                pos = p2
                if key == 4:
                    have_bs = True
                    if not neg and v < np.uint64(1 << 40):
                        bs = int(np.int64(v))
                else:
                    if neg or v >= np.uint64(MAX_GROUPS):
                        return FALLBACK
                    group = int(np.int64(v))
                continue
            if key == 17:  # origin: nil, or the msgspec path reads it
                if c != 0xC0:
                    return FALLBACK
                pos += 1
                continue
            if key == 6 or key == 10 or key == 12 or key == 7 or key == 16:  # str or nil
                if c == 0xC0:
                    pos += 1
                    continue
                p2, sp, sn = _str(buf, pos, end)
                if p2 < 0:
                    return FALLBACK
                pos = p2
                if key == 6:
                    medium = _lk_media(buf, sp, sn)
                    if medium < 0:
                        return FALLBACK
                elif key == 10:
                    kind = _lk_kinds(buf, sp, sn)
                    if kind < 0:
                        return FALLBACK
                elif key == 12:
                    lv = _lk_loc(buf, sp, sn)
                    if lv < 0:
                        return FALLBACK
                    loc_ok = lv == 1
                elif not _utf8_ok(buf, sp, sn):  # lora_name / cache_salt: free-form str
                    return FALLBACK
                elif key == 7:
                    lpos, llen = sp, sn
                if key == 16 and sn > 0:  # a salted store: the msgspec path namespaces it
                    return FALLBACK
                continue
            if key == 15 and extra == 1 and c != 0xC0:
                return FALLBACK  # EAGLE lookahead tokens: the msgspec path completes the window
            if key == 14 and (0x80 <= c <= 0x8F or c == 0xDE or c == 0xDF):
                return FALLBACK  # SGLang's salt map at slot 14: the msgspec path reads it
            # lora_id, extra_keys, sliding window, ownership, session_id, lookahead: opaque
            p2 = skip(buf, pos, end)
            if p2 < 0:
                return FALLBACK
            pos = p2
        if tag < 0:
            return FALLBACK
        # ---- gate and emit ---------------------------------------------------------------------
        if tag == 2:
            stats[ST_CLEARED] += 1
            ops[ne] = 2
            parent[ne] = 0
            has_parent[ne] = False
            salt[ne] = 0
            llen_out[ne] = 0
            ne += 1
            blk_off[ne] = nb
            tok_off[ne] = nt
            continue
        if not have_hashes:
            return FALLBACK
        if tag == 0:
            stats[ST_STORED] += 1
            if is_map is False and (not have_tokens or not have_bs or (seen & 4) == 0):
                return FALLBACK  # array era: positions 1-4 are required
        else:
            stats[ST_REMOVED] += 1
        if medium != 0:
            stats[_D_HOST + medium - 1] += 1
            continue
        if not loc_ok:
            stats[_D_LOC] += 1
            continue
        if tag == 1:
            gk = groups[group] if group >= 0 else 1  # no group_idx: applied
            if not (gk == 1 or gk == UNSURE or (gk < 0 and group == 0)):
                stats[_D_GROUP] += 1
                continue
            if nh == 0:
                stats[_D_EMPTY] += 1
                continue
            ops[ne] = 1
            parent[ne] = 0
            has_parent[ne] = False
            salt[ne] = 0
            llen_out[ne] = 0
            nb += nh
            ne += 1
            blk_off[ne] = nb
            tok_off[ne] = nt
            continue
        # store
        if kind < 0:
            if group >= 0 and not (groups[group] == 1 or (groups[group] != 0 and group == 0)):
                stats[_D_NONFULL] += 1
                continue
        elif kind == 1:
            if group >= 0:
                groups[group] = 1
        else:
            if group >= 0:
                groups[group] = 0
            stats[_D_NONFULL] += 1
            continue
        if nh == 0:
            stats[_D_EMPTY] += 1
            continue
        if bs == 0 or tok_n == 0:
            stats[_D_PLACEHOLDER] += 1
            continue
        if bs != bsz:
            stats[_D_BS] += 1
            continue
        ntok = tok_n + 1 if tok_big else tok_n
        k = (ntok - extra) // bsz
        if k > nh:  # more whole blocks of tokens than hashes: which tokens they hash is unknown
            stats[_D_EXCESS] += 1
            continue
        if k <= 0:
            stats[_D_SHORT] += 1
            continue
        # every hash the store names, the ones a truncation drops too (Dynamo checks the whole
        # store before it walks its blocks)
        if drop_self and _has_dup(ext, h_start, nh, par, hp):
            stats[_D_SELF] += 1
            continue
        if k < nh:
            stats[ST_TRUNCATED] += 1
        if tok_big:
            stats[ST_EAGLE] += 1
        need = k * bsz + extra
        if tok_bad < need:  # a token the batch needs is not a u32 (or a pair is not a pair)
            stats[ST_MALFORMED] += 1
            stats[_D_MALF] += 1
            continue
        ops[ne] = 0
        parent[ne] = par
        has_parent[ne] = hp
        salt[ne] = 1337
        lpos_out[ne] = lpos
        llen_out[ne] = llen
        if llen > 0:
            n_lora += 1
        nb += k
        nt += need
        ne += 1
        blk_off[ne] = nb
        tok_off[ne] = nt
    # ---- envelope tail ---------------------------------------------------------------------------
    dp = -1
    if n_env == 3:
        if pos >= end:
            return FALLBACK
        if buf[pos] == 0xC0:
            pos += 1
        else:
            p2, v, neg = _int(buf, pos, end)
            if p2 < 0 or neg or v >= np.uint64(1 << 62):
                return FALLBACK
            dp = int(np.int64(v))
            pos = p2
    if pos != end:
        return FALLBACK
    stats[META] = ne
    stats[META + 1] = dp
    stats[META + 2] = n_lora
    stats[META + 3] = nb
    return OK


@kernel(  # type: ignore[misc]
    "ingest",
    types.int64(
        types.Array(types.uint8, 1, "C", readonly=True),  # payload
        types.Array(types.uint8, 1, "C"),  # workspace (see ``layout``)
        types.Array(types.int8, 1, "C"),  # groups learned so far (MAX_GROUPS)
        types.int64,  # block size
        types.int64,  # eagle extra token (0/1)
        types.boolean,  # drop self reference
        types.Array(types.int64, 2, "C", readonly=True),  # array-form key id per tag, position
        types.Array(types.int64, 1, "C", readonly=True),  # array-form positions per tag
        types.int64,  # the decoder's DP rank
    ),
)
def walk(
    buf: npt.NDArray[np.uint8],
    work: npt.NDArray[np.uint8],
    groups: npt.NDArray[np.int8],
    bsz: int,
    extra: int,
    drop_self: bool,
    arr_ids: npt.NDArray[np.int64],
    arr_len: npt.NDArray[np.int64],
    rank: int,
) -> int:
    """Entry point: every output in ``work`` on return (``SMALL``, and nothing written, when it
    is shorter than ``layout``'s total). ``groups`` (the kv-cache group kinds learned so far) is
    updated only when the walk returns ``OK`` for a batch of ``rank`` (or naming none): a
    fallback, or another rank's batch (which the decoder drops), leaves the caller's state as it
    was, as the msgspec path does.
    The copies are made here, not by numpy slice assignments in the caller: at light load those
    cost more than the walk."""
    n = buf.shape[0] + 1
    o_stats, o_ts, o_groups, o_ops, o_hp, o_w64, o_i64, o_tok, total, e = _layout_nb(n)
    if work.shape[0] < total:
        return SMALL
    stats = work[o_stats:o_ts].view(np.int64)
    stats[:] = 0
    learned = work[o_groups:o_ops].view(np.int8)
    learned[:] = groups
    rc = _walk(
        buf,
        bsz,
        extra,
        drop_self,
        work[o_groups:o_ops].view(np.int8),
        work[o_ops : o_ops + e],
        work[o_w64:o_i64].view(np.uint64),
        work[o_i64:o_tok].view(np.int64),
        work[o_hp : o_hp + e].view(np.bool_),
        work[o_tok : o_tok + 4 * n].view(np.uint32),
        stats,
        work[o_ts:o_groups].view(np.float64),
        arr_ids,
        arr_len,
    )
    if rc == OK:
        if stats[META + 1] < 0 or stats[META + 1] == rank:
            groups[:] = learned
        stats[META + 4] = e
        stats[META + 5] = o_ops
        stats[META + 6] = o_hp
        stats[META + 7] = o_w64
        stats[META + 8] = o_i64
        stats[META + 9] = o_tok
    return rc  # type: ignore[no-any-return]
