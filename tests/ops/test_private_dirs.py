"""The private directories of ``ops/private_dirs.py`` and the sweep of those whose process died.

Real processes: a child makes its directories (the internal socket's, with a bound socket in it,
and a hot upgrade's) and is killed outright, so it cannot remove them; the next sweep does, and
never a directory whose owner lives, whatever pid its pid file gives, nor anything else.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvrelay.ops.private_dirs import (
    INTERNAL_SOCKET,
    PID_FILE,
    SOCKET_PATH_MAX,
    PrivateDir,
    socket_path_problem,
    sweep,
)
from tests.support.commands import REPO

#: Makes both kinds of directory under argv[1], binds a socket in the first, prints both, waits.
CHILD = r"""
import socket, sys, time
from kvrelay.ops.private_dirs import PrivateDir
dirs = [PrivateDir(sys.argv[1]), PrivateDir(sys.argv[1], "upgrade")]
socket.socket(socket.AF_UNIX).bind(dirs[0].path + "/ingest.sock")
print(*(d.path for d in dirs), flush=True)
time.sleep(60)
"""


def _owner(base: Path) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(base)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait(10)
    return proc.pid


def _left(path: Path, pid: int) -> Path:
    """A directory as a process ``pid`` killed outright leaves it (its lock gone)."""
    path.mkdir(mode=0o700)
    (path / PID_FILE).write_text(f"{pid}\n")
    return path


def test_a_killed_processs_directories_are_swept_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc, made = _owner(tmp_path)
    try:
        assert [Path(d).name.split("-")[:-1] for d in made] == [["kvrelay"], ["kvrelay", "upgrade"]]
        assert all((Path(d) / PID_FILE).read_text() == f"{proc.pid}\n" for d in made)
        assert sweep([str(tmp_path)]) == [] and all(os.path.isdir(d) for d in made)
    finally:
        _kill(proc)
    dead = _dead_pid()
    keep = _left(tmp_path / "kept", dead)
    others = {
        "kvrelay-numba-0": "dir",  # the kernel cache
        "kvrelay-abcd1234": "dir",  # no pid file: an earlier kvrelay's, which did not lock it
        "kvrelay-bad_pid0": "bad pid",
        "kvrelay-file0000": "file",
        "kvrelay-link0000": "link",  # never followed
        "kvrelay-a": "named",  # not mkdtemp's name
        "kvrelay-mirror-abcdefgh": "named",
    }
    for name, kind in others.items():
        p = tmp_path / name
        if kind == "dir":
            p.mkdir()
        elif kind == "bad pid":
            p.mkdir()
            (p / PID_FILE).write_text("1x\n")
        elif kind == "named":
            _left(p, dead)
        elif kind == "file":
            p.write_text(f"{dead}\n")
        else:
            p.symlink_to(keep)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # None: the temporary directory
    assert sweep([str(tmp_path), None]) == sorted(made)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*others, "kept"])
    assert sweep([str(tmp_path / "missing")]) == []


def test_a_live_owner_keeps_its_directory_whatever_its_pid_file_says(tmp_path: Path) -> None:
    """Its lock keeps it (another pid namespace, where its pid means nothing here); a directory
    of this process's own pid that it does not hold (a container's pid 1, restarted) is swept,
    the one it holds is not."""
    proc, made = _owner(tmp_path)
    dead = _dead_pid()
    try:
        (Path(made[0]) / PID_FILE).write_text(f"{dead}\n")
        assert sweep([str(tmp_path)]) == [] and os.path.isdir(made[0])
    finally:
        _kill(proc)
    assert sweep([str(tmp_path)]) == sorted(made)
    mine = PrivateDir(str(tmp_path))
    stale = _left(tmp_path / "kvrelay-abcdefgh", os.getpid())
    try:
        assert sweep([str(tmp_path)]) == [str(stale)] and os.path.isdir(mine.path)
    finally:
        mine.remove()
    assert list(tmp_path.iterdir()) == []
    mine.remove()  # idempotent


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
def test_another_users_directory_is_never_swept(tmp_path: Path) -> None:
    theirs = _left(tmp_path / "kvrelay-abcdefgh", _dead_pid())
    os.chown(theirs, 65534, 65534)
    assert sweep([str(tmp_path)]) == [] and theirs.is_dir()


def test_a_private_dir_is_private_and_holds_a_socket_whose_path_fits() -> None:
    """The longest base ``socket_path_problem`` lets through binds the internal socket (the
    kernel is the oracle: its path is exactly ``SOCKET_PATH_MAX`` bytes); one byte more is
    refused, and so is the bind. Bases in the temporary directory: pytest's own may be long."""
    top = tempfile.mkdtemp(prefix="kvr-")
    try:
        room = SOCKET_PATH_MAX - len(os.path.join("", "kvrelay-XXXXXXXX", INTERNAL_SOCKET)) - 1
        fits = os.path.join(top, "b" * (room - len(top) - 1))
        longer = fits + "b"
        for base in (fits, longer):
            os.mkdir(base)
        assert socket_path_problem(fits, INTERNAL_SOCKET) is None
        problem = socket_path_problem(longer, INTERNAL_SOCKET)
        assert problem is not None and f"at most {len(fits)} bytes" in problem
        for base, ok in ((fits, True), (longer, False)):
            d = PrivateDir(base)
            try:
                assert (os.stat(d.path).st_mode & 0o777) == 0o700
                path = os.path.join(d.path, INTERNAL_SOCKET)
                assert len(path) == SOCKET_PATH_MAX + (0 if ok else 1)
                with socket.socket(socket.AF_UNIX) as s:
                    if ok:
                        s.bind(path)
                    else:
                        with pytest.raises(OSError):
                            s.bind(path)
            finally:
                d.remove()
            assert not os.path.exists(d.path)
    finally:
        shutil.rmtree(top)


#: Makes one directory under argv[1] (a hot upgrade's), prints it and its pid file, waits.
ONE = r"""
import os, sys, time
from kvrelay.ops.private_dirs import PID_FILE, PrivateDir
d = PrivateDir(sys.argv[1], "upgrade")
print(d.path, os.path.getsize(os.path.join(d.path, PID_FILE)), flush=True)
time.sleep(60)
"""


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path | None]:
    """A 64 KiB tmpfs filled to its last byte (root on Linux), else None. A full file system
    still makes directories and empty files, and refuses the pid file's few bytes."""
    if sys.platform != "linux" or os.geteuid() != 0:
        yield None
        return
    mnt = tmp_path / "full"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, timeout=30)  # fmt: skip
    if res.returncode != 0:
        yield None
        return
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 4096):
                    pass
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.mark.parametrize("disk", ["full", "emptied"])
def test_a_directory_whose_pid_file_is_empty_goes_by_its_lock(
    tmp_path: Path, full_tmpfs: Path | None, disk: str
) -> None:
    """Before: a runtime directory too full for the pid file's bytes left that file empty, and
    the sweep skipped a directory naming no pid, so a successor SIGKILLed mid-upgrade left its
    directory for good. The file was made after the lock was taken: its owner's lock alone now
    decides (``emptied``: the same file made empty by hand, where no tmpfs can be mounted)."""
    base = full_tmpfs if disk == "full" else tmp_path
    if base is None:
        pytest.skip("mounting a tmpfs needs root on Linux")
    proc = subprocess.Popen([sys.executable, "-c", ONE, str(base)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    path, size = proc.stdout.readline().split()
    try:
        if disk == "emptied":
            assert size != "0"
            (Path(path) / PID_FILE).write_text("")
        else:
            assert size == "0", "the full disk took the pid after all"
        assert (Path(path) / PID_FILE).read_text() == ""
        assert sweep([str(base)]) == [] and os.path.isdir(path), "its live owner holds it"
    finally:
        _kill(proc)
    assert sweep([str(base)]) == [path] and not os.path.exists(path)


#: Takes every descriptor it may have, then tries to make a directory under argv[1].
NO_FDS = r"""
import os, sys
from kvrelay.ops.private_dirs import PrivateDir
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    PrivateDir(sys.argv[1])
except OSError as exc:
    print("refused:", exc.errno)
"""


def test_a_directory_that_cannot_be_locked_for_want_of_a_descriptor_is_not_left(
    tmp_path: Path,
) -> None:
    """Before: ``mkdtemp`` made the directory, opening it to lock it failed (no descriptor left:
    ``EMFILE``) and the directory stayed, with no lock and no pid file, so no sweep removes it."""
    res = subprocess.run([sys.executable, "-c", NO_FDS, str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"refused: {errno.EMFILE}"
    assert list(tmp_path.iterdir()) == []


def test_a_directory_whose_owner_exited_unreaped_is_swept(tmp_path: Path) -> None:
    """An owner killed and not yet reaped by its parent (a zombie) still answers ``kill(pid,
    0)``: its directories were kept until a later start. It holds no lock: swept."""
    exits = CHILD.replace("time.sleep(60)", "")
    proc = subprocess.Popen([sys.executable, "-c", exits, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    made = proc.stdout.readline().split()
    try:
        stat = Path(f"/proc/{proc.pid}/stat")
        for _ in range(600):  # until it exited (its parent, this test, has not waited)
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        os.kill(proc.pid, 0)
        assert all(os.path.isdir(d) for d in made)
        assert sweep([str(tmp_path)]) == sorted(made)
    finally:
        proc.wait(10)
        proc.stdout.close()
