"""Periodic checkpoints (``[relay] checkpoint_interval_s``, ``relay/checkpoint.py``) over real
sockets: written while the relay runs and ingests, each one complete or none, and a start from a
checkpoint (what a crash leaves) resumes every member from its checkpointed cursor once its engine
vouches for it. The real SIGKILL of a daemon process is ``tests/chaos/test_crash.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from kvrelay.relay import safe_files, state_file
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


def test_a_write_that_fails_midway_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p.kvstate"
    old = {"a": np.arange(10, dtype=np.uint64)}
    state_file.write(path, {"n": 1}, old)
    calls = {"n": 0}
    real = safe_files.write_all

    def full_disk(fd: int, data: bytes | memoryview) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(safe_files, "write_all", full_disk)
    with pytest.raises(OSError, match="No space"):
        state_file.write(path, {"n": 2}, {"a": np.arange(1 << 16, dtype=np.uint64)})
    assert [p.name for p in tmp_path.iterdir()] == ["p.kvstate"], "no temporary file left"
    parsed = state_file.read(path)
    assert parsed.header == {"n": 1} and np.array_equal(parsed.arrays["a"], old["a"])
