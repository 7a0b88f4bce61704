"""Pure-Python reference model of the decoder's output (the test oracle).

Works on plain Python event descriptions (not msgpack), so it shares no code with the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvrelay.pool.batch import BatchBuilder, EventBatch

M = (1 << 64) - 1
FULL = {"full_attention", "mla_attention", "sink_full_attention"}
ORIGINS = {"NEW": 1, "REUSED": 2}  # BlockStored.origin → EventBatch.origin


def salt_of(lora: str | None, ns: str | None = None) -> int:
    s = 1337
    if lora:
        s += xxhash.xxh3_64_intdigest(lora.encode(), seed=0)
    if ns:
        s += xxhash.xxh3_64_intdigest(ns.encode(), seed=1)
    return s & M


def u64(h: int | bytes) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h.rjust(8, b"\0")[-8:], "big")
    return h % (1 << 64)


def mm_u64(ident: str) -> int:
    """An mm identifier as a u64 (§7.2): a 64-hex digest's first 16 hex digits, else XXH3."""
    if len(ident) == 64 and all(c in "0123456789abcdefABCDEF" for c in ident):
        return int(ident[:16], 16)
    return xxhash.xxh3_64_intdigest(ident.encode(), seed=0)


def _u32(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32


@dataclass
class Ref:
    """Event dicts: {"kind": "store"|"remove"|"clear", vLLM field names...}.

    ``namespacing`` / ``multimodal``: the pool's ``cache_salt_namespacing`` and
    ``multimodal_hashing`` (§18.4), read from the contract's words, not the decoder's code."""

    block_size: int
    eagle: bool = False
    groups: dict[int, bool] = field(default_factory=dict)
    namespacing: bool = False
    multimodal: bool = False

    def build(self, events: list[dict[str, Any]]) -> EventBatch:
        b = BatchBuilder()
        for ev in events:
            kind = ev["kind"]
            med = ev.get("medium")
            if med is not None and med.upper() not in ("", "GPU", "DEVICE"):  # any case (§18.2)
                continue  # another tier's event (a clear of one tier included)
            if kind == "clear":
                b.clear()
                continue
            if ev.get("locality") not in (None, "", "LOCAL"):
                continue
            g = ev.get("group_idx")
            if kind == "remove":
                if g is not None and not self.groups.get(g, g == 0):
                    continue
                if ev["block_hashes"]:
                    b.remove([u64(h) for h in ev["block_hashes"]])
                continue
            sk = ev.get("kv_cache_spec_kind")
            if sk is None:
                if g is not None and not self.groups.get(g, g == 0):
                    continue
            elif sk in FULL:
                if g is not None:
                    self.groups[g] = True
            else:
                if g is not None:
                    self.groups[g] = False
                continue
            hs = [u64(h) for h in ev["block_hashes"]]
            toks = ev["token_ids"]
            if toks and isinstance(toks[0], list):
                toks = [p[0] for p in toks] + [toks[-1][1]]
            bs = ev["block_size"]
            if not hs or bs == 0 or not toks or bs != self.block_size:
                continue
            e = 1 if self.eagle else 0
            la = ev.get("lookahead_token_ids")
            if (  # §18.3: vLLM's exactly k·B plain tokens for k hashes, one lookahead entry
                e  # per block, the last starting with a token: it ends the last block's window
                and toks is ev["token_ids"]
                and len(toks) == len(hs) * bs
                and isinstance(la, list)
                and len(la) == len(hs)
                and isinstance(la[-1], list)
                and la[-1]
                and _u32(la[-1][0])
            ):
                toks = [*toks, la[-1][0]]
            k = max(0, (len(toks) - e) // bs)
            if k == 0 or k > len(hs):  # tokens for more whole blocks than hashes: tokens_excess
                continue
            parent = ev.get("parent_block_hash")
            parent = None if parent is None or u64(parent) == 0 else u64(parent)
            # Dynamo's order: the whole store is checked for a repeat before its walk truncates
            if len(set(hs)) != len(hs) or (parent is not None and parent in hs):
                continue
            hs = hs[:k]
            cs = ev.get("cache_salt") or None  # an explicit salt field is always honoured
            lora = ev.get("lora_name")
            ek = ev.get("extra_keys") or []
            if cs is None and self.namespacing and parent is None:
                # a root: block 0's last bare string, past a leading LoRA name
                first = ek[0] if ek and isinstance(ek[0], list) else []
                if lora is not None and first[:1] == [lora]:
                    first = first[1:]
                names = [x for x in first if isinstance(x, str) and x]
                cs = names[-1] if names else None
            # no namespace of its own: the parent's recorded one, if any (namespacing or not)
            inherit = cs is None and parent is not None
            mm: list[list[int]] | None = None
            if self.multimodal:
                mm = []
                for j in range(k):
                    keys = ek[j] if j < len(ek) and isinstance(ek[j], list) else []
                    mm.append(
                        [
                            mm_u64(x[0])
                            for x in keys
                            if isinstance(x, list)
                            and len(x) == 2
                            and isinstance(x[0], str)
                            and x[0]
                            and isinstance(x[1], int)
                        ]
                    )
                if not any(mm):
                    mm = None  # no mm hashes in the event: the same bytes as text-only
            b.store(
                hs,
                np.array(toks[: k * bs + e], dtype=np.uint32),
                parent=parent,
                salt=salt_of(lora, cs),
                ns_part=xxhash.xxh3_64_intdigest(cs.encode(), seed=1) if cs else 0,
                ns_inherit=inherit,
                mm=mm,
                origin=ORIGINS.get(ev.get("origin") or "", 0),  # map form only (§8.2.1)
            )
        return b.build()


def assert_batch_equal(got: EventBatch, want: EventBatch) -> None:
    for name in (
        "ops",
        "parent",
        "has_parent",
        "salt",
        "ns_part",
        "ns_inherit",
        "blk_off",
        "ext_hashes",
        "tok_off",
        "tokens",
        "mm_off",
        "mm",
    ):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert np.array_equal(g, w), (name, g, w)
