"""Per-connection HTTP/2 budgets: rapid reset, PING and SETTINGS floods, oversized headers.

Why: h2 and grpclib answer every frame a client sends, however many. A client that opens a
stream and resets it in a loop (CVE-2023-44487, "rapid reset"), or floods PING or SETTINGS
frames (each answered with an ACK), keeps the relay's one event loop busy and grows its
buffers while every other client waits. ``FrameGuard`` reads the frame headers of what the
client sends before h2 does (a few bytes per frame: the 9-byte header; payloads are skipped by
length) and counts, per connection and per ``window_s``, the frames that cost the server work
without giving it any. Past a budget it writes GOAWAY with ``ENHANCE_YOUR_CALM`` (the code
RFC 9113 gives for this) and closes the connection; other connections are untouched.

The frames are read on the plain-text side (after TLS), as h2 sees them. Nothing of grpclib's
or h2's private state is used: the guard wraps the protocol's public ``data_received``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ABUSE_REASONS", "FrameGuard", "H2Budgets", "H2Counters"]

PREFACE_LEN = 24  # b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, PING, CONTINUATION = 0x1, 0x3, 0x4, 0x6, 0x9
ACK, END_HEADERS = 0x1, 0x4
ENHANCE_YOUR_CALM = 0xB
ABUSE_REASONS = ("rapid_reset", "ping_flood", "settings_flood", "oversized_headers")


@dataclass(frozen=True, slots=True)
class H2Budgets:
    """Frames one connection may send per ``window_s`` (defaults far above any gRPC client's)."""

    window_s: float = 10.0
    max_resets: int = 256  # RST_STREAM from the client
    max_pings: int = 64  # PING without ACK
    max_settings: int = 64  # SETTINGS without ACK
    max_header_block_bytes: int = 65536  # one HEADERS + CONTINUATION sequence


@dataclass(slots=True)
class H2Counters:
    """Connections closed with GOAWAY ENHANCE_YOUR_CALM, by reason."""

    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ABUSE_REASONS, 0))


def goaway(last_stream_id: int, code: int = ENHANCE_YOUR_CALM) -> bytes:
    """A GOAWAY frame (RFC 9113 §6.8): length 8, type 7, stream 0, last stream id, code."""
    payload = (last_stream_id & 0x7FFFFFFF).to_bytes(4, "big") + code.to_bytes(4, "big")
    return len(payload).to_bytes(3, "big") + b"\x07\x00" + b"\x00\x00\x00\x00" + payload


class FrameGuard:
    """The frame-header reader of one server connection (see the module docstring)."""

    __slots__ = (
        "_budgets",
        "_counters",
        "_head",
        "_header_bytes",
        "_in_headers",
        "_last_stream",
        "_pings",
        "_preface",
        "_resets",
        "_settings",
        "_skip",
        "_transport",
        "_window_end",
        "tripped",
    )  # fmt: skip

    def __init__(self, transport: Any, budgets: H2Budgets, counters: H2Counters) -> None:
        self._transport = transport
        self._budgets = budgets
        self._counters = counters
        self._preface = PREFACE_LEN
        self._head = b""  # a frame header split across reads
        self._skip = 0  # payload bytes of the current frame still to pass
        self._in_headers = False
        self._header_bytes = 0
        self._last_stream = 0
        self._window_end = time.monotonic() + budgets.window_s
        self._resets = self._pings = self._settings = 0
        self.tripped: str | None = None

    def feed(self, data: bytes) -> bool:
        """Account for ``data``; False once the connection broke a budget (it is closed)."""
        if self.tripped is not None:
            return False
        pos, n = 0, len(data)
        if self._preface:
            take = min(self._preface, n)
            self._preface -= take
            pos = take
        while pos < n:
            if self._skip:
                take = min(self._skip, n - pos)
                self._skip -= take
                pos += take
                continue
            need = 9 - len(self._head)
            chunk = data[pos : pos + need]
            pos += len(chunk)
            if len(chunk) < need:
                self._head += chunk
                break
            head = self._head + chunk if self._head else chunk
            self._head = b""
            reason = self._frame(head)
            if reason is not None:
                self._trip(reason)
                return False
        return True

    def _frame(self, head: bytes) -> str | None:
        length = int.from_bytes(head[0:3], "big")
        kind, flags = head[3], head[4]
        stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
        self._skip = length
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end = now + self._budgets.window_s
            self._resets = self._pings = self._settings = 0
        b = self._budgets
        if kind == HEADERS:
            self._last_stream = max(self._last_stream, stream)
            self._header_bytes = length
            self._in_headers = not flags & END_HEADERS
        elif kind == CONTINUATION and self._in_headers:
            self._header_bytes += length
            self._in_headers = not flags & END_HEADERS
        elif kind == RST_STREAM:
            self._resets += 1
            if self._resets > b.max_resets:
                return "rapid_reset"
        elif kind == PING and not flags & ACK:
            self._pings += 1
            if self._pings > b.max_pings:
                return "ping_flood"
        elif kind == SETTINGS and not flags & ACK:
            self._settings += 1
            if self._settings > b.max_settings:
                return "settings_flood"
        if kind in (HEADERS, CONTINUATION) and self._header_bytes > b.max_header_block_bytes:
            return "oversized_headers"
        return None

    def _trip(self, reason: str) -> None:
        self.tripped = reason
        self._counters.closed[reason] += 1
        t = self._transport
        if not t.is_closing():
            t.write(goaway(self._last_stream))
            t.close()  # flushes the GOAWAY, then closes


def guard_protocol(proto: Any, budgets: H2Budgets, counters: H2Counters) -> None:
    """Put a ``FrameGuard`` in front of ``proto.data_received`` once its connection is made."""
    made: Callable[[Any], None] = proto.connection_made
    received: Callable[[bytes], None] = proto.data_received

    def connection_made(transport: Any) -> None:
        made(transport)
        guard = FrameGuard(transport, budgets, counters)

        def data_received(data: bytes) -> None:
            if guard.feed(data):
                received(data)

        proto.data_received = data_received

    proto.connection_made = connection_made
