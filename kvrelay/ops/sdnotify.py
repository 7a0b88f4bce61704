"""systemd notification protocol (``sd_notify``) without libsystemd.

One AF_UNIX datagram per state change to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the
abstract namespace). Everything is best effort: outside systemd (no variable) every call is a
no-op, and a send failure is counted and logged once, never raised — readiness reporting must not
be able to take the relay down.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Mapping

from kvrelay._text import is_decimal
from kvrelay.logging import get_logger

_LOG = get_logger(__name__)


class Notifier:
    """Sends ``READY=1`` / ``RELOADING=1`` / ``WATCHDOG=1`` / ``STOPPING=1`` / ``STATUS=...`` /
    ``EXTEND_TIMEOUT_USEC=...`` to systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_interval(env)
        self.sent = 0
        self.failures = 0
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one state datagram; False when disabled or the send failed."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(state.encode(), self.address)
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                kind = state.split("=", 1)[0]
                _LOG.warning("sd_notify_failed", error=str(exc), state=kind)
            return False
        self.sent += 1
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self, within_s: float | None = None) -> bool:
        """``STOPPING=1``; with ``within_s``, also ``EXTEND_TIMEOUT_USEC``: the stop may take
        that long (systemd then waits for it past a shorter ``TimeoutStopSec=``; a longer one
        is unchanged)."""
        extend = "" if within_s is None else f"\nEXTEND_TIMEOUT_USEC={int(within_s * 1_000_000)}"
        return self.notify("STOPPING=1" + extend)

    def reloading(self) -> bool:
        """``RELOADING=1`` with the ``MONOTONIC_USEC`` systemd ≥ 253 wants (``Type=notify-reload``
        and ``ExecReload=`` both work); ``ready()`` ends the reload."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for ``seconds`` more before its start (or stop) timeout fires."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog(self) -> bool:
        """One ``WATCHDOG=1`` ping (only when systemd asked for a watchdog)."""
        if self.watchdog_s is None:
            return False
        return self.notify("WATCHDOG=1")

    async def watchdog_loop(self) -> None:
        """Ping ``WATCHDOG=1`` at half the watchdog interval until cancelled.

        Runs on the event loop on purpose: a wedged loop stops the pings and systemd restarts us.
        """
        if self.watchdog_s is None or self.address is None:
            return
        period = self.watchdog_s / 2
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(period)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock and other forms are not supported; treat as absent


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """``WATCHDOG_USEC`` in seconds, honouring ``WATCHDOG_PID`` (only when it names us)."""
    usec = env.get("WATCHDOG_USEC", "")
    if not is_decimal(usec) or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and (not is_decimal(pid) or int(pid) != os.getpid()):
        return None
    return int(usec) / 1_000_000
