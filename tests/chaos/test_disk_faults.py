"""Real file-system faults under the state directory and the hot upgrade's cut directory.

The other state tests inject ``ENOSPC`` through a Python-level writer; these mount a small tmpfs
(as root on Linux; skipped elsewhere) and let the kernel refuse: the disk fills up during
checkpoints and the clean stop's save, turns read-only, is removed or opened up to others while
the relay runs, and the runtime directory of a hot upgrade is full or read-only. Each time the
relay keeps ingesting and serving, the previous good file stays byte for byte, no temporary file
is left, the failures are counted and logged at a bounded rate, checkpointing resumes by itself
once the disk is usable again, and a restart restores an exact state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from kvrelay.ops.upgrade import UpgradeFailed, Upgrader
from kvrelay.relay import checkpoint, state_file, takeover
from kvrelay.sim.engine import SimEngine
from tests.ops.test_upgrade import CHILD, _dirs, _listener
from tests.relay.test_handover import _cfg, _exact, _live, _relay, _settings
from tests.support.fleet import eventually


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own (mode 0700), unmounted after the test."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        _mount("-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt))
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"mounting a tmpfs is not permitted here: {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def _fill(mnt: Path) -> Path:
    """Fill the file system to the last byte; the filler's path (unlink it to free the disk)."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                continue
    finally:
        os.close(fd)
    return filler


@pytest.fixture
async def fleet() -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(_cfg("df0", 601)), SimEngine(_cfg("df1", 602))]
    for e in engines:
        await e.start()
    yield engines
    for e in engines:
        await e.stop()


def _events(
    logs: list[MutableMapping[str, Any]], name: str
) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def _traffic(fleet: list[SimEngine], steps: int = 4) -> None:
    for e in fleet:
        await e.step(steps)


async def test_a_full_state_directory_keeps_the_last_checkpoint_and_checkpoints_resume(
    fleet: list[SimEngine], small_fs: Path
) -> None:
    state = small_fs / "state"
    settings = dataclasses.replace(_settings(fleet, state), checkpoint_interval_s=0.1)
    saves: dict[str, int]
    with structlog.testing.capture_logs() as logs:
        async with _relay(fleet, settings) as r:
            saves = r.relay.state_saves
            await _live(r, 4)
            await _traffic(fleet, 16)
            await eventually(lambda: saves.get("checkpointed", 0) >= 2, what="checkpoints")
            filler = _fill(small_fs)
            await eventually(lambda: saves.get("checkpoint_failed", 0) >= 1, what="a failure")
            (path,) = state.iterdir()
            good = path.read_bytes()
            failed = saves["checkpoint_failed"]
            await _traffic(fleet)  # ingest goes on meanwhile
            await eventually(lambda: saves["checkpoint_failed"] >= failed + 8, what="failures")
            await eventually(lambda: _exact(r.relay, fleet), what="exact on a full disk")
            assert list(state.iterdir()) == [path], "no temporary file left"
            assert path.read_bytes() == good, "the last good checkpoint stays, byte for byte"
            lines = _events(logs, "state_checkpoint_failed")
            assert len(lines) == 1, f"one line per reason a minute, not per failure: {lines}"
            assert lines[0]["reason"] == "ENOSPC"
            filler.unlink()
            written = saves["checkpointed"]
            await eventually(lambda: saves["checkpointed"] > written, what="resumed by itself")
            assert path.read_bytes() != good and state_file.read(path).header["members"]
            (resumed,) = _events(logs, "state_checkpoint_resumed")
            assert resumed["failures"] >= 9
            await _traffic(fleet)
            await eventually(lambda: _exact(r.relay, fleet), what="exact")
            await eventually(lambda: saves["checkpointed"] > written + 1, what="a checkpoint")
            filler = _fill(small_fs)  # the clean stop's save cannot be written either
            await asyncio.sleep(0.3)
            await r.relay.checkpoints.drain()
            good = path.read_bytes()
    assert saves["failed"] == 1 and "saved" not in saves
    assert list(state.iterdir()) == [path] and path.read_bytes() == good
    filler.unlink()
    async with _relay(fleet, settings) as r:  # restores the last checkpoint: exact
        await eventually(lambda: _exact(r.relay, fleet), what="exact after the restart")
        await eventually(lambda: not r.pool.restore.awaiting, what="vouched")
        assert r.relay.state_restores == {"restored": 1}
        assert r.pool.counters.member_resets == {}, "every member resumed from the checkpoint"


async def test_a_read_only_removed_or_opened_up_state_directory_is_survived(
    fleet: list[SimEngine], small_fs: Path
) -> None:
    state = small_fs / "state"
    settings = dataclasses.replace(_settings(fleet, state), checkpoint_interval_s=0.1)
    with structlog.testing.capture_logs() as logs:
        async with _relay(fleet, settings) as r:
            saves = r.relay.state_saves
            await _live(r, 4)
            await _traffic(fleet, 16)
            await eventually(lambda: saves.get("checkpointed", 0) >= 1, what="a checkpoint")
            for _ in range(20):  # refused (EBUSY) while a checkpoint has its file open
                await r.relay.checkpoints.drain()
                try:
                    _mount("-o", "remount,ro", str(small_fs))
                    break
                except subprocess.CalledProcessError:
                    await asyncio.sleep(0.02)
            else:
                pytest.fail("the tmpfs could not be remounted read-only")
            try:
                failed = saves.get("checkpoint_failed", 0)
                await eventually(lambda: saves.get("checkpoint_failed", 0) >= failed + 5,
                                 what="read-only failures")  # fmt: skip
                await _traffic(fleet)
                await eventually(lambda: _exact(r.relay, fleet), what="exact, read-only")
            finally:
                _mount("-o", "remount,rw", str(small_fs))
            reasons = [e["reason"] for e in _events(logs, "state_checkpoint_failed")]
            assert reasons == ["EROFS"]
            written = saves["checkpointed"]
            await eventually(lambda: saves["checkpointed"] > written, what="resumed after ro")
            await r.relay.checkpoints.drain()
            shutil.rmtree(state)  # removed: made again, private, by the next checkpoint
            written = saves["checkpointed"]
            await eventually(lambda: saves["checkpointed"] > written, what="resumed after rm")
            assert (state.stat().st_mode & 0o777) == 0o700
            await r.relay.checkpoints.drain()
            state.chmod(0o777)  # writable by others: nothing more is written there
            before = sorted(p.name for p in state.iterdir())
            unsafe = saves.get("unsafe_dir", 0)
            await eventually(lambda: saves.get("unsafe_dir", 0) >= unsafe + 3, what="refused")
            assert sorted(p.name for p in state.iterdir()) == before
            state.chmod(0o700)
            written = saves["checkpointed"]
            await eventually(lambda: saves["checkpointed"] > written, what="resumed after chmod")
            await _traffic(fleet)
            await eventually(lambda: _exact(r.relay, fleet), what="exact")
    assert [p.name for p in state.iterdir() if p.name.startswith(".")] == [], "no temporary file"
    async with _relay(fleet, settings) as r:
        await eventually(lambda: _exact(r.relay, fleet), what="exact after the restart")
        assert r.relay.state_restores == {"restored": 1}


async def test_a_hot_upgrade_cut_into_a_full_runtime_directory_fails_and_cleans_up(
    fleet: list[SimEngine], small_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(small_fs))
    async with _relay(fleet, _settings(fleet, tmp_path / "state")) as r:
        await _live(r, 4)
        await _traffic(fleet, 16)
        await eventually(lambda: _exact(r.relay, fleet), what="exact")
        filler = _fill(small_fs)

        async def cut(d: Path) -> dict[str, object]:
            c = await takeover.cut_aside(r.relay.pools, d)
            return {"pools": list(c.pools)}

        lst = _listener()
        try:
            up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", CHILD, "serve"])
            with pytest.raises(UpgradeFailed) as info:
                await up.run(cut, lambda pid: None)
            assert info.value.result == "cut_failed" and "No space left" in str(info.value)
            assert up.proc is not None and up.proc.poll() is not None, "successor stopped"
            assert _dirs(small_fs) == [], "the cut's directory and partial files removed"
            filler.unlink()
            await _traffic(fleet)
            await eventually(lambda: _exact(r.relay, fleet), what="the old process serves on")
        finally:
            lst.close()


async def test_a_hot_upgrade_without_a_writable_runtime_directory_fails_typed(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the ``OSError`` of making the cut's directory escaped ``Upgrader.run``, so the
    daemon's upgrade task died with it, neither logged as ``upgrade_failed`` nor counted."""
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(small_fs))
    _mount("-o", "remount,ro", str(small_fs))
    lst = _listener()
    cuts: list[Path] = []

    async def cut(d: Path) -> dict[str, object]:
        cuts.append(d)
        return {}

    try:
        up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", CHILD, "serve"])
        with pytest.raises(UpgradeFailed) as info:
            await up.run(cut, lambda pid: None)
        assert info.value.result == "cut_failed" and "Read-only" in str(info.value)
        assert up.proc is None and cuts == [], "no successor started, nothing cut"
    finally:
        lst.close()


def test_failure_reasons_are_typed() -> None:
    assert checkpoint.failure_reason(OSError(28, "No space left on device")) == "ENOSPC"
    assert checkpoint.failure_reason(PermissionError(13, "Permission denied")) == "EACCES"
    assert checkpoint.failure_reason(ValueError("x")) == "ValueError"
