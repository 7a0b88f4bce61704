"""The private directories kvrelay makes in a runtime directory, and the sweep of dead ones.

Two kinds, both ``0700``: ``kvrelay-XXXXXXXX`` holds the internal socket of ``workers = N ≥ 2``
(``ops/front.py``), ``kvrelay-upgrade-XXXXXXXX`` a hot upgrade's cut (``ops/upgrade.py``). The
process that made one removes it when it exits; one killed (SIGKILL, the OOM killer, a successor
the upgrade gave up on) cannot, and in a Kubernetes ``emptyDir`` or a systemd
``RuntimeDirectory=`` they would pile up, one per incident.

So the maker holds an exclusive ``flock(2)`` on its directory for as long as it lives (the kernel
drops it however the process ends; it is not inherited across ``exec``), and only then writes its
pid into the file ``pid`` inside. :func:`sweep`, run at start, removes a directory of exactly
these names only if this user owns it, it has that file (so its lock was taken before: a
directory being made is never swept), the pid it names is not alive (or is this process's own,
restarted under the same pid in a container) and its lock can be taken. A pid file that is
there but empty or unreadable (a full runtime directory refuses the write, not the file) names
no pid: the lock alone decides. A live owner keeps its lock, even in another pid namespace;
another name (the kernel cache's ``kvrelay-numba-*``), a directory without the file (an
earlier kvrelay's, which did not lock it), a symbolic link or another user's directory is never
touched. Where the file system cannot lock, nothing is removed. The names are as long as they
were, which matters: a UNIX socket's path has 107 bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable

from kvrelay._text import is_decimal
from kvrelay.relay.safe_files import process_alive

__all__ = [
    "INTERNAL_SOCKET", "PID_FILE", "SOCKET_PATH_MAX", "PrivateDir", "socket_path_problem", "sweep",
]

#: ``mkdtemp``'s eight random characters after the prefix.
_NAME = re.compile(r"kvrelay-(?:upgrade-)?[a-z0-9_]{8}")
#: The file in each directory that names the process holding its lock.
PID_FILE = "pid"
#: Directories this process made and still holds: never swept by itself.
_MINE: set[str] = set()
#: The internal socket's name in its private directory (``workers`` ≥ 2, ``ops/front.py``).
INTERNAL_SOCKET = "ingest.sock"
#: The longest path a UNIX socket can be bound at on Linux (``sun_path``: 108 bytes, its NUL).
SOCKET_PATH_MAX = 107


def socket_path_problem(base: str | None, name: str, kind: str = "") -> str | None:
    """Why no socket ``name`` can be bound in a private directory under ``base`` (None: the
    temporary directory): its path would be too long (``bind`` fails "AF_UNIX path too
    long"); None when it fits. ``check-config`` and the start ask before anything is made, so
    the operator reads which setting to shorten, and by how much."""
    where = os.path.abspath(base or tempfile.gettempdir())
    prefix = f"kvrelay-{kind}-" if kind else "kvrelay-"
    length = len(os.fsencode(os.path.join(where, prefix + "X" * 8, name)))
    if length <= SOCKET_PATH_MAX:
        return None
    room = len(os.fsencode(where)) - (length - SOCKET_PATH_MAX)
    return (f"the socket path {os.path.join(where, prefix + 'XXXXXXXX', name)!r} would be "
            f"{length} bytes, over the {SOCKET_PATH_MAX} a UNIX socket's path may have: the "
            f"directory may have at most {room} bytes")  # fmt: skip


class PrivateDir:
    """A new private directory ``kvrelay-[<kind>-]XXXXXXXX`` under ``base`` (None: the temporary
    directory), locked until :meth:`remove`. ``OSError`` when it cannot be made."""

    def __init__(self, base: str | None, kind: str = "") -> None:
        self.path = tempfile.mkdtemp(prefix=f"kvrelay-{kind}-" if kind else "kvrelay-", dir=base)
        try:
            os.chmod(self.path, 0o700)  # mkdtemp's mode already, stated: the socket relies on it
            self._fd: int | None = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # (no fd left, say) unlocked and without a pid file: never swept
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            raise
        _MINE.add(self.path)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: no pid file, never swept
            return
        # A full runtime directory leaves the file empty (made, its write refused): the sweep
        # then goes by the lock alone. Without the file the directory is never swept.
        with contextlib.suppress(OSError):
            with open(os.path.join(self.path, PID_FILE), "x") as f:
                f.write(f"{os.getpid()}\n")

    def remove(self) -> None:
        """Remove the directory and what it holds, then let the lock go (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            shutil.rmtree(self.path)
        os.close(self._fd)
        self._fd = None
        _MINE.discard(self.path)


def sweep(bases: Iterable[str | None]) -> list[str]:
    """Remove the private directories under ``bases`` (None: the temporary directory) whose
    process is gone (see the module docstring); the paths removed. Never raises."""
    removed: list[str] = []
    for base in {r for b in bases if (r := _resolved(b)) is not None}:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            if _NAME.fullmatch(name) is None or path in _MINE:
                continue
            pid = _owner(path)
            if pid is None or (pid > 0 and process_alive(pid) and pid != os.getpid()):
                continue
            if _remove_if_unlocked(path):
                removed.append(path)
    return sorted(removed)


def _resolved(base: str | None) -> str | None:
    """``base``, or the temporary directory; None when there is no usable one (a read-only
    root file system: nothing can have been made there)."""
    try:
        return os.path.realpath(base or tempfile.gettempdir())
    except OSError:
        return None


#: What :func:`_owner` gives for a pid file that is there but names no pid: empty (its write
#: refused on a full disk) or unreadable. It was made after the lock was taken, so the lock
#: alone decides.
_UNKNOWN = 0


def _owner(path: str) -> int | None:
    """The pid in the directory's pid file, ``_UNKNOWN`` for an empty or unreadable one; None
    without a regular file there, or one that says something else (not a directory of ours)."""
    try:
        fd = os.open(os.path.join(path, PID_FILE),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # fmt: skip
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 32).decode("ascii", "replace").strip()
    except OSError:
        return _UNKNOWN
    finally:
        os.close(fd)
    if not text:
        return _UNKNOWN
    return int(text) if is_decimal(text) and 0 < int(text) < 2**31 else None


def _remove_if_unlocked(path: str) -> bool:
    """Remove ``path`` if it is this user's directory and nobody holds its lock."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return False
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live process: BlockingIOError
        shutil.rmtree(path)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
