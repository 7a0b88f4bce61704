"""Lines from a worker to its supervisor that never block the worker's event loop.

A worker reports on its stdout pipe (``READY <port>``, then ``STATS <json>`` every second). The
supervisor reads it on the ingest process's event loop: when that loop stalls for a few seconds,
the pipe (64 KiB) fills, and a blocking ``print`` would stall every worker with it. Lines go
through a small bounded queue to one writer thread instead; ``os.write`` on the raw descriptor
blocks only that thread (and releases the GIL meanwhile). When the queue is full, the oldest
pending droppable line (a ``STATS`` report: the next one supersedes it) makes room, counted in
``dropped``; lines that must arrive (``READY``) are never dropped. A reader that is gone (EPIPE)
stops the thread: the worker notices its supervisor is gone through stdin.
"""

from __future__ import annotations

import os
import threading
from collections import deque

#: Lines waiting for the writer thread at most (a STATS report is at most a few MiB).
PENDING_LINES = 4


class ReportPipe:
    """One writer thread per descriptor; ``send`` is safe from the event loop (never blocks on
    the reader, only on a short queue lock)."""

    def __init__(self, fd: int, capacity: int = PENDING_LINES) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.fd = fd
        self.capacity = capacity
        self.dropped = 0  # droppable lines discarded because the reader was behind
        self.written = 0  # lines written completely
        self.broken = False  # the reader went away (EPIPE, or another write error)
        self._lines: deque[tuple[bytes, bool]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvrelay-report", daemon=True)
        self._thread.start()

    def send(self, line: str, *, droppable: bool = True) -> bool:
        """Queue ``line`` (a newline is added). False if it, or an older droppable line, was
        dropped to stay within ``capacity``."""
        data = line.encode() + b"\n"
        with self._cond:
            if self._closed or self.broken:
                self.dropped += droppable
                return False
            kept = True
            if len(self._lines) >= self.capacity:
                victim = next((i for i, (_, d) in enumerate(self._lines) if d), None)
                if victim is not None:
                    del self._lines[victim]
                    self.dropped += 1
                    kept = False
                elif droppable:
                    self.dropped += 1
                    return False
            self._lines.append((data, droppable))
            self._cond.notify()
        return kept

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._lines)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._lines and not self._closed:
                    self._cond.wait()
                if not self._lines:
                    return
                data, _ = self._lines.popleft()
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError:
                with self._cond:
                    self.broken = True
                    self._lines.clear()
                return
            with self._cond:
                self.written += 1

    def close(self, timeout_s: float = 1.0) -> bool:
        """Write what is queued, for at most ``timeout_s`` (a stalled reader is not waited for);
        True if everything went out."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
