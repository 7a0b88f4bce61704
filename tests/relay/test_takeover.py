"""A hot upgrade's live cut (``relay/takeover.py``), over real sockets, two relays in one process.

The first relay keeps ingesting after the cut; the second starts from the cut while the engines
go on publishing, and every member resumes from its cursor through the engines' replay: exact
against the simulator's ground truth, per member, with no member rebuilt, though the history is
many times the replay buffer. A damaged cut refuses the takeover instead of rebuilding; only a
pool the new settings index otherwise starts from replay.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from kvrelay.relay import handover, takeover
from kvrelay.relay.relay import Relay
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually, ground_truth, relay_view
from tests.support.rig import make_settings, stop_relay

BUFFER_STEPS = 8


def _exact(relay: Relay, engines: list[SimEngine]) -> bool:
    if relay.pools[0].generation is None:
        return False
    truth, view = ground_truth(engines), relay_view(relay)
    return all(view.get(k, set()) == v for k, v in truth.items()) and set(view) == set(truth)


def _live(relay: Relay, members: int) -> bool:
    subs = relay.pools[0].subscribers
    return len(subs) == members and all(s.state == "live" for s in subs.values())


async def _started_with_history(relay: Relay, engines: list[SimEngine]) -> None:
    """Start ``relay``, then 240 steps of history (30x the replay buffer) until it is exact."""
    await relay.start()
    await eventually(lambda: _live(relay, 4), what="every member live")
    for _ in range(30):
        for e in engines:
            await e.step(8)
    await eventually(lambda: _exact(relay, engines), what="relay exact")


@pytest.mark.parametrize("where", ["loop", "aside"])
async def test_a_live_cut_resumes_every_member_while_the_old_relay_ingests(
    tmp_path: Path, where: str
) -> None:
    """``aside`` (what a hot upgrade does): the cut is a fork and the old relay ingests while
    the child writes it."""
    engines = [SimEngine(SimConfig(name=f"tk{i}", seed=70 + i, dp_size=2, capacity_blocks=4096,
                                   buffer_steps=BUFFER_STEPS)) for i in range(2)]  # fmt: skip
    for e in engines:
        await e.start()
    settings = make_settings(engines, expected_blocks=16_384)
    old = Relay(settings)
    new: Relay | None = None
    try:
        await _started_with_history(old, engines)
        if where == "loop":
            summary = takeover.cut(old.pools, tmp_path)
        else:
            writing = asyncio.ensure_future(takeover.cut_aside(old.pools, tmp_path))
            await asyncio.sleep(0)  # the fork happens here, before the engines step again
            for e in engines:  # published and ingested while the child writes
                await e.step(2)
            summary = await writing
        assert summary.bytes > 0
        assert summary.pools == ("ns/backend/generate",) and summary.members == 4
        for e in engines:  # the old relay goes on ingesting after the cut
            await e.step(3)
        new = Relay(settings)
        await new.start(takeover.load(new.pools, tmp_path))
        assert list(tmp_path.iterdir()) == []  # the cut is consumed
        for e in engines:
            await e.step(2)
        await eventually(lambda: _exact(new, engines), what="successor exact")  # type: ignore[arg-type]
        await eventually(lambda: _exact(old, engines), what="old relay still exact")
        stats = new.pools[0].stats()
        assert stats.counters["members_resumed"] == 4
        assert sum(stats.member_resets.values()) == 0, stats.member_resets
    finally:
        if new is not None:
            await stop_relay(new)
        await stop_relay(old)
        for e in engines:
            await e.stop()


async def test_a_damaged_cut_refuses_the_takeover(tmp_path: Path) -> None:
    engines = [SimEngine(SimConfig(name="tk9", seed=79, dp_size=1, buffer_steps=BUFFER_STEPS))]
    await engines[0].start()
    settings = make_settings(engines)
    old = Relay(settings)
    try:
        await old.start()
        await eventually(lambda: _live(old, 1), what="member live")
        await engines[0].step(4)
        await eventually(lambda: _exact(old, engines), what="exact")
        takeover.cut(old.pools, tmp_path)
        path = handover.path_for(tmp_path, settings.pools[0])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(takeover.TakeoverRefused) as info:
            takeover.load(Relay(settings).pools, tmp_path)
        assert info.value.kind == "state_corrupt"
    finally:
        await stop_relay(old)
        await engines[0].stop()


async def test_a_pool_the_new_settings_index_otherwise_starts_fresh_the_rest_is_handed_over(
    tmp_path: Path,
) -> None:
    """An upgrade that also changes one pool's hash setting: that pool's cut is of no use to
    the new process (refused as ``incompatible``, consumed) and the pool starts from replay;
    the takeover itself goes on. Any other refusal stays strict (above)."""
    engines = [SimEngine(SimConfig(name="tk7", seed=77, dp_size=1, buffer_steps=BUFFER_STEPS))]
    await engines[0].start()
    settings = make_settings(engines)
    old = Relay(settings)
    try:
        await old.start()
        await eventually(lambda: _live(old, 1), what="member live")
        await engines[0].step(4)
        await eventually(lambda: _exact(old, engines), what="exact")
        takeover.cut(old.pools, tmp_path)
        pool = settings.pools[0]
        changed = dataclasses.replace(settings, pools=(dataclasses.replace(
            pool, hash_format=2 if pool.hash_format == 1 else 1),))  # fmt: skip
        assert takeover.load(Relay(changed).pools, tmp_path) == {}
        assert list(tmp_path.iterdir()) == []
    finally:
        await stop_relay(old)
        await engines[0].stop()


async def test_a_cut_whose_writer_fails_says_why(tmp_path: Path) -> None:
    engines = [SimEngine(SimConfig(name="tk8", seed=78, dp_size=1, buffer_steps=BUFFER_STEPS))]
    await engines[0].start()
    old = Relay(make_settings(engines))
    try:
        await old.start()
        await eventually(lambda: _live(old, 1), what="member live")
        await engines[0].step(4)
        await eventually(lambda: _exact(old, engines), what="exact")
        with pytest.raises(takeover.CutFailed, match="FileNotFoundError"):
            await takeover.cut_aside(old.pools, tmp_path / "gone")
        assert _exact(old, engines)  # the relay itself is untouched
    finally:
        await stop_relay(old)
        await engines[0].stop()


async def test_a_pool_absent_from_the_cut_keeps_its_state_file(tmp_path: Path) -> None:
    """The old process read the pool's state file but never had a generation for it (no engine's
    Control answered), so the cut leaves the pool out. The successor reads that state file as a
    start would: once Control answers, every member resumes from it and the pool is exact,
    though the engines' replay holds a fraction of their history. (It used to be rebuilt from
    replay alone, and its first checkpoint replaced the file.)"""
    engines = [SimEngine(SimConfig(name=f"tu{i}", seed=90 + i, dp_size=2, capacity_blocks=4096,
                                   buffer_steps=BUFFER_STEPS)) for i in range(2)]  # fmt: skip
    for e in engines:
        await e.start()
    state, cut_dir = tmp_path / "state", tmp_path / "cut"
    cut_dir.mkdir()
    settings = dataclasses.replace(
        make_settings(engines, expected_blocks=16_384), state_dir=str(state)
    )
    first = Relay(settings)
    old: Relay | None = None
    new: Relay | None = None
    try:
        await _started_with_history(first, engines)
        await stop_relay(first)  # saves the state file
        for e in engines:
            await e.stop_control()
        old = Relay(settings)
        await old.start()
        assert old.state_restores == {"restored": 1} and old.pools[0].generation is None
        assert takeover.cut(old.pools, cut_dir).pools == ()  # nothing materialized to cut
        # the old process may be writing a checkpoint meanwhile: its temporary file stays
        writing = state / f".{handover.path_for(state, settings.pools[0]).name}.1.x.tmp"
        writing.write_bytes(b"")
        new = Relay(settings)
        await new.start(takeover.load(new.pools, cut_dir))
        assert new.state_restores == {"restored": 1} and writing.exists()
        for e in engines:
            await e.start_control()
        # (the restored state equals the engines' until they step: wait for the resume too)
        await eventually(
            lambda: _exact(new, engines)  # type: ignore[arg-type]
            and new.pools[0].stats().counters["members_resumed"] == 4,  # type: ignore[union-attr]
            what="successor exact, every member resumed",
        )
        stats = new.pools[0].stats()
        assert sum(stats.member_resets.values()) == 0, stats.member_resets
    finally:
        if new is not None:
            await stop_relay(new)
        if old is not None:
            await asyncio.wait_for(old.stop(save_state=False), 30)
        for e in engines:
            await e.stop()
