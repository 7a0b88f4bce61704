"""Packed bucketed quotient tables: the compact layout of the pool's exact state.

A table is ``d`` subtables of ``nb_j`` buckets × ``b`` slots. A key ``x`` (any u64) is mixed once,
``y = fmix64(x ^ salt)`` (a bijection, so structured engine hashes spread like random ones, and a
secret salt keeps inputs from aiming at one bucket); subtable ``j`` reads ``y`` rotated left by
``j · 64/d`` bits, so each subtable picks its candidate bucket from other bits. Each slot stores
only what its position does not imply (quotienting):

* the bucket index is ``(hi32(y) · nb) >> 32``; the low 32 bits of that product, shifted right
  by ``k = floor(log2 nb)``, still tell the ``hi32`` values of one bucket apart, so a slot keeps
  ``32 − k`` of those bits plus the 32 low bits of ``y``: ``64 − k`` bits identify the key
  exactly, and no division is needed to compare (only to rebuild ``x``);
* 7 of those bits (the low bits of ``y``) sit in a tag byte whose high bit marks the slot as
  used, 8 tags per u64 word in a tag region: one word-wide byte compare scans 8 slots, and
  occupancy comes from the same word. The remaining ``57 − k`` bits and the payload are
  bit-packed in a data region.

Two insertion policies share the layout:

* **stable** (``kicks == 0``, the owners table): least-loaded of the ``d`` candidate buckets,
  ties to the lowest subtable ("d-left"). Entries never move until the whole table is rebuilt,
  so lineage entries may hold an owner's slot index as a reference.
* **cuckoo** (``kicks > 0``, lineage tables, ``d == 2``): when both buckets are full, a bounded
  random walk relocates entries to their other bucket; a failed walk is undone step by step, so
  the table is exactly as before. Nothing points into these tables.

An insert can fail (every candidate bucket full / the walk exhausted): the caller grows the table
and retries. A table is two flat numpy arrays, ``tm`` (meta) and ``w`` (tag and data regions), so
a pool's state can be written out and mapped back as is. Kernels never allocate.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvrelay._jit import inline
from kvrelay.pool import cow
from kvrelay.pool.bitops import ctz, popcount
from kvrelay.pool.ckf import splitmix_next
from kvrelay.pool.prefetch import prefetch

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
Int = int | np.int64  # kernel integers (Python ints from callers, int64 inside numba)

# ---- meta layout (tm: u64[TM_LEN]) ---------------------------------------------------------------
TM_LIVE = 0
TM_D = 1
TM_B = 2
TM_PBITS = 3
TM_RNG = 4
TM_KICKS = 5
TM_CAP = 6
TM_SALT = 7
TM_LOGB = 8  # log2(slots per bucket): bucket index = slot >> TM_LOGB (no division)
#: Address of the control block that arms ``w`` while a checkpoint reads it (``pool/cow.py``);
#: 0 otherwise, and always 0 in an exported or restored table.
TM_COW = 9
TM_SUB = 10  # per-subtable block of SUB_W words
SUB_W = 8
S_NB = 0
S_K = 1
S_RBITS = 2
S_WIDTH = 3
S_SLOT0 = 4
S_BIT0 = 5  # bit offset of the subtable's data in w
S_ROT = 6  # subtable j reads the mixed key rotated left by j · 64/d bits
MAX_D = 3
TM_LEN = TM_SUB + SUB_W * MAX_D
MAX_NB = 1 << 30  # keeps (h << 32) + nb in u64 when rebuilding a key
TAG_BITS = 7

_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_M32 = np.uint64(0xFFFFFFFF)
_M25 = np.uint64((1 << 25) - 1)
_M7 = np.uint64(0x7F)
_FF = np.uint64(0xFF)
_USED = np.uint64(0x80)
_C1 = np.uint64(0xFF51AFD7ED558CCD)
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_C1_INV = np.uint64(0x4F74430C22A54005)
_C2_INV = np.uint64(0x9CB4B2F8129337DB)
_L8 = np.uint64(0x0101010101010101)
_H8 = np.uint64(0x8080808080808080)
_S7 = np.uint64(0x7F7F7F7F7F7F7F7F)


# ---- bit helpers ---------------------------------------------------------------------------------


@inline
def fmix(x: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finalizer: a bijection with full avalanche."""
    x ^= x >> np.uint64(33)
    x *= _C1
    x ^= x >> np.uint64(33)
    x *= _C2
    x ^= x >> np.uint64(33)
    return x


@inline
def unfmix(y: np.uint64) -> np.uint64:
    y ^= y >> np.uint64(33)
    y *= _C2_INV
    y ^= y >> np.uint64(33)
    y *= _C1_INV
    y ^= y >> np.uint64(33)
    return y


@inline
def byte_eq(w: np.uint64, tag: np.uint64) -> np.uint64:
    """Bit 7 of each byte of ``w`` that equals ``tag``, other bits zero (exact SWAR compare; a
    slot's index in its word is ``ctz(mask) >> 3``)."""
    x = w ^ (tag * _L8)
    t = ((x & _S7) + _S7) | x
    return ~(t | _S7)  # type: ignore[no-any-return]


@inline
def get_bits(a: U64, off: Int, n: Int) -> np.uint64:
    """``n`` (1..64) bits of ``a`` starting at bit ``off`` (little-endian bit order)."""
    w = off >> 6
    sh = off & 63
    v = a[w] >> np.uint64(sh)
    if sh + n > 64:
        v |= a[w + 1] << np.uint64(64 - sh)
    if n < 64:
        v &= (_ONE << np.uint64(n)) - _ONE
    return v  # type: ignore[no-any-return]


@inline
def put_bits(a: U64, off: Int, n: Int, v: np.uint64) -> None:
    w = off >> 6
    sh = off & 63
    m = ~_ZERO if n == 64 else (_ONE << np.uint64(n)) - _ONE
    a[w] = (a[w] & ~(m << np.uint64(sh))) | (v << np.uint64(sh))
    if sh + n > 64:
        r = np.uint64(64 - sh)
        a[w + 1] = (a[w + 1] & ~(m >> r)) | (v >> r)


@inline
def rng_next(tm: U64) -> np.uint64:
    """xorshift64*: the cuckoo walk's victim choices (deterministic per table)."""
    s = tm[TM_RNG]
    s ^= s >> np.uint64(12)
    s ^= s << np.uint64(25)
    s ^= s >> np.uint64(27)
    tm[TM_RNG] = s
    return s * np.uint64(0x2545F4914F6CDD1D)  # type: ignore[no-any-return]


@inline
def clamp(x: Int, lo: Int, hi: Int) -> Int:
    """``x`` limited to ``[lo, hi]`` (ranged kernels take any range)."""
    v = np.int64(x)
    if v < lo:
        return np.int64(lo)
    if v > hi:
        return np.int64(hi)
    return v


# ---- addressing ----------------------------------------------------------------------------------


@inline
def mix(tm: U64, x: np.uint64) -> np.uint64:
    """The table's mixed key (one per key, shared by all subtables)."""
    return fmix(x ^ tm[TM_SALT])


@inline
def unmix(tm: U64, y: np.uint64) -> np.uint64:
    return unfmix(y) ^ tm[TM_SALT]  # type: ignore[no-any-return]


@inline
def _rotl(y: np.uint64, r: np.uint64) -> np.uint64:
    if r == _ZERO:
        return y
    return (y << r) | (y >> (np.uint64(64) - r))  # type: ignore[no-any-return]


@inline
def split(tm: U64, j: Int, y: np.uint64) -> tuple[Int, np.uint64, np.uint64]:
    """``(bucket, tag byte, rest)`` of mixed key ``y`` in subtable ``j``."""
    o = TM_SUB + SUB_W * j
    yj = _rotl(y, tm[o + S_ROT])
    p = (yj >> np.uint64(32)) * tm[o + S_NB]
    t = (p & _M32) >> tm[o + S_K]
    rest = (t << np.uint64(25)) | ((yj >> np.uint64(TAG_BITS)) & _M25)
    return np.int64(p >> np.uint64(32)), _USED | (yj & _M7), rest  # type: ignore[return-value]


@inline
def unsplit(tm: U64, j: Int, h: Int, tag: np.uint64, rest: np.uint64) -> np.uint64:
    """Inverse of ``split``. The true product ``hi32 · nb`` lies in ``[num, num + 2^k)``, which
    holds exactly one multiple of ``nb`` (``2^k ≤ nb``), so ``hi32 = ceil(num / nb)``."""
    o = TM_SUB + SUB_W * j
    nb = tm[o + S_NB]
    num = (np.uint64(h) << np.uint64(32)) | ((rest >> np.uint64(25)) << tm[o + S_K])
    hi = (num + nb - _ONE) // nb
    lo = ((rest & _M25) << np.uint64(TAG_BITS)) | (tag & _M7)
    r = tm[o + S_ROT]
    return _rotl((hi << np.uint64(32)) | lo, (np.uint64(64) - r) & np.uint64(63))


@inline
def locate(tm: U64, j: Int, x: np.uint64) -> tuple[Int, np.uint64, np.uint64]:
    """``(bucket, tag byte, rest)`` of key ``x`` in subtable ``j``."""
    return split(tm, j, mix(tm, x))  # type: ignore[no-any-return]


@inline
def key_at(tm: U64, j: Int, h: Int, tag: np.uint64, rest: np.uint64) -> np.uint64:
    """The key stored as ``(tag, rest)`` in bucket ``h`` of subtable ``j``."""
    return unmix(tm, unsplit(tm, j, h, tag, rest))


@inline
def sub_of(tm: U64, s: Int) -> Int:
    """Subtable of global slot ``s``."""
    j = np.int64(tm[TM_D]) - 1
    while j > 0 and np.int64(tm[TM_SUB + SUB_W * j + S_SLOT0]) > s:
        j -= 1
    return j  # type: ignore[no-any-return]


@inline
def bucket_start(tm: U64, j: Int, h: Int) -> Int:
    return np.int64(tm[TM_SUB + SUB_W * j + S_SLOT0]) + h * np.int64(tm[TM_B])  # type: ignore[no-any-return]


@inline
def fill(w: U64, s0: Int, b: Int) -> Int:
    """Used slots of the bucket at ``s0`` (``b`` a multiple of 8, ``s0`` of ``b``)."""
    n = 0
    w0 = s0 >> 3
    for q in range(b >> 3):
        n += popcount(w[w0 + q] & _H8)
    return n


@inline
def first_free(w: U64, s0: Int, b: Int) -> Int:
    """Global slot of the bucket's first free slot, or -1 when it is full."""
    w0 = s0 >> 3
    for q in range(b >> 3):
        f = ~w[w0 + q] & _H8
        if f != _ZERO:
            return s0 + 8 * q + (ctz(f) >> 3)  # type: ignore[no-any-return]
    return -1


@inline
def slot_off(tm: U64, j: Int, s: Int) -> Int:
    """Bit offset in ``w`` of global slot ``s`` (in subtable ``j``)."""
    o = TM_SUB + SUB_W * j
    return np.int64(tm[o + S_BIT0]) + (s - np.int64(tm[o + S_SLOT0])) * np.int64(tm[o + S_WIDTH])  # type: ignore[no-any-return]


@inline
def rest_at(tm: U64, w: U64, j: Int, s: Int) -> np.uint64:
    return get_bits(w, slot_off(tm, j, s), np.int64(tm[TM_SUB + SUB_W * j + S_RBITS]))  # type: ignore[no-any-return]


@inline
def pay_off(tm: U64, s: Int) -> Int:
    """Bit offset in ``w`` of global slot ``s``'s payload."""
    j = sub_of(tm, s)
    return slot_off(tm, j, s) + np.int64(tm[TM_SUB + SUB_W * j + S_RBITS])  # type: ignore[no-any-return]


@inline
def pay_of(tm: U64, w: U64, s: Int) -> np.uint64:
    """Payload of used global slot ``s``."""
    return get_bits(w, pay_off(tm, s), np.int64(tm[TM_PBITS]))  # type: ignore[no-any-return]


@inline
def _touch_bits(tm: U64, w: U64, off: Int, n: Int) -> None:
    """Before writing bits ``[off, off + n)`` of ``w``: its checkpoint barrier (``cow``)."""
    c = tm[TM_COW]
    cow.touch_item(c, w, off >> 6)
    cow.touch_item(c, w, (off + n - 1) >> 6)


@inline
def set_pay(tm: U64, w: U64, s: Int, pay: np.uint64) -> None:
    off = pay_off(tm, s)
    pb = np.int64(tm[TM_PBITS])
    _touch_bits(tm, w, off, pb)
    put_bits(w, off, pb, pay)


@inline
def tag_of(w: U64, s: Int) -> np.uint64:
    return (w[s >> 3] >> np.uint64(8 * (s & 7))) & _FF  # type: ignore[no-any-return]


@inline
def _set_tag(w: U64, s: Int, tag: np.uint64) -> None:
    sh = np.uint64(8 * (s & 7))
    w[s >> 3] = (w[s >> 3] & ~(_FF << sh)) | (tag << sh)


@inline
def y_of(tm: U64, w: U64, s: Int) -> np.uint64:
    """The mixed key held by used global slot ``s``."""
    j = sub_of(tm, s)
    local = s - np.int64(tm[TM_SUB + SUB_W * j + S_SLOT0])
    h = local >> np.int64(tm[TM_LOGB])
    return unsplit(tm, j, h, tag_of(w, s), rest_at(tm, w, j, s))


@inline
def key_of(tm: U64, w: U64, s: Int) -> np.uint64:
    """The key held by used global slot ``s``."""
    return unmix(tm, y_of(tm, w, s))


@inline
def holds(tm: U64, w: U64, s: Int, y: np.uint64) -> bool:
    """Whether used global slot ``s`` holds mixed key ``y`` (compares stored bits)."""
    j = sub_of(tm, s)
    h, tag, rest = split(tm, j, y)
    local = s - np.int64(tm[TM_SUB + SUB_W * j + S_SLOT0])
    if local >> np.int64(tm[TM_LOGB]) != h:
        return False
    return tag_of(w, s) == tag and rest_at(tm, w, j, s) == rest  # type: ignore[no-any-return]


@inline
def write_slot(
    tm: U64, w: U64, j: Int, s: Int, tag: np.uint64, rest: np.uint64, pay: np.uint64
) -> None:
    off = slot_off(tm, j, s)
    rb = np.int64(tm[TM_SUB + SUB_W * j + S_RBITS])
    cow.touch_item(tm[TM_COW], w, s >> 3)
    _touch_bits(tm, w, off, rb + np.int64(tm[TM_PBITS]))
    _set_tag(w, s, tag)
    put_bits(w, off, rb, rest)
    put_bits(w, off + rb, np.int64(tm[TM_PBITS]), pay)


# ---- operations ----------------------------------------------------------------------------------


@inline
def find(tm: U64, w: U64, y: np.uint64) -> Int:
    """Global slot holding mixed key ``y``, or -1."""
    b = np.int64(tm[TM_B])
    for j in range(np.int64(tm[TM_D])):
        h, tag, rest = split(tm, j, y)
        s0 = bucket_start(tm, j, h)
        for q in range(b >> 3):
            c = byte_eq(w[(s0 >> 3) + q], tag)
            while c != _ZERO:
                s = s0 + 8 * q + (ctz(c) >> 3)
                c &= c - _ONE
                if rest_at(tm, w, j, s) == rest:
                    return s
    return -1


@inline
def home_words(tm: U64, j: Int, y: np.uint64) -> tuple[Int, Int, Int]:
    """``(tag word, first data word, last data word)`` of ``y``'s bucket in subtable ``j`` (for
    prefetching: a bucket's data often spans two cache lines)."""
    h, _, _ = split(tm, j, y)
    s0 = bucket_start(tm, j, h)
    off = slot_off(tm, j, s0)
    end = off + np.int64(tm[TM_B]) * np.int64(tm[TM_SUB + SUB_W * j + S_WIDTH]) - 1
    return s0 >> 3, off >> 6, end >> 6


@inline
def find_or_insert_stable(tm: U64, w: U64, y: np.uint64, pay: np.uint64) -> tuple[Int, bool]:
    """``(slot, created)``: the slot holding mixed key ``y``, else ``y`` inserted with ``pay``
    into the least-loaded candidate bucket (ties to the lowest subtable); ``(-1, True)`` when
    absent and every candidate bucket is full (nothing changed)."""
    b = np.int64(tm[TM_B])
    best = np.int64(-1)
    best_fill = np.int64(b)
    best_s0 = np.int64(0)
    for j in range(np.int64(tm[TM_D])):
        h, tag, rest = split(tm, j, y)
        s0 = bucket_start(tm, j, h)
        f = 0
        for q in range(b >> 3):
            wd = w[(s0 >> 3) + q]
            c = byte_eq(wd, tag)
            while c != _ZERO:
                s = s0 + 8 * q + (ctz(c) >> 3)
                c &= c - _ONE
                if rest_at(tm, w, j, s) == rest:
                    return s, False
            f += popcount(wd & _H8)
        if f < best_fill:
            best_fill = np.int64(f)
            best = np.int64(j)
            best_s0 = np.int64(s0)
    if best < 0:
        return -1, True
    _, tag, rest = split(tm, best, y)
    s = first_free(w, best_s0, b)
    write_slot(tm, w, best, s, tag, rest, pay)
    tm[TM_LIVE] += _ONE
    return s, True


@inline
def _place_free(tm: U64, w: U64, j: Int, y: np.uint64, pay: np.uint64, b: Int) -> bool:
    h, tag, rest = split(tm, j, y)
    s = first_free(w, bucket_start(tm, j, h), b)
    if s < 0:
        return False
    write_slot(tm, w, j, s, tag, rest, pay)
    return True


@inline
def insert_cuckoo(tm: U64, w: U64, y: np.uint64, pay: np.uint64, walk: U64) -> bool:
    """Insert absent mixed key ``y`` (two subtables); False leaves the table exactly as before.
    ``walk`` is caller scratch of at least ``3 · tm[TM_KICKS]`` words (the undo log)."""
    b = np.int64(tm[TM_B])
    h0, t0, r0 = split(tm, 0, y)
    h1, t1, r1 = split(tm, 1, y)
    s0 = bucket_start(tm, 0, h0)
    s1 = bucket_start(tm, 1, h1)
    f0 = fill(w, s0, b)
    f1 = fill(w, s1, b)
    if f0 < b or f1 < b:
        if f0 <= f1:
            write_slot(tm, w, 0, first_free(w, s0, b), t0, r0, pay)
        else:
            write_slot(tm, w, 1, first_free(w, s1, b), t1, r1, pay)
        tm[TM_LIVE] += _ONE
        return True
    kicks = np.int64(tm[TM_KICKS])
    vshift = np.uint64(64) - tm[TM_LOGB]  # victim slot = top log2(b) bits of a random word
    side = np.int64(rng_next(tm) >> np.uint64(63))
    cy = y
    cp = pay
    for step in range(kicks):
        h, tag, rest = split(tm, side, cy)
        s = bucket_start(tm, side, h) + np.int64(rng_next(tm) >> vshift)
        vy = y_of(tm, w, s)
        vp = pay_of(tm, w, s)
        walk[3 * step] = vy
        walk[3 * step + 1] = vp
        walk[3 * step + 2] = np.uint64(s)
        write_slot(tm, w, side, s, tag, rest, cp)
        cy = vy
        cp = vp
        side = 1 - side
        if _place_free(tm, w, side, cy, cp, b):
            tm[TM_LIVE] += _ONE
            return True
    for step in range(kicks - 1, -1, -1):  # undo, newest first
        s = np.int64(walk[3 * step + 2])
        j = sub_of(tm, s)
        _, tag, rest = split(tm, j, walk[3 * step])
        write_slot(tm, w, j, s, tag, rest, walk[3 * step + 1])
    return False


@inline
def delete(tm: U64, w: U64, s: Int) -> None:
    cow.touch_item(tm[TM_COW], w, s >> 3)
    _set_tag(w, s, _ZERO)
    tm[TM_LIVE] -= _ONE


# ---- whole-table kernels (called from Python) ----------------------------------------------------


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def list_entries(tm: U64, w: U64, keys: U64, pays: U64, slots: I64) -> Int:
    """Every ``(key, payload, slot)``, in slot order."""
    n = 0
    for q in range(np.int64(tm[TM_CAP]) >> 3):
        v = w[q] & _H8
        while v != _ZERO:
            s = q * 8 + (ctz(v) >> 3)
            v &= v - _ONE
            keys[n] = key_of(tm, w, s)
            pays[n] = pay_of(tm, w, s)
            slots[n] = s
            n += 1
    return n


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def rebuild(otm: U64, ow: U64, ntm: U64, nw: U64, remap: U32, walk: U64) -> bool:
    """Move every entry into the empty table ``ntm``/``nw`` (same salt and payload width, other
    bucket counts).

    Bucket indices are monotone in the mixed key for any bucket count, so an entry's bucket in
    its own subtable of the new table is found without rehashing and the new table is written in
    order (a streaming pass, not random inserts); only entries meeting an (almost) full bucket
    take the table's insertion path. ``remap[old slot] = new slot`` for stable tables (cuckoo
    tables are not referenced, and their insertion path may move entries). False if some entry
    found no room (the new table is then garbage)."""
    b = np.int64(otm[TM_B])
    cuckoo = otm[TM_KICKS] != _ZERO
    mapped = remap.shape[0] > 0
    pb = np.int64(otm[TM_PBITS])
    # Streamed buckets of stable tables keep slack: filled to the brim they clump (d-left needs a
    # free slot among few candidates); cuckoo tables relocate instead.
    spare = 0 if cuckoo else (3 * b) >> 4
    lb = np.int64(otm[TM_LOGB])
    for j in range(np.int64(otm[TM_D])):
        o = TM_SUB + SUB_W * j
        # subtable parameters in locals: stores into the arrays would force reloads from tm
        onb = otm[o + S_NB]
        ok = otm[o + S_K]
        orb = np.int64(otm[o + S_RBITS])
        owd = np.int64(otm[o + S_WIDTH])
        os0 = np.int64(otm[o + S_SLOT0])
        ob0 = np.int64(otm[o + S_BIT0])
        nnb = ntm[o + S_NB]
        nk = ntm[o + S_K]
        nrb = np.int64(ntm[o + S_RBITS])
        nwd = np.int64(ntm[o + S_WIDTH])
        ns0 = np.int64(ntm[o + S_SLOT0])
        nb0 = np.int64(ntm[o + S_BIT0])
        moved = 0
        for q in range(os0 >> 3, (os0 + np.int64(onb) * b) >> 3):  # tag words, in slot order
            used = ow[q] & _H8
            while used != _ZERO:
                s = 8 * q + (ctz(used) >> 3)
                used &= used - _ONE
                local = s - os0
                h = local >> lb
                off = ob0 + local * owd
                tag = tag_of(ow, s)
                if owd <= 64:  # one read for the whole slot
                    v = get_bits(ow, off, owd)
                    rest = v & ((_ONE << np.uint64(orb)) - _ONE)
                    p = v >> np.uint64(orb)
                else:
                    rest = get_bits(ow, off, orb)
                    p = get_bits(ow, off + orb, pb)
                # unsplit in the old subtable, split in the new one (same rotation)
                num = (np.uint64(h) << np.uint64(32)) | ((rest >> np.uint64(25)) << ok)
                hi = (num + onb - _ONE) // onb
                qq = hi * nnb
                h2 = np.int64(qq >> np.uint64(32))
                rest2 = (((qq & _M32) >> nk) << np.uint64(25)) | (rest & _M25)
                t0 = ns0 + h2 * b
                if fill(nw, t0, b) < b - spare:
                    ns = np.int64(first_free(nw, t0, b))
                    off2 = nb0 + (ns - ns0) * nwd
                    _set_tag(nw, ns, tag)
                    if nwd <= 64:
                        put_bits(nw, off2, nwd, rest2 | (p << np.uint64(nrb)))
                    else:
                        put_bits(nw, off2, nrb, rest2)
                        put_bits(nw, off2 + nrb, pb, p)
                    moved += 1
                else:
                    ntm[TM_LIVE] += np.uint64(moved)
                    moved = 0
                    y = unsplit(otm, j, h, tag, rest)
                    if cuckoo:
                        if not insert_cuckoo(ntm, nw, y, p, walk):
                            return False
                        continue
                    placed, _ = find_or_insert_stable(ntm, nw, y, p)
                    if placed < 0:
                        return False
                    ns = np.int64(placed)
                if mapped:
                    remap[s] = np.uint32(ns)
        ntm[TM_LIVE] += np.uint64(moved)
    return True


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def repack(otm: U64, ow: U64, ntm: U64, nw: U64, remap: U32) -> None:
    """Same buckets and slots into ``ntm``/``nw`` (which may be ``otm``/``ow`` when the payload
    width is unchanged), payloads passed through ``remap`` when it is non-empty (lineage
    references after the owners table was rebuilt)."""
    mapped = remap.shape[0] > 0
    opb = np.int64(otm[TM_PBITS])
    npb = np.int64(ntm[TM_PBITS])
    b = np.int64(otm[TM_B])
    ahead = 4  # tag words: remap reads are random, prefetch them this far ahead
    for j in range(np.int64(otm[TM_D])):
        o = TM_SUB + SUB_W * j
        nbk = np.int64(otm[o + S_NB])
        rb = np.int64(otm[o + S_RBITS])
        owd = np.int64(otm[o + S_WIDTH])
        nwd = np.int64(ntm[o + S_WIDTH])
        s0j = np.int64(otm[o + S_SLOT0])
        ob0 = np.int64(otm[o + S_BIT0])
        nb0 = np.int64(ntm[o + S_BIT0])
        q0 = s0j >> 3
        q1 = (s0j + nbk * b) >> 3
        for q in range(q0, q1):  # tag words, in slot order; the tag region is unchanged
            if mapped and q + ahead < q1:
                u = ow[q + ahead] & _H8
                while u != _ZERO:
                    local = 8 * (q + ahead) + (ctz(u) >> 3) - s0j
                    u &= u - _ONE
                    prefetch(remap, np.int64(get_bits(ow, ob0 + local * owd + rb, opb)))
            nw[q] = ow[q]
            u = ow[q] & _H8
            while u != _ZERO:
                local = 8 * q + (ctz(u) >> 3) - s0j
                u &= u - _ONE
                off = ob0 + local * owd
                rest = get_bits(ow, off, rb)
                p = get_bits(ow, off + rb, opb)
                if mapped:
                    p = np.uint64(remap[np.int64(p)])
                off2 = nb0 + local * nwd
                _touch_bits(ntm, nw, off2, rb + npb)  # in place on an armed table
                put_bits(nw, off2, rb, rest)
                put_bits(nw, off2 + rb, npb, p)


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def check_entries(tm: U64, w: U64) -> Int:
    """Used slots, or -1 if the tag and data regions are not a table these kernels could have
    written: a free slot's tag byte not zero, or a used slot that a lookup of its own key would
    not find (remainder bits no key in that bucket produces, a key held twice). Any other bits
    decode to some valid key: quotienting cannot tell a flipped or moved entry from another key
    (the state file's checksum covers that)."""
    n = 0
    for q in range(np.int64(tm[TM_CAP]) >> 3):
        wd = w[q]
        used = wd & _H8
        if wd & (((~wd & _H8) >> np.uint64(7)) * _FF) != _ZERO:
            return -1
        while used != _ZERO:
            s = q * 8 + (ctz(used) >> 3)
            used &= used - _ONE
            if find(tm, w, y_of(tm, w, s)) != s:
                return -1
            n += 1
    return n


@njit(cache=True, _nrt=False)  # type: ignore[misc,call-overload,untyped-decorator]
def count_payloads_range(tm: U64, w: U64, counts: U32, q0: Int, q1: Int) -> bool:
    """``counts[payload] += 1`` per entry in tag words ``[q0, q1)`` (lineage: edges per owner
    slot); False, with counts partly added, if a payload is not an index of ``counts``."""
    n = counts.shape[0]
    nw = np.int64(tm[TM_CAP]) >> 3
    for q in range(clamp(q0, 0, nw), clamp(q1, 0, nw)):
        v = w[q] & _H8
        while v != _ZERO:
            s = q * 8 + (ctz(v) >> 3)
            v &= v - _ONE
            p = pay_of(tm, w, s)
            if p >= np.uint64(n):
                return False
            counts[np.int64(p)] += np.uint32(1)
    return True


def count_payloads(tm: U64, w: U64, counts: U32) -> bool:
    """:func:`count_payloads_range` over the whole table."""
    return bool(count_payloads_range(tm, w, counts, 0, int(tm[TM_CAP]) >> 3))


# ---- Python side ---------------------------------------------------------------------------------


class Scratch:
    """Caller-owned buffers for the table kernels (they run without numba's runtime)."""

    __slots__ = ("no_remap", "walk")

    def __init__(self, kicks: int) -> None:
        self.walk = np.zeros(3 * max(kicks, 1), dtype=np.uint64)  # cuckoo walk undo log
        self.no_remap = np.zeros(0, dtype=np.uint32)


def slot_bits(nb: int, pbits: int) -> int:
    """Bits one slot of a subtable of ``nb`` buckets costs (tag byte + rest + payload)."""
    return 8 + 57 - (nb.bit_length() - 1) + pbits


class PackedTable:
    """The two arrays of one packed table plus its shape (see the module docstring)."""

    __slots__ = ("b", "bounds", "d", "kicks", "pbits", "salt", "tm", "w")

    def __init__(
        self, d: int, b: int, pbits: int, nbs: list[int], salt: int, kicks: int = 0
    ) -> None:
        if not 1 <= d <= MAX_D or len(nbs) != d or b not in (8, 16, 32, 64):
            raise ValueError("bad packed table shape")
        if kicks and d != 2:
            raise ValueError("cuckoo tables have two subtables")
        if not 1 <= pbits <= 32 or not all(1 <= nb <= MAX_NB for nb in nbs):
            raise ValueError("bad packed table size")
        self.d, self.b, self.pbits, self.kicks, self.salt = d, b, pbits, kicks, salt
        cap = sum(nbs) * b
        tm = np.zeros(TM_LEN, dtype=np.uint64)
        tm[TM_D], tm[TM_B], tm[TM_PBITS], tm[TM_KICKS], tm[TM_CAP] = d, b, pbits, kicks, cap
        tm[TM_LOGB] = b.bit_length() - 1
        state, rng = splitmix_next(salt)
        tm[TM_RNG] = rng | 1
        state, tm[TM_SALT] = splitmix_next(state)
        slot0 = 0
        word = cap // 8  # data after the tag region
        for j, nb in enumerate(nbs):
            k = nb.bit_length() - 1
            rbits = 57 - k
            o = TM_SUB + SUB_W * j
            tm[o + S_NB], tm[o + S_K], tm[o + S_RBITS] = nb, k, rbits
            tm[o + S_WIDTH], tm[o + S_SLOT0], tm[o + S_BIT0] = rbits + pbits, slot0, word * 64
            tm[o + S_ROT] = j * (64 // d)
            slot0 += nb * b
            word += -(-(nb * b * (rbits + pbits)) // 64)
        self.tm = tm
        self.w = np.zeros(word, dtype=np.uint64)
        #: live-entry range ``(lo, hi)`` its owner keeps it in (resize outside); set by the owner
        self.bounds = (0, cap)

    @property
    def nbs(self) -> list[int]:
        return [int(self.tm[TM_SUB + SUB_W * j + S_NB]) for j in range(self.d)]

    @property
    def nb0(self) -> int:
        return int(self.tm[TM_SUB + S_NB])

    @property
    def live(self) -> int:
        return int(self.tm[TM_LIVE])

    @property
    def cap(self) -> int:
        return int(self.tm[TM_CAP])

    @property
    def nbytes(self) -> int:
        return int(self.tm.nbytes + self.w.nbytes)

    def empty_like(self, nbs: list[int], pbits: int | None = None) -> PackedTable:
        """An empty table with the same salt and policy, other bucket counts / payload width."""
        t = PackedTable(
            self.d, self.b, self.pbits if pbits is None else pbits, nbs, self.salt, self.kicks
        )
        t.tm[TM_RNG] = self.tm[TM_RNG]
        if nbs == self.nbs:
            t.bounds = self.bounds
        return t

    def repacked(self, pbits: int, remap: U32) -> PackedTable:
        """The same entries in the same slots with a ``pbits``-wide payload, mapped by
        ``remap`` (empty: unchanged); in place when the width does not change and no checkpoint
        is reading the table."""
        if pbits == self.pbits and self.tm[TM_COW] == 0:
            repack(self.tm, self.w, self.tm, self.w, remap)
            return self
        # (an armed table is rewritten into a new one: in place, every chunk would be captured)
        t = self.empty_like(self.nbs, pbits)
        t.tm[TM_LIVE] = self.tm[TM_LIVE]
        repack(self.tm, self.w, t.tm, t.w, remap)
        return t

    def rebuilt(self, nbs: list[int], sc: Scratch, remap: U32 | None = None) -> PackedTable | None:
        """The entries moved into an empty table of ``nbs`` buckets per subtable (``remap``, if
        given, gets old → new slots; stable tables only), or None if some entry had no room."""
        t = self.empty_like(nbs)
        if remap is None:
            remap = sc.no_remap
        elif self.kicks:
            raise ValueError("cuckoo tables move entries: nothing may refer to their slots")
        return t if rebuild(self.tm, self.w, t.tm, t.w, remap, sc.walk) else None

    @classmethod
    def restored(
        cls, d: int, b: int, pbits: int, kicks: int, salt: int, tm: U64, w: U64
    ) -> PackedTable:
        """The table held by exported arrays ``tm``/``w`` (taken, not copied), after checks that
        they are exactly what a table of this shape, payload width, policy and salt (with one
        bucket count for all subtables, as ``sizing`` keeps them) could hold; ValueError if not."""
        if tm.dtype != np.uint64 or tm.shape != (TM_LEN,) or w.dtype != np.uint64 or w.ndim != 1:
            raise ValueError("packed table arrays of the wrong type or shape")
        nb = int(tm[TM_SUB + S_NB])
        k = nb.bit_length() - 1
        words = nb * d * b // 8 + d * -(-(nb * b * (57 - k + pbits)) // 64)
        if not 1 <= nb <= MAX_NB or words != w.shape[0]:
            raise ValueError("packed table size disagrees with its arrays")
        t = cls(d, b, pbits, [nb] * d, salt, kicks)
        shape = np.ones(TM_LEN, dtype=np.bool_)
        shape[[TM_LIVE, TM_RNG]] = False  # the only words that change after construction
        if not np.array_equal(t.tm[shape], tm[shape]) or (kicks and tm[TM_RNG] == 0):
            raise ValueError("packed table shape or salt disagrees with the layout")
        if check_entries(tm, w) != int(tm[TM_LIVE]):
            raise ValueError("packed table entries are not a table this layout writes")
        t.tm, t.w = tm, w
        return t

    def entries(self) -> tuple[U64, U64, I64]:
        """``(keys, payloads, slots)`` of every entry, in slot order."""
        n = self.live
        keys = np.empty(n, dtype=np.uint64)
        pays = np.empty(n, dtype=np.uint64)
        slots = np.empty(n, dtype=np.int64)
        list_entries(self.tm, self.w, keys, pays, slots)
        return keys, pays, slots
