"""Ground truth: held blocks are self-consistent and their canonical hashes match an
independent recomputation (documented vectors + test-side xxhash code)."""

from __future__ import annotations

from dataclasses import replace

from kvrelay.sim import SimConfig, SimEngine, TrafficConfig, dynamo_sequence_hashes
from kvrelay.sim.blocks import BlockManager, ChainState
from kvrelay.sim.hashing import none_digest
from tests.support.simwire_reader import block_hash, chain, salt

CFG = SimConfig(
    capacity_blocks=80,
    max_running=6,
    grpc_port=None,
    metrics_port=None,
    traffic=TrafficConfig(
        arrivals_per_step=1.5,
        lora_fraction=0.4,
        salt_fraction=0.4,
        system_len=(16, 80),
        user_len=(4, 40),
        max_prompt_tokens=256,
    ),
)


def test_spec_vectors() -> None:
    # docs/contract.md §12.5 vectors (tokens 0..31, bs 16)
    assert dynamo_sequence_hashes(list(range(32)), 16) == [0xD47A8F41C833328A, 0xBF15DFFB16447F38]
    assert dynamo_sequence_hashes([1, 2, 3, 4], 4) == [0xCB38E4D7FB2DCA5C]
    s = salt("adapter-a", None, False)
    assert [block_hash(list(range(16)), s), block_hash(list(range(16, 32)), s)] == [
        0xF1E20C61558F16BB,
        0x17EAB4607C24352E,
    ]


async def test_submitted_prompt_ground_truth_matches_independent_hashes() -> None:
    eng = SimEngine(replace(CFG, traffic=replace(CFG.traffic, arrivals_per_step=0.0)))
    await eng.start()
    try:
        eng.load_lora("adapter-a")
        eng.submit(0, list(range(32)), max_new_tokens=1)
        eng.submit(0, list(range(64)), lora_name="adapter-a", cache_salt="tenant-a")
        await eng.step(1)
        assert eng.ground_truth(0) >= {0xD47A8F41C833328A, 0xBF15DFFB16447F38}
        for ns in (False, True):
            seed = salt("adapter-a", "tenant-a", ns)
            prev, want = None, []
            for i in range(4):
                prev = chain(prev, block_hash(list(range(i * 16, i * 16 + 16)), seed))
                want.append(prev)
            assert set(want) <= eng.ground_truth(0, cache_salt_namespacing=ns)
        assert len(eng.held_blocks(0)) == 6
    finally:
        await eng.stop()


async def test_held_blocks_are_chain_consistent_under_eviction() -> None:
    eng = SimEngine(CFG)
    await eng.start()
    try:
        eng.load_lora("adapter-a")
        eng.load_lora("adapter-b")
        await eng.step(150)
        held = eng.held_blocks(0)
        assert 0 < len(held) <= CFG.capacity_blocks
        orphans = 0
        for h, b in held.items():
            assert h == int.from_bytes(b.digest[-8:], "big")
            assert len(b.tokens) == CFG.block_size
            for ns, canon, pc in (
                (False, b.canonical, b.parent_canonical),
                (True, b.canonical_ns, b.parent_canonical_ns),
            ):
                assert canon == chain(
                    pc, block_hash(list(b.tokens), salt(b.lora_name, b.cache_salt, ns))
                )
            if b.parent is None:
                assert b.position == 0 and b.parent_canonical is None
            elif b.parent in held:
                p = held[b.parent]
                assert p.position == b.position - 1 and p.canonical == b.parent_canonical
                assert (p.lora_name, p.cache_salt) == (b.lora_name, b.cache_salt)
            else:
                orphans += 1  # parent evicted first (shared child still in use), allowed
            # full walk: if every ancestor is held, recompute the chain from tokens alone
            walk, cur = [b], b
            while cur.parent is not None and cur.parent in held:
                cur = held[cur.parent]
                walk.append(cur)
            if cur.parent is None:
                toks = [t for blk in reversed(walk) for t in blk.tokens]
                assert dynamo_sequence_hashes(toks, 16, b.lora_name)[-1] == b.canonical
        assert eng.ground_truth(0) == {b.canonical for b in held.values()}
        bm = eng.schedulers[0].blocks
        assert bm.used_blocks() + bm.free_slots() + len(bm.free_lru) == bm.capacity
        assert orphans < len(held)
    finally:
        await eng.stop()


def test_block_manager_lru_evicts_tail_first() -> None:
    bm = BlockManager(capacity=4, block_size=2)
    chain_state = ChainState(None, None)
    root = none_digest(0)
    assert bm.allocate(3, [])
    blocks = [chain_state.extend(root, (i, i + 1)) for i in range(3)]
    ids = []
    for b in blocks:
        pid, new = bm.commit_full(b)
        assert new
        ids.append(pid)
    for pid in reversed(ids):  # finished request frees tail first
        bm.unref(pid)
    removed: list = []
    assert bm.allocate(2, removed)  # 1 free slot + 1 eviction
    assert [r.vllm_hash for r in removed] == [blocks[2].vllm_hash]
    assert not bm.allocate(5, removed)
    assert set(bm.cached) == {blocks[0].vllm_hash, blocks[1].vllm_hash}


def test_reproducible_across_processes_and_hash_seeds() -> None:
    """Seeded streams must not depend on PYTHONHASHSEED (str hash randomisation)."""
    import os
    import subprocess
    import sys

    code = (
        "import asyncio\n"
        "from kvrelay.sim import SimEngine, SimConfig\n"
        "async def m():\n"
        "    e = SimEngine(SimConfig(grpc_port=None, metrics_port=None, seed=7))\n"
        "    await e.start(); e.load_lora('x'); await e.step(60)\n"
        "    print(sorted(e.ground_truth(0)), e.publishers[0].seq); await e.stop()\n"
        "asyncio.run(m())\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and len(next(iter(outs))) > 100
