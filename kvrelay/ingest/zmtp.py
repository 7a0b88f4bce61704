"""The live stream read by a SUB peer that speaks ZMTP 3 itself, on the event loop.

With pyzmq, every engine message crosses libzmq's I/O thread: that thread wakes, reads the TCP
socket, decodes the frames into a pipe and signals the socket's mailbox; the loop then wakes and
asks ``ZMQ_EVENTS`` before and after each read. At light load both wakes are cold, and the I/O
thread alone cost about as much as the relay's whole decode. Here the loop's transport reads the
socket and this module cuts the bytes into messages: one wake per message, no second thread.

What it speaks (ZMTP 3.0/3.1, the NULL mechanism, as a libzmq PUB expects of a SUB):

* the 64-byte greeting (signature, version 3.0, ``NULL``, not as-server);
* ``READY`` with ``Socket-Type: SUB``; the peer's ``READY`` must name ``PUB`` or ``XPUB``;
* a subscription to every topic (the message ``0x01``, which both versions accept: topics are
  checked in ``frames.py``, counted);
* ``PING`` answered with ``PONG`` (a publisher with heartbeats on keeps the connection);
  other commands are ignored, as ZMTP says.

What libzmq's SUB did for the relay, it does too: reconnects every ``reconnect_s`` (100 ms, as
``ZMQ_RECONNECT_IVL``; the wait doubles, up to ``reconnect_max_s``, 1 s, after each connect that
fails or each connection that ends within ``HEALTHY_S`` without a message, so a port that
refuses or drops every connection, or an address a hostile discovery source names, is tried once
a second, not ten times; once a publisher's connection was had at the address, the wait is
100 ms for as long as the source is read: until the engine is declared down, when the
discovery probe takes over), ``CONNECTED`` once TCP is up and ``DISCONNECTED`` when it ends (the
monitor events the subscriber vouches on, in the same order), TCP keepalive, a handshake
bounded in time (``ZMQ_HANDSHAKE_IVL``'s 30 s) and a bounded receive queue: at ``hwm`` messages
or ``max_queue_bytes`` it stops reading the socket, so the publisher drops at its own high-water
mark and the subscriber sees a gap it repairs from the replay, as before.

Hostile peers: a greeting that is not ZMTP 3 with NULL, a peer that is not a publisher, a frame
or message larger than ``max_frame_bytes``, a message of more than ``MAX_FRAMES`` frames, a
command over ``MAX_COMMAND_BYTES`` or malformed, or PINGs whose PONGs it never reads ends the
connection, is counted by kind (``error_counts``) and the source reconnects later (libzmq never
reconnects after a protocol error). Nothing of a message is handed on before all its frames
arrived; the messages a read completed before the fault are handed on first.

Endpoints: ``tcp://host:port`` (names resolved at each connect, IPv6 in brackets) and
``ipc://path``. Anything else stays on pyzmq (``supports``): abstract ``ipc://@name`` sockets,
source-interface forms, and host names the resolver would refuse (libzmq reports those at once).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import cast

from kvrelay._text import is_decimal
from kvrelay.ingest.frames import MAX_FRAME_BYTES

__all__ = [
    "CONNECTED",
    "DISCONNECTED",
    "GREETING",
    "FrameReader",
    "ZmtpError",
    "ZmtpSource",
    "supports",
]

#: Monitor event codes, as libzmq numbers them (``zmq.EVENT_CONNECTED``, ``EVENT_DISCONNECTED``).
CONNECTED = 0x0001
DISCONNECTED = 0x0200

# signature (0xFF, padding, 0x7F), version 3.0, mechanism NULL, as-server 0, filler
GREETING = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
_MORE, _LONG, _COMMAND = 1, 2, 4
_SUBSCRIBE_ALL = b"\x00\x01\x01"  # one short frame: 0x01 + the empty topic
_PUBLISHERS = (b"PUB", b"XPUB")
#: Frames one message may have (an engine's have 3): empty frames add no bytes, so the byte
#: bound alone would let a peer grow one message's frame list without end.
MAX_FRAMES = 64
#: A connection that lasted this long, or brought a message, was a publisher's: the next
#: reconnect waits ``reconnect_s`` again (the subscriber's ``FLAP_S`` is this value).
HEALTHY_S = 2.0
#: Bytes one command may have. A publisher's commands are a READY of a few properties and PINGs;
#: without this, a READY of millions of properties up to the frame bound would hold the loop.
MAX_COMMAND_BYTES = 65535


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) > 255:
        return bytes([_COMMAND | _LONG]) + len(data).to_bytes(8, "big") + data
    return bytes([_COMMAND, len(data)]) + data


def _ready() -> bytes:
    key, value = b"Socket-Type", b"SUB"
    return _command(b"READY", bytes([len(key)]) + key + len(value).to_bytes(4, "big") + value)


_READY = _ready()


class ZmtpError(Exception):
    """A peer broke the protocol; ``kind`` names how (the counter's label). ``messages``: those
    the same read completed before the fault, which are handed on first, as libzmq would have
    delivered them frame by frame before it saw the bad one."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.messages: list[tuple[list[bytes], int]] = []


def supports(endpoint: str) -> bool:
    """Whether this reader can connect to ``endpoint`` (else the subscriber uses pyzmq, which
    also reports an endpoint it cannot use at once, as before)."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        # ``@name``: a Linux abstract socket, which libzmq knows and a file path is not
        return sys.platform != "win32" and bool(path) and not path.startswith("@")
    if not endpoint.startswith("tcp://"):
        return False
    try:
        _split_tcp(endpoint)
    except ValueError:
        return False
    return True


def _split_tcp(endpoint: str) -> tuple[str, int]:
    rest = endpoint[len("tcp://") :]
    if ";" in rest:  # a source-interface form libzmq knows: leave it to libzmq
        raise ValueError(endpoint)
    host, sep, port = rest.rpartition(":")
    if not sep or not host or host == "*" or not is_decimal(port) or not 0 < int(port) < 65536:
        raise ValueError(endpoint)
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(endpoint)
        host = host[1:-1]
    host.encode("idna")  # a name the resolver would refuse (an empty label): UnicodeError
    return host, int(port)


def _properties(body: bytes) -> dict[bytes, bytes]:
    """The name/value pairs of a ``READY`` command's body (ZMTP 3 metadata)."""
    out: dict[bytes, bytes] = {}
    at, n = 0, len(body)
    while at < n:
        k = body[at]
        if at + 1 + k + 4 > n:
            raise ZmtpError("bad_command", "truncated READY property")
        name = bytes(body[at + 1 : at + 1 + k])
        at += 1 + k
        v = int.from_bytes(body[at : at + 4], "big")
        if at + 4 + v > n:
            raise ZmtpError("bad_command", "truncated READY property value")
        out[name.lower()] = bytes(body[at + 4 : at + 4 + v])
        at += 4 + v
    return out


class FrameReader:
    """Cuts a ZMTP 3 byte stream, from its greeting on, into whole messages and commands.

    ``feed`` returns what the bytes completed; it raises ``ZmtpError`` on anything a NULL-mechanism
    publisher would not send. Pure: no I/O (the source writes the replies it asks for)."""

    __slots__ = ("_buf", "_frames", "_greeted", "_msg_bytes", "max_frame_bytes", "ready")

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._greeted = False
        self._frames: list[bytes] = []  # the message being assembled
        self._msg_bytes = 0
        self.ready = False  # the peer's READY arrived (and named a publisher)

    def feed(self, data: bytes) -> tuple[list[tuple[list[bytes], int]], list[tuple[bytes, bytes]]]:
        """``(messages, commands)`` completed by ``data``: each message its frames and their
        bytes, each command ``(name, body)`` other than ``READY`` (checked here). Bytes that
        arrive whole (nothing left over from the last read, the usual case) are cut where they
        are, not copied into the buffer first."""
        buf: bytes | bytearray
        if self._buf or not self._greeted:
            buf = self._buf
            buf += data
        else:
            buf = data
        at = 0
        if not self._greeted:
            if len(buf) >= 1 and buf[0] != 0xFF:
                raise ZmtpError("bad_greeting", "not a ZMTP peer")
            if len(buf) >= 10 and buf[9] != 0x7F:
                raise ZmtpError("bad_greeting", "not a ZMTP 3 signature")
            if len(buf) >= 11 and buf[10] < 3:
                raise ZmtpError("bad_greeting", f"ZMTP version {buf[10]} (3 is needed)")
            if len(buf) < 64:
                return [], []
            mech = bytes(buf[12:32]).rstrip(b"\0")
            if mech != b"NULL":
                raise ZmtpError("bad_greeting", f"mechanism {mech!r} (NULL is supported)")
            at = 64
            self._greeted = True
        messages: list[tuple[list[bytes], int]] = []
        commands: list[tuple[bytes, bytes]] = []
        n = len(buf)
        try:
            limit = self.max_frame_bytes
            while n - at >= 2:
                flags = buf[at]
                if flags & ~(_MORE | _LONG | _COMMAND):
                    raise ZmtpError("bad_frame", f"reserved flag bits set: {flags:#x}")
                if flags & _LONG:
                    if n - at < 9:
                        break
                    size, head = int.from_bytes(buf[at + 1 : at + 9], "big"), 9
                else:
                    size, head = buf[at + 1], 2
                if size > limit:
                    raise ZmtpError("oversized", f"frame of {size} bytes (limit {limit})")
                if flags & _COMMAND and size > MAX_COMMAND_BYTES:
                    raise ZmtpError("bad_command", f"command of {size} bytes")
                end = at + head + size
                if end > n:
                    break
                body = bytes(buf[at + head : end])  # bytes slices bytes once; a bytearray's twice
                at = end
                if flags & _COMMAND:
                    if flags & _MORE:
                        raise ZmtpError("bad_frame", "a command with the MORE flag")
                    commands.extend(self._command(body))
                    continue
                if not self.ready:
                    raise ZmtpError("bad_frame", "a message before the peer's READY")
                self._msg_bytes += size
                if self._msg_bytes > limit:
                    raise ZmtpError("oversized", f"message over {limit} bytes")
                if len(self._frames) >= MAX_FRAMES:
                    raise ZmtpError("too_many_frames", f"message over {MAX_FRAMES} frames")
                self._frames.append(body)
                if not flags & _MORE:
                    messages.append((self._frames, self._msg_bytes))
                    self._frames, self._msg_bytes = [], 0
        except ZmtpError as exc:
            exc.messages = messages
            raise
        if buf is self._buf:
            if at:
                del self._buf[:at]
        elif at < n:
            self._buf += buf[at:]  # the start of a frame: kept for the next read
        return messages, commands

    def _command(self, body: bytes) -> list[tuple[bytes, bytes]]:
        if not body or 1 + body[0] > len(body):
            raise ZmtpError("bad_command", "truncated command name")
        name = body[1 : 1 + body[0]]
        rest = body[1 + body[0] :]
        if name == b"READY":
            if self.ready:
                raise ZmtpError("bad_command", "a second READY")
            kind = _properties(rest).get(b"socket-type", b"")
            if kind not in _PUBLISHERS:
                raise ZmtpError("peer_type", f"peer is {kind.decode(errors='replace')!r}")
            self.ready = True
            return []
        if name == b"ERROR":
            raise ZmtpError("peer_error", bytes(rest[1:]).decode(errors="replace"))
        if not self.ready:
            raise ZmtpError("bad_command", f"{name!r} before READY")
        return [(name, rest)]


def _pong(ping_body: bytes) -> bytes:
    """The ``PONG`` for a ``PING`` body (2-byte TTL, then up to 16 bytes of context)."""
    return _command(b"PONG", ping_body[2:18])


class _Connection(asyncio.Protocol):
    def __init__(self, source: ZmtpSource) -> None:
        self._source = source
        self._reader = FrameReader(source.max_frame_bytes)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = t.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            _keepalive(sock, self._source.keepalive)
        t.write(GREETING + _READY)
        self._source._on_connected(self)

    def data_received(self, data: bytes) -> None:
        t = self.transport
        assert t is not None
        was_ready = self._reader.ready
        try:
            messages, commands = self._reader.feed(data)
        except ZmtpError as exc:
            if exc.messages:
                self._source._on_messages(exc.messages)
            self._source._on_error(exc)
            t.abort()
            return
        if not was_ready and self._reader.ready:
            t.write(_SUBSCRIBE_ALL)
            self._source._on_ready()
        for name, body in commands:
            if name == b"PING":
                t.write(_pong(body))
        if messages:
            self._source._on_messages(messages)

    def pause_writing(self) -> None:
        """The relay only writes its handshake and PONGs: a peer that sends PINGs and never
        reads the answers would otherwise grow the write buffer without end."""
        self._source._on_error(ZmtpError("write_backlog", "the peer does not read its PONGs"))
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._source._on_lost(self)


def _keepalive(sock: socket.socket, opts: tuple[int, int, int]) -> None:
    idle, intvl, cnt = opts
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", intvl), ("TCP_KEEPCNT", cnt)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


class ZmtpSource:
    """One endpoint's live messages and connection events, for one subscriber.

    ``open(notify)`` starts connecting; ``notify`` is called (synchronously, from the loop's
    transport callbacks) whenever messages or events were queued. The subscriber then takes
    events (``take_events``) before messages (``next_message``), as it did from the monitor
    socket and the SUB socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        hwm: int = 100_000,
        max_queue_bytes: int = 64 << 20,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        reconnect_s: float = 0.1,
        reconnect_max_s: float = 1.0,
        handshake_s: float = 30.0,
        keepalive: tuple[int, int, int] = (10, 5, 3),
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        if not supports(endpoint):
            raise ValueError(f"not an endpoint the ZMTP reader connects to: {endpoint!r}")
        self.endpoint = endpoint
        self.hwm = max(1, hwm)
        self.max_queue_bytes = max_queue_bytes
        self.max_frame_bytes = max_frame_bytes
        self.reconnect_s = reconnect_s
        self.reconnect_max_s = max(reconnect_s, reconnect_max_s)
        self.handshake_s = handshake_s
        self.keepalive = keepalive
        self._on_error_kind = on_error
        #: protocol errors by kind (``ZmtpError.kind``, ``handshake_timeout``), each also passed
        #: to ``on_error``; connects refused or failed are ``connect_failures``
        self.error_counts: dict[str, int] = {}
        self.connect_failures = 0
        self._messages: deque[tuple[list[bytes], int]] = deque()  # (frames, their bytes)
        self.messages_in = 0  # messages received, every connection
        self._connected_at = 0.0  # (monotonic) when the current connection was made
        self._messages_at_connect = 0  # messages_in then
        self._queued_bytes = 0
        self._events: list[int] = []
        self._notify: Callable[[], None] | None = None
        self._conn: _Connection | None = None
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._lost = asyncio.Event()  # the current connection ended
        self._ready = asyncio.Event()  # the current connection is subscribed

    @property
    def ready(self) -> bool:
        """The current connection is subscribed (the peer's READY arrived, ours was sent)."""
        return self._ready.is_set()

    # ---- what the subscriber calls ---------------------------------------------------------
    def open(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self._task = asyncio.get_running_loop().create_task(
            self._keep_connected(), name=f"kvrelay-zmtp-{self.endpoint}"
        )

    async def wait_ready(self, timeout: float) -> bool:
        """Until the publisher has the subscription (its READY arrived, ours was sent), at most
        ``timeout`` s; whether it has. A replay asked before that could answer up to a batch the
        live stream then misses, with nothing after it to show the hole."""
        if self.ready:
            return True
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return self.ready

    def detach(self) -> None:
        """Stop calling ``notify``: messages and events still queue (bounded) until ``close``."""
        self._notify = None

    def close(self) -> None:
        """Stop reconnecting and drop the connection (no events after this)."""
        self._closed = True
        self._notify = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._cancel_handshake()
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.abort()
        self._messages.clear()
        self._queued_bytes = 0
        self._events.clear()

    def has_events(self) -> bool:
        return bool(self._events)

    def take_events(self) -> list[int]:
        out, self._events = self._events, []
        return out

    def readable(self) -> bool:
        return bool(self._messages)

    def next_message(self, woken: bool = False) -> list[bytes] | None:
        """The oldest queued message, or None."""
        q = self._messages
        if not q:
            return None
        frames, size = q.popleft()
        self._queued_bytes -= size
        low = len(q) <= self.hwm // 2 and self._queued_bytes <= self.max_queue_bytes // 2
        if self._paused and low:
            self._paused = False
            conn = self._conn
            if conn is not None and conn.transport is not None:
                conn.transport.resume_reading()
        return frames

    # ---- the connection's callbacks ----------------------------------------------------------
    def _on_connected(self, conn: _Connection) -> None:
        self._conn = conn
        self._handshake_timer = asyncio.get_running_loop().call_later(
            self.handshake_s, self._handshake_expired, conn
        )
        self._connected_at, self._messages_at_connect = time.monotonic(), self.messages_in
        self._event(CONNECTED)

    def _on_ready(self) -> None:
        self._ready.set()
        self._cancel_handshake()

    def _cancel_handshake(self) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def _handshake_expired(self, conn: _Connection) -> None:
        if conn is self._conn and conn.transport is not None:
            self._count("handshake_timeout")
            conn.transport.abort()

    def _on_error(self, exc: ZmtpError) -> None:
        self._count(exc.kind)

    def _on_messages(self, messages: list[tuple[list[bytes], int]]) -> None:
        q = self._messages
        self.messages_in += len(messages)
        for m in messages:
            q.append(m)
            self._queued_bytes += m[1]
        if (len(self._messages) >= self.hwm or self._queued_bytes >= self.max_queue_bytes) and (
            not self._paused
        ):
            self._paused = True
            conn = self._conn
            if conn is not None and conn.transport is not None:
                conn.transport.pause_reading()
        notify = self._notify
        if notify is not None:
            notify()

    def _on_lost(self, conn: _Connection) -> None:
        self._cancel_handshake()
        if conn is self._conn:
            self._conn = None
        self._ready.clear()
        self._paused = False
        self._lost.set()
        if not self._closed:
            self._event(DISCONNECTED)

    def _event(self, code: int) -> None:
        self._events.append(code)
        notify = self._notify
        if notify is not None:
            notify()

    def _count(self, kind: str) -> None:
        self.error_counts[kind] = self.error_counts.get(kind, 0) + 1
        if self._on_error_kind is not None:
            self._on_error_kind(kind)

    async def _keep_connected(self) -> None:
        loop = asyncio.get_running_loop()
        lost = self._lost
        wait = self.reconnect_s
        published = False  # a publisher's connection was had here (then: no backoff)
        while not self._closed:
            lost.clear()
            healthy = False
            try:
                if self.endpoint.startswith("ipc://"):
                    connecting = loop.create_unix_connection(
                        lambda: _Connection(self), self.endpoint[len("ipc://") :]
                    )
                else:
                    host, port = _split_tcp(self.endpoint)
                    connecting = loop.create_connection(lambda: _Connection(self), host, port)
                # a peer that never answers the SYN: tried again, not waited for by the OS
                await asyncio.wait_for(connecting, self.handshake_s)
            except (OSError, TimeoutError):
                self.connect_failures += 1
            except Exception:  # anything else the connect raised: counted, and tried again
                self.connect_failures += 1
                self._count("connect_error")
            else:
                await lost.wait()
                healthy = (self.messages_in > self._messages_at_connect
                           or time.monotonic() - self._connected_at >= HEALTHY_S)  # fmt: skip
            if healthy:
                wait, published = self.reconnect_s, True
            await asyncio.sleep(wait)
            # 0.1, 0.2, 0.4, 0.8, then 1 s while an address that never had a publisher keeps
            # failing; an engine's address stays at 0.1 s while it is read (a restart
            # takes minutes, and without a replay socket what it publishes before the
            # reconnect is lost)
            if not healthy and not published:
                wait = min(2 * wait, self.reconnect_max_s)
