"""The process ``kvrelay reload`` and ``kvrelay upgrade`` signal, read from ``/proc``.

A pid (given, or read from a pid file) says nothing of the process behind it: a stale pid file
names whatever the system gave that pid to since, and SIGHUP or SIGUSR2 end most processes.
``reload`` then reported "applied" for a ``sleep`` it had killed, and ``upgrade`` "handed over"
to nobody. So both check first that the pid is a kvrelay daemon (``serve`` or ``mirror``, run
as the console script or as ``python -m kvrelay``), and read its arguments, working directory
and environment: which configuration file a SIGHUP makes it read again, which pid file a hot
upgrade's successor rewrites. A process is also tracked while it lives (its children: the
successor a hot upgrade starts) and judged gone once it exited, a zombie included.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

__all__ = [
    "DAEMON_COMMANDS", "NotARelay", "RelayProcess", "alive", "children", "kvrelay_args",
    "relay_process",
]

#: The kvrelay commands that run a daemon (the ones that act on SIGHUP and SIGUSR2).
DAEMON_COMMANDS = ("serve", "mirror")
#: ``python -m NAME`` that runs kvrelay's command line.
_MODULES = ("kvrelay", "kvrelay.__main__", "kvrelay.cli")
#: Interpreter options that take the next argument as their value.
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
#: The most bytes of a command line or environment read (both are bounded by the kernel anyway).
_PROC_READ_MAX = 1 << 20


class NotARelay(Exception):
    """The pid is a process, but not a kvrelay daemon; the message says what it is."""


@dataclass(frozen=True, slots=True)
class RelayProcess:
    """A running kvrelay daemon as ``/proc`` shows it."""

    pid: int
    #: kvrelay's own arguments, from the command on: ``("serve", "--config", "x.toml")``
    args: tuple[str, ...]
    #: its working directory (None: not readable, another user's process)
    cwd: str | None
    #: its environment as it was started (None: not readable)
    environ: dict[str, str] | None

    @property
    def command(self) -> str:
        return self.args[0]

    def resolve(self, path: str) -> str | None:
        """``path`` as the process opens it: a relative one is taken from its working
        directory (through ``/proc/PID/cwd``, which also holds in another mount namespace);
        None when that directory cannot be read."""
        if os.path.isabs(path):
            return path
        if self.cwd is None:
            return None
        return os.path.join(f"/proc/{self.pid}/cwd", path)

    def absolute(self, path: str) -> str | None:
        """``path`` made absolute with the working directory's name: what still names the file
        once the process is gone (a pid file its successor rewrote); None when unknown."""
        if os.path.isabs(path):
            return path
        return None if self.cwd is None else os.path.join(self.cwd, path)


def kvrelay_args(argv: list[str]) -> list[str] | None:
    """The arguments kvrelay's command line parser got, from a process's ``argv``: after the
    console script (``…/bin/kvrelay``, run directly or by an interpreter, as a shebang line
    does) or ``-m kvrelay``; None when ``argv`` does not run kvrelay."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "kvrelay":
        return argv[1:]
    if not os.path.basename(argv[0]).startswith(("python", "pypy")):
        return None  # (``sleep kvrelay`` names kvrelay, and runs something else)
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        opt = argv[i]
        if opt == "-m" or (opt.startswith("-m") and not opt.startswith("--")):
            module = argv[i + 1] if opt == "-m" and i + 1 < len(argv) else opt[2:]
            rest = i + 2 if opt == "-m" else i + 1
            return argv[rest:] if module in _MODULES else None
        if opt == "-c":
            return None
        i += 2 if opt in _OPTIONS_WITH_VALUE else 1
    if i < len(argv) and os.path.basename(argv[i]) == "kvrelay":
        return argv[i + 1:]
    return None


def relay_process(pid: int) -> RelayProcess:
    """The kvrelay daemon ``pid`` is. ``ProcessLookupError`` when there is no such process (or
    only its zombie), ``NotARelay`` when it runs something else."""
    if not alive(pid):
        raise ProcessLookupError(f"no process {pid}")
    try:
        raw = _read(f"/proc/{pid}/cmdline")
    except FileNotFoundError:
        raise ProcessLookupError(f"no process {pid}") from None
    argv = [a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1]]
    args = kvrelay_args(argv)
    shown = " ".join(argv)[:120] or "(no command line: a kernel thread?)"
    if args is None:
        raise NotARelay(f"process {pid} is not kvrelay: {shown}")
    if not args or args[0] not in DAEMON_COMMANDS:
        raise NotARelay(f"process {pid} is not a kvrelay daemon (serve or mirror): {shown}")
    cwd = None
    with contextlib.suppress(OSError):
        cwd = os.readlink(f"/proc/{pid}/cwd")
    environ = None
    with contextlib.suppress(OSError):
        env = _read(f"/proc/{pid}/environ")
        environ = {}
        for entry in env.split(b"\0"):
            name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
            if sep:
                environ[name] = value
    return RelayProcess(pid, tuple(args), cwd, environ)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not reaped yet by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # no /proc to ask: kill(2) said it exists
    return stat.rpartition(b")")[2].split()[:1] not in ([b"Z"], [b"X"])


def children(pid: int) -> set[int]:
    """The processes ``pid`` started that still run (every thread's, ``/proc/PID/task/*/
    children``); empty when the kernel does not list them."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                    found |= {int(p) for p in f.read().split() if p.isdigit()}
    return found


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(_PROC_READ_MAX)
