"""Periodic checkpoints (``[relay] checkpoint_interval_s``, ``relay/checkpoint.py``) over real
sockets: written while the relay runs and ingests, each one complete or none, and a start from a
checkpoint (what a crash leaves) resumes every member from its checkpointed cursor once its engine
vouches for it. The real SIGKILL of a daemon process is ``tests/chaos/test_crash.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvrelay.pool.batch import BatchBuilder
from kvrelay.pool.ckf import DM_COW
from kvrelay.pool.packed import TM_COW
from kvrelay.pool.pool import Pool
from kvrelay.relay import checkpoint, safe_files, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.sim.engine import SimEngine
from tests.relay.test_handover import BUFFER_STEPS, _cfg, _exact, _live, _relay, _settings
from tests.support.fleet import eventually


@pytest.fixture
async def fleet() -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(_cfg("ck0", 301)), SimEngine(_cfg("ck1", 302))]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.stop()


async def test_a_start_from_a_checkpoint_resumes_every_member(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    state, aside = tmp_path / "state", tmp_path / "aside"
    aside.mkdir()
    settings = dataclasses.replace(_settings(fleet, state), checkpoint_interval_s=0.2)
    async with _relay(fleet, settings) as r:
        await _live(r, 4)
        for _ in range(30):  # 240 steps: far more history than the replay buffers hold
            for e in fleet:
                await e.step(8)
        await eventually(lambda: _exact(r.relay, fleet), what="exact")
        written = r.relay.state_saves.get("checkpointed", 0)
        await eventually(lambda: r.relay.state_saves.get("checkpointed", 0) >= written + 2,
                         what="checkpoints after the history")  # fmt: skip
        (ckpt,) = state.iterdir()
        shutil.copy(ckpt, aside / ckpt.name)  # what a crash right now would leave
        assert r.metric("kvrelay_state_checkpoint_timestamp_seconds",
                        pool="ns/backend/generate") > 0  # fmt: skip
        for e in fleet:  # after the checkpoint, within the replay window
            await e.step(BUFFER_STEPS // 2)
    for f in state.iterdir():
        f.unlink()  # the clean stop's save is not what a crash leaves
    shutil.copy(aside / ckpt.name, state / ckpt.name)
    async with _relay(fleet, settings) as r:
        await eventually(lambda: _exact(r.relay, fleet), what="exact from the checkpoint")
        await eventually(lambda: r.pool.counters.members_vouched == 4, what="vouched")
        assert r.pool.counters.members_resumed == 4
        assert r.pool.counters.member_resets == {}, "every member resumed, none rebuilt"
        assert r.relay.state_restores == {"restored": 1}


async def test_checkpoints_off_write_nothing_while_running(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    settings = dataclasses.replace(_settings(fleet, tmp_path), checkpoint_interval_s=0.0)
    async with _relay(fleet, settings) as r:
        await _live(r, 4)
        for e in fleet:
            await e.step(4)
        await asyncio.sleep(1.5)  # several ticks of the relay
        assert "checkpointed" not in r.relay.state_saves
        assert list(tmp_path.iterdir()) == []
    assert r.relay.state_saves == {"saved": 1}, "a clean stop still saves"


async def test_a_reload_that_shortens_the_interval_applies_at_once(
    fleet: list[SimEngine], tmp_path: Path
) -> None:
    """The next checkpoint was set from the interval in force when the last one ran: a reload
    from an hour to a fraction of a second waited out the hour. It is taken on the new interval
    now."""
    settings = dataclasses.replace(_settings(fleet, tmp_path), checkpoint_interval_s=3600.0)
    async with _relay(fleet, settings) as r:
        await _live(r, 4)
        await asyncio.sleep(1.2)  # ticks of the relay under the hour
        assert "checkpointed" not in r.relay.state_saves
        await r.relay.reconfigure(dataclasses.replace(settings, checkpoint_interval_s=0.2))
        await eventually(lambda: r.relay.state_saves.get("checkpointed", 0) >= 2,
                         what="checkpoints on the new interval", timeout=5)  # fmt: skip


@pytest.mark.parametrize("direct", [True, False])
def test_a_write_that_fails_midway_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    path = tmp_path / "p.kvstate"
    old = {"a": np.arange(10, dtype=np.uint64)}
    state_file.write(path, {"n": 1}, old, direct=direct)
    calls = {"n": 0}
    real = safe_files.write_all

    def full_disk(fd: int, data: bytes | memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(safe_files, "write_all", full_disk)
    with pytest.raises(OSError, match="No space"):  # 4 MiB: several writes either way
        state_file.write(path, {"n": 2}, {"a": np.arange(1 << 19, dtype=np.uint64)},
                         direct=direct)  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["p.kvstate"], "no temporary file left"
    parsed = state_file.read(path)
    assert parsed.header == {"n": 1} and np.array_equal(parsed.arrays["a"], old["a"])


def _pool_and_spec() -> tuple[Pool, PoolSpec, PoolIdentity]:
    pool = Pool(1 << 12, 7, 1, 1)
    spec = PoolSpec(namespace="ns", component="c", endpoint="e", expected_blocks=1 << 12,
                    engines=(EngineSpec(name="e0", host="127.0.0.1", grpc_port=1),))  # fmt: skip
    return pool, spec, PoolIdentity(model="m", model_source="m", block_size=1)


def _store(pool: Pool, member: int, first: int, n: int) -> None:
    bb = BatchBuilder()
    for h in range(first, first + n):
        bb.store([h], [h & 0x7FFF_FFFF])
    pool.apply(member, bb.build())
    pool.take_publication()


async def test_a_checkpoint_written_while_the_pool_changes_holds_the_cut(tmp_path: Path) -> None:
    """No fork: the writer thread reads an image of the pool (``Pool.open_image``) while the
    event loop goes on applying batches. The file holds the state of the instant of the cut,
    byte for byte (a plain copy of ``export_state`` then is the oracle), and a restore of it is
    that pool."""
    pool, spec, ident = _pool_and_spec()
    mids = [pool.add_member(w, 0) for w in range(3)]
    for i, m in enumerate(mids):
        _store(pool, m, (i + 1) << 32, 40_000)
    results: list[str] = []
    # read paced (4 MiB/s: about half a second for this pool) so that the changes below land
    # while the image is open however the writer thread and the loop are scheduled (with the
    # other core busy, an unpaced writer finished reading before the first change: nothing was
    # captured)
    ck = checkpoint.Checkpointer(results.append, rate=lambda: 4 << 20)
    meta, arrays = pool.export_state()
    oracle = {k: a.copy() for k, a in arrays.items()}
    members = [MemberResume(w, 0, f"e{w}", "", 100 + w, w) for w in range(3)]
    assert ck.submit("ns/c/e", tmp_path, lambda: checkpoint.Cut(spec, ident, pool, members))
    assert ck.busy("ns/c/e") and not ck.submit("ns/c/e", tmp_path, lambda: None)
    h, n = 9 << 40, 0
    while ck.busy("ns/c/e"):  # ingest goes on: stores, a member cleared, one removed
        _store(pool, mids[n % 3], h, 300)
        h, n = h + 300, n + 1
        if n == 5:
            pool.reset_member(mids[0])
        if n == 9:
            pool.remove_member(mids[1])
            mids[1] = pool.add_member(7, 0)
        await asyncio.sleep(0.001)
    assert results == ["checkpoint_busy", "checkpointed"] and ck.last_captured_bytes > 0
    (path,) = tmp_path.iterdir()
    saved = state_file.read(path)
    assert set(saved.arrays) == set(oracle)
    for name, a in oracle.items():
        assert np.array_equal(saved.arrays[name], a), name
    assert saved.header["pool_meta"] == meta
    assert [m["last_seq"] for m in saved.header["members"]] == [100, 101, 102]
    restored = Pool.from_state(meta, saved.arrays, bucket_count=1 << 12, seed=7, block_size=1,
                               hash_format=1)  # fmt: skip
    assert restored.memberships == 120_000
    assert not pool._own.tm[TM_COW] and not pool._dmeta[DM_COW], "the image was closed"


async def test_an_image_that_overruns_is_abandoned_and_the_previous_file_stays(
    tmp_path: Path,
) -> None:
    pool, spec, ident = _pool_and_spec()
    m = pool.add_member(1, 0)
    _store(pool, m, 1 << 32, 60_000)
    results: list[str] = []
    ck = checkpoint.Checkpointer(results.append)
    cut = checkpoint.Cut(spec, ident, pool, [])
    ck.submit("ns/c/e", tmp_path, lambda: cut)
    await ck.drain()
    (path,) = tmp_path.iterdir()
    before = path.read_bytes()
    # read slowly (256 KiB/s until the side store is a quarter full): the rewrites below then
    # land while the image is open, however the writer thread and the loop are scheduled (on a
    # busy machine an unpaced writer could finish reading before the first rewrite)
    tight = checkpoint.Checkpointer(results.append, rate=lambda: 256 << 10, side_bytes=4096)
    tight.submit("ns/c/e", tmp_path, lambda: cut)
    for h in range(2 << 32, (2 << 32) + 30_000, 1000):  # more chunks rewritten than it keeps
        _store(pool, m, h, 1000)
    await tight.drain()
    assert results == ["checkpointed", "checkpoint_overrun"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary file left"
    assert path.read_bytes() == before


async def test_pools_due_together_are_cut_one_at_a_time(tmp_path: Path) -> None:
    """Each pool's image is taken when the writer is ready for it, so only one is ever armed;
    a pool still waiting is busy, and a stop's drain drops the ones still waiting."""
    cuts: list[str] = []
    results: list[str] = []
    ck = checkpoint.Checkpointer(results.append)
    pools = {}
    for name in ("a", "b", "c"):
        pool, spec, ident = _pool_and_spec()
        _store(pool, pool.add_member(1, 0), 1 << 32, 20_000)
        pools[name] = (pool, dataclasses.replace(spec, endpoint=name), ident)

    def cutter(name: str) -> checkpoint.Cut:
        cuts.append(name)
        assert sum(p._image is not None for p, _, _ in pools.values()) == 0
        pool, spec, ident = pools[name]
        return checkpoint.Cut(spec, ident, pool, [])

    for name in pools:
        assert ck.submit(name, tmp_path, functools.partial(cutter, name))
    assert cuts == ["a"] and all(ck.busy(n) for n in pools)
    while ck.busy("c"):
        await asyncio.sleep(0.01)
    assert cuts == ["a", "b", "c"] and results == ["checkpointed"] * 3
    assert len(list(tmp_path.iterdir())) == 3
    for name in pools:
        ck.submit(name, tmp_path, functools.partial(cutter, name))
    await ck.drain()  # "a" was being written: it ends; "b" and "c" never start
    assert cuts == ["a", "b", "c", "a"] and not any(ck.busy(n) for n in pools)
    ck.close()
