"""Files the relay writes where others might reach them: state files, checkpoints, the pid file.

Three rules, one implementation:

* a directory that another user could write to (group- or world-writable, or owned by someone
  else) is refused with a typed :class:`UnsafeDirectory` before anything is read from or written
  to it: whoever can write there can replace the relay's state with one it made up;
* temporary files are created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` under an unguessable name, so a
  planted file or symlink is never opened, written through or truncated;
* a file replaces another only complete and fsynced (temporary file, fsync, rename, fsync of the
  directory): a crash leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from kvrelay._text import is_decimal

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: For files read back: a symlink is not followed, and a FIFO planted at the name opens at once
#: (and is then refused as no regular file) instead of blocking the opening thread for good;
#: ``O_NONBLOCK`` changes nothing for a regular file's reads.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
TEMP_SUFFIX = ".tmp"


class UnsafeDirectory(Exception):
    """A directory others can write to; ``kind`` is the counted reason."""

    kind = "unsafe_dir"


def check_private_dir(path: str | os.PathLike[str], *, owner: bool = True) -> None:
    """Raise :class:`UnsafeDirectory` unless ``path`` is a directory only this user can write
    (``owner=False``: any owner, and a sticky world-writable one such as ``/tmp`` is allowed,
    for a pid file in a shared run directory). ``OSError`` if it cannot be examined."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{os.fspath(path)}: not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if owner and st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{os.fspath(path)}: owned by uid {st.st_uid}, this process runs as {os.geteuid()}"
        )
    if mode & 0o022 and not (not owner and mode & stat.S_ISVTX):
        raise UnsafeDirectory(f"{os.fspath(path)}: group- or world-writable (mode {mode:04o})")


def create_temp(directory: Path, name: str, mode: int = 0o600) -> tuple[int, Path]:
    """A new, empty temporary file beside ``directory / name``: ``(fd, path)``, locked
    (``flock``) for as long as ``fd`` is open."""
    for _ in range(16):
        tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, _CREATE, mode)
        except FileExistsError:
            continue
        # held until the file is committed or abandoned (closed), or its writer dies: a start's
        # sweep (``remove_stale_temps``) leaves a file it cannot lock to its live writer
        with contextlib.suppress(OSError):  # no locks here: the file is this writer's anyway
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, tmp
    raise FileExistsError(f"{directory}: no free temporary name for {name}")


def write_all(fd: int, data: bytes | memoryview) -> None:
    """All of ``data``; an ``OSError`` raised after part of it was written carries how much in
    ``written`` (a caller that goes on another way writes only the rest)."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        try:
            done += os.write(fd, view[done:])
        except OSError as exc:
            exc.written = done  # type: ignore[attr-defined]
            raise


def commit(fd: int, tmp: Path, path: Path) -> None:
    """fsync and close ``fd``, rename ``tmp`` over ``path``, fsync the directory; ``tmp`` is
    removed if any step fails."""
    try:
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def abandon(fd: int, tmp: Path) -> None:
    """Close and remove a temporary file that will not be committed."""
    os.close(fd)
    tmp.unlink(missing_ok=True)


def remove_stale_temps(directory: Path, name: str) -> int:
    """Remove temporary files of ``name`` that a crashed writer left (unlink never follows a
    link); returns how many. Called at a start, before this process writes its own: every such
    file goes but one a writer still holds (:func:`create_temp` locks it, and the lock goes with
    the writer, however it ends, in whatever pid namespace it ran). A second relay started on
    the same state directory used to remove the running one's file mid-write, and that
    checkpoint then failed at its rename (``ENOENT``)."""
    return _remove_temps(directory, name, lambda _writer, _at: True)


def remove_dead_temps(directory: Path, name: str) -> int:
    """Remove temporary files of ``name`` whose writer (the pid in the name) is no longer alive;
    returns how many. Unlike :func:`remove_stale_temps` this is safe while another process may
    be writing here (a hot upgrade's old and new process share the state directory): a live
    writer's file is left alone. Without it, a writer killed outright after a hand-over left a
    file the size of a pool's state until the next start, and a state directory sized for two
    files then failed every checkpoint of the new process. A pid this process cannot see (a
    writer in another PID namespace) counts as dead, as at a start, unless its writer still
    holds the file's lock. A writer that exited but is not reaped yet (a zombie) is dead, and so
    is one whose pid another process took since it last wrote the file (started after that)."""

    def dead(writer: str, written_at: float) -> bool:
        return (is_decimal(writer) and int(writer) != os.getpid()
                and not process_alive(int(writer), written_at))  # fmt: skip

    return _remove_temps(directory, name, dead)


def _remove_temps(directory: Path, name: str, remove: Callable[[str, float], bool]) -> int:
    """Unlink the temporary files of ``name`` whose writer field (the pid in the name) passes
    ``remove`` (given with the file's modification time) and whose lock no writer holds
    (:func:`create_temp`); returns how many. What is no regular file at such a name (a planted
    link or FIFO) is no writer's: removed, never opened."""
    n = 0
    for p in directory.glob(f".{name}.*{TEMP_SUFFIX}"):
        try:
            written_at = p.lstat().st_mtime
        except OSError:
            continue
        if not remove(p.name[len(name) + 2 :].split(".", 1)[0], written_at):
            continue
        try:
            if stat.S_ISREG(p.lstat().st_mode):
                fd = os.open(p, READ_FLAGS)  # a link put there meanwhile: ELOOP, left
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its writer is alive
                    p.unlink()
                finally:
                    os.close(fd)
            else:
                p.unlink()
            n += 1
        except OSError:
            continue
    return n


def process_alive(pid: int, written_at: float | None = None) -> bool:
    """Whether ``pid`` may still be the process that wrote a file (its temporary file, its pid
    file) last written at ``written_at``: it exists, has not exited (a zombie, exited and not
    reaped yet, holds no lock and writes nothing, though ``kill(pid, 0)`` finds it), and
    started before then (a later process with that pid is another program)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state, started = fields[0], int(fields[19]) / os.sysconf("SC_CLK_TCK") + _boot_time()
    except (OSError, IndexError, ValueError):  # no /proc here: alive, as kill said
        return True
    if state in (b"Z", b"X"):
        return False
    return written_at is None or started <= written_at + 1.0


def _boot_time() -> float:
    """When this machine booted (Unix time, /proc/stat's ``btime``): processes' start times in
    /proc count from it."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise ValueError("no btime in /proc/stat")
