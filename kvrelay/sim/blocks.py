"""Per-DP-rank block manager: prefix cache with LRU eviction and exact ground truth.

The model follows vLLM's GPU block pool closely enough for an event consumer: a fixed number of
physical blocks; full blocks are cached under their chained hash; blocks of finished requests stay
cached but evictable (LRU, tail blocks first); allocating a block when nothing is free evicts the
least recently freed cached block and emits a one-hash ``BlockRemoved``.

Like vLLM, a hash may be held by several physical blocks (``commit_full(dedupe=False)``: vLLM never
merges a newly filled block into an identical cached one, so block tables stay append-only); each
copy is stored, evicted and reported on its own, and lookups use the oldest copy. SGLang's radix
cache merges instead (``dedupe=True``): a block whose hash is cached reuses it, no store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvrelay.sim.hashing import (
    digest_to_u64,
    dynamo_block_hash,
    dynamo_chain,
    dynamo_salt,
    vllm_digest,
)


@dataclass(frozen=True, slots=True)
class HeldBlock:
    """One cached block as the engine holds it (ground truth)."""

    vllm_hash: int  # u64 int form (last 8 digest bytes, big-endian)
    digest: bytes  # full 32-byte digest (the bytes-hash wire form)
    tokens: tuple[int, ...]
    lora_name: str | None
    cache_salt: str | None
    parent: int | None  # parent's vllm_hash; None at block 0
    position: int  # block index within its request chain
    canonical: int  # Dynamo sequence hash, salt = lora only
    canonical_ns: int  # Dynamo sequence hash with cache-salt namespacing
    parent_canonical: int | None
    parent_canonical_ns: int | None


@dataclass(slots=True)
class ChainState:
    """A request's block chain so far (full blocks only)."""

    lora_name: str | None
    cache_salt: str | None
    digests: list[bytes] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    canon: list[int] = field(default_factory=list)
    canon_ns: list[int] = field(default_factory=list)

    def extra_keys(self, position: int) -> tuple[str, ...] | None:
        """vLLM-style untagged extra keys: LoRA name on every block, cache salt on block 0."""
        keys: list[str] = []
        if self.lora_name:
            keys.append(self.lora_name)
        if position == 0 and self.cache_salt:
            keys.append(self.cache_salt)
        return tuple(keys) if keys else None

    def extend(self, root: bytes, window: tuple[int, ...]) -> HeldBlock:
        """Hash the next full block of the chain and return its (not yet cached) record."""
        pos = len(self.hashes)
        parent_digest = self.digests[-1] if self.digests else root
        digest = vllm_digest(parent_digest, window, self.extra_keys(pos))
        salt = dynamo_salt(self.lora_name, self.cache_salt, namespacing=False)
        salt_ns = dynamo_salt(self.lora_name, self.cache_salt, namespacing=True)
        pc = self.canon[-1] if self.canon else None
        pcn = self.canon_ns[-1] if self.canon_ns else None
        blk = HeldBlock(
            vllm_hash=digest_to_u64(digest),
            digest=digest,
            tokens=window,
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            parent=self.hashes[-1] if self.hashes else None,
            position=pos,
            canonical=dynamo_chain(pc, dynamo_block_hash(window, salt)),
            canonical_ns=dynamo_chain(pcn, dynamo_block_hash(window, salt_ns)),
            parent_canonical=pc,
            parent_canonical_ns=pcn,
        )
        self.digests.append(digest)
        self.hashes.append(blk.vllm_hash)
        self.canon.append(blk.canonical)
        self.canon_ns.append(blk.canonical_ns)
        return blk


class BlockManager:
    """Fixed-capacity block pool with a prefix cache. Not thread-safe (one scheduler owns it).

    Physical blocks are ids; ``refs``/``free_lru`` count and order ids, ``by_hash`` lists the ids
    holding each hash (oldest first)."""

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity <= 0 or block_size <= 0:
            raise ValueError("capacity and block_size must be positive")
        self.capacity = capacity
        self.block_size = block_size
        self.phys: dict[int, HeldBlock] = {}
        self.by_hash: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}
        self.free_lru: OrderedDict[int, None] = OrderedDict()  # ref-0 cached ids, oldest first
        self.uncached_in_use = 0  # partial (not yet hashable) blocks held by requests
        self._next_id = 0

    @property
    def cached(self) -> dict[int, HeldBlock]:
        """Held hash → its block (one entry per hash, however many copies)."""
        return {h: self.phys[ids[0]] for h, ids in self.by_hash.items()}

    def lookup(self, h: int) -> int | None:
        """The physical block a prefix-cache hit on ``h`` uses, or None."""
        ids = self.by_hash.get(h)
        return ids[0] if ids else None

    def copies(self, h: int) -> int:
        return len(self.by_hash.get(h, ()))

    # ---- accounting ----
    def free_slots(self) -> int:
        return self.capacity - len(self.phys) - self.uncached_in_use

    def can_allocate(self, n: int) -> bool:
        return self.free_slots() + len(self.free_lru) >= n

    def used_blocks(self) -> int:
        """Blocks pinned by running requests (what vLLM reports as KV usage)."""
        return self.capacity - self.free_slots() - len(self.free_lru)

    # ---- operations ----
    def ref(self, pid: int) -> None:
        self.refs[pid] += 1
        self.free_lru.pop(pid, None)

    def unref(self, pid: int) -> None:
        n = self.refs[pid] - 1
        self.refs[pid] = n
        if n == 0:
            self.free_lru[pid] = None

    def allocate(self, n: int, removed: list[HeldBlock]) -> bool:
        """Reserve ``n`` uncached slots, evicting LRU cached blocks (appended to ``removed``)."""
        if not self.can_allocate(n):
            return False
        while self.free_slots() < n:
            pid, _ = self.free_lru.popitem(last=False)
            del self.refs[pid]
            blk = self.phys.pop(pid)
            ids = self.by_hash[blk.vllm_hash]
            ids.remove(pid)
            if not ids:
                del self.by_hash[blk.vllm_hash]
            removed.append(blk)
        self.uncached_in_use += n
        return True

    def commit_full(self, blk: HeldBlock, dedupe: bool = True) -> tuple[int, bool]:
        """Turn a reserved slot into cached block ``blk``: ``(id, True)`` for a new physical block
        (one more copy when the hash is held and ``dedupe`` is off), ``(id of the held block,
        False)`` when ``dedupe`` merges it into the held copy (the slot goes back to free)."""
        self.uncached_in_use -= 1
        held = self.lookup(blk.vllm_hash)
        if dedupe and held is not None:
            self.ref(held)
            return held, False
        pid = self._next_id
        self._next_id += 1
        self.phys[pid] = blk
        self.by_hash.setdefault(blk.vllm_hash, []).append(pid)
        self.refs[pid] = 1
        return pid, True

    def release_partial(self, n: int = 1) -> None:
        self.uncached_in_use -= n

    def clear(self) -> None:
        """Drop every cached block (reset_prefix_cache); callers must have released requests."""
        self.phys.clear()
        self.by_hash.clear()
        self.refs.clear()
        self.free_lru.clear()
        self.uncached_in_use = 0

    def ground_truth(self, cache_salt_namespacing: bool = False) -> set[int]:
        """Dynamo canonical sequence hashes of every held block."""
        if cache_salt_namespacing:
            return {b.canonical_ns for b in self.phys.values()}
        return {b.canonical for b in self.phys.values()}
