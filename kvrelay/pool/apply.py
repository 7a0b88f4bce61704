"""The apply kernel: one numba call per ``EventBatch`` for one member (§7.3, §8.2).

Each store is validated completely (parent, token count, self-reference, conflicting re-store)
before anything is mutated, so a rejected event leaves tables, CKF and dirty log untouched.
A valid store then *places* its new edges (owner slot, lineage entry) before it changes any count
or the CKF; when a table has no room for one of them (every candidate bucket full, which Python's
capacity reservation makes rare), the event's placements are undone and the kernel returns to
Python, which grows that table and resumes at the same event.
Clears drop edges in ascending external-hash order so the resulting CKF image is deterministic
(independent of hash-table layout), which lets a reference model reproduce it byte for byte.

Lineage entries hold owner *slots*: owners never move between rebuilds (``packed``), and a rebuild
rewrites every member's references.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay.hashing.xxh3 import xxh3_64_tokens_mm_into, xxh3_64_tokens_with, xxh3_64_u64x2
from kvrelay.pool import cow
from kvrelay.pool import packed as pk
from kvrelay.pool.ckf import _addr, ckf_insert_fp, ckf_remove_fp
from kvrelay.pool.errors import E_BAD_OP, E_INVALID_SEQ, E_OK, E_PARENT, E_TOKENS
from kvrelay.pool.owners import (
    PM_OVERFLOW,
    PM_OVF_ROOM,
    PM_RESIDENT,
    PM_STOP,
    RES_BIT,
    owner_decref,
    owner_incref,
)
from kvrelay.pool.packed import Int
from kvrelay.pool.prefetch import prefetch
from kvrelay.pool.tables import EMPTY32, MIN_CAP, _mix, tab_del, tab_find, tab_put

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

CHAIN_SEED = np.uint64(1337)
_NS_EMPTY = np.uint64(0)
_LOW32 = np.uint64(0xFFFFFFFF)

# stats indices
ST_APPLIED = 0
ST_REJECTED = 1
ST_STORED = 2
ST_REMOVED = 3
ST_UNKNOWN = 4
ST_CAPACITY = 5
ST_INVARIANT = 6
ST_REOFFER = 7  # stored blocks the member already held (every kind below)
ST_DUP = 8  # of those, counted as one more physical copy
ST_REPORT = 9  # of those, taken as a report (no new copy)
ST_AMBIGUOUS = 10  # store events that could be either; taken as reports
ST_COPY_REMOVED = 11  # removes that dropped one extra copy (the edge stays)
N_STATS = 12

# why apply_batch returned before the end of the batch (pm[PM_STOP])
STOP_CLEAR = 1  # a CLEAR event: Python runs clear_member (it allocates)
STOP_LINEAGE_FULL = 2  # the member's lineage table had no room: grow it, resume at the event
STOP_OWNERS_FULL = 3  # the owners table had no room: grow it, resume at the event
STOP_COUNTS_FULL = 4  # the overflow count table might run out of room: grow it, resume
STOP_COPIES_FULL = 5  # the member's copy-count table might run out of room: grow it, resume

# origin[i] of a store (``EventBatch.origin``; an empty array means all unknown)
ORIGIN_UNKNOWN = 0
ORIGIN_NEW = 1  # the engine says: new physical blocks
ORIGIN_REPORT = 2  # the engine says: a report of blocks it already holds

# cmeta (per member copy-count table): live entries, entries it takes without a rehash
CM_LIVE = 0
CM_ROOM = 1
# a member's side tables' checkpoint barrier (mc: u64[MC_LEN], ``pool/cow.py``; 0: not armed)
MC_NS_KEYS = 0
MC_NS_VALS = 1
MC_CP_KEYS = 2
MC_CP_VALS = 3
MC_LEN = 4
#: most physical copies of one hash one member may hold; a store past it is rejected (no engine
#: has that many blocks, and a count must never wrap)
MAX_COPIES = 1 << 24

# own_buf[g] = owner slot · 4 + kind, per block of one store
K_REOFFER = 0  # the edge exists (same canonical)
K_SHARED = 1  # new edge to an existing owner
K_FIRST = 2  # new edge that created its owner
K_NEW = 3  # new edge, not placed yet

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
CFG_REPORTS = 5  # 1: the engine may send reports (vLLM kv_cache_report_mode "full")


@njit(cache=True, inline="always")  # type: ignore[misc]
def _prefetch_homes(tm: U64, w: U64, y: np.uint64) -> None:
    for j in range(np.int64(tm[pk.TM_D])):
        tw, d0, d1 = pk.home_words(tm, j, y)
        prefetch(w, tw)
        prefetch(w, d0)
        prefetch(w, d1)


@njit(cache=True, inline="always")  # type: ignore[misc]
def _drop_ref(
    o: Int,
    table: U64,
    cfg: U64,
    deltas: U64,
    mark: U8,
    dlog_b: U32,
    dlog_o: U64,
    dmeta: I64,
    otm: U64,
    ow: U64,
    pm: I64,
    xk: U64,
    xv: U32,
    pc: U64,
    stats: I64,
) -> None:
    """One reference to owner slot ``o`` gone; 1→0 removes the fingerprint (if resident) and
    frees the owner."""
    if not owner_decref(otm, ow, xk, xv, pm, pc, o):
        return
    if (pk.pay_of(otm, ow, o) & RES_BIT) != np.uint64(0):
        fp, a = _addr(pk.key_of(otm, ow, o), cfg[CFG_SEED], cfg[CFG_MASK], deltas)
        if not ckf_remove_fp(table, fp, a, deltas, mark, dlog_b, dlog_o, dmeta):
            stats[ST_INVARIANT] += 1
        pm[PM_RESIDENT] -= 1
    pk.delete(otm, ow, o)


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
    ltm: U64,
    lw: U64,
    nkeys: U64,
    nvals: U64,
    nmeta: I64,
    ck: U64,
    cv: U32,
    cmeta: I64,
    otm: U64,
    ow: U64,
    pm: I64,
    xk: U64,
    xv: U32,
    pc: U64,
    mc: U64,
    stats: I64,
) -> None:
    """Drop every lineage edge of the member, in ascending external-hash order (extra copies
    go with their edge: a clear empties the rank's cache)."""
    n = np.int64(ltm[pk.TM_LIVE])
    ks = np.empty(n, dtype=np.uint64)
    ps = np.empty(n, dtype=np.uint64)
    ss = np.empty(n, dtype=np.int64)
    pk.list_entries(ltm, lw, ks, ps, ss)
    order = np.argsort(ks)
    for t in range(n):
        _drop_ref(
            np.int64(ps[order[t]]), table, cfg, deltas, mark, dlog_b, dlog_o, dmeta, otm, ow, pm,
            xk, xv, pc, stats,
        )  # fmt: skip
        stats[ST_REMOVED] += 1
    for t in range(n):
        pk.delete(ltm, lw, ss[t])
    if nmeta[0] > 0:
        cow.touch_all(mc[MC_NS_VALS], nvals)
        nvals[:] = _NS_EMPTY
        nmeta[0] = 0
    if cmeta[CM_LIVE] > 0:
        cow.touch_all(mc[MC_CP_VALS], cv)
        cv[:] = EMPTY32
        cmeta[CM_LIVE] = 0


# Compiled without NRT: no reference counting on the ~40 arrays at every inlined helper boundary
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
    origin: U8,
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
    ltm: U64,
    lw: U64,
    nkeys: U64,
    nvals: U64,
    nmeta: I64,
    ck: U64,
    cv: U32,
    cmeta: I64,
    otm: U64,
    ow: U64,
    pm: I64,
    xk: U64,
    xv: U32,
    pc: U64,
    mc: U64,
    okey_buf: U64,
    addr_buf: U64,
    own_buf: I64,
    set_keys: U64,
    set_stamp: I64,
    walk: U64,
    mm_scratch: U8,
    sec: U8,
    acc: U64,
    start: int,
    err: U8,
    stats: I64,
) -> int:
    """Apply events ``start..`` of one batch for one member; per-event codes go to ``err``.

    Returns ``len(ops)`` when done, else the index of the event it stopped at (the reason in
    ``pm[PM_STOP]``: a CLEAR, or a table without room)."""
    bs = np.int64(cfg[CFG_BLOCK])
    eagle = cfg[CFG_FORMAT] == np.uint64(2)
    extra = 1 if eagle else 0
    win = bs + extra
    mk = np.int64(cfg[CFG_KICKS])
    reports = cfg[CFG_REPORTS] != np.uint64(0)
    has_origin = origin.shape[0] > 0
    cseed = cfg[CFG_SEED]
    cmask = cfg[CFG_MASK]
    ocap = np.int64(otm[pk.TM_CAP])
    tok8 = tokens.view(np.uint8)
    n = ops.shape[0]
    # The pipeline below reaches PF_FAR events ahead; warm the lineage buckets of the first ones
    # too (engine batches are often shorter than the pipeline).
    for j in range(start, min(n, start + PF_FAR)):
        g0 = blk_off[j]
        for g in range(g0, min(blk_off[j + 1], g0 + 8)):
            _prefetch_homes(ltm, lw, pk.mix(ltm, ext[g]))
        if has_parent[j]:
            _prefetch_homes(ltm, lw, pk.mix(ltm, parent[j]))
    for i in range(start, n):
        # Prefetch pipeline (hints only, never affects results): lineage buckets PF_FAR events
        # ahead, then for removes the owner slot PF_MID ahead (kept in own_buf) and its CKF
        # bucket PF_NEAR ahead.
        j = i + PF_FAR
        if j < n:
            g0 = blk_off[j]
            for g in range(g0, min(blk_off[j + 1], g0 + 8)):
                _prefetch_homes(ltm, lw, pk.mix(ltm, ext[g]))
            if has_parent[j]:
                _prefetch_homes(ltm, lw, pk.mix(ltm, parent[j]))
        j = i + PF_MID
        if j < n and ops[j] == 1 and blk_off[j + 1] > blk_off[j]:
            s = pk.find(ltm, lw, pk.mix(ltm, ext[blk_off[j]]))
            o = np.int64(-1)
            if s >= 0:
                o = np.int64(pk.pay_of(ltm, lw, s))
                prefetch(ow, o >> 3)
                prefetch(ow, pk.pay_off(otm, o) >> 6)
            own_buf[blk_off[j]] = o
        j = i + PF_NEAR
        if j < n and ops[j] == 1 and blk_off[j + 1] > blk_off[j]:
            o = own_buf[blk_off[j]]  # stale before PF_MID reached j: still a valid slot or -1
            if 0 <= o < ocap:
                _, a = _addr(pk.key_of(otm, ow, o), cseed, cmask, deltas)
                prefetch(table, a)
                prefetch(mark, a)
        op = ops[i]
        code = E_OK
        if op == 0:
            # ---- STORE: validate everything first (no mutation), then place, then commit ----
            # (written inline: a nested numba call would pay NRT refcounts on ~40 arrays)
            b0 = blk_off[i]
            b1 = blk_off[i + 1]
            k = b1 - b0
            hp = has_parent[i]
            prev = np.uint64(0)
            pns = np.uint64(0)
            if hp:
                s = pk.find(ltm, lw, pk.mix(ltm, parent[i]))
                if s < 0:
                    code = E_PARENT
                else:
                    prev = pk.key_of(otm, ow, np.int64(pk.pay_of(ltm, lw, s)))
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
            held = 0
            if code == E_OK and k > 0:
                seed = salt[i] + pns
                tb = tok_off[i]
                for j in range(k):
                    g = b0 + j
                    bh = _block_hash(
                        tokens, tok8, tb + j * bs, win, mm_off, mm, g, seed, mm_scratch, sec, acc  # type: ignore[arg-type]
                    )
                    c = bh if (j == 0 and not hp) else xxh3_64_u64x2(prev, bh, CHAIN_SEED)
                    prev = c
                    yo = pk.mix(otm, c)  # the owners table's key for c
                    okey_buf[g] = yo
                    _prefetch_homes(otm, ow, yo)
                    fp, a = _addr(c, cseed, cmask, deltas)
                    addr_buf[g] = (fp << np.uint64(32)) | a
                    prefetch(table, a)
                    prefetch(mark, a)
                    s = pk.find(ltm, lw, pk.mix(ltm, ext[g]))
                    if s >= 0:
                        o = np.int64(pk.pay_of(ltm, lw, s))
                        if not pk.holds(otm, ow, o, yo):
                            code = E_INVALID_SEQ
                            break
                        own_buf[g] = o * 4 + K_REOFFER
                        held += 1
                    else:
                        own_buf[g] = K_NEW
            # ---- held blocks: one more physical copy each, or a report of what is held ----
            copies = False
            if code == E_OK and held > 0:
                org = origin[i] if has_origin else np.uint8(ORIGIN_UNKNOWN)
                if org == ORIGIN_NEW:
                    copies = True
                elif org == ORIGIN_REPORT:
                    copies = False
                elif not reports or hp:
                    # a report names the request's cache hit: a prefix from block 0 (no parent).
                    # Its blocks may not all be held here (a miss of an earlier wrong guess):
                    # those are new edges, the held ones still taken as reported, never copies
                    copies = True
                else:
                    stats[ST_AMBIGUOUS] += 1
                if copies:
                    if cmeta[CM_LIVE] + held > cmeta[CM_ROOM]:
                        pm[PM_STOP] = STOP_COPIES_FULL
                        return i
                    if cmeta[CM_LIVE] > 0:
                        for g in range(b0, b1):
                            if own_buf[g] & 3 == K_REOFFER:
                                t = tab_find(ck, cv, EMPTY32, ext[g])
                                if t >= 0 and cv[t] >= np.uint32(MAX_COPIES - 1):
                                    code = E_INVALID_SEQ
            if code == E_OK and k > 0:
                # ---- place: owner slots and lineage entries of the new edges, all undone when
                # a table has no room (duplicates inside one event were rejected above) ----
                stop = 0
                shared = 0
                g = b0
                while g < b1:
                    if own_buf[g] != K_NEW:
                        g += 1
                        continue
                    placed, created = pk.find_or_insert_stable(
                        otm, ow, okey_buf[g], np.uint64(0)
                    )
                    if placed < 0:
                        stop = STOP_OWNERS_FULL
                        break
                    o = np.int64(placed)
                    if not pk.insert_cuckoo(ltm, lw, pk.mix(ltm, ext[g]), np.uint64(o), walk):
                        stop = STOP_LINEAGE_FULL
                        if created:
                            pk.delete(otm, ow, o)
                        break
                    own_buf[g] = o * 4 + (K_FIRST if created else K_SHARED)
                    shared += 0 if created else 1
                    g += 1
                # every count that grows may need an overflow entry (7 → 8)
                if stop == 0 and pm[PM_OVERFLOW] + shared > pm[PM_OVF_ROOM]:
                    stop = STOP_COUNTS_FULL
                if stop != 0:
                    for g2 in range(g - 1, b0 - 1, -1):
                        kind = own_buf[g2] & 3
                        if kind == K_REOFFER:
                            continue
                        pk.delete(ltm, lw, pk.find(ltm, lw, pk.mix(ltm, ext[g2])))
                        if kind == K_FIRST:
                            pk.delete(otm, ow, own_buf[g2] >> 2)
                    pm[PM_STOP] = stop
                    return i
                # ---- commit: counts, namespace, CKF ----
                ns_blk = ns_part[i] if ns_part[i] != np.uint64(0) else pns
                for g in range(b0, b1):
                    o = own_buf[g] >> 2
                    kind = own_buf[g] & 3
                    if kind == K_REOFFER:
                        stats[ST_REOFFER] += 1
                        if copies:
                            stats[ST_DUP] += 1
                            t = tab_find(ck, cv, EMPTY32, ext[g])
                            if t < 0:
                                tab_put(ck, cv, EMPTY32, ext[g], np.uint32(1), mc[MC_CP_KEYS],
                                        mc[MC_CP_VALS])  # fmt: skip
                                cmeta[CM_LIVE] += 1
                            else:
                                cow.touch_item(mc[MC_CP_VALS], cv, t)
                                cv[t] += np.uint32(1)
                        else:
                            stats[ST_REPORT] += 1
                        p = pk.pay_of(otm, ow, o)
                        if (p & RES_BIT) == np.uint64(0):
                            fp = addr_buf[g] >> np.uint64(32)
                            a = addr_buf[g] & _LOW32
                            if ckf_insert_fp(
                                table, fp, a, deltas, 0, rng, mark, dlog_b, dlog_o, dmeta,
                                undo_b, undo_o,
                            ):  # fmt: skip
                                pk.set_pay(otm, ow, o, p | RES_BIT)
                                pm[PM_RESIDENT] += 1
                        continue
                    first = kind == K_FIRST
                    if not first:
                        owner_incref(otm, ow, xk, xv, pm, pc, o)
                    if ns_blk != np.uint64(0):
                        tab_put(nkeys, nvals, _NS_EMPTY, ext[g], ns_blk, mc[MC_NS_KEYS],
                                mc[MC_NS_VALS])  # fmt: skip
                        nmeta[0] += 1
                    stats[ST_STORED] += 1
                    p = pk.pay_of(otm, ow, o)
                    if (p & RES_BIT) == np.uint64(0):
                        fp = addr_buf[g] >> np.uint64(32)
                        a = addr_buf[g] & _LOW32
                        if ckf_insert_fp(
                            table, fp, a, deltas, mk if first else 0, rng, mark, dlog_b, dlog_o,
                            dmeta, undo_b, undo_o,
                        ):  # fmt: skip
                            pk.set_pay(otm, ow, o, p | RES_BIT)
                            pm[PM_RESIDENT] += 1
                        elif first:
                            stats[ST_CAPACITY] += 1
        elif op == 1:
            for g in range(blk_off[i], blk_off[i + 1]):
                e = ext[g]
                s = pk.find(ltm, lw, pk.mix(ltm, e))
                if s < 0:
                    stats[ST_UNKNOWN] += 1
                    continue
                if cmeta[CM_LIVE] > 0:
                    t = tab_find(ck, cv, EMPTY32, e)
                    if t >= 0:  # one of several physical copies: the block stays
                        c = cv[t]
                        if c == np.uint32(1):
                            tab_del(ck, cv, EMPTY32, t, mc[MC_CP_KEYS], mc[MC_CP_VALS])
                            cmeta[CM_LIVE] -= 1
                        else:
                            cow.touch_item(mc[MC_CP_VALS], cv, t)
                            cv[t] = c - np.uint32(1)
                        stats[ST_COPY_REMOVED] += 1
                        continue
                o = np.int64(pk.pay_of(ltm, lw, s))
                pk.delete(ltm, lw, s)
                if nmeta[0] > 0:
                    t = tab_find(nkeys, nvals, _NS_EMPTY, e)
                    if t >= 0:
                        tab_del(nkeys, nvals, _NS_EMPTY, t, mc[MC_NS_KEYS], mc[MC_NS_VALS])
                        nmeta[0] -= 1
                _drop_ref(
                    o, table, cfg, deltas, mark, dlog_b, dlog_o, dmeta, otm, ow, pm, xk, xv, pc,
                    stats,
                )  # fmt: skip
                stats[ST_REMOVED] += 1
        elif op == 2:
            pm[PM_STOP] = STOP_CLEAR
            return i
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
    ltm: U64,
    lw: U64,
    otm: U64,
    ow: U64,
    out_e: U64,
    out_c: U64,
    out_r: npt.NDArray[np.bool_],
) -> Int:
    """External hash, canonical hash and residency of each of a member's edges (diagnostics)."""
    n = np.int64(ltm[pk.TM_LIVE])
    ps = np.empty(n, dtype=np.uint64)
    ss = np.empty(n, dtype=np.int64)
    pk.list_entries(ltm, lw, out_e, ps, ss)
    for t in range(n):
        o = np.int64(ps[t])
        out_c[t] = pk.key_of(otm, ow, o)
        out_r[t] = (pk.pay_of(otm, ow, o) & RES_BIT) != np.uint64(0)
    return n


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
BS_ORIGIN = 6  # checked in Python (one argument less per call)
# batch_summary's uses_ns bits
NS_OWN = 1
NS_INHERIT = 2


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
    """Structural checks in one call; ``out = [store_blocks, max_event_blocks, uses_ns]``,
    ``uses_ns`` holding ``NS_OWN`` (a store names a namespace) and ``NS_INHERIT`` (a store
    takes its parent's, which only a member holding namespaces has to give)."""
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
            if ns_part[i] != np.uint64(0):
                uses_ns |= NS_OWN
            if ns_inherit[i]:
                uses_ns |= NS_INHERIT
    out[0] = store_blocks
    out[1] = max_k
    out[2] = uses_ns
    return BS_OK


# apply_packed's answers
PACKED_APPLIED = 0  # the whole batch applied, its stats added to the running totals too
PACKED_GENERAL = 1  # nothing done: the batch needs the general path (Pool.apply of an EventBatch)
PACKED_STOPPED = 2  # applied from event 0 up to io[IO_STOP] (a CLEAR, a full table): go on there
# apply_packed's io: batch_summary's three outputs, then where it stopped and the set capacity
IO_STOP = 3
IO_SET_CAP = 4
IO_LEN = 5


def room(live: int, lo: int, hi: int) -> tuple[int, int]:
    """How many entries a table of ``live`` entries and size bounds ``(lo, hi)`` may gain (lose,
    below 0) and keep its size: outside that range ``Pool.reserve`` resizes it."""
    return lo - live, hi - live


def counts_oversized(cap: int, overflow: int) -> bool:
    """The overflow count table (``cap`` slots, ``overflow`` entries) is over eight times larger
    than its entries need: ``Pool.apply`` shrinks it before applying."""
    return cap > MIN_CAP and (overflow + 1) * 8 < cap


_room_nb = njit(cache=True, inline="always")(room)
_counts_oversized_nb = njit(cache=True, inline="always")(counts_oversized)


def set_capacity(max_k: int) -> int:
    """Slots of the per-event duplicate-check set for stores of up to ``max_k`` blocks: a power
    of two at least twice as large (16 at least), or 1 (a linear scan) up to 16 blocks."""
    if max_k <= 16:
        return 1
    bits = 0
    v = 2 * max_k
    while v:
        bits += 1
        v >>= 1
    return 1 << max(4, bits)


_set_capacity_nb = njit(cache=True, inline="always")(set_capacity)


# Without NRT, as ``apply_batch``: it allocates nothing (the batch's all-zero namespace columns are
# views of the caller's ``zeros``), and numba then unboxes its ~50 array arguments without a
# reference-counted wrapper each, which is most of what a call costs when the caches are cold.
@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def apply_packed(
    work: U8,
    ne: int,
    e: int,
    o_ops: int,
    o_hp: int,
    o_w64: int,
    o_i64: int,
    o_tok: int,
    own_lo: int,
    own_hi: int,
    lin_lo: int,
    lin_hi: int,
    io: I64,
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
    ltm: U64,
    lw: U64,
    nkeys: U64,
    nvals: U64,
    nmeta: I64,
    ck: U64,
    cv: U32,
    cmeta: I64,
    otm: U64,
    ow: U64,
    pm: I64,
    xk: U64,
    xv: U32,
    pc: U64,
    mc: U64,
    okey_buf: U64,
    addr_buf: U64,
    own_buf: I64,
    set_keys: U64,
    set_stamp: I64,
    walk: U64,
    mm_scratch: U8,
    sec: U8,
    acc: U64,
    err: U8,
    stats: I64,
    totals: I64,
    zeros: U8,
) -> int:
    """``batch_summary`` and ``apply_batch`` of a ``PackedBatch`` in one call: what a message
    costs at light load is mostly per call and per Python object, not per event.

    Only the common case: the batch passes ``batch_summary``, uses no namespace, fits the
    caller's buffers (``err``, ``set_keys``/``set_stamp``, ``okey_buf``, 9 bytes per event of
    ``zeros``, which must stay all zero and is only read), finds the overflow count table not
    oversized (``counts_oversized``) and adds a number of stored blocks that both the owners
    table (size bounds ``own_lo``/``own_hi``) and the member's lineage table (``lin_lo``/
    ``lin_hi``) take without a resize (``room``): where ``Pool.apply`` would change no table
    first. Otherwise it returns ``PACKED_GENERAL`` before touching anything. Else
    ``err[:ne]`` and ``stats`` are filled as ``apply_batch`` fills them, and the answer is
    ``PACKED_APPLIED`` when the whole batch was applied (``stats`` then added to ``totals``, the
    pool's running counts: a numpy ``+=`` costs more than the walk at light load), or
    ``PACKED_STOPPED`` with ``io[IO_STOP]`` where ``apply_batch`` stopped and ``io[IO_SET_CAP]``
    the duplicate-check set it used (the caller goes on from there, and adds the totals)."""
    n = work.shape[0]
    # a packed batch's stores with a parent take the parent's namespace (it names none of its
    # own): nothing to take while the member holds none, else the general path does
    if nmeta[0] > 0 or _counts_oversized_nb(xk.shape[0], pm[PM_OVERFLOW]):
        return PACKED_GENERAL
    o_add_lo, o_add_hi = _room_nb(np.int64(otm[pk.TM_LIVE]), own_lo, own_hi)  # type: ignore[arg-type]
    l_add_lo, l_add_hi = _room_nb(np.int64(ltm[pk.TM_LIVE]), lin_lo, lin_hi)  # type: ignore[arg-type]
    add_lo = max(o_add_lo, l_add_lo)
    add_hi = min(o_add_hi, l_add_hi)
    if (
        ne < 0
        or e < ne
        or not (0 <= o_ops <= o_hp <= o_w64 <= o_i64 <= o_tok <= n)
        or o_ops + ne > o_hp
        or o_hp + ne > o_w64
        or (o_i64 - o_w64) % 8 != 0
        or (o_tok - o_i64) % 8 != 0
        or (o_i64 - o_w64) // 8 < 2 * e
        or (o_tok - o_i64) // 8 < 2 * e + 2
    ):
        return PACKED_GENERAL
    w64 = work[o_w64:o_i64].view(np.uint64)
    i64 = work[o_i64:o_tok].view(np.int64)
    blk_off = i64[: ne + 1]
    tok_off = i64[e + 1 : e + 2 + ne]
    nb = blk_off[ne]
    nt = tok_off[ne]
    if nb < 0 or 2 * e + nb > w64.shape[0] or nt < 0 or o_tok + 4 * nt > n:
        return PACKED_GENERAL
    ops = work[o_ops : o_ops + ne]
    has_parent = work[o_hp : o_hp + ne].view(np.bool_)
    parent = w64[:ne]
    salt = w64[e : e + ne]
    ext = w64[2 * e : 2 * e + nb]
    tokens = work[o_tok : o_tok + 4 * nt].view(np.uint32)
    if 9 * ne > zeros.shape[0]:
        return PACKED_GENERAL
    ns_part = zeros[: 8 * ne].view(np.uint64)
    ns_inherit = zeros[8 * ne : 9 * ne].view(np.bool_)
    mm_off = zeros[:0].view(np.int64)
    mm = zeros[:0].view(np.uint64)
    origin = zeros[:0]
    summary = io[:3]
    code = batch_summary(
        ops, parent, has_parent, salt, ns_part, ns_inherit, blk_off, ext, tok_off, tokens, mm_off,
        mm, summary,
    )  # fmt: skip
    if code != BS_OK:
        return PACKED_GENERAL
    store_blocks = summary[0]
    set_cap = _set_capacity_nb(summary[1])
    if (
        summary[2] != 0
        or store_blocks < add_lo
        or store_blocks > add_hi
        or nb > okey_buf.shape[0]
        or ne > err.shape[0]
        or set_cap > set_keys.shape[0]
    ):
        return PACKED_GENERAL
    sk = set_keys[:set_cap]
    ss = set_stamp[:set_cap]
    ev = err[:ne]
    sk[:] = 0
    ss[:] = 0
    ev[:] = 0
    stats[:] = 0
    stop = apply_batch(
        ops, parent, has_parent, salt, ns_part, ns_inherit, blk_off, ext, tok_off, tokens, mm_off,
        mm, origin, cfg, table, deltas, rng, mark, dlog_b, dlog_o, dmeta, undo_b, undo_o, ltm, lw,
        nkeys, nvals, nmeta, ck, cv, cmeta, otm, ow, pm, xk, xv, pc, mc, okey_buf, addr_buf,
        own_buf, sk, ss, walk, mm_scratch, sec, acc, np.int64(0), ev, stats,
    )  # fmt: skip
    io[IO_STOP] = stop
    io[IO_SET_CAP] = set_cap
    if stop < ne:
        return PACKED_STOPPED
    for i in range(stats.shape[0]):
        totals[i] += stats[i]
    return PACKED_APPLIED
