"""Hot upgrade (``SIGUSR2``, ``kvrelay upgrade``): a new process takes over without an ingest gap.

nginx's convention, adapted to a relay whose state is in memory:

1. The running process (the *predecessor*) starts its own command line again (``sys.orig_argv``
   under ``sys.executable``: the code and configuration now installed), handing it the listening
   sockets (gRPC, metrics) and one end of a private ``socketpair`` by descriptor inheritance
   (``KVRELAY_TAKEOVER=chan=N,grpc=N[,metrics=N]``). No socket file, nothing in the file system
   but a ``0700`` temporary directory for the state cut.
2. The *successor* warms its kernels and builds its relay, then says ``warm``. Only now does the
   predecessor cut every pool's exact state and member cursors (``relay/takeover.py``), between
   two batches, by a fork: a child writes the cut while the predecessor goes on ingesting and
   serving. The later the cut, the less of the engines' replay buffers the successor needs.
3. The successor starts from the cut: each member resumes from its cursor once the engine vouches
   (the same incarnation, the cut batch still in replay with the same bytes), the replay filling
   what the predecessor applied after the cut; a member that cannot be vouched for is rebuilt.
   Once its members are live again (vouched for, or reset; bounded) it accepts on the inherited
   listener (never closed, so the port never refuses a connection), writes the pid file and says
   ``serving``.
4. The predecessor tells systemd ``MAINPID=<successor>``, stops accepting,
   ends every stream as a shutdown does (status OK, §4.8 of the contract: routers resubscribe
   and land on the successor), stops without saving state, removes the cut directory, exits 0.

Anything else — the successor cannot start, exits, reports a failure (a configuration it
refuses, a cut it cannot use) or misses a deadline — is a failed upgrade: the successor is stopped
(SIGTERM, so it removes its runtime directory and stops its workers; SIGKILL past
``KILL_GRACE_S``), the predecessor keeps serving as if nothing happened, and the reason is logged
(``upgrade_failed``) and counted (``kvrelay_upgrades_total{result}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrelay._text import is_decimal
from kvrelay.logging import get_logger
from kvrelay.ops.private_dirs import PrivateDir

_LOG = get_logger("kvrelay.ops.upgrade")

ENV = "KVRELAY_TAKEOVER"
#: The predecessor's pid, beside ``ENV``: the successor's parent while the predecessor lives (a
#: parent read by the successor itself may already be init, the predecessor having died).
ENV_PREDECESSOR = "KVRELAY_TAKEOVER_PREDECESSOR"
#: From the spawn to the successor's ``warm`` (a first start compiles kernels: be generous; the
#: predecessor serves meanwhile).
WARM_TIMEOUT_S = 300.0
#: From the cut to the successor's ``serving``.
TAKEOVER_TIMEOUT_S = 30.0
#: A successor the upgrade gives up on has this long to stop on SIGTERM before SIGKILL.
KILL_GRACE_S = 5.0
#: One control message (JSON line) is at most this long.
MAX_MESSAGE = 64 << 10
_POLL_S = 0.05

#: Counted outcomes (``kvrelay_upgrades_total{result}``). The predecessor counts all but
#: ``taken_over`` (``handed_over`` is seen only until it exits); the successor counts
#: ``taken_over``.
RESULTS = (
    "handed_over", "taken_over", "refused", "spawn_failed", "cut_failed", "successor_exited",
    "successor_failed", "timeout",
)  # fmt: skip


@dataclass(slots=True)
class UpgradeStats:
    """Upgrade outcomes since start, by result."""

    results: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESULTS, 0))

    def outcome(self, result: str) -> None:
        self.results[result] = self.results.get(result, 0) + 1


class UpgradeFailed(Exception):
    """A takeover that did not happen; ``result`` is the counted outcome."""

    def __init__(self, result: str, why: str) -> None:
        super().__init__(why)
        self.result = result


def command_line() -> list[str]:
    """This process's own command line, run by the interpreter now installed."""
    return [sys.executable, *sys.orig_argv[1:]]


def handover_parent() -> str:
    """Where the cut directory goes: systemd's private runtime directory, else the temp dir."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()


def _encode(msg: Mapping[str, Any]) -> bytes:
    return json.dumps(dict(msg), separators=(",", ":")).encode() + b"\n"


async def _read_message(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next control message; None at EOF (or the channel reset: its peer is gone);
    UpgradeFailed when it is not one."""
    try:
        line = await reader.readuntil(b"\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except asyncio.LimitOverrunError:
        raise UpgradeFailed("successor_failed", "oversized control message") from None
    try:
        msg = json.loads(line)
    except json.JSONDecodeError:
        raise UpgradeFailed("successor_failed", "malformed control message") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("msg"), str):
        raise UpgradeFailed("successor_failed", "malformed control message")
    return msg


# ---- the predecessor ------------------------------------------------------------------------


class Upgrader:
    """One hot upgrade, run by the predecessor."""

    def __init__(
        self,
        listeners: Mapping[str, socket.socket],
        *,
        argv: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        warm_timeout_s: float = WARM_TIMEOUT_S,
        takeover_timeout_s: float = TAKEOVER_TIMEOUT_S,
        kill_grace_s: float = KILL_GRACE_S,
    ) -> None:
        self.listeners = dict(listeners)
        self.argv = list(argv) if argv is not None else command_line()
        self.env = dict(os.environ if env is None else env)
        self.warm_timeout_s = warm_timeout_s
        self.takeover_timeout_s = takeover_timeout_s
        self.kill_grace_s = kill_grace_s
        self.proc: subprocess.Popen[bytes] | None = None

    async def run(
        self,
        cut: Callable[[Path], Awaitable[Mapping[str, Any]]],
        handed_over: Callable[[int], None],
    ) -> int:
        """Spawn the successor, cut the state when it is warm (``await cut(directory)`` is what
        it wrote, for the log; any exception it raises fails the upgrade as
        ``cut_failed``), and call ``handed_over(pid)`` once it serves; the successor's
        pid. Raises UpgradeFailed (the successor stopped, ``_kill``) otherwise."""
        try:
            owned = PrivateDir(handover_parent(), "upgrade")
        except OSError as exc:  # a read-only, full or vanished runtime directory: nowhere to cut
            raise UpgradeFailed("cut_failed", f"no directory for the cut: {exc}") from None
        work = Path(owned.path)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        writer: asyncio.StreamWriter | None = None
        try:
            fds = {"chan": theirs.fileno(), **{k: s.fileno() for k, s in self.listeners.items()}}
            env = {**self.env, ENV: ",".join(f"{k}={fd}" for k, fd in fds.items()),
                   ENV_PREDECESSOR: str(os.getpid())}  # fmt: skip
            env.pop("WATCHDOG_PID", None)  # names us; the successor pings once it is main
            try:
                self.proc = subprocess.Popen(self.argv, env=env, pass_fds=tuple(fds.values()))
            except OSError as exc:
                raise UpgradeFailed("spawn_failed", f"{type(exc).__name__}: {exc}") from None
            theirs.close()
            _LOG.info("upgrade_started", successor_pid=self.proc.pid, command=self.argv)
            reader, writer = await asyncio.open_unix_connection(sock=ours, limit=MAX_MESSAGE)
            await self._expect(reader, "warm", self.warm_timeout_s)
            t0 = time.monotonic()
            try:
                summary = await cut(work)
            except Exception as exc:
                raise UpgradeFailed("cut_failed", f"{type(exc).__name__}: {exc}") from None
            _LOG.info("upgrade_state_cut", cut_s=round(time.monotonic() - t0, 3), **summary)
            try:
                writer.write(_encode({"msg": "state", "dir": str(work)}))
                await writer.drain()
            except ConnectionError:  # the successor died while the state was cut
                rc = await self._exit_code(5.0)
                raise UpgradeFailed("successor_exited",
                                    f"the successor exited (status {rc}) before it took the "
                                    "state") from None  # fmt: skip
            await self._expect(reader, "serving", self.takeover_timeout_s)
            handed_over(self.proc.pid)
            return self.proc.pid
        except BaseException:  # failed, cancelled (a stop meanwhile) or a bug: never half-way
            await self._kill()
            raise
        finally:
            if writer is not None:
                writer.close()
            else:
                ours.close()
            with contextlib.suppress(OSError):
                theirs.close()
            owned.remove()

    async def _expect(self, reader: asyncio.StreamReader, what: str, timeout: float) -> None:
        """Wait for message ``what``, the successor's exit, or the deadline."""
        assert self.proc is not None
        read = asyncio.ensure_future(_read_message(reader))
        deadline = time.monotonic() + timeout
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=_POLL_S)
                if done:
                    msg = read.result()
                    if msg is None:
                        rc = await self._exit_code(5.0)
                        raise UpgradeFailed("successor_exited",
                                            f"the successor exited (status {rc}) before {what}")
                    if msg["msg"] == "failed":
                        raise UpgradeFailed("successor_failed", str(msg.get("why", "")))
                    if msg["msg"] != what:
                        raise UpgradeFailed("successor_failed",
                                            f"expected {what!r}, got {msg['msg']!r}")
                    return
                rc = self.proc.poll()
                if rc is not None:
                    raise UpgradeFailed("successor_exited",
                                        f"the successor exited (status {rc}) before {what}")
                if time.monotonic() > deadline:
                    raise UpgradeFailed("timeout", f"no {what!r} from the successor within "
                                                   f"{timeout:g} s")  # fmt: skip
        finally:
            read.cancel()

    async def _exit_code(self, wait_s: float) -> int | None:
        assert self.proc is not None
        deadline = time.monotonic() + wait_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return self.proc.returncode

    async def _kill(self) -> None:
        """End a successor that did not take over and reap it: SIGTERM first, so it stops as on
        any stop (its runtime directory removed, its workers stopped, the streams its workers
        may already hold ended cleanly; the predecessor's are untouched), SIGKILL past
        ``kill_grace_s`` or if this is cancelled meanwhile. Polled: the loop serves on."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.kill_grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(_POLL_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10.0)


# ---- the successor --------------------------------------------------------------------------


def close_on_exec(fd: int) -> None:
    """Mark an inherited descriptor close-on-exec, as Python makes its own. The predecessor's
    listeners reach this process inheritable (they had to survive its exec); uvloop's
    subprocesses do not close descriptors (``close_fds`` is not honoured), so every fan-out
    worker this process started held the metrics listener, and could keep its port bound past
    this process's end. A descriptor already closed is left."""
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)


class Handoff:
    """The successor's side: the inherited listeners and the control channel."""

    def __init__(self, fds: Mapping[str, int], predecessor: int | None = None) -> None:
        self._fds = dict(fds)
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        #: the predecessor spawned this process: while it is still the parent, it lives (its
        #: pid as it said, else the parent at this point: a predecessor already dead then read
        #: as alive, the parent being init)
        self._predecessor = os.getppid() if predecessor is None else predecessor

    def predecessor_lives(self) -> bool:
        """Whether the process that started this hand-over is still this one's parent (a
        predecessor that died leaves its children to init or a subreaper)."""
        return os.getppid() == self._predecessor

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Handoff | None:
        """The hand-over this process was started for (the variable is removed, so nothing this
        process starts inherits it); None for an ordinary start. ValueError when malformed."""
        env = os.environ if env is None else env  # type: ignore[assignment]
        assert env is not None
        raw = env.pop(ENV, None)
        pred = env.pop(ENV_PREDECESSOR, None)
        if not raw:
            return None
        fds: dict[str, int] = {}
        for part in raw.split(","):
            name, _, fd = part.partition("=")
            if name not in ("chan", "grpc", "metrics") or not is_decimal(fd):
                raise ValueError(f"{ENV}: malformed entry {part!r}")
            fds[name] = int(fd)
        if "chan" not in fds or "grpc" not in fds:
            raise ValueError(f"{ENV}: needs chan= and grpc=")
        if pred is not None and not is_decimal(pred):
            raise ValueError(f"{ENV_PREDECESSOR}: not a pid: {pred!r}")
        for inherited in fds.values():  # (inheritable across exec: see ``close_on_exec``)
            close_on_exec(inherited)
        return cls(fds, None if pred is None else int(pred))

    def has(self, name: str) -> bool:
        """Whether listener ``name`` was handed over (and not taken yet)."""
        return name in self._fds

    def listener(self, name: str) -> socket.socket | None:
        """The inherited listening socket ``name`` (``grpc``, ``metrics``), if handed over."""
        fd = self._fds.pop(name, None)
        return None if fd is None else socket.socket(fileno=fd)

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._writer is None:
            sock = socket.socket(fileno=self._fds.pop("chan"))
            self._reader, self._writer = await asyncio.open_unix_connection(
                sock=sock, limit=MAX_MESSAGE
            )
        assert self._reader is not None
        return self._reader, self._writer

    async def send(self, msg: Mapping[str, Any]) -> None:
        _, writer = await self._open()
        writer.write(_encode(msg))
        await writer.drain()

    async def state_dir(self, timeout: float = TAKEOVER_TIMEOUT_S) -> Path:
        """Say ``warm``; the directory of the predecessor's cut."""
        await self.send({"msg": "warm", "pid": os.getpid()})
        reader, _ = await self._open()
        try:
            msg = await asyncio.wait_for(_read_message(reader), timeout)
        except TimeoutError:
            why = f"no state from the predecessor in {timeout:g} s"
            raise UpgradeFailed("timeout", why) from None
        if msg is None or msg["msg"] != "state" or not isinstance(msg.get("dir"), str):
            raise UpgradeFailed("successor_failed", "the predecessor sent no state")
        return Path(msg["dir"])

    async def fail(self, why: str) -> None:
        """Tell the predecessor this takeover failed (best effort: it also sees the exit)."""
        with contextlib.suppress(OSError, RuntimeError):
            await self.send({"msg": "failed", "why": why})
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
