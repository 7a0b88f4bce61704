"""The normalized event batch: the one typed interface between ``ingest`` and ``pool``.

One ``EventBatch`` is one decoded engine message (one ZMQ batch) for one member
``(worker_id, dp_rank)``. Everything is a flat numpy array so that the pool applies the whole batch
in a single numba call. Ingest has already gated tiers, locality, groups, placeholders and block
size, converted hashes to u64 and sliced token windows exactly; the pool re-validates what it
relies on and rejects bad events with typed errors.

Layout (``n`` events, ``b`` block hashes in total):

* ``ops[n]`` (uint8): ``OP_STORE``, ``OP_REMOVE`` or ``OP_CLEAR``.
* ``parent[n]`` (uint64) / ``has_parent[n]`` (bool): the store's external parent hash.
* ``salt[n]`` (uint64): the block-hash seed of §7.1 for the event, LoRA (and, when namespacing is
  enabled, an explicit cache namespace) already folded in. Unused for removes and clears.
* ``ns_part[n]`` (uint64): the cache-namespace component already inside ``salt`` (0 when none).
* ``ns_inherit[n]`` (bool): the store has a parent and no namespace of its own, so it takes the
  namespace component recorded for its parent in the member's chain, if any (vLLM sends
  ``cache_salt`` only in the block at token 0, and a producer may put an explicit salt on a
  request's first store only). As Dynamo does, whether namespacing is on or off.
* ``blk_off[n+1]`` (int64): event ``i`` owns ``ext_hashes[blk_off[i]:blk_off[i+1]]``: the stored
  blocks (in chain order) for a store, the removed hashes for a remove, nothing for a clear.
* ``ext_hashes[b]`` (uint64): vLLM's block hashes as u64 (opaque lineage keys).
* ``tok_off[n+1]`` (int64): event ``i`` owns ``tokens[tok_off[i]:tok_off[i+1]]``. A store of ``k``
  blocks has exactly ``k*B`` tokens (DYNAMO_STANDARD_V1) or ``k*B+1`` (DYNAMO_EAGLE_V1).
* ``tokens`` (uint32).
* ``mm_off[b+1]`` (int64) / ``mm`` (uint64): per-block multimodal hashes, sorted ascending, appended
  to the block bytes (§7.2). Empty arrays (``mm_off`` of length 0) mean "no multimodal data".
* ``origin[n]`` (uint8) or empty: what the engine says a store is, ``ORIGIN_NEW`` (new physical
  blocks) or ``ORIGIN_REPORT`` (a report of blocks it already holds), ``ORIGIN_UNKNOWN`` (0) when
  it says nothing; an empty array (the usual case) means unknown for every event. The pool
  infers what it is not told (docs/contract.md, "Duplicate stores").

A ``PackedBatch`` is the same batch where the decoder's walker wrote it: every array at a fixed
offset in one byte buffer. The pool applies it in one kernel call that takes the buffer and the
offsets, so no per-array view is built in Python; anything that needs more than that call
(``unpack``) sees it as the ``EventBatch`` it describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

OP_STORE = 0
OP_REMOVE = 1
OP_CLEAR = 2

ORIGIN_UNKNOWN = 0
ORIGIN_NEW = 1
ORIGIN_REPORT = 2

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


# One shared empty array per optional field: nothing can write into an array of length 0, and a
# batch without multimodal data or origins (nearly every batch) then allocates nothing for them.
_NO_MM_OFF = np.zeros(0, dtype=np.int64)
_NO_MM = np.zeros(0, dtype=np.uint64)
_NO_ORIGIN = np.zeros(0, dtype=np.uint8)


@dataclass(slots=True)
class EventBatch:
    """Flat arrays for one engine message (see module docstring for the layout)."""

    ops: npt.NDArray[np.uint8]
    parent: U64
    has_parent: npt.NDArray[np.bool_]
    salt: U64
    ns_part: U64
    ns_inherit: npt.NDArray[np.bool_]
    blk_off: I64
    ext_hashes: U64
    tok_off: I64
    tokens: npt.NDArray[np.uint32]
    mm_off: I64 = field(default_factory=lambda: _NO_MM_OFF)
    mm: U64 = field(default_factory=lambda: _NO_MM)
    origin: npt.NDArray[np.uint8] = field(default_factory=lambda: _NO_ORIGIN)
    #: Every array is already 1-D, C-contiguous and of its field's dtype (the decoder's fast path
    #: builds them as views of that dtype): the pool skips its per-array conversion check.
    #: Contents are checked by the pool either way.
    normalized: bool = False

    @property
    def n_events(self) -> int:
        return int(self.ops.shape[0])

    @property
    def n_blocks(self) -> int:
        return int(self.ext_hashes.shape[0])


@dataclass(slots=True)
class PackedBatch:
    """An ``EventBatch`` laid out in one buffer (the ingest walker's workspace), described by
    offsets: what the pool reads without creating a Python object per array.

    At light load a message arrives on cold caches, and every object it creates costs a few µs
    (a dozen views, a zeroed pair and the batch object came to about a tenth of a message's cost
    in the running relay). Sections, ``e`` being the capacity of each per-event section:

    * ``ops`` = ``work[o_ops : o_ops + n_events]``; ``has_parent`` = ``work[o_hp : o_hp +
      n_events]`` as bool;
    * ``w64`` = ``work[o_w64 : o_i64]`` as uint64: ``parent`` = ``w64[:n]``, ``salt`` =
      ``w64[e : e + n]``, ``ext_hashes`` = ``w64[2e : 2e + n_blocks]``;
    * ``i64`` = ``work[o_i64 : o_tok]`` as int64: ``blk_off`` = ``i64[: n + 1]``, ``tok_off`` =
      ``i64[e + 1 : e + 2 + n]``;
    * ``tokens`` = ``work[o_tok : o_tok + 4 * tok_off[n]]`` as uint32;
    * no namespaces, multimodal hashes or origins (zeros / empty), and every store with a parent
      takes its parent's namespace (``ns_inherit`` = ``has_parent``: the walker leaves every
      salted store to the msgspec path).

    The buffer is borrowed: its owner reuses it only once nothing refers to it any more.
    """

    work: npt.NDArray[np.uint8]
    n_events: int
    n_blocks: int
    e: int
    o_ops: int
    o_hp: int
    o_w64: int
    o_i64: int
    o_tok: int

    @classmethod
    def pack(cls, batch: EventBatch) -> PackedBatch:
        """``batch`` copied into a buffer of its own (warm-up, tests). Only batches a walker can
        produce: no namespaces, multimodal hashes or origins, each store with a parent taking its
        parent's namespace (``ValueError`` otherwise)."""
        b = batch
        ne, nb, nt = b.ops.shape[0], b.ext_hashes.shape[0], b.tokens.shape[0]
        if (
            b.mm_off.shape[0]
            or b.origin.shape[0]
            or b.ns_part.any()
            or not np.array_equal(b.ns_inherit, b.has_parent)
        ):
            raise ValueError("a packed batch has no namespaces, multimodal hashes or origins")
        e = ne
        e8 = (e + 7) & ~7
        o_ops = 0
        o_hp = o_ops + e8
        o_w64 = o_hp + e8
        o_i64 = o_w64 + 8 * (2 * e + nb)
        o_tok = o_i64 + 8 * (2 * e + 2)
        work = np.zeros(o_tok + 4 * nt, dtype=np.uint8)
        work[o_ops : o_ops + ne] = b.ops
        work[o_hp : o_hp + ne] = b.has_parent
        w64 = work[o_w64:o_i64].view(np.uint64)
        w64[:ne], w64[e : e + ne], w64[2 * e :] = b.parent, b.salt, b.ext_hashes
        i64 = work[o_i64:o_tok].view(np.int64)
        i64[: ne + 1], i64[e + 1 : e + 2 + ne] = b.blk_off, b.tok_off
        work[o_tok:].view(np.uint32)[:] = b.tokens
        return cls(work, ne, nb, e, o_ops, o_hp, o_w64, o_i64, o_tok)

    def unpack(self) -> EventBatch:
        """The same batch as views of the buffer (nothing copied)."""
        work, ne, e = self.work, self.n_events, self.e
        w64 = work[self.o_w64 : self.o_i64].view(np.uint64)
        i64 = work[self.o_i64 : self.o_tok].view(np.int64)
        tok_off = i64[e + 1 : e + 2 + ne]
        has_parent = work[self.o_hp : self.o_hp + ne].view(np.bool_)
        return EventBatch(
            ops=work[self.o_ops : self.o_ops + ne],
            parent=w64[:ne],
            has_parent=has_parent,
            salt=w64[e : e + ne],
            ns_part=np.zeros(ne, dtype=np.uint64),
            ns_inherit=has_parent,
            blk_off=i64[: ne + 1],
            ext_hashes=w64[2 * e : 2 * e + self.n_blocks],
            tok_off=tok_off,
            tokens=work[self.o_tok : self.o_tok + 4 * int(tok_off[ne])].view(np.uint32),
            normalized=True,
        )


#: What ``BatchSink.on_batch`` and ``Pool.apply`` take.
AnyBatch = EventBatch | PackedBatch


def as_events(batch: AnyBatch) -> EventBatch:
    """``batch`` as an ``EventBatch`` (a packed one unpacked: views, nothing copied)."""
    return batch.unpack() if isinstance(batch, PackedBatch) else batch


class BatchBuilder:
    """Builds an ``EventBatch`` event by event (decoder, simulator, tests).

    Not for the hottest path of the decoder, which may fill arrays directly; it is the reference
    for what those arrays must contain.
    """

    __slots__ = (
        "_blk_off",
        "_ext",
        "_has_parent",
        "_mm",
        "_mm_off",
        "_ns_inherit",
        "_ns_part",
        "_ops",
        "_origin",
        "_parent",
        "_salt",
        "_tok_off",
        "_tokens",
        "_use_mm",
    )

    def __init__(self) -> None:
        self._ops: list[int] = []
        self._origin: list[int] = []
        self._parent: list[int] = []
        self._has_parent: list[bool] = []
        self._salt: list[int] = []
        self._ns_part: list[int] = []
        self._ns_inherit: list[bool] = []
        self._blk_off: list[int] = [0]
        self._ext: list[int] = []
        self._tok_off: list[int] = [0]
        self._tokens: list[npt.NDArray[np.uint32]] = []
        self._mm_off: list[int] = [0]
        self._mm: list[int] = []
        self._use_mm = False

    def _push(
        self,
        op: int,
        hashes: list[int] | npt.NDArray[np.uint64],
        *,
        parent: int | None = None,
        salt: int = 0,
        ns_part: int = 0,
        ns_inherit: bool = False,
        tokens: npt.ArrayLike | None = None,
        mm: list[list[int]] | None = None,
        origin: int = ORIGIN_UNKNOWN,
    ) -> None:
        self._ops.append(op)
        self._origin.append(origin)
        self._parent.append(0 if parent is None else parent & 0xFFFF_FFFF_FFFF_FFFF)
        self._has_parent.append(parent is not None)
        self._salt.append(salt & 0xFFFF_FFFF_FFFF_FFFF)
        self._ns_part.append(ns_part & 0xFFFF_FFFF_FFFF_FFFF)
        self._ns_inherit.append(ns_inherit)
        hs = [int(h) & 0xFFFF_FFFF_FFFF_FFFF for h in hashes]
        self._ext.extend(hs)
        self._blk_off.append(len(self._ext))
        tok = np.zeros(0, np.uint32) if tokens is None else np.asarray(tokens, dtype=np.uint32)
        self._tokens.append(tok)
        self._tok_off.append(self._tok_off[-1] + int(tok.shape[0]))
        if mm is not None:
            self._use_mm = True
        per_block = mm if mm is not None else [[] for _ in hs]
        if len(per_block) != len(hs):
            raise ValueError("mm needs one list per block")
        for vals in per_block:
            self._mm.extend(sorted(int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in vals))
            self._mm_off.append(len(self._mm))

    def store(
        self,
        hashes: list[int] | npt.NDArray[np.uint64],
        tokens: npt.ArrayLike,
        *,
        parent: int | None = None,
        salt: int = 1337,
        ns_part: int = 0,
        ns_inherit: bool | None = None,
        mm: list[list[int]] | None = None,
        origin: int = ORIGIN_UNKNOWN,
    ) -> BatchBuilder:
        """``ns_inherit``: by default what the decoder says, a store with a parent and no
        namespace of its own takes its parent's."""
        if ns_inherit is None:
            ns_inherit = parent is not None and ns_part == 0
        self._push(
            OP_STORE,
            hashes,
            parent=parent,
            salt=salt,
            ns_part=ns_part,
            ns_inherit=ns_inherit,
            tokens=tokens,
            mm=mm,
            origin=origin,
        )
        return self

    def remove(self, hashes: list[int] | npt.NDArray[np.uint64]) -> BatchBuilder:
        self._push(OP_REMOVE, hashes)
        return self

    def clear(self) -> BatchBuilder:
        self._push(OP_CLEAR, [])
        return self

    def build(self) -> EventBatch:
        tokens = (
            np.concatenate(self._tokens) if self._tokens else np.zeros(0, dtype=np.uint32)
        ).astype(np.uint32, copy=False)
        return EventBatch(
            ops=np.asarray(self._ops, dtype=np.uint8),
            parent=np.asarray(self._parent, dtype=np.uint64),
            has_parent=np.asarray(self._has_parent, dtype=np.bool_),
            salt=np.asarray(self._salt, dtype=np.uint64),
            ns_part=np.asarray(self._ns_part, dtype=np.uint64),
            ns_inherit=np.asarray(self._ns_inherit, dtype=np.bool_),
            blk_off=np.asarray(self._blk_off, dtype=np.int64),
            ext_hashes=np.asarray(self._ext, dtype=np.uint64),
            tok_off=np.asarray(self._tok_off, dtype=np.int64),
            tokens=tokens,
            mm_off=np.asarray(self._mm_off if self._use_mm else [], dtype=np.int64),
            mm=np.asarray(self._mm, dtype=np.uint64),
            origin=np.asarray(self._origin if any(self._origin) else [], dtype=np.uint8),
        )
