"""The apply kernel: one numba call per ``EventBatch`` for one member (§7.3, §8.2).

Each store is validated completely (parent, token count, self-reference, conflicting re-store)
before anything is mutated, so a rejected event leaves tables, CKF and dirty log untouched.
Clears drop edges in ascending external-hash order so the resulting CKF image is deterministic
(independent of hash-table layout), which lets a reference model reproduce it byte for byte.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay.hashing.xxh3 import xxh3_64_tokens_mm_into, xxh3_64_tokens_with, xxh3_64_u64x2
from kvrelay.pool.ckf import _addr, ckf_insert_fp, ckf_remove_fp
from kvrelay.pool.errors import E_BAD_OP, E_INVALID_SEQ, E_OK, E_PARENT, E_TOKENS
from kvrelay.pool.prefetch import prefetch
from kvrelay.pool.tables import (
    COUNT_MASK,
    EMPTY32,
    OM_RESIDENT,
    RESIDENT,
    _mix,
    _tag,
    _tag_home,
    home,
    own_alloc,
    own_del,
    own_find,
    own_free,
    own_put,
    tab_del,
    tab_find,
    tab_put,
)

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

CHAIN_SEED = np.uint64(1337)
_NS_EMPTY = np.uint64(0)

# stats indices
ST_APPLIED = 0
ST_REJECTED = 1
ST_STORED = 2
ST_REMOVED = 3
ST_UNKNOWN = 4
ST_CAPACITY = 5
ST_INVARIANT = 6
ST_REOFFER = 7
N_STATS = 8

# prefetch distances (events ahead)
PF_FAR = 12
PF_MID = 6
PF_NEAR = 3

# cfg indices
CFG_SEED = 0
CFG_MASK = 1
CFG_BLOCK = 2
CFG_FORMAT = 3
CFG_KICKS = 4


@njit(cache=True, inline="always")  # type: ignore[misc]
def _drop_ref(
    oi: int | np.int64,
    table: U64,
    cfg: U64,
    deltas: U64,
    mark: U8,
    dlog_b: U32,
    dlog_o: U64,
    dmeta: I64,
    ocanon: U64,
    ocnt: U32,
    ometa: I64,
    oidx: U64,
    stats: I64,
) -> None:
    """One owner reference gone; 1→0 removes the fingerprint (if resident) and frees the owner."""
    c = ocnt[oi]
    if (c & COUNT_MASK) > np.uint32(1):
        ocnt[oi] = c - np.uint32(1)
        return
    key = ocanon[oi]
    if (c & RESIDENT) != np.uint32(0):
        fp, a = _addr(key, cfg[CFG_SEED], cfg[CFG_MASK], deltas)
        if not ckf_remove_fp(table, fp, a, deltas, mark, dlog_b, dlog_o, dmeta):
            stats[ST_INVARIANT] += 1
        ometa[OM_RESIDENT] -= 1
    slot, _ = own_find(oidx, ocanon, key)
    own_del(oidx, slot)
    own_free(ocanon, ocnt, ometa, oi)


@njit(cache=True, inline="always")  # type: ignore[misc]
def _block_hash(
    tokens: npt.NDArray[np.uint32],
    tok8: U8,
    start: int,
    cnt: int,
    mm_off: I64,
    mm: U64,
    g: int,
    seed: np.uint64,
    mm_scratch: U8,
    sec: U8,
    acc: U64,
) -> np.uint64:
    """§7.2 block hash; ``tok8`` is ``tokens`` viewed as bytes (made once per batch).

    Multimodal blocks are assembled in ``mm_scratch`` and blocks over 240 bytes hash with the
    ``sec``/``acc`` scratch (all caller-owned): this kernel runs without numba's runtime, and
    numba compiles callees with the caller's runtime flag, so nothing reachable may allocate."""
    if mm_off.shape[0] > 0:
        m0 = mm_off[g]
        m1 = mm_off[g + 1]
        if m1 > m0:
            return xxh3_64_tokens_mm_into(  # type: ignore[no-any-return]
                tokens, start, cnt, mm, m0, m1 - m0, seed, mm_scratch, sec, acc
            )
    return xxh3_64_tokens_with(tokens, tok8, start, cnt, seed, sec, acc)  # type: ignore[no-any-return]


@njit(cache=True)  # type: ignore[misc]
def clear_member(
    cfg: U64,
    table: U64,
    deltas: U64,
    mark: U8,
    dlog_b: U32,
    dlog_o: U64,
    dmeta: I64,
    lkeys: U64,
    lvals: U32,
    lmeta: I64,
    nkeys: U64,
    nvals: U64,
    nmeta: I64,
    ocanon: U64,
    ocnt: U32,
    ometa: I64,
    oidx: U64,
    stats: I64,
) -> None:
    """Drop every lineage edge of the member, in ascending external-hash order."""
    n = lmeta[0]
    ks = np.empty(n, dtype=np.uint64)
    vs = np.empty(n, dtype=np.uint32)
    m = 0
    for s in range(lkeys.shape[0]):
        if lvals[s] != EMPTY32:
            ks[m] = lkeys[s]
            vs[m] = lvals[s]
            m += 1
    order = np.argsort(ks[:m])
    for t in range(m):
        _drop_ref(
            np.int64(vs[order[t]]),
            table,
            cfg,
            deltas,
            mark,
            dlog_b,
            dlog_o,
            dmeta,
            ocanon,
            ocnt,
            ometa,
            oidx,
            stats,
        )
        stats[ST_REMOVED] += 1
    lvals[:] = EMPTY32
    lmeta[0] = 0
    if nmeta[0] > 0:
        nvals[:] = _NS_EMPTY
        nmeta[0] = 0


# Compiled without NRT: no reference counting on the ~35 arrays at every inlined helper boundary
# (it cost ~45% of the time with NRT on). Consequently this kernel never allocates: scratch
# buffers come from Python, and CLEAR events (which allocate to sort) are handed back to Python.
@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def apply_batch(
    ops: U8,
    parent: U64,
    has_parent: npt.NDArray[np.bool_],
    salt: U64,
    ns_part: U64,
    ns_inherit: npt.NDArray[np.bool_],
    blk_off: I64,
    ext: U64,
    tok_off: I64,
    tokens: npt.NDArray[np.uint32],
    mm_off: I64,
    mm: U64,
    cfg: U64,
    table: U64,
    deltas: U64,
    rng: U64,
    mark: U8,
    dlog_b: U32,
    dlog_o: U64,
    dmeta: I64,
    undo_b: U32,
    undo_o: U64,
    lkeys: U64,
    lvals: U32,
    lmeta: I64,
    nkeys: U64,
    nvals: U64,
    nmeta: I64,
    ocanon: U64,
    ocnt: U32,
    ometa: I64,
    oidx: U64,
    canon_buf: U64,
    slot_buf: I64,
    set_keys: U64,
    set_stamp: I64,
    mm_scratch: U8,
    sec: U8,
    acc: U64,
    start: int,
    err: U8,
    stats: I64,
) -> int:
    """Apply every event of one batch for one member; per-event codes go to ``err``."""
    bs = np.int64(cfg[CFG_BLOCK])
    eagle = cfg[CFG_FORMAT] == np.uint64(2)
    extra = 1 if eagle else 0
    win = bs + extra
    mk = np.int64(cfg[CFG_KICKS])
    cseed = cfg[CFG_SEED]
    cmask = cfg[CFG_MASK]
    tok8 = tokens.view(np.uint8)
    n = ops.shape[0]
    lcap = lkeys.shape[0]
    icap = oidx.shape[0]
    for i in range(start, n):
        # Prefetch pipeline (hints only, never affects results): lineage slots PF_FAR events
        # ahead, then for removes the owner entry PF_MID ahead and its CKF bucket PF_NEAR ahead.
        j = i + PF_FAR
        if j < n:
            g0 = blk_off[j]
            for g in range(g0, min(blk_off[j + 1], g0 + 8)):
                h = home(ext[g], lcap)
                prefetch(lkeys, h)
                prefetch(lvals, h)
            if has_parent[j]:
                h = home(parent[j], lcap)
                prefetch(lkeys, h)
                prefetch(lvals, h)
        j = i + PF_MID
        if j < n and ops[j] == 1 and blk_off[j + 1] > blk_off[j]:
            s = tab_find(lkeys, lvals, EMPTY32, ext[blk_off[j]])
            if s >= 0:
                prefetch(ocanon, lvals[s])
                prefetch(ocnt, lvals[s])
        j = i + PF_NEAR
        if j < n and ops[j] == 1 and blk_off[j + 1] > blk_off[j]:
            s = tab_find(lkeys, lvals, EMPTY32, ext[blk_off[j]])
            if s >= 0:
                c = ocanon[lvals[s]]
                _, a = _addr(c, cseed, cmask, deltas)
                prefetch(table, a)
                prefetch(mark, a)
                prefetch(oidx, _tag_home(_tag(c), icap))
        op = ops[i]
        code = E_OK
        if op == 0:
            # ---- STORE: validate everything first (no mutation), then mutate ----
            # (written inline: a nested numba call would pay NRT refcounts on ~35 arrays)
            b0 = blk_off[i]
            b1 = blk_off[i + 1]
            k = b1 - b0
            hp = has_parent[i]
            prev = np.uint64(0)
            pns = np.uint64(0)
            if hp:
                s = tab_find(lkeys, lvals, EMPTY32, parent[i])
                if s < 0:
                    code = E_PARENT
                else:
                    prev = ocanon[lvals[s]]
                    if ns_inherit[i] and nmeta[0] > 0:
                        t = tab_find(nkeys, nvals, _NS_EMPTY, parent[i])
                        if t >= 0:
                            pns = nvals[t]
            if code == E_OK and k > 0 and tok_off[i + 1] - tok_off[i] != k * bs + extra:
                code = E_TOKENS
            if code == E_OK and k > 0 and hp:
                for g in range(b0, b1):
                    if ext[g] == parent[i]:
                        code = E_INVALID_SEQ
                        break
            if code == E_OK and k > 1:
                if k <= 16:
                    for g in range(b0, b1):
                        for g2 in range(g + 1, b1):
                            if ext[g] == ext[g2]:
                                code = E_INVALID_SEQ
                        if code != E_OK:
                            break
                else:
                    # stamped open-addressing set in caller scratch (no allocation, no clearing)
                    smask = set_keys.shape[0] - 1
                    stamp = i + 1
                    for g in range(b0, b1):
                        e = ext[g]
                        h = np.int64(_mix(e) >> np.uint64(33)) & smask
                        while set_stamp[h] == stamp and set_keys[h] != e:
                            h = (h + 1) & smask
                        if set_stamp[h] == stamp:
                            code = E_INVALID_SEQ
                            break
                        set_stamp[h] = stamp
                        set_keys[h] = e
            if code == E_OK and k > 0:
                seed = salt[i] + pns
                tb = tok_off[i]
                for j in range(k):
                    g = b0 + j
                    bh = _block_hash(
                        tokens, tok8, tb + j * bs, win, mm_off, mm, g, seed, mm_scratch, sec, acc  # type: ignore[arg-type]
                    )
                    c = bh if (j == 0 and not hp) else xxh3_64_u64x2(prev, bh, CHAIN_SEED)
                    canon_buf[g] = c
                    prev = c
                    prefetch(oidx, _tag_home(_tag(c), icap))
                    _, a = _addr(c, cseed, cmask, deltas)
                    prefetch(table, a)
                    prefetch(mark, a)
                    s = tab_find(lkeys, lvals, EMPTY32, ext[g])
                    slot_buf[g] = s
                    if s >= 0 and ocanon[lvals[s]] != c:
                        code = E_INVALID_SEQ
                        break
            if code == E_OK and k > 0:
                ns_blk = ns_part[i] if ns_part[i] != np.uint64(0) else pns
                for g in range(b0, b1):
                    c = canon_buf[g]
                    e = ext[g]
                    # Slots found during validation stay valid: inserts never move entries, and
                    # duplicate hashes inside one event were rejected, so "absent" still holds.
                    s = slot_buf[g]
                    if s >= 0:
                        stats[ST_REOFFER] += 1
                        ro = lvals[s]
                        if (ocnt[ro] & RESIDENT) == np.uint32(0):
                            fp, a = _addr(c, cseed, cmask, deltas)
                            if ckf_insert_fp(
                                table,
                                fp,
                                a,
                                deltas,
                                0,
                                rng,
                                mark,
                                dlog_b,
                                dlog_o,
                                dmeta,
                                undo_b,
                                undo_o,
                            ):
                                ocnt[ro] |= RESIDENT
                                ometa[OM_RESIDENT] += 1
                        continue
                    _, oi = own_find(oidx, ocanon, c)
                    if oi < 0:
                        oi = own_alloc(ocanon, ocnt, ometa, c)
                        own_put(oidx, ocanon, oi)
                    cnt = ocnt[oi]
                    first = (cnt & COUNT_MASK) == np.uint32(0)
                    ocnt[oi] = cnt + np.uint32(1)
                    tab_put(lkeys, lvals, EMPTY32, e, np.uint32(oi))
                    lmeta[0] += 1
                    if ns_blk != np.uint64(0):
                        tab_put(nkeys, nvals, _NS_EMPTY, e, ns_blk)
                        nmeta[0] += 1
                    stats[ST_STORED] += 1
                    if (cnt & RESIDENT) == np.uint32(0):
                        fp, a = _addr(c, cseed, cmask, deltas)
                        if ckf_insert_fp(
                            table,
                            fp,
                            a,
                            deltas,
                            mk if first else 0,
                            rng,
                            mark,
                            dlog_b,
                            dlog_o,
                            dmeta,
                            undo_b,
                            undo_o,
                        ):
                            ocnt[oi] |= RESIDENT
                            ometa[OM_RESIDENT] += 1
                        elif first:
                            stats[ST_CAPACITY] += 1
        elif op == 1:
            for g in range(blk_off[i], blk_off[i + 1]):
                e = ext[g]
                s = tab_find(lkeys, lvals, EMPTY32, e)
                if s < 0:
                    stats[ST_UNKNOWN] += 1
                    continue
                oi = np.int64(lvals[s])  # type: ignore[assignment]
                tab_del(lkeys, lvals, EMPTY32, s)
                lmeta[0] -= 1
                if nmeta[0] > 0:
                    t = tab_find(nkeys, nvals, _NS_EMPTY, e)
                    if t >= 0:
                        tab_del(nkeys, nvals, _NS_EMPTY, t)
                        nmeta[0] -= 1
                _drop_ref(
                    oi,
                    table,
                    cfg,
                    deltas,
                    mark,
                    dlog_b,
                    dlog_o,
                    dmeta,
                    ocanon,
                    ocnt,
                    ometa,
                    oidx,
                    stats,
                )
                stats[ST_REMOVED] += 1
        elif op == 2:
            return i  # Python runs clear_member (it allocates) and resumes at i + 1
        else:
            code = E_BAD_OP
        err[i] = code
        if code == E_OK:
            stats[ST_APPLIED] += 1
        else:
            stats[ST_REJECTED] += 1
    return int(ops.shape[0])


@njit(cache=True)  # type: ignore[misc]
def member_edges(
    lkeys: U64, lvals: U32, ocanon: U64, ocnt: U32, out_c: U64, out_r: npt.NDArray[np.bool_]
) -> int:
    """Canonical hash + residency of each of a member's edges (diagnostics, tests)."""
    m = 0
    for s in range(lkeys.shape[0]):
        v = lvals[s]
        if v != EMPTY32:
            out_c[m] = ocanon[v]
            out_r[m] = (ocnt[v] & RESIDENT) != np.uint32(0)
            m += 1
    return m


def _offsets_bad(off: I64, n: int, total: int) -> bool:
    if off.shape[0] != n + 1 or off[0] != 0 or off[n] != total:
        return True
    for i in range(n):  # noqa: SIM110 (compiled by numba: plain loop)
        if off[i + 1] < off[i]:
            return True
    return False


_offsets_bad_nb = njit(cache=True, inline="always")(_offsets_bad)

# batch_summary codes
BS_OK = 0
BS_LENGTHS = 1
BS_BLK_OFF = 2
BS_TOK_OFF = 3
BS_MM_OFF = 4
BS_CLEAR_BLOCKS = 5


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def batch_summary(
    ops: U8,
    parent: U64,
    has_parent: npt.NDArray[np.bool_],
    salt: U64,
    ns_part: U64,
    ns_inherit: npt.NDArray[np.bool_],
    blk_off: I64,
    ext: U64,
    tok_off: I64,
    tokens: npt.NDArray[np.uint32],
    mm_off: I64,
    mm: U64,
    out: I64,
) -> int:
    """Structural checks in one call; ``out = [store_blocks, max_event_blocks, uses_ns]``."""
    n = ops.shape[0]
    if (
        parent.shape[0] != n
        or has_parent.shape[0] != n
        or salt.shape[0] != n
        or ns_part.shape[0] != n
        or ns_inherit.shape[0] != n
    ):
        return BS_LENGTHS
    nb = ext.shape[0]
    if _offsets_bad_nb(blk_off, n, nb):
        return BS_BLK_OFF
    if _offsets_bad_nb(tok_off, n, tokens.shape[0]):
        return BS_TOK_OFF
    if mm_off.shape[0] != 0 and _offsets_bad_nb(mm_off, nb, mm.shape[0]):
        return BS_MM_OFF
    store_blocks = 0
    max_k = 0
    uses_ns = 0
    for i in range(n):
        k = blk_off[i + 1] - blk_off[i]
        if ops[i] == 2 and k != 0:
            return BS_CLEAR_BLOCKS
        if ops[i] == 0:
            store_blocks += k
            if k > max_k:
                max_k = k
            if ns_part[i] != np.uint64(0) or ns_inherit[i]:
                uses_ns = 1
    out[0] = store_blocks
    out[1] = max_k
    out[2] = uses_ns
    return BS_OK
