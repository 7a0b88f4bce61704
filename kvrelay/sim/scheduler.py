"""One DP rank's scheduler: admits requests, prefills, decodes, finishes; yields KV events.

Events are produced in an encoding-neutral form (``Stored``/``Removed``/``Cleared``); the engine
renders them in the configured era and hash mode. One call to ``step`` = one vLLM scheduler step.

``eagle``: SGLang's EAGLE radix keys are token *bigrams*, so a page of ``B`` keys spans ``B + 1``
tokens and becomes hashable one token later; its block's window is those ``B + 1`` tokens (the
Dynamo EAGLE_V1 window). Physical block accounting is unchanged.

``copies`` (vLLM): a newly filled block is never merged into a cached one with the same hash, and
a prefix-cache hit is capped so that the prompt's last token is computed: a fully cached prompt
of whole blocks recomputes its last block into a second physical block under the same hash;
``drop_last_hit`` (vLLM with EAGLE/MTP) also drops the last hit block and recomputes it. With
``report_reused`` the hit (after both rules) is re-announced as a store from block 0.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from kvrelay.sim.blocks import BlockManager, ChainState, HeldBlock
from kvrelay.sim.traffic import RequestSpec, TrafficGenerator


@dataclass(frozen=True, slots=True)
class Stored:
    parent_hash: int | None  # None when blocks[0] is block 0 of its chain
    parent_digest: bytes | None
    blocks: tuple[HeldBlock, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    vllm_hash: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


SimEvent = Stored | Removed | Cleared


class _Request:
    __slots__ = ("chain", "max_new", "partial", "pids", "spec", "tokens")

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.tokens = list(spec.prompt)
        self.chain = ChainState(spec.lora_name, spec.cache_salt)
        self.max_new = spec.max_new_tokens
        self.partial = 0  # reserved, not-yet-full slots held
        self.pids: list[int] = []  # physical block of each chain block


class RankScheduler:
    """Deterministic per-rank engine core (block pool + running set + waiting queue)."""

    def __init__(
        self,
        blocks: BlockManager,
        traffic: TrafficGenerator,
        root_digest: bytes,
        max_running: int,
        max_waiting: int = 256,
        report_reused: bool = False,
        eagle: bool = False,
        copies: bool = False,
        drop_last_hit: bool = False,
    ) -> None:
        self.blocks = blocks
        self.traffic = traffic
        self.root = root_digest
        self.max_running = max_running
        self.report_reused = report_reused  # kv_cache_report_mode="full": re-announce hits
        self.eagle = eagle
        self.copies = copies
        self.drop_last_hit = drop_last_hit
        self.running: list[_Request] = []
        self.waiting: deque[RequestSpec] = deque(maxlen=max_waiting)  # full: oldest dropped
        self.gen_rng = random.Random(traffic.rng.getrandbits(64))
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.finished = 0
        self.generated_tokens = 0  # every decoded token (vllm:generation_tokens_total)
        self.rejected = 0  # prompts that can never fit in the pool (dropped, like a 400)
        self.dropped_waiting = 0  # arrivals discarded because the waiting queue was full

    # ---- helpers ----
    def _hashable(self, n_tokens: int) -> int:
        """Blocks of a request with ``n_tokens`` tokens that are full enough to be cached."""
        bs = self.blocks.block_size
        return max(0, n_tokens - 1) // bs if self.eagle else n_tokens // bs

    def _window(self, tokens: list[int], i: int) -> tuple[int, ...]:
        bs = self.blocks.block_size
        return tuple(tokens[i * bs : (i + 1) * bs + (1 if self.eagle else 0)])

    def _stores_from(self, req: _Request, start: int, end: int, out: list[SimEvent]) -> None:
        """Cache the request's full blocks [start, end) as contiguous store runs."""
        run: list[HeldBlock] = []
        run_parent: tuple[int | None, bytes | None] = (None, None)
        for i in range(start, end):
            parent = (req.chain.hashes[-1], req.chain.digests[-1]) if i > 0 else (None, None)
            blk = req.chain.extend(self.root, self._window(req.tokens, i))
            req.partial -= 1
            pid, new = self.blocks.commit_full(blk, dedupe=not self.copies)
            req.pids.append(pid)
            if new:
                if not run:
                    run_parent = parent
                run.append(blk)
            elif run:
                out.append(Stored(run_parent[0], run_parent[1], tuple(run)))
                run = []
        if run:
            out.append(Stored(run_parent[0], run_parent[1], tuple(run)))

    def _admit(self, spec: RequestSpec, out: list[SimEvent]) -> bool:
        bm, bs = self.blocks, self.blocks.block_size
        req = _Request(spec)
        n_full = self._hashable(len(req.tokens))
        need_total = (len(req.tokens) + 1 + bs - 1) // bs  # room for the first generated token
        # longest cached prefix (hash chain, so a hit implies identical content)
        probe = ChainState(spec.lora_name, spec.cache_salt)
        hits = 0
        for i in range(n_full):
            blk = probe.extend(self.root, self._window(req.tokens, i))
            if bm.lookup(blk.vllm_hash) is None:
                break
            hits += 1
        if self.copies:
            hits = min(hits, (len(req.tokens) - 1) // bs)  # the last token is always computed
            if self.drop_last_hit and hits:
                hits -= 1
        pids = [bm.lookup(h) for h in probe.hashes[:hits]]
        hit_ids = [p for p in pids if p is not None]
        for pid in hit_ids:
            bm.ref(pid)
        removed: list[HeldBlock] = []
        if not bm.allocate(need_total - hits, removed):
            for pid in hit_ids:
                bm.unref(pid)
            return False
        out.extend(Removed(b.vllm_hash, b.digest) for b in removed)
        req.chain.digests = probe.digests[:hits]
        req.chain.hashes = probe.hashes[:hits]
        req.chain.canon = probe.canon[:hits]
        req.chain.canon_ns = probe.canon_ns[:hits]
        req.pids = hit_ids
        req.partial = need_total - hits
        if self.report_reused and hits:
            out.append(Stored(None, None, tuple(bm.phys[p] for p in hit_ids)))
        self.prefix_queries += len(req.tokens)
        self.prefix_hits += hits * bs
        self._stores_from(req, hits, n_full, out)
        self.running.append(req)
        return True

    def _release(self, req: _Request) -> None:
        for pid in reversed(req.pids):  # tail first: evicted before shared prefixes
            self.blocks.unref(pid)
        self.blocks.release_partial(req.partial)
        req.partial = 0

    # ---- public ----
    def step(self, loras: list[str], admit: bool = True) -> list[SimEvent]:
        out: list[SimEvent] = []
        bm, bs = self.blocks, self.blocks.block_size
        vocab = self.traffic.cfg.vocab
        # decode one token for every running request
        done: list[_Request] = []
        for req in self.running:
            req.tokens.append(self.gen_rng.randint(vocab[0], vocab[1]))
            req.max_new -= 1
            self.generated_tokens += 1
            n_full = self._hashable(len(req.tokens))
            if n_full > len(req.chain.hashes):
                self._stores_from(req, len(req.chain.hashes), n_full, out)
            if len(req.tokens) % bs == 0 and req.max_new > 0:  # a physical block filled up
                removed: list[HeldBlock] = []
                if bm.allocate(1, removed):
                    req.partial += 1
                else:
                    req.max_new = 0  # preempted: no room to grow
                out.extend(Removed(b.vllm_hash, b.digest) for b in removed)
            if req.max_new <= 0:
                done.append(req)
        for req in done:
            self.running.remove(req)
            self._release(req)
            self.finished += 1
        if admit:
            for _ in range(self.traffic.arrivals()):
                spec = self.traffic.next_request(loras, bs)
                for _ in range(self.traffic.siblings()):
                    self._enqueue(spec)
        while self.waiting and len(self.running) < self.max_running:
            head = self.waiting[0]
            if len(head.prompt) // bs + 1 > bm.capacity:
                self.waiting.popleft()
                self.rejected += 1
                continue
            if not self._admit(head, out):
                break
            self.waiting.popleft()
        return out

    def _enqueue(self, spec: RequestSpec) -> None:
        if len(self.waiting) == self.waiting.maxlen:
            self.dropped_waiting += 1  # deque drops the oldest waiting request
        self.waiting.append(spec)

    def submit(self, spec: RequestSpec) -> None:
        """Queue an explicit request (tests use this to control prompts exactly)."""
        self._enqueue(spec)

    def reset(self) -> list[SimEvent]:
        """reset_prefix_cache: abort running requests, clear the cache, emit AllBlocksCleared."""
        for req in self.running:
            self._release(req)
        self.running.clear()
        self.blocks.clear()
        return [Cleared()]

    def wipe(self) -> None:
        """Engine restart: all state gone, nothing published."""
        self.running.clear()
        self.waiting.clear()
        self.blocks.clear()
