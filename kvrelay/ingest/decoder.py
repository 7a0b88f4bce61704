"""vLLM KV-event payload → ``EventBatch`` (``docs/contract.md`` §17, §18).

One ``Decoder`` per source (it learns which ``group_idx`` values are full attention from stores,
so removes of sliding-window/mamba groups, which carry only ``group_idx``, can be dropped).
``decode`` either returns a ``DecodeResult`` or raises a ``DecodeError`` subclass for the whole
message; it never raises anything else and never returns a partial batch for a bad message.
Inside a good envelope, events with an unknown tag or badly typed known fields are skipped and
counted (``unknown_tags`` / ``malformed_events``) so one odd event never costs the whole step.

Two paths with identical results (differentially fuzzed in tests/ingest): the numba walker
(``fastwalk``) decodes clean vLLM output straight from the bytes; anything it does not accept
(bytes hashes, unknown tags/fields/strings, the per-pool options) goes through msgspec structs
with ``token_ids`` kept raw and parsed by ``tokens_kernel``.

The engine kind picks the array-form field layout: SGLang's positions differ from vLLM's
(``ingest/sglang.py``, §21); everything after decoding — gates, hashing, counters — is shared.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash
from msgspec import Raw

from kvrelay.ingest import fastwalk as FW
from kvrelay.ingest import sglang as SG
from kvrelay.ingest import stats as S
from kvrelay.ingest import wire
from kvrelay.ingest.errors import (
    DecodeError,
    DpRankMismatchError,
    InternalDecodeError,
    MalformedEnvelopeError,
    MalformedPayloadError,
    MalformedRemovalError,
)
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.salt import namespace_part, request_salt
from kvrelay.ingest.stats import DecodeStats
from kvrelay.ingest.tokens_kernel import fill_tokens
from kvrelay.pool.batch import (
    OP_CLEAR,
    OP_REMOVE,
    OP_STORE,
    ORIGIN_NEW,
    ORIGIN_REPORT,
    ORIGIN_UNKNOWN,
    AnyBatch,
    EventBatch,
    PackedBatch,
)

M64 = (1 << 64) - 1
HASH_FORMAT_STANDARD = 1
HASH_FORMAT_EAGLE = 2

_TIERS = {
    "CPU": "host_pinned",
    "CPU_PINNED": "host_pinned",
    "CPU_TIER1": "host_pinned",
    "CPU_TIER2": "disk",
    "DISK": "disk",
    "NVME": "disk",
    "STORAGE": "disk",
    "EXTERNAL": "external",
    "NETWORK": "external",
    "REMOTE": "external",
    "SHARED": "external",
}
#: The walker's workspace (``fastwalk.layout``: ~17 bytes per payload byte) is kept for the next
#: message when it is at most ``_WORK_KEEP`` bytes (bounded per source); at least ``_WORK_MIN``
#: is allocated so messages of other sizes can reuse it.
_WORK_MIN = 1 << 18
_WORK_KEEP = 1 << 20
#: LoRA names up to this many bytes have their salt cached (per source, at most 4096 names): an
#: adapter's name is short, and a cache of any length would let an engine's odd names (one per
#: message, up to a message each) stay in the relay's memory.
_SALT_KEY_MAX = 256
#: The head of the walker's workspace: its stats and meta (int64) and the time stamp (float64).
_HEAD = struct.Struct(f"<{FW.N_STATS + FW.N_META}qd")
assert FW.layout(1)[1] == _HEAD.size - 8  # the time stamp follows the stats and meta
#: Kinds whose groups hold the prefix cache as full attention does (vLLM manages a sink full
#: attention group with its full-attention manager: the same prefix hits)
_FULL_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_STORE, _REMOVE, _CLEAR = wire.STORE, wire.REMOVE, wire.CLEAR
#: Event kinds that take blocks away: one that does not decode makes the whole batch bad.
_REMOVAL_TAGS = frozenset({"BlockRemoved", "AllBlocksCleared"})


@dataclass(frozen=True, slots=True)
class _Layout:
    """The array-form (positional) event structs of one engine kind."""

    envelope: msgspec.msgpack.Decoder[Any]
    event: msgspec.msgpack.Decoder[Any]
    lengths: dict[str, int]  # known positions per tag (longer = unknown fields)
    walker_ids: npt.NDArray[np.int64]  # the numba walker's key per (tag, position)
    walker_len: npt.NDArray[np.int64]  # … and its positions per tag (longer = fallback)


_LAYOUTS = {
    EngineKind.VLLM: _Layout(
        wire.ARR_ENVELOPE, wire.ARR_EVENT, wire.ARR_LEN, FW.ARR_IDS, FW.ARR_LEN
    ),
    EngineKind.SGLANG: _Layout(SG.ARR_ENVELOPE, SG.ARR_EVENT, SG.ARR_LEN, FW.SGL_IDS, FW.SGL_LEN),
}


@dataclass(slots=True)
class DecodeResult:
    batch: AnyBatch  # a PackedBatch only when asked for (``decode(packed=True)``)
    dp_rank: int
    ts: float
    stats: DecodeStats


def norm_hash(h: int | bytes) -> int:
    """u64 view of a vLLM hash: ints by two's complement, bytes by their last 8 bytes (BE)."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(bytes(h[-8:]), "big")
    return int(h) & M64


def medium_drop_reason(medium: str) -> str | None:
    """``None`` when the tier is the device (GPU) tier; else the drop reason label."""
    up = medium.upper()
    if up in ("", "GPU", "DEVICE"):
        return None
    return S.DROP_MEDIUM_PREFIX + _TIERS.get(up, "unknown")


_HEX = frozenset("0123456789abcdefABCDEF")


def mm_hash(identifier: str) -> int:
    """vLLM mm identifier → u64: a digest of exactly 64 hex digits gives its first 16 as a
    number; anything else (other lengths, a ``0x`` prefix, underscores, spaces, non-ASCII digits
    that ``int()`` would accept) is hashed: XXH3-64 of its UTF-8 bytes, seed 0."""
    if len(identifier) == 64 and _HEX.issuperset(identifier):
        return int(identifier[:16], 16)
    return int(xxhash.xxh3_64_intdigest(identifier.encode("utf-8", "surrogatepass"), seed=0))


def _tok_header(raw: Raw) -> tuple[int, int, bool]:
    """``(n, header_len, bigram)`` of a raw msgpack token array; n = -1 if it is not an array.

    An absent field (empty raw) or nil is an empty list (a placeholder store).
    """
    mv = memoryview(raw)
    if len(mv) == 0:
        return 0, 0, False
    b0 = mv[0]
    if 0x90 <= b0 <= 0x9F:
        n, h = b0 & 0x0F, 1
    elif b0 == 0xDC and len(mv) >= 3:
        n, h = (mv[1] << 8) | mv[2], 3
    elif b0 == 0xDD and len(mv) >= 5:
        n, h = int.from_bytes(mv[1:5], "big"), 5
    elif b0 == 0xC0:
        return 0, 1, False
    else:
        return -1, 0, False
    big = n > 0 and len(mv) > h and (0x90 <= mv[h] <= 0x9F or mv[h] in (0xDC, 0xDD))
    return n, h, big


#: ``BlockStored.origin`` (map form): what the engine says a store is (contract §8.2.1)
_ORIGINS = {"NEW": ORIGIN_NEW, "REUSED": ORIGIN_REPORT}


def _lookahead(raw: Raw, n_blocks: int) -> int:
    """The first lookahead token of block ``n_blocks - 1`` (vLLM >= 0.33 ``lookahead_token_ids``:
    per block, the tokens past it that went into its hash), or -1 when there is none to use. With
    it, an EAGLE window of the last stored block is complete instead of one token short."""
    if not raw:
        return -1
    try:
        la = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return -1
    if not isinstance(la, list) or len(la) != n_blocks:
        return -1
    last = la[-1]
    if not isinstance(last, list) or not last:
        return -1
    t = last[0]
    return t if type(t) is int and 0 <= t < 1 << 32 else -1


def _self_referencing(hs: list[int], parent: int | None) -> bool:
    """Duplicate hash among the blocks, or the parent among them (compared as u64)."""
    norm = {h & M64 for h in hs}
    return len(norm) != len(hs) or (parent is not None and (parent & M64) in norm)


def _u64(vals: list[int]) -> npt.NDArray[np.uint64]:
    try:
        return np.array(vals, dtype=np.uint64)
    except OverflowError:
        return np.array([v & M64 for v in vals], dtype=np.uint64)


def _empty_batch() -> EventBatch:
    z64 = np.zeros(0, dtype=np.uint64)
    return EventBatch(
        ops=np.zeros(0, dtype=np.uint8),
        parent=z64,
        has_parent=np.zeros(0, dtype=np.bool_),
        salt=z64.copy(),
        ns_part=z64.copy(),
        ns_inherit=np.zeros(0, dtype=np.bool_),
        blk_off=np.zeros(1, dtype=np.int64),
        ext_hashes=z64.copy(),
        tok_off=np.zeros(1, dtype=np.int64),
        tokens=np.zeros(0, dtype=np.uint32),
    )


def _tier_and_locality_ok(ev: Any, stats: DecodeStats) -> bool:
    """Only the GPU/device tier and local (or unspecified) locality change the filter; anything
    else is dropped and counted by reason."""
    m = ev.medium
    if m is not None and m != "GPU":
        r = medium_drop_reason(m)
        if r is not None:
            stats.drop(r)
            return False
    loc = ev.locality
    if loc is not None and loc != "LOCAL" and loc != "":
        stats.drop(S.DROP_LOCALITY)
        return False
    return True


class Decoder:
    """Stateful (per source) payload decoder; see the module docstring for the contract."""

    __slots__ = (
        "_fast",
        "_garr",
        "_gextra",
        "_gunsure",
        "_layout",
        "_lora_bytes",
        "_map_first",
        "_salts",
        "_work",
        "block_size",
        "dp_rank",
        "extra",
        "options",
    )

    def __init__(
        self,
        *,
        kv_block_size: int,
        dp_rank: int,
        hash_format: int = HASH_FORMAT_STANDARD,
        options: DecodeOptions | None = None,
        fast: bool = True,
        kind: EngineKind = EngineKind.VLLM,
    ) -> None:
        if kv_block_size <= 0:
            raise ValueError("kv_block_size must be positive")
        if hash_format not in (HASH_FORMAT_STANDARD, HASH_FORMAT_EAGLE):
            raise ValueError("hash_format must be 1 (DYNAMO_STANDARD_V1) or 2 (DYNAMO_EAGLE_V1)")
        self.block_size = kv_block_size
        self.dp_rank = dp_rank
        self.extra = 1 if hash_format == HASH_FORMAT_EAGLE else 0
        self.options = options or DecodeOptions()
        self._layout = _LAYOUTS[kind]
        # learned kv-cache group kinds: -1 unknown, 0 not full attention, 1 full attention,
        # FW.UNSURE not known after a restore that did not keep them (``assume_unsure_groups``)
        self._garr = np.full(FW.MAX_GROUPS, -1, dtype=np.int8)
        self._gextra: dict[int, bool] = {}
        self._gunsure = False
        self._salts: dict[str, int] = {}
        self._lora_bytes: dict[bytes, int] = {}
        self._map_first = True
        self._work: npt.NDArray[np.uint8] | None = None
        # the numba walker handles the clean common case; the options need the msgspec path
        self._fast = fast and not (
            self.options.cache_salt_namespacing or self.options.multimodal_hashing
        )

    def reset(self) -> None:
        """Forget learned group kinds (new engine incarnation)."""
        self._garr[:] = -1
        self._gextra.clear()
        self._gunsure = False

    def learned_groups(self) -> dict[int, bool]:
        """The group kinds learned from this incarnation's stores (True: full attention). A
        member saved with its state keeps them: a remove names only its group, and a resumed
        member that had to learn them again would drop the removes of a non-zero full group."""
        known = (self._garr == 0) | (self._garr == 1)
        out = {g: bool(self._garr[g] == 1) for g in np.flatnonzero(known).tolist()}
        out.update(self._gextra)
        return out

    @property
    def groups_unsure(self) -> bool:
        """Resumed without the group kinds learned before (``assume_unsure_groups``): a save
        must say so again, the kinds learned since are not all there were."""
        return self._gunsure

    def assume_unsure_groups(self) -> None:
        """A member resumed from state saved without its learned group kinds (files of kvrelay
        before it saved them): a full-attention group numbered above 0 could be any group not
        learned yet. Until a store teaches a group's kind, its removes are applied (at worst a
        block the member still holds through another group is dropped: a miss, never a
        phantom); its stores without a kind stay gated as an unknown group's."""
        self._gunsure = True
        self._garr[self._garr < 0] = FW.UNSURE

    def learn_groups(self, groups: Mapping[int, bool]) -> None:
        """Take group kinds learned before (a member resumed from saved state)."""
        for g, full in groups.items():
            self._group_learn(int(g), bool(full))

    def _group_ok(self, g: int, default: bool) -> bool:
        """A kind-less store of group ``g`` is kept (``default``: the group is 0)."""
        st = int(self._garr[g]) if 0 <= g < FW.MAX_GROUPS else int(self._gextra.get(g, -1))
        return st == 1 or (st != 0 and default)

    def _remove_ok(self, g: int) -> bool:
        """A remove of group ``g`` is applied: a full-attention group, group 0 unless learned
        otherwise, or any group not learned yet while the kinds are unsure."""
        if 0 <= g < FW.MAX_GROUPS:
            st = int(self._garr[g])
        else:
            v = self._gextra.get(g)
            st = (FW.UNSURE if self._gunsure else -1) if v is None else int(v)
        return st == 1 or st == FW.UNSURE or (st < 0 and g == 0)

    def _group_learn(self, g: int, full: bool) -> None:
        if 0 <= g < FW.MAX_GROUPS:
            self._garr[g] = 1 if full else 0
        elif len(self._gextra) < 1024:  # odd group ids from a broken engine stay bounded
            self._gextra[g] = full

    def decode(self, payload: bytes, *, packed: bool = False) -> DecodeResult:
        """``packed``: the walker's batch may come as the ``PackedBatch`` it wrote (what the
        pool applies with the fewest Python objects); otherwise always an ``EventBatch``."""
        try:
            if self._fast:  # the walker first, without a frame between (a message's hot path)
                res = self._walk(payload, packed)
                if res is not None:
                    return res
            return self._decode(payload)
        except DecodeError:
            raise
        except RecursionError:  # msgspec reads nested values recursively: hostile, not a bug
            raise MalformedPayloadError("msgpack nested deeper than the decoder reads") from None
        except Exception as exc:  # defensive: a bug must still be a typed, counted rejection
            raise InternalDecodeError(repr(exc)) from exc

    # ---- envelope -------------------------------------------------------------------------
    def _decode(self, payload: bytes) -> DecodeResult:
        """The msgspec path: what the walker hands back, and every decoder without it."""
        stats = DecodeStats(slow_path=1)
        ts, dp, events, loose = self._envelope(payload, stats)
        rank = self.dp_rank if dp is None else dp
        if rank != self.dp_rank:
            raise DpRankMismatchError(f"batch for dp_rank {rank} on the socket of {self.dp_rank}")
        batch = self._build(events, loose, stats)
        return DecodeResult(batch, rank, ts, stats)

    def _workspace(self, n: int) -> npt.NDArray[np.uint8]:
        """A new workspace for a payload of ``n - 1`` bytes, kept for the next message when it
        is at most ``_WORK_KEEP`` bytes."""
        total = FW.layout(n)[8]
        work = np.empty(max(total, _WORK_MIN), dtype=np.uint8)
        self._work = work if total <= _WORK_KEEP else None
        return work

    def _walk(self, payload: bytes, packed: bool = False) -> DecodeResult | None:
        """numba fast path; ``None`` = fall back to the msgspec path (nothing committed).

        At light load every statement here runs with cold caches, so the walk's outcome (its
        stats, the arrays' offsets and the time stamp) is read with one ``struct.unpack_from``
        and the workspace's size is checked by the walker itself."""
        work = self._work
        # reused while nothing decoded from it is alive (a batch's arrays are views of it, each
        # one a reference): one allocation less per message, and its cache lines still warm
        if work is None or sys.getrefcount(work) > 3:
            work = self._workspace(len(payload) + 1)
        buf = np.frombuffer(payload, dtype=np.uint8)
        args = (self._garr, self.block_size, self.extra, self.options.drop_self_reference,
                self._layout.walker_ids, self._layout.walker_len, self.dp_rank)  # fmt: skip
        rc = FW.walk(buf, work, *args)
        if rc == FW.SMALL:
            work = self._workspace(len(payload) + 1)
            rc = FW.walk(buf, work, *args)
        if rc != FW.OK:
            return None
        st = _HEAD.unpack_from(work)  # type: ignore[arg-type]  # numpy arrays are buffers
        ne, dp, n_lora, nb, e, o_ops, o_hp, o_w64, o_i64, o_tok = st[FW.META : FW.META + FW.N_META]
        if n_lora:
            salt = work[o_w64:o_i64].view(np.uint64)[e : e + ne]
            i64 = work[o_i64:o_tok].view(np.int64)
            lpos, llen = i64[2 * e + 2 : 2 * e + 2 + ne], i64[3 * e + 2 : 3 * e + 2 + ne]
            for i in np.flatnonzero(llen).tolist():
                p = int(lpos[i])
                key = payload[p : p + int(llen[i])]
                s = self._lora_bytes.get(key)
                if s is None:
                    s = self._salt(key.decode("utf-8"), None)  # UTF-8 checked by the walker
                    if len(self._lora_bytes) < 4096 and len(key) <= _SALT_KEY_MAX:
                        self._lora_bytes[key] = s
                salt[i] = s
        rank = self.dp_rank if dp < 0 else dp
        if rank != self.dp_rank:
            raise DpRankMismatchError(f"batch for dp_rank {rank} on the socket of {self.dp_rank}")
        ds = DecodeStats(
            stored=st[FW.ST_STORED],
            removed=st[FW.ST_REMOVED],
            cleared=st[FW.ST_CLEARED],
            malformed_events=st[FW.ST_MALFORMED],
            eagle_bigram=st[FW.ST_EAGLE],
            truncated=st[FW.ST_TRUNCATED],
        )
        if any(st[FW.DROP_BASE : FW.N_STATS]):
            for j, reason in enumerate(FW.DROP_REASONS):
                v = st[FW.DROP_BASE + j]
                if v:
                    ds.drops[reason] = v
        batch = PackedBatch(work, ne, nb, e, o_ops, o_hp, o_w64, o_i64, o_tok)
        return DecodeResult(batch if packed else batch.unpack(), rank, st[-1], ds)

    def _envelope(
        self, payload: bytes, stats: DecodeStats
    ) -> tuple[float, int | None, list[Any], bool]:
        arr = self._layout.envelope
        order = (wire.MAP_ENVELOPE, arr) if self._map_first else (arr, wire.MAP_ENVELOPE)
        for dec in order:
            try:
                env = dec.decode(payload)
            except msgspec.ValidationError:
                continue
            except msgspec.DecodeError as exc:
                raise MalformedPayloadError(str(exc)) from None
            self._map_first = dec is wire.MAP_ENVELOPE
            return float(env.ts), env.dp_rank, env.events, False
        try:
            renv = wire.RAW_ENVELOPE.decode(payload)
        except msgspec.ValidationError as exc:
            raise MalformedEnvelopeError(str(exc)) from None
        except msgspec.DecodeError as exc:
            raise MalformedPayloadError(str(exc)) from None
        events = []
        for raw in renv.events:
            ev = self._event(raw, stats)
            if ev is not None:
                events.append(ev)
        return float(renv.ts), renv.dp_rank, events, True

    def _event(self, raw: Raw, stats: DecodeStats) -> Any:
        """Tolerant single-event decode (slow path). ``None`` = skipped (and counted)."""
        b0 = memoryview(raw)[0]
        is_map = 0x80 <= b0 <= 0x8F or b0 in (0xDE, 0xDF)
        is_arr = 0x90 <= b0 <= 0x9F or b0 in (0xDC, 0xDD)
        tag: Any = None
        try:
            if is_map:
                keys = wire.MAP_KEYS.decode(raw)
                traw = keys.get("type")
                tag = wire.STR.decode(traw) if traw is not None else None
                if tag in wire.KNOWN_TAGS:
                    ev = wire.MAP_EVENT.decode(raw)
                    known = wire.MAP_FIELDS[tag]
                    stats.unknown_fields += sum(1 for k in keys if k not in known)
                    return ev
            elif is_arr:
                items = wire.ARR_ITEMS.decode(raw)
                tag = wire.STR.decode(items[0]) if items else None
                if tag in wire.KNOWN_TAGS:
                    ev = self._layout.event.decode(raw)
                    stats.unknown_fields += max(0, len(items) - self._layout.lengths[tag])
                    return ev
            else:
                tag = None
        except msgspec.DecodeError:
            if tag in _REMOVAL_TAGS:
                raise MalformedRemovalError(f"a {tag} event that does not decode") from None
            if tag not in wire.KNOWN_TAGS:
                tag = None
        if tag in wire.KNOWN_TAGS:  # a store that does not decode: skipped, counted
            stats.malformed_events += 1
            stats.drop(S.DROP_MALFORMED)
            return None
        if isinstance(tag, str):
            stats.unknown_tags += 1
            stats.drop(S.DROP_UNKNOWN_TAG)
            return None
        # A store skipped costs a miss; a remove or clear skipped would leave what the engine
        # dropped held (phantoms), and an event whose kind cannot be read may be either: the
        # batch is bad (re-fetched from the replay once, else the member is reset).
        raise MalformedRemovalError("an event whose kind cannot be read")

    # ---- events → arrays ------------------------------------------------------------------
    def _salt(self, lora: str | None, ns: str | None) -> int:
        if not ns:
            if not lora:
                return 1337
            s = self._salts.get(lora)
            if s is None:
                s = request_salt(lora, None)
                if len(self._salts) < 4096 and len(lora) <= _SALT_KEY_MAX:
                    self._salts[lora] = s
            return s
        return request_salt(lora, ns)

    def _extra_keys(self, raw: Raw, stats: DecodeStats) -> list[Any] | None:
        try:
            val = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            stats.extra_keys_ignored += 1
            return None
        if not isinstance(val, list):
            stats.extra_keys_ignored += 1
            return None
        return val

    @staticmethod
    def _cache_salt(entries: list[Any], lora: str | None) -> str | None:
        """vLLM puts ``cache_salt`` as a bare string among block 0's keys, after the LoRA name
        (which is first when there is one): only that first key is the LoRA's, so a salt that
        happens to equal the adapter's name is still the salt."""
        if not entries:
            return None
        first = entries[0]
        keys = first if isinstance(first, list) else [first]
        if lora is not None and keys and keys[0] == lora:
            keys = keys[1:]
        found = None
        for k in keys:
            if isinstance(k, str) and k:
                found = k
        return found

    @staticmethod
    def _mm(entries: list[Any], k: int) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(k):
            entry = entries[i] if i < len(entries) else None
            vals: list[int] = []
            if isinstance(entry, list):
                for item in entry:
                    # an empty identifier names no input: it adds nothing to the block's hash
                    if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) \
                            and item[0]:
                        vals.append(mm_hash(item[0]))
            out.append(sorted(vals))
        return out

    def _build(self, events: list[Any], loose: bool, stats: DecodeStats) -> EventBatch:
        B = self.block_size
        extra = self.extra
        group_ok = self._group_ok
        remove_ok = self._remove_ok
        group_learn = self._group_learn
        opts = self.options
        want_ek = opts.cache_salt_namespacing or opts.multimodal_hashing
        ops: list[int] = []
        counts: list[int] = []
        ext: list[int] = []
        s_idx: list[int] = []
        s_parent: list[int] = []
        s_has: list[bool] = []
        s_salt: list[int] = []
        s_nsp: list[int] = []
        s_nsi: list[bool] = []
        s_need: list[int] = []
        s_fill: list[int] = []  # tokens taken from token_ids (s_need less a lookahead token)
        s_la: list[int] = []
        s_org: list[int] = []
        seg_raw: list[Raw] = []
        seg_hdr: list[int] = []
        seg_n: list[int] = []
        seg_big: list[bool] = []
        mm_events: dict[int, list[list[int]]] = {}

        for ev in events:
            kind = ev.KIND
            if kind == _REMOVE:
                stats.removed += 1
                if not _tier_and_locality_ok(ev, stats):
                    continue
                g = ev.group_idx
                if g is not None and not remove_ok(g):
                    stats.drop(S.DROP_GROUP)
                    continue
                hs = ev.block_hashes
                if not hs:
                    stats.drop(S.DROP_EMPTY)
                    continue
                if loose:
                    hs = [norm_hash(h) for h in hs]
                ops.append(OP_REMOVE)
                counts.append(len(hs))
                ext.extend(hs)
            elif kind == _STORE:
                stats.stored += 1
                if not _tier_and_locality_ok(ev, stats):
                    continue
                sk = ev.kv_cache_spec_kind
                g = ev.group_idx
                if sk is None:
                    if g is not None and not group_ok(g, g == 0):
                        stats.drop(S.DROP_NON_FULL_ATTENTION)
                        continue
                elif sk in _FULL_ATTENTION:
                    if g is not None:
                        group_learn(g, True)
                else:
                    if g is not None:
                        group_learn(g, False)
                    stats.drop(S.DROP_NON_FULL_ATTENTION)
                    continue
                hs = ev.block_hashes
                if not hs:
                    stats.drop(S.DROP_EMPTY)
                    continue
                raw = ev.token_ids
                n, hdr, big = _tok_header(raw)
                if n < 0:
                    stats.malformed_events += 1
                    stats.drop(S.DROP_MALFORMED)
                    continue
                bs = ev.block_size
                if bs == 0 or n == 0:
                    stats.drop(S.DROP_PLACEHOLDER)
                    continue
                if bs != B:
                    stats.drop(S.DROP_BLOCK_SIZE)
                    continue
                ntok = n + 1 if big else n
                k = (ntok - extra) // B
                nh = len(hs)
                if k > nh:  # a sliding window's tokens: not aligned to its hashes from the head
                    stats.drop(S.DROP_TOKENS_EXCESS)
                    continue
                la = -1  # the last block's lookahead token (EAGLE window), when sent
                if extra and not big and k == nh - 1 and ntok == nh * B:
                    la = _lookahead(getattr(ev, "lookahead_token_ids", wire.NO_RAW), nh)
                    if la >= 0:
                        k = nh
                if k <= 0:
                    stats.drop(S.DROP_TOKENS_SHORT)
                    continue
                parent = ev.parent_block_hash
                if loose:
                    hs = [norm_hash(h) for h in hs]
                    if parent is not None:
                        parent = norm_hash(parent)
                if parent is not None and norm_hash(parent) == 0:
                    parent = None  # llm-d's "no parent" (its positional format); §17.3
                # every hash the store names, the ones a truncation drops too (as Dynamo)
                if opts.drop_self_reference and _self_referencing(hs, parent):
                    stats.drop(S.DROP_SELF_REFERENCE)
                    continue
                if k < nh:
                    stats.truncated += 1
                    hs = hs[:k]
                if big:
                    stats.eagle_bigram += 1
                lora = ev.lora_name
                nsp = 0
                nsi = False
                entries = None
                if want_ek and len(ev.extra_keys):
                    entries = self._extra_keys(ev.extra_keys, stats)
                # An explicit salt field (SGLang's salt map, a map-form ``cache_salt``) is
                # honoured always, as Dynamo does: salted and unsalted blocks never merge.
                # vLLM's bare salt in block 0's extra keys only with the namespacing option.
                # A store without a namespace of its own takes its parent's (the pool knows
                # it, if any): a producer may salt a request's first store only.
                ns = ev.cache_salt or None
                if not ns and opts.cache_salt_namespacing and parent is None and entries:
                    ns = self._cache_salt(entries, lora)
                if ns:
                    nsp = namespace_part(ns)
                    salt = self._salt(lora, ns)
                else:
                    salt = self._salt(lora, None)
                    nsi = parent is not None
                idx = len(ops)
                if opts.multimodal_hashing and entries:
                    per_block = self._mm(entries, k)
                    if any(per_block):
                        mm_events[idx] = per_block
                ops.append(OP_STORE)
                counts.append(k)
                ext.extend(hs)
                s_idx.append(idx)
                s_parent.append(0 if parent is None else parent)
                s_has.append(parent is not None)
                s_salt.append(salt)
                s_nsp.append(nsp)
                s_nsi.append(nsi)
                s_need.append(k * B + extra)
                s_fill.append(k * B if la >= 0 else k * B + extra)
                s_la.append(la)
                s_org.append(_ORIGINS.get(getattr(ev, "origin", None) or "", ORIGIN_UNKNOWN))
                seg_raw.append(raw)
                seg_hdr.append(hdr)
                seg_n.append(n)
                seg_big.append(big)
            else:
                stats.cleared += 1
                # a clear of one tier (it names a medium other than the device's) leaves the
                # GPU blocks held: applied, it would drop what the engine still has (misses)
                m = getattr(ev, "medium", None)
                if m is not None and m != "GPU":
                    r = medium_drop_reason(m)
                    if r is not None:
                        stats.drop(r)
                        continue
                ops.append(OP_CLEAR)
                counts.append(0)

        n_ev = len(ops)
        if n_ev == 0:
            return _empty_batch()
        counts_a = np.array(counts, dtype=np.int64)
        parent_a = np.zeros(n_ev, dtype=np.uint64)
        has_a = np.zeros(n_ev, dtype=np.bool_)
        salt_a = np.zeros(n_ev, dtype=np.uint64)
        nsp_a = np.zeros(n_ev, dtype=np.uint64)
        nsi_a = np.zeros(n_ev, dtype=np.bool_)
        org_a = np.zeros(n_ev if any(s_org) else 0, dtype=np.uint8)
        tcount = np.zeros(n_ev, dtype=np.int64)
        tokens = np.zeros(0, dtype=np.uint32)
        keep: npt.NDArray[np.bool_] | None = None
        if s_idx:
            si = np.array(s_idx, dtype=np.intp)
            parent_a[si] = _u64(s_parent)
            has_a[si] = s_has
            salt_a[si] = _u64(s_salt)
            nsp_a[si] = _u64(s_nsp)
            nsi_a[si] = s_nsi
            if org_a.shape[0]:
                org_a[si] = s_org
            need = np.array(s_need, dtype=np.int64)
            tcount[si] = need
            out_off = np.zeros(len(s_idx), dtype=np.int64)
            np.cumsum(need[:-1], out=out_off[1:])
            lens = np.fromiter((len(r) for r in seg_raw), dtype=np.int64, count=len(seg_raw))
            starts = np.zeros(len(seg_raw), dtype=np.int64)
            np.cumsum(lens[:-1], out=starts[1:])
            buf = np.frombuffer(b"".join(seg_raw), dtype=np.uint8)
            tokens = np.empty(int(need.sum()), dtype=np.uint32)
            status = np.zeros(len(s_idx), dtype=np.int8)
            bad = fill_tokens(
                buf,
                starts + np.array(seg_hdr, dtype=np.int64),
                starts + lens,
                np.array(seg_n, dtype=np.int64),
                np.array(seg_big, dtype=np.bool_),
                np.array(s_fill, dtype=np.int64),
                out_off,
                tokens,
                status,
            )
            for j, tok in enumerate(s_la):
                if tok >= 0:  # the EAGLE window's last token, from lookahead_token_ids
                    tokens[out_off[j] + need[j] - 1] = tok
            if bad:
                keep = np.ones(n_ev, dtype=np.bool_)
                keep[si[status != 0]] = False
                stats.malformed_events += int(bad)
                stats.drops[S.DROP_MALFORMED] = stats.drops.get(S.DROP_MALFORMED, 0) + int(bad)
                tokens = tokens[np.repeat(keep[si], need)]
        ext_a = _u64(ext)
        ops_a = np.array(ops, dtype=np.uint8)
        kept_idx: npt.NDArray[np.intp] | None = None
        if keep is not None:
            ext_a = ext_a[np.repeat(keep, counts_a)]
            kept_idx = np.nonzero(keep)[0]
            ops_a, counts_a, tcount = ops_a[keep], counts_a[keep], tcount[keep]
            parent_a, has_a, salt_a = parent_a[keep], has_a[keep], salt_a[keep]
            nsp_a, nsi_a = nsp_a[keep], nsi_a[keep]
            if org_a.shape[0]:
                org_a = org_a[keep]
            if ops_a.shape[0] == 0:
                return _empty_batch()
        m_ev = int(ops_a.shape[0])
        blk_off = np.zeros(m_ev + 1, dtype=np.int64)
        np.cumsum(counts_a, out=blk_off[1:])
        tok_off = np.zeros(m_ev + 1, dtype=np.int64)
        np.cumsum(tcount, out=tok_off[1:])
        batch = EventBatch(
            ops=ops_a,
            parent=parent_a,
            has_parent=has_a,
            salt=salt_a,
            ns_part=nsp_a,
            ns_inherit=nsi_a,
            blk_off=blk_off,
            ext_hashes=ext_a,
            tok_off=tok_off,
            tokens=tokens,
            origin=org_a,
        )
        if mm_events:
            self._attach_mm(batch, mm_events, counts_a, kept_idx)
        return batch

    @staticmethod
    def _attach_mm(
        batch: EventBatch,
        mm_events: dict[int, list[list[int]]],
        counts: npt.NDArray[np.int64],
        kept_idx: npt.NDArray[np.intp] | None,
    ) -> None:
        mm_off = [0]
        mm: list[int] = []
        for j in range(int(counts.shape[0])):
            orig = j if kept_idx is None else int(kept_idx[j])
            per_block = mm_events.get(orig)
            for b in range(int(counts[j])):
                if per_block is not None:
                    mm.extend(per_block[b])
                mm_off.append(len(mm))
        batch.mm_off = np.array(mm_off, dtype=np.int64)
        batch.mm = _u64(mm)
