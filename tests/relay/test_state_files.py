"""State and pid files where others might reach them (``relay/safe_files.py``, ``state_file``,
``handover.load``, ``ops/reload`` pid files): unsafe directories refused, links never followed,
planted temporary names never opened, a planted FIFO refused without blocking, oversized files
refused unread, bounded memory, and a file that could not be read is not deleted."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvrelay.ops.reload import read_pid_file, remove_pid_file, write_pid_file
from kvrelay.pool.pool import Pool
from kvrelay.relay import handover, safe_files, state_file
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.settings import EngineSpec, PoolSpec

SPEC = PoolSpec(namespace="ns", component="c", endpoint="e", expected_blocks=4096,
                engines=(EngineSpec(name="e0", host="127.0.0.1", grpc_port=1),))


def _arrays(mib: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    n = (mib << 20) // 8
    return {"a": rng.integers(0, 2**63, n, dtype=np.uint64),
            "b": rng.integers(0, 2**31, n // 2, dtype=np.uint32),
            "flags": np.ones(1001, dtype=np.bool_)}  # fmt: skip


def test_a_group_or_world_writable_or_foreign_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    safe_files.check_private_dir(d)
    for mode in (0o770, 0o702, 0o1777):
        d.chmod(mode)
        with pytest.raises(safe_files.UnsafeDirectory, match="writable"):
            safe_files.check_private_dir(d)
    d.chmod(0o700)
    os.chown(d, 4321, -1)  # the suite runs as root: hand the directory to another user
    with pytest.raises(safe_files.UnsafeDirectory, match="owned by uid 4321"):
        safe_files.check_private_dir(d)
    # a pid file's directory may be another user's (``/run``) or sticky (``/tmp``)
    safe_files.check_private_dir(d, owner=False)
    d.chmod(0o1777)
    safe_files.check_private_dir(d, owner=False)
    d.chmod(0o777)
    with pytest.raises(safe_files.UnsafeDirectory):
        safe_files.check_private_dir(d, owner=False)


def test_a_planted_temporary_name_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    names = iter(["aaaa", "aaaa", "bbbb"])
    monkeypatch.setattr(safe_files.secrets, "token_hex", lambda _n: next(names))
    planted = tmp_path / f".x.{os.getpid()}.aaaa.tmp"
    planted.symlink_to(victim)
    fd, tmp = safe_files.create_temp(tmp_path, "x")
    safe_files.abandon(fd, tmp)
    assert tmp.name == f".x.{os.getpid()}.bbbb.tmp"
    assert victim.read_bytes() == b"keep me" and planted.is_symlink()


def test_a_symlinked_state_file_is_not_followed_nor_deleted(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 100)
    path = handover.path_for(tmp_path, SPEC)
    path.symlink_to(target)
    with pytest.raises(handover.Refused) as err:
        handover.load(tmp_path, SPEC, max_age_s=60)
    assert err.value.kind == "unreadable"
    assert path.is_symlink() and target.read_bytes() == b"x" * 100, "a read error keeps the file"
    # a write replaces the link itself, never what it points to
    state_file.write(path, {"k": 1}, {"a": np.arange(4, dtype=np.uint64)})
    assert not path.is_symlink() and target.read_bytes() == b"x" * 100
    assert state_file.read(path).header == {"k": 1}


def _within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``'s result or exception, failing the test if it has not returned in time (a
    daemon thread: a blocked open cannot hang the suite)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still blocked after {seconds} s"
    return out[0]


def test_a_fifo_at_the_state_or_pid_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: a planted one would hang the start for
    good (the restore runs on the event loop) or ``kvrelay reload``."""
    path = handover.path_for(tmp_path, SPEC)
    os.mkfifo(path, 0o600)
    got = _within(5, lambda: handover.load(tmp_path, SPEC, max_age_s=60))
    assert isinstance(got, handover.Refused), got
    pid = tmp_path / "kvrelay.pid"
    os.mkfifo(pid, 0o600)
    got = _within(5, lambda: read_pid_file(pid))
    assert isinstance(got, ValueError) and "not a regular file" in str(got), got


def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = handover.path_for(tmp_path, SPEC)
    state_file.write(path, {"k": 1}, {"a": np.arange(4, dtype=np.uint64)})
    with open(path, "r+b") as f:  # sparse: the size says 64 GiB, the disk holds almost nothing
        f.truncate(handover.max_state_bytes(SPEC) + 1)
    tracemalloc.start()
    try:
        with pytest.raises(handover.Refused) as err:
            handover.load(tmp_path, SPEC, max_age_s=60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.kind == "oversized"
    assert peak < 1 << 20, peak
    assert not path.exists(), "an unusable file that was examined is consumed"


def test_save_and_load_stay_within_half_the_state_over_it(tmp_path: Path) -> None:
    arrays = _arrays(48)
    state = sum(a.nbytes for a in arrays.values())
    path = tmp_path / "s.kvstate"
    tracemalloc.start()
    try:
        state_file.write(path, {"k": 1}, arrays)
        save_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        parsed = state_file.read(path)
        load_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert save_peak < 0.5 * state, (save_peak, state)  # nothing beyond the arrays themselves
    assert load_peak < 1.5 * state, (load_peak, state)  # the arrays, and not much more
    for k, a in arrays.items():
        assert np.array_equal(parsed.arrays[k], a) and parsed.arrays[k].flags.owndata


def test_a_restore_takes_the_read_arrays_without_copying_them(tmp_path: Path) -> None:
    pool = Pool(64, 7, 4, 1)
    pool.add_member(1, 0)
    meta, arrays = pool.export_state()
    path = tmp_path / "p.kvstate"
    state_file.write(path, {}, arrays)
    read = state_file.read(path).arrays
    restored = Pool.from_state(meta, read, bucket_count=64, seed=7, block_size=4, hash_format=1,
                               take=True)  # fmt: skip
    assert restored._own.w is read["own.w"]
    copied = Pool.from_state(meta, arrays, bucket_count=64, seed=7, block_size=4, hash_format=1)
    assert copied._own.w is not arrays["own.w"], "without take the caller's arrays stay its own"


def test_truncations_and_flips_anywhere_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.kvstate"
    state_file.write(path, {"k": 1}, {"a": np.arange(100, dtype=np.uint64),
                                      "b": np.ones(3, dtype=np.bool_)})  # fmt: skip
    data = path.read_bytes()
    assert state_file.decode(data).header == {"k": 1}
    for cut in range(0, len(data), 37):
        with pytest.raises(state_file.StateFileError):
            state_file.decode(data[:cut])
    for at in range(0, len(data), 29):
        bad = bytearray(data)
        bad[at] ^= 0x04
        with pytest.raises(state_file.StateFileError):
            state_file.decode(bytes(bad))


def test_the_pid_file_is_written_safely_and_removed_only_by_its_process(tmp_path: Path) -> None:
    pid = tmp_path / "run" / "kvrelay.pid"
    pid.parent.mkdir(mode=0o755)
    write_pid_file(pid)
    assert read_pid_file(pid) == os.getpid() and oct(pid.stat().st_mode & 0o777) == "0o644"
    pid.write_text("1234567\n")  # another process (a hot upgrade's successor) took it over
    assert not remove_pid_file(pid) and pid.exists()
    write_pid_file(pid)
    assert remove_pid_file(pid) and not pid.exists()
    pid.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text(f"{os.getpid()}\n")
    with pytest.raises(OSError):
        read_pid_file(pid)  # a link is not followed
    assert not remove_pid_file(pid) and pid.is_symlink(), "an unreadable pid file is left alone"
    pid.unlink()
    pid.write_text("9" * 100)
    with pytest.raises(ValueError, match="not a process id"):
        read_pid_file(pid)
    pid.parent.chmod(0o777)
    with pytest.raises(safe_files.UnsafeDirectory):
        write_pid_file(pid)


def test_state_files_of_pools_no_longer_configured_are_removed_once_stale(tmp_path: Path) -> None:
    """One file per pool ever configured would grow the directory with the configuration's
    history: a removed pool's file (and a crashed writer's temporary file for it) goes once
    older than the age limit; a configured pool's files and a young orphan stay."""
    other = PoolSpec(namespace="ns", component="c", endpoint="gone", expected_blocks=4096,
                     engines=SPEC.engines)  # fmt: skip
    young = PoolSpec(namespace="ns", component="c", endpoint="young", expected_blocks=4096,
                     engines=SPEC.engines)  # fmt: skip
    arrays = {"a": np.arange(4, dtype=np.uint64)}
    for spec in (SPEC, other, young):
        state_file.write(handover.path_for(tmp_path, spec), {"k": 1}, arrays)
    fd, crashed = safe_files.create_temp(tmp_path, handover.path_for(tmp_path, other).name)
    os.close(fd)
    old = 1_000_000.0
    for p in (handover.path_for(tmp_path, SPEC), handover.path_for(tmp_path, other), crashed):
        os.utime(p, (old, old))
    keep = {handover.path_for(tmp_path, SPEC).name}
    assert handover.remove_orphans(tmp_path, keep, 3600, now=old + 7200) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        handover.path_for(tmp_path, s).name for s in (SPEC, young)
    )


def test_a_killed_writers_temporary_file_goes_at_the_next_save_a_live_ones_stays(
    tmp_path: Path,
) -> None:
    """A hot upgrade's old process killed outright while it wrote a checkpoint left its
    temporary file in the state directory, and only a start removed such files: the new process
    kept it (the size of the pool's state) as long as it ran. Each save now removes those of
    writers that are gone, never one a live process (the other side of a hand-over) writes."""
    path = handover.path_for(tmp_path, SPEC)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_tmp = tmp_path / f".{path.name}.{gone.pid}.aaaaaaaaaaaa{safe_files.TEMP_SUFFIX}"
        live_tmp = tmp_path / f".{path.name}.{live.pid}.bbbbbbbbbbbb{safe_files.TEMP_SUFFIX}"
        other = tmp_path / f".pool-other{handover.SUFFIX}.{gone.pid}.cccc{safe_files.TEMP_SUFFIX}"
        # a pid this process cannot see (another PID namespace's writer) whose writer holds the
        # file's lock, as ``create_temp`` takes it
        held = tmp_path / f".{path.name}.{gone.pid}.dddddddddddd{safe_files.TEMP_SUFFIX}"
        for p in (dead_tmp, live_tmp, other, held):
            p.write_bytes(b"x" * 4096)
        lock = os.open(held, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)
        pool = Pool(1 << 12, 7, 1, 1)
        ident = PoolIdentity(model="m", model_source="m", block_size=1)
        try:
            handover.save(tmp_path, SPEC, ident, pool, [])
        finally:
            os.close(lock)
        assert not dead_tmp.exists(), "a dead writer's temporary file is removed"
        assert live_tmp.exists(), "a live writer's is not"
        assert held.exists(), "nor one whose writer holds its lock"
        assert other.exists(), "nor another pool's (its own saves see to it)"
        assert path.exists()
    finally:
        live.kill()
        live.wait()



@pytest.mark.parametrize(
    ("plant", "kind", "consumed"),
    [("empty", "corrupt", True), ("other_pool", "incompatible", True),
     ("directory", "unreadable", False)],
)  # fmt: skip
def test_an_empty_foreign_or_directory_state_file_starts_the_pool_clean(
    tmp_path: Path, plant: str, kind: str, consumed: bool
) -> None:
    """Whatever sits at the pool's name, the start never uses it: refused with its kind; a file
    is removed once examined, a directory (which no save can replace) is left for whoever put
    it there, and every later save fails typed instead of writing through it."""
    path = handover.path_for(tmp_path, SPEC)
    ident = PoolIdentity(model="m", model_source="m", block_size=1)
    if plant == "empty":
        path.write_bytes(b"")
    elif plant == "other_pool":
        other = PoolSpec(namespace="ns", component="c", endpoint="other", expected_blocks=4096,
                         engines=SPEC.engines)  # fmt: skip
        handover.save(tmp_path, other, ident, Pool(1 << 12, 7, 1, 1), [])
        handover.path_for(tmp_path, other).rename(path)
    else:
        path.mkdir()
    with pytest.raises(handover.Refused) as err:
        handover.load(tmp_path, SPEC, max_age_s=60, keep=True)
    assert err.value.kind == kind
    assert path.exists() is not consumed
    if plant == "directory":
        with pytest.raises(IsADirectoryError):
            handover.save(tmp_path, SPEC, ident, Pool(1 << 12, 7, 1, 1), [])
        assert [p.name for p in tmp_path.iterdir()] == [path.name], "no temporary file left"
