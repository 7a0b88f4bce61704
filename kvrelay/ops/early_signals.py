"""The daemon's signals before its event loop handles them, and after it stopped handling them.

``kvrelay serve`` spends its first second (more on a busy host) importing and validating before
the event loop installs its handlers, and some more tearing down after it removed them. A
signal's default action then killed the process outright: a SIGHUP (``kvrelay reload``, a
configuration tool, ``systemctl kill -s HUP``), a SIGUSR1 or a SIGUSR2 (``kvrelay upgrade``)
ended it by that signal, a SIGTERM without the exit 0 a stop during start-up promises. From the
first line of the command on, ``hold`` keeps SIGHUP, SIGUSR1 and SIGUSR2 here for the loop to
act on (``take``), and makes SIGTERM stop the start-up with exit status 0.

The stop is ``StartupStopped``, a ``SystemExit(0)``: it unwinds the start-up (its ``finally``
blocks run), and whatever it interrupts ends the process with 0. It was ``KeyboardInterrupt``
(SIGINT's): one raised where no ``try`` caught it (the unblocking below, argument parsing) ended
the process by SIGINT with a traceback (status 130), and one raised in code that CPython runs for
an extension module marked the interpreter's exit as an unhandled interrupt, so the process still
killed itself with SIGINT after the command had caught it and returned 0.

A signal sent to the process reaches one thread of it that does not block it, and Python runs
its handler only on the main thread, interrupting a blocking call only there. Importing numpy
starts OpenBLAS's thread pool, which blocks nothing: a SIGTERM the kernel gave to one of those
threads left the main thread blocked in its read of the configuration (a FIFO, a hung network
mount) until the read ended, so the stop never came. ``hold`` therefore starts those threads with
the daemon's signals blocked (threads inherit the mask of the thread that starts them) and only
then unblocks them on the main thread, which is left as the one thread to deliver them to until
the event loop (whose wake-up descriptor any thread's delivery reaches) takes over.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import NoReturn

#: What the daemon acts on once it serves (reload, upgrade), or only logs (SIGUSR1).
KEPT = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)

_pending: list[signal.Signals] = []
#: How long the main thread waits at most between two looks at a signal (``read_bytes``).
_STEP_S = 0.1


class StartupStopped(SystemExit):
    """SIGTERM before the event loop handles it: the command ends with status 0."""

    def __init__(self) -> None:
        super().__init__(0)


def _stop(signum: int, frame: FrameType | None) -> NoReturn:
    raise StartupStopped()


def _keep(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    if sig not in _pending:  # several coalesce, as on the loop
        _pending.append(sig)


def hold(*, stop_on_term: bool = True) -> None:
    """Keep SIGHUP, SIGUSR1 and SIGUSR2 for the loop; with ``stop_on_term``, SIGTERM raises
    ``StartupStopped`` (the command exits 0, as for a stop during start-up). Main thread only
    (``signal.signal``)."""
    for sig in KEPT:
        signal.signal(sig, _keep)
    if stop_on_term:
        signal.signal(signal.SIGTERM, _stop)
    held = {*KEPT, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)  # one that comes meanwhile waits, pending
    try:
        import numpy  # noqa: F401 (the import that starts threads: OpenBLAS's pool)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def read_bytes(path: str | os.PathLike[str]) -> bytes:
    """``Path.read_bytes``, read by a thread (with the daemon's signals blocked) that the main
    thread waits for in short steps. Why: Python runs a signal's handler only between bytecodes
    of the main thread; one that arrives just before the main thread enters a blocking read (a
    FIFO ``--config``, a hung network mount) waits for the read to end, for ever if nothing is
    written, and the stop during start-up never came (1 in 30 tries with both cores busy). A
    wait in steps returns to Python every ``_STEP_S`` whatever came."""
    result: list[bytes | BaseException] = []

    def work() -> None:
        try:
            result.append(Path(path).read_bytes())
        except BaseException as exc:  # (handed to the caller, as the read would raise it)
            result.append(exc)

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {*KEPT, signal.SIGTERM, signal.SIGINT})
    try:  # the thread starts with the mask it is created with
        reader = threading.Thread(target=work, name="kvrelay-read-file", daemon=True)
        reader.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    while reader.is_alive():
        reader.join(_STEP_S)
    got = result[0]
    if isinstance(got, BaseException):
        raise got
    return got


def take() -> list[signal.Signals]:
    """The signals kept since the last call, in the order they first came."""
    got = list(_pending)
    _pending.clear()
    return got
