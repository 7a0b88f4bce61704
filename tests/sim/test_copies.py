"""The simulator's physical copies, rule by rule (one rank's scheduler, no sockets): vLLM's capped
prefix hits, EAGLE's dropped last hit block, ``n > 1`` siblings, report mode, and SGLang's merge."""

from __future__ import annotations

from kvrelay.sim.blocks import BlockManager
from kvrelay.sim.hashing import none_digest
from kvrelay.sim.scheduler import RankScheduler, Removed, SimEvent, Stored
from kvrelay.sim.traffic import RequestSpec, TrafficConfig, TrafficGenerator

BS = 4
PROMPT = list(range(100, 100 + 3 * BS))  # three whole blocks


def _rank(**kw: bool) -> RankScheduler:
    traffic = TrafficGenerator(TrafficConfig(arrivals_per_step=0.0), pool_seed=1, stream_seed=2)
    return RankScheduler(BlockManager(64, BS), traffic, none_digest(0), max_running=8, **kw)


def _run(rank: RankScheduler, prompt: list[int], n: int = 1) -> list[SimEvent]:
    for _ in range(n):
        rank.submit(RequestSpec(list(prompt), None, None, 1))
    out = rank.step([])
    out += rank.step([])  # the requests finish (one token each)
    return out


def _stores(events: list[SimEvent]) -> list[Stored]:
    return [e for e in events if isinstance(e, Stored)]


def test_a_fully_cached_block_aligned_prompt_recomputes_its_last_block() -> None:
    rank = _rank(copies=True)
    first = _stores(_run(rank, PROMPT))
    hashes = [b.vllm_hash for b in first[0].blocks]
    (again,) = _stores(_run(rank, PROMPT))
    assert [b.vllm_hash for b in again.blocks] == hashes[2:] and again.parent_hash == hashes[1]
    assert [rank.blocks.copies(h) for h in hashes] == [1, 1, 2]
    assert rank.blocks.ground_truth() == {b.canonical for b in first[0].blocks}


def test_eagle_drops_the_last_hit_block_too() -> None:
    rank = _rank(copies=True, drop_last_hit=True)
    first = _stores(_run(rank, PROMPT))
    hashes = [b.vllm_hash for b in first[0].blocks]
    (again,) = _stores(_run(rank, PROMPT))  # hit capped to 2 blocks, then 1
    assert [b.vllm_hash for b in again.blocks] == hashes[1:] and again.parent_hash == hashes[0]
    assert [rank.blocks.copies(h) for h in hashes] == [1, 2, 2]


def test_siblings_admitted_together_share_all_but_the_recomputed_block() -> None:
    rank = _rank(copies=True)
    stores = _stores(_run(rank, PROMPT, n=3))
    assert len(stores[0].blocks) == 3 and all(len(s.blocks) == 1 for s in stores[1:])
    assert rank.blocks.copies(stores[0].blocks[-1].vllm_hash) == 3


def test_report_mode_reannounces_the_hit_from_block_0() -> None:
    rank = _rank(copies=True, report_reused=True)
    first = _stores(_run(rank, PROMPT))
    report, copy = _stores(_run(rank, PROMPT))
    assert report.parent_hash is None and report.blocks == first[0].blocks[:2]
    assert copy.parent_hash == first[0].blocks[1].vllm_hash


def test_evicting_copies_removes_each_physical_block() -> None:
    rank = _rank(copies=True)
    hashes = [b.vllm_hash for b in _stores(_run(rank, PROMPT))[0].blocks]
    _run(rank, PROMPT)
    big = list(range(5000, 5000 + 63 * BS))  # needs every block: all cached ones evicted
    rank.submit(RequestSpec(big, None, None, 1))
    removed = [e.vllm_hash for e in rank.step([]) if isinstance(e, Removed)]
    assert sorted(removed) == sorted([*hashes, hashes[-1]])  # the last one twice: two copies
    assert not any(rank.blocks.copies(h) for h in hashes)


def test_sglang_merges_a_block_it_already_holds() -> None:
    rank = _rank(copies=False)
    _run(rank, PROMPT)
    assert _stores(_run(rank, PROMPT)) == []  # the whole prompt is a hit: nothing stored
    assert all(len(v) == 1 for v in rank.blocks.by_hash.values())
