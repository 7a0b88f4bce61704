"""Pure-Python reference model of the pool (the oracle for the numba kernels).

Independent of ``kvrelay``: hashing via the ``xxhash`` package, dict-based exact state, a naive
list-of-slots cuckoo filter with the §6.3 addressing and the §6.4 insert/kick/rollback rules, and
the §8.2 event semantics. It reads ``EventBatch`` arrays (the shared interface) directly.

Duplicate stores (docs/contract.md): a store of a hash the member already holds is one more
physical copy (a later remove drops a copy, the last remove the block) unless it is a report:
the engine says so (``origin``), or, with ``reports`` on, the store has no parent and every block
of it is held (a report names a cache hit, a prefix from block 0); that last case is ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvrelay.pool.batch import EventBatch

M64 = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN = 0x9E3779B97F4A7C15

OK, PARENT, INVALID, TOKENS, BAD_OP = 0, 1, 2, 3, 4
NEW, REPORT = 1, 2  # EventBatch.origin values
MAX_COPIES = 1 << 24


def xxh(data: bytes, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=seed & M64)


def splitmix(state: int) -> tuple[int, int]:
    s = (state + GOLDEN) & M64
    z = s
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return s, z ^ (z >> 31)


def lora_salt(name: str | None, namespace: str | None = None) -> int:
    s = 1337
    if name:
        s = (s + xxh(name.encode(), 0)) & M64
    if namespace:
        s = (s + xxh(namespace.encode(), 1)) & M64
    return s


def chain(prev: int, bh: int) -> int:
    return xxh(prev.to_bytes(8, "little") + bh.to_bytes(8, "little"), 1337)


class RefCKF:
    """Naive CKF: a list of 4-slot lists."""

    def __init__(self, bucket_count: int, seed: int) -> None:
        self.n = bucket_count
        self.mask = bucket_count - 1
        self.seed = seed
        self.b: list[list[int]] = [[0, 0, 0, 0] for _ in range(bucket_count)]
        _, self.rng = splitmix((seed ^ GOLDEN) & M64)  # lane 0 initial state

    def _next(self) -> int:
        self.rng, out = splitmix(self.rng)
        return out

    def delta(self, fp: int) -> int:
        d = xxh(fp.to_bytes(2, "little"), self.seed ^ GOLDEN) & self.mask
        return d or 1

    def addr(self, h: int) -> tuple[int, int, int]:
        mixed = xxh(h.to_bytes(8, "little"), self.seed)
        fp = (mixed & 0xFFFF) or 1
        a = (mixed >> 16) & self.mask
        return fp, a, a ^ self.delta(fp)

    def contains(self, h: int) -> bool:
        fp, a, b = self.addr(h)
        return fp in self.b[a] or fp in self.b[b]

    def insert(self, h: int, max_kicks: int) -> bool:
        fp, a, b = self.addr(h)
        for bk in (a, b):
            if 0 in self.b[bk]:
                self.b[bk][self.b[bk].index(0)] = fp
                return True
        if max_kicks <= 0:
            return False
        saved = [list(x) for x in self.b]
        cur = a if self._next() & 1 == 0 else b
        carried = fp
        for _ in range(max_kicks):
            s = self._next() & 3
            carried, self.b[cur][s] = self.b[cur][s], carried
            cur ^= self.delta(carried)
            if 0 in self.b[cur]:
                self.b[cur][self.b[cur].index(0)] = carried
                return True
        self.b = saved
        return False

    def remove(self, h: int) -> bool:
        fp, a, b = self.addr(h)
        for bk in (a, b):
            if fp in self.b[bk]:
                self.b[bk][self.b[bk].index(fp)] = 0
                return True
        return False

    def words(self) -> np.ndarray:
        return np.array(
            [s[0] | (s[1] << 16) | (s[2] << 32) | (s[3] << 48) for s in self.b], dtype=np.uint64
        )


@dataclass
class Counts:
    applied: int = 0
    rejected: int = 0
    stored: int = 0
    removed: int = 0
    unknown: int = 0
    capacity: int = 0
    duplicate: int = 0
    report: int = 0
    ambiguous: int = 0
    copy_removed: int = 0
    codes: list[int] = field(default_factory=list)


class RefPool:
    def __init__(
        self,
        bucket_count: int,
        seed: int,
        block_size: int,
        fmt: int,
        max_kicks: int,
        reports: bool = False,
    ) -> None:
        self.ckf = RefCKF(bucket_count, seed)
        self.bs = block_size
        self.eagle = fmt == 2
        self.max_kicks = max_kicks
        self.reports = reports
        self.lineage: dict[int, dict[int, int]] = {}
        self.copies: dict[int, dict[int, int]] = {}  # member -> ext -> physical copies (>= 2)
        self.ns: dict[int, dict[int, int]] = {}
        self.owners: dict[int, list[int]] = {}  # canon -> [count, resident(0/1)]

    def _mem(self, m: int) -> dict[int, int]:
        self.ns.setdefault(m, {})
        self.copies.setdefault(m, {})
        return self.lineage.setdefault(m, {})

    def _drop(self, canon: int) -> None:
        o = self.owners[canon]
        if o[0] > 1:
            o[0] -= 1
            return
        if o[1]:
            assert self.ckf.remove(canon), "model invariant"
        del self.owners[canon]

    def clear(self, m: int, c: Counts) -> None:
        lin = self._mem(m)
        for e in sorted(lin):
            self._drop(lin[e])
            c.removed += 1
        lin.clear()
        self.ns[m].clear()
        self.copies[m].clear()

    def _block_hash(self, b: EventBatch, g: int, start: int, win: int, seed: int) -> int:
        data = b.tokens[start : start + win].astype("<u4").tobytes()
        if b.mm_off.shape[0]:
            vals = sorted(int(v) for v in b.mm[b.mm_off[g] : b.mm_off[g + 1]])
            data += b"".join(v.to_bytes(8, "little") for v in vals)
        return xxh(data, seed)

    def _store(self, m: int, b: EventBatch, i: int, c: Counts) -> int:
        lin = self._mem(m)
        nsm = self.ns[m]
        exts = [int(x) for x in b.ext_hashes[b.blk_off[i] : b.blk_off[i + 1]]]
        k = len(exts)
        hp = bool(b.has_parent[i])
        par = int(b.parent[i])
        prev, pns = 0, 0
        if hp:
            if par not in lin:
                return PARENT
            prev = lin[par]
            if b.ns_inherit[i]:
                pns = nsm.get(par, 0)
        if k == 0:
            return OK
        ntok = int(b.tok_off[i + 1] - b.tok_off[i])
        if ntok != k * self.bs + (1 if self.eagle else 0):
            return TOKENS
        if (hp and par in exts) or len(set(exts)) != k:
            return INVALID
        seed = (int(b.salt[i]) + pns) & M64
        ns_blk = int(b.ns_part[i]) or pns
        win = self.bs + 1 if self.eagle else self.bs
        canons = []
        for j, e in enumerate(exts):
            g = int(b.blk_off[i]) + j
            bh = self._block_hash(b, g, int(b.tok_off[i]) + j * self.bs, win, seed)
            cval = bh if (j == 0 and not hp) else chain(prev, bh)
            if e in lin and lin[e] != cval:
                return INVALID
            canons.append(cval)
            prev = cval
        held = sum(1 for e in exts if e in lin)
        org = int(b.origin[i]) if b.origin.shape[0] else 0
        if org == NEW or (org != REPORT and (not self.reports or hp)):
            copies = True
        else:
            copies = False
            if held and org != REPORT:
                c.ambiguous += 1
        cnt = self.copies[m]
        if held and copies and any(cnt.get(e, 1) >= MAX_COPIES for e in exts if e in lin):
            return INVALID
        for e, cval in zip(exts, canons, strict=True):
            if e in lin:
                if copies:
                    cnt[e] = cnt.get(e, 1) + 1
                    c.duplicate += 1
                else:
                    c.report += 1
                o = self.owners[cval]
                if not o[1] and self.ckf.insert(cval, 0):
                    o[1] = 1
                continue
            o = self.owners.setdefault(cval, [0, 0])
            first = o[0] == 0
            o[0] += 1
            lin[e] = cval
            if ns_blk:
                nsm[e] = ns_blk
            c.stored += 1
            if not o[1]:
                if self.ckf.insert(cval, self.max_kicks if first else 0):
                    o[1] = 1
                elif first:
                    c.capacity += 1
        return OK

    def apply(self, m: int, b: EventBatch) -> Counts:
        c = Counts()
        for i in range(b.ops.shape[0]):
            op = int(b.ops[i])
            code = OK
            if op == 0:
                code = self._store(m, b, i, c)
            elif op == 1:
                lin = self._mem(m)
                for e in (int(x) for x in b.ext_hashes[b.blk_off[i] : b.blk_off[i + 1]]):
                    if e not in lin:
                        c.unknown += 1
                        continue
                    cnt = self.copies[m]
                    if cnt.get(e, 1) > 1:  # one of several physical copies: the block stays
                        cnt[e] -= 1
                        if cnt[e] == 1:
                            del cnt[e]
                        c.copy_removed += 1
                        continue
                    self._drop(lin.pop(e))
                    self.ns[m].pop(e, None)
                    c.removed += 1
            elif op == 2:
                self.clear(m, c)
            else:
                code = BAD_OP
            c.codes.append(code)
            if code == OK:
                c.applied += 1
            else:
                c.rejected += 1
        return c

    def owned(self, m: int) -> set[int]:
        return set(self._mem(m).values())

    def resident(self, m: int) -> set[int]:
        return {h for h in self.owned(m) if self.owners[h][1]}
