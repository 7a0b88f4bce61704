"""Packed quotient tables against plain Python: bit fields, SWAR tag compares and bit scans,
quotienting round trips at every kind of bucket count, random operation histories of both
insertion policies against a dict (including full buckets and failed inserts, which must leave
the arrays bit for bit unchanged), and rebuilds / repacks with their slot remaps."""

from __future__ import annotations

import random

import numpy as np
import pytest
from numba import njit

from kvrelay.pool import packed as pk
from kvrelay.pool.bitops import ctz, popcount

M64 = (1 << 64) - 1


# ---- numba drivers (the table operations are inline kernels, callable from numba only; not
# cached: numba would keep a driver compiled against an older version of the kernels it inlines)


@njit(cache=False)
def _bits_ops(a, offs, widths, vals, out):  # type: ignore[no-untyped-def]
    for i in range(offs.shape[0]):
        pk.put_bits(a, offs[i], widths[i], vals[i])
    for i in range(offs.shape[0]):
        out[i] = pk.get_bits(a, offs[i], widths[i])


@njit(cache=False)
def _swar(words, tags, eq, used):  # type: ignore[no-untyped-def]
    for i in range(words.shape[0]):
        eq[i] = pk.byte_eq(words[i], tags[i])
        used[i] = words[i] & np.uint64(0x8080808080808080)


@njit(cache=False)
def _scan(vals, tz, pc):  # type: ignore[no-untyped-def]
    for i in range(vals.shape[0]):
        tz[i] = ctz(vals[i])
        pc[i] = popcount(vals[i])


@njit(cache=False)
def _round_trip(tm, j, xs, hs, out):  # type: ignore[no-untyped-def]
    for i in range(xs.shape[0]):
        h, tag, rest = pk.locate(tm, j, xs[i])
        hs[i] = h
        out[i] = pk.key_at(tm, j, h, tag, rest)


@njit(cache=False)
def _ops(tm, w, kinds, keys, pays, walk, out):  # type: ignore[no-untyped-def]
    """kinds: 0 insert (if absent), 1 delete (if present), 2 find → out: slot, -1 or -2."""
    for i in range(kinds.shape[0]):
        y = pk.mix(tm, keys[i])
        s = pk.find(tm, w, y)
        if kinds[i] == 0:
            if s >= 0:
                out[i] = -2
            elif tm[pk.TM_KICKS] != np.uint64(0):
                out[i] = 1 if pk.insert_cuckoo(tm, w, y, pays[i], walk) else -1
            else:
                placed, created = pk.find_or_insert_stable(tm, w, y, pays[i])
                out[i] = placed if created else -3
        elif kinds[i] == 1:
            if s >= 0:
                pk.delete(tm, w, s)
            out[i] = s
        else:
            out[i] = -1 if s < 0 else np.int64(pk.pay_of(tm, w, s))


def _apply_ops(t: pk.PackedTable, kinds: list[int], keys: list[int], pays: list[int]) -> np.ndarray:
    out = np.zeros(len(kinds), dtype=np.int64)
    walk = np.zeros(3 * max(t.kicks, 1), dtype=np.uint64)
    _ops(
        t.tm, t.w, np.asarray(kinds, np.int64), np.asarray(keys, np.uint64),
        np.asarray(pays, np.uint64), walk, out,
    )  # fmt: skip
    return out


def _contents(t: pk.PackedTable) -> dict[int, int]:
    keys, pays, _ = t.entries()
    assert len(set(keys.tolist())) == keys.size
    return dict(zip(keys.tolist(), pays.tolist(), strict=True))


# ---- bit level ----------------------------------------------------------------------------------


def test_bit_fields_match_a_big_integer_model() -> None:
    rng = random.Random(1)
    a = np.zeros(8, dtype=np.uint64)
    model = 0
    offs, widths, vals = [], [], []
    pos = 0
    while True:
        n = rng.choice([1, 7, 25, 31, 32, 33, 57, 63, 64])
        if pos + n > 8 * 64:
            break
        v = rng.getrandbits(n)
        offs.append(pos)
        widths.append(n)
        vals.append(v)
        model |= v << pos
        pos += n
    out = np.zeros(len(offs), dtype=np.uint64)
    _bits_ops(a, np.asarray(offs), np.asarray(widths), np.asarray(vals, np.uint64), out)
    assert out.tolist() == vals
    assert sum(int(x) << (64 * i) for i, x in enumerate(a.tolist())) == model
    # overwrite a field that straddles a word boundary: neighbours keep their bits
    i = next(k for k in range(len(offs)) if offs[k] // 64 != (offs[k] + widths[k] - 1) // 64)
    new = (1 << widths[i]) - 1 - vals[i]
    _bits_ops(
        a, np.asarray([offs[i]]), np.asarray([widths[i]]), np.asarray([new], np.uint64), out[:1]
    )
    mask = ((1 << widths[i]) - 1) << offs[i]
    model = (model & ~mask) | (new << offs[i])
    assert sum(int(x) << (64 * k) for k, x in enumerate(a.tolist())) == model


def test_swar_byte_compare_is_exact() -> None:
    rng = random.Random(2)
    words, tags = [], []
    for pattern in range(256):  # every set of equal bytes, other bytes one bit away or random
        t = rng.randrange(128, 256)
        bs = [
            t if pattern >> i & 1 else rng.choice([t ^ 1, t ^ 0x80, rng.randrange(256)])
            for i in range(8)
        ]
        words.append(sum(b << (8 * i) for i, b in enumerate(bs)))
        tags.append(t)
    eq = np.zeros(256, dtype=np.uint64)
    used = np.zeros(256, dtype=np.uint64)
    _swar(np.asarray(words, np.uint64), np.asarray(tags, np.uint64), eq, used)
    for w, t, e, u in zip(words, tags, eq.tolist(), used.tolist(), strict=True):
        bs = [(w >> (8 * i)) & 0xFF for i in range(8)]
        assert e == sum(1 << (8 * i + 7) for i, b in enumerate(bs) if b == t)
        assert u == sum(1 << (8 * i + 7) for i, b in enumerate(bs) if b & 0x80)


def test_ctz_and_popcount() -> None:
    rng = random.Random(3)
    vals = [1 << i for i in range(64)] + [
        rng.getrandbits(64) | 1 << rng.randrange(64) for _ in range(200)
    ]
    tz = np.zeros(len(vals), dtype=np.int64)
    pc = np.zeros(len(vals), dtype=np.int64)
    _scan(np.asarray(vals, np.uint64), tz, pc)
    assert tz.tolist() == [(v & -v).bit_length() - 1 for v in vals]
    assert pc.tolist() == [bin(v).count("1") for v in vals]


# ---- quotienting --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nb", [1, 2, 3, 7, 8, 9, 1000, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, (1 << 20) + 7, pk.MAX_NB]
)
def test_quotient_round_trip_and_bucket_range(nb: int) -> None:
    tm = pk.PackedTable(2, 8, 4, [1, 1], salt=nb).tm  # addressing reads only nb, k and salt
    for j in range(2):
        tm[pk.TM_SUB + pk.SUB_W * j + pk.S_NB] = nb
        tm[pk.TM_SUB + pk.SUB_W * j + pk.S_K] = nb.bit_length() - 1
    rng = np.random.default_rng(nb)
    xs = np.concatenate(
        [
            rng.integers(0, 2**64, 5000, dtype=np.uint64),
            np.arange(2000, dtype=np.uint64),  # structured keys, as engines may send
            np.array([0, M64, 1 << 63, (1 << 32) - 1, 1 << 32], dtype=np.uint64),
        ]
    )
    for j in range(2):
        hs = np.zeros(xs.size, dtype=np.int64)
        out = np.zeros_like(xs)
        _round_trip(tm, j, xs, hs, out)
        assert np.array_equal(out, xs)
        assert hs.min() >= 0 and hs.max() < nb
    assert pk.slot_bits(nb, 4) == 8 + 57 - (nb.bit_length() - 1) + 4


# ---- operations vs a dict -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("d", "b", "kicks", "pbits"), [(2, 8, 64, 21), (2, 8, 2, 1), (3, 16, 0, 4), (1, 8, 0, 32)]
)
@pytest.mark.parametrize("nb", [1, 2, 5, 64])
def test_random_histories_match_a_dict(d: int, b: int, kicks: int, pbits: int, nb: int) -> None:
    rng = random.Random(nb * 31 + d)
    t = pk.PackedTable(d, b, pbits, [nb] * d, salt=rng.getrandbits(64), kicks=kicks)
    model: dict[int, int] = {}
    universe = [rng.getrandbits(64) for _ in range(t.cap)] + list(range(t.cap))
    failures = 0
    most = 0
    for _round in range(6):
        kinds = [rng.choice([0, 0, 0, 1, 2]) for _ in range(t.cap)]
        keys = [rng.choice(universe) for _ in kinds]
        pays = [rng.getrandbits(pbits) for _ in kinds]
        out = _apply_ops(t, kinds, keys, pays).tolist()
        for k, x, p, r in zip(kinds, keys, pays, out, strict=True):
            if k == 0:
                if x in model:
                    assert r in (-2, -3)
                elif r == -1:
                    failures += 1  # no room: checked below, the table holds exactly the model
                else:
                    model[x] = p
            elif k == 1:
                assert (r >= 0) == (x in model)
                model.pop(x, None)
            else:
                assert r == model.get(x, -1)
        assert _contents(t) == model
        assert t.live == len(model)
        most = max(most, t.live)
    assert most >= 0.9 * t.cap  # the histories reach (nearly) full buckets


@pytest.mark.parametrize("kicks", [0, 1, 16])
def test_failed_insert_leaves_the_arrays_unchanged(kicks: int) -> None:
    d, b = (2, 8) if kicks else (3, 16)
    t = pk.PackedTable(d, b, 8, [2] * d, salt=5, kicks=kicks)
    rng = random.Random(kicks)
    fails = 0
    for _ in range(200):
        x = rng.getrandbits(64)
        before_w, before_live = t.w.copy(), t.live
        r = _apply_ops(t, [0], [x], [rng.getrandbits(8)])[0]
        if r == -1:
            fails += 1
            assert np.array_equal(t.w, before_w) and t.live == before_live
    assert fails > 0 and t.live <= t.cap


# ---- rebuild and repack -------------------------------------------------------------------------


def _filled(d: int, b: int, kicks: int, pbits: int, nb: int, n: int, seed: int) -> pk.PackedTable:
    t = pk.PackedTable(d, b, pbits, [nb] * d, salt=seed, kicks=kicks)
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(n)]
    out = _apply_ops(t, [0] * n, keys, [rng.getrandbits(pbits) for _ in range(n)])
    assert (out != -1).all()
    return t


@pytest.mark.parametrize("new_nb", [40, 46, 200, 23])
def test_stable_rebuild_moves_every_entry_and_remaps_slots(new_nb: int) -> None:
    t = _filled(3, 16, 0, 4, 40, 1700, seed=new_nb)  # ~89% full
    before = _contents(t)
    keys, _, slots = t.entries()
    remap = np.zeros(t.cap, dtype=np.uint32)
    new = t.rebuilt([new_nb] * 3, pk.Scratch(0), remap)
    if new_nb * 48 < len(before):
        assert new is None  # cannot fit: reported, the old table is untouched
        assert _contents(t) == before
        return
    assert new is not None and _contents(new) == before and new.live == t.live
    nkeys, _, nslots = new.entries()
    at = dict(zip(nslots.tolist(), nkeys.tolist(), strict=True))
    for k, s in zip(keys.tolist(), slots.tolist(), strict=True):
        assert at[int(remap[s])] == k


@pytest.mark.parametrize("new_nb", [30, 60, 13])
def test_cuckoo_rebuild_keeps_every_entry(new_nb: int) -> None:
    t = _filled(2, 8, 64, 20, 30, 460, seed=new_nb)  # ~96% full
    before = _contents(t)
    new = t.rebuilt([new_nb] * 2, pk.Scratch(64))
    if new_nb * 16 < len(before):
        assert new is None and _contents(t) == before
        return
    assert new is not None and _contents(new) == before
    with pytest.raises(ValueError):
        t.rebuilt([new_nb] * 2, pk.Scratch(64), np.zeros(t.cap, dtype=np.uint32))


@pytest.mark.parametrize("pbits", [20, 21, 25])
def test_repack_maps_payloads_in_place_or_into_a_wider_table(pbits: int) -> None:
    t = _filled(2, 8, 64, 20, 30, 400, seed=pbits)
    before = _contents(t)
    rng = np.random.default_rng(pbits)
    remap = rng.integers(0, 1 << 20, 1 << 20, dtype=np.uint32)
    new = t.repacked(pbits, remap)
    assert (new is t) == (pbits == 20)
    assert _contents(new) == {k: int(remap[v]) for k, v in before.items()}
    same = new.repacked(pbits, np.zeros(0, dtype=np.uint32))
    assert _contents(same) == _contents(new)


# ---- restore from exported arrays ---------------------------------------------------------------


@njit(cache=False)
def _copy_entry(tm, w, s, h):  # type: ignore[no-untyped-def]
    """Copy used slot ``s`` (tag, rest, payload) into the first free slot of its bucket ``h``:
    the same key held twice. (An entry moved to another bucket is just another key: quotienting
    makes the position part of the key.)"""
    j = pk.sub_of(tm, s)
    tag = pk.tag_of(w, s)
    rest = pk.rest_at(tm, w, j, s)
    pay = pk.pay_of(tm, w, s)
    f = pk.first_free(w, pk.bucket_start(tm, j, h), np.int64(tm[pk.TM_B]))
    pk.write_slot(tm, w, j, f, tag, rest, pay)
    tm[pk.TM_LIVE] += np.uint64(1)
    return f


@njit(cache=False)
def _bucket_of(tm, s):  # type: ignore[no-untyped-def]
    j = pk.sub_of(tm, s)
    return (s - np.int64(tm[pk.TM_SUB + pk.SUB_W * j + pk.S_SLOT0])) >> np.int64(tm[pk.TM_LOGB])


@pytest.mark.parametrize(("d", "b", "kicks", "pbits"), [(3, 16, 0, 4), (2, 8, 64, 13)])
def test_restored_takes_exactly_the_tables_this_layout_writes(
    d: int, b: int, kicks: int, pbits: int
) -> None:
    nb = 37
    t = _filled(d, b, kicks, pbits, nb, nb * d * b * 3 // 4, seed=11)
    r = pk.PackedTable.restored(d, b, pbits, kicks, 11, t.tm.copy(), t.w.copy())
    assert _contents(r) == _contents(t) and r.nbs == t.nbs and r.salt == t.salt
    used = np.flatnonzero(t.w.view(np.uint8)[: t.cap] & 0x80)
    free = np.flatnonzero((t.w.view(np.uint8)[: t.cap] & 0x80) == 0)
    s = int(used[0])
    h = int(_bucket_of(t.tm, s))

    def dup(tm: np.ndarray, w: np.ndarray) -> None:
        _copy_entry(tm, w, s, h)

    def dirty_free_tag(tm: np.ndarray, w: np.ndarray) -> None:
        w.view(np.uint8)[int(free[0])] = 0x05

    def live_off(tm: np.ndarray, w: np.ndarray) -> None:
        tm[pk.TM_LIVE] += 1

    def other_salt(tm: np.ndarray, w: np.ndarray) -> None:
        tm[pk.TM_SALT] ^= 1

    def other_width(tm: np.ndarray, w: np.ndarray) -> None:
        tm[pk.TM_PBITS] += 1

    cases = {dup: "entries are not", dirty_free_tag: "entries are not", live_off: "entries are not",
             other_salt: "shape or salt", other_width: "shape or salt"}  # fmt: skip
    for damage, why in cases.items():
        tm, w = t.tm.copy(), t.w.copy()
        damage(tm, w)
        with pytest.raises(ValueError, match=why):
            pk.PackedTable.restored(d, b, pbits, kicks, 11, tm, w)
    with pytest.raises(ValueError, match="size disagrees"):
        pk.PackedTable.restored(d, b, pbits, kicks, 11, t.tm.copy(), t.w[:-1].copy())
    with pytest.raises(ValueError, match="shape or salt"):  # another table's salt
        pk.PackedTable.restored(d, b, pbits, kicks, 12, t.tm.copy(), t.w.copy())
    with pytest.raises(ValueError, match="wrong type"):
        pk.PackedTable.restored(d, b, pbits, kicks, 11, t.tm.astype(np.int64), t.w.copy())
