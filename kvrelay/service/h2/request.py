"""Reading one request message with its length checked before its bytes are taken.

Why: grpclib's ``recv_message`` reads a message's 5-byte prefix and then takes as many bytes as
the prefix claims (up to 4 GiB), granting the client flow-control window as they arrive, before
the codec can see the size: a client that claims a huge request makes the relay buffer it. Here
the prefix is read first, and a claim over ``max_bytes`` is refused with RESOURCE_EXHAUSTED /
RESOURCE_LIMIT before any of its body is read. A body shorter than its prefix, or a compressed
message without a ``grpc-encoding`` (or with ``identity``), is INVALID_ARGUMENT /
INVALID_REQUEST, where grpclib raised ``AssertionError`` / ``NotImplementedError`` (which would
read as a relay bug).

Compressed requests (the gRPC compression rules): a message with the compressed flag on a call
whose ``grpc-encoding`` is ``gzip`` or ``deflate`` is inflated and read as usual. Inflating is
bounded: zlib's incremental decompressor is asked for at most one byte more than the request
limit, so a small message that would inflate past it (a decompression bomb) costs that much
work and is refused with the error an uncompressed request of that size gets; data that does
not inflate (corrupt, cut short, trailing bytes) is INVALID_REQUEST. A compressed message in any
other encoding is UNIMPLEMENTED, as the gRPC spec says (plain gRPC, no reason trailer: no relay
reason fits, and Dynamo answers a ``grpc-encoding`` with that status), refused at its prefix, and
its response headers carry ``grpc-accept-encoding`` (``identity,gzip,deflate``), as the spec asks
of a server that refuses an encoding, so a client can retry in one the relay reads. grpclib's
metadata refuses ``grpc-`` names, so those headers are written as grpclib writes its own
(``internals.REQUEST_NEEDS``), before grpclib's trailers with the status.
grpclib drops ``grpc-*`` headers from a stream's metadata, so ``mend`` notes each call's
``grpc-encoding`` as grpclib accepts the stream (``note_request_encoding``); where ``mend`` is
not installed no encoding is known and a compressed message stays INVALID_REQUEST.

It uses grpclib's private stream parts (``internals.REQUEST_NEEDS``); where the installed grpclib
lacks one it falls back to ``recv_message`` with the same mapping of its framing errors. grpclib's
``RecvMessage`` event is not dispatched on the checked path (the relay listens for none).

Requests are small (a pool id, a subscriber id, a producer identity; a service name for health
and reflection): one over ``MAX_REQUEST_BYTES`` cannot be valid and is refused as
INVALID_REQUEST, also before its body is read (one over the message limit stays RESOURCE_LIMIT,
as the contract says), so a stream pins at most that much of a client's sending. Across the
port, the bytes of larger requests being read and the streams waiting for their request are
bounded too (``request_guards.py``).
``BoundedRequests`` puts grpclib's own health and reflection services on the same reader, and
ends a bug in them as the relay's own calls end one (INTERNAL with the reason trailer, logged
``rpc_failed``, counted) instead of grpclib's bare UNKNOWN.
``finish_early`` ends a stream with status OK while its client may still send requests (a
reflection stream on the drain).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NoReturn

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvrelay._aio import bounded
from kvrelay._grpc import BrokenFraming, CompressedMessage, read_framed
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import PermitCounter
from kvrelay.service.h2.guard import H2Counters
from kvrelay.service.h2.internals import (
    EARLY_END_STATE,
    NO_ERROR,
    REQUEST_NEEDS,
    stream_internals,
)
from kvrelay.service.h2.request_guards import SMALL_REQUEST_BYTES, RequestGuards

__all__ = [
    "ACCEPTED_ENCODINGS",
    "INBOUND_WINDOW_BYTES",
    "INFLATED_ENCODINGS",
    "MAX_REQUEST_BYTES",
    "REQUEST_TIMEOUT_S",
    "BoundedRequests",
    "finish_early",
    "inflate_bounded",
    "missing_request_needs",
    "note_request_encoding",
    "recv_request",
    "recv_within",
]

#: A stream (or call) whose request message has not arrived after this long ends INVALID_REQUEST.
REQUEST_TIMEOUT_S = 10.0
#: The largest request message read: larger ones are no valid request (every request of the
#: contract is well under 1 KiB) and refused unread.
MAX_REQUEST_BYTES = 1024 * 1024
#: The flow-control windows the relay grants its clients, per stream and per connection (the
#: HTTP/2 minimum): clients send requests only, all small, and a client's DATA that nothing
#: reads (after a request, on a stream that reads no more) stays buffered up to the window.
#: grpclib's 4 MiB let each connection pin 4 MiB that way.
INBOUND_WINDOW_BYTES = 65_535
#: The ``grpc-encoding`` values whose compressed requests are inflated, and zlib's ``wbits``
#: for each (gRPC's ``deflate`` is the zlib format, RFC 1950, as grpc-core writes it).
INFLATED_ENCODINGS: dict[str, int] = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_IDENTITY = "identity"
#: ``grpc-accept-encoding``: what the relay reads, told with an UNIMPLEMENTED encoding.
ACCEPTED_ENCODINGS = ",".join((_IDENTITY, *INFLATED_ENCODINGS))

#: Each call's ``grpc-encoding`` (lower case; several different values joined by ", "), by
#: grpclib's protocol stream; only calls that sent one. Weak: an entry goes with its stream.
_ENCODINGS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def note_request_encoding(inner: Any, headers: Iterable[tuple[Any, Any]]) -> None:
    """Remember the ``grpc-encoding`` among a new call's request ``headers`` for its protocol
    stream ``inner`` (``mend`` calls it as grpclib accepts the stream)."""
    values: list[str] = []
    for name, value in headers:
        if name in ("grpc-encoding", b"grpc-encoding"):
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if (v := text.strip().lower()) not in values:
                values.append(v)
    if values:
        with contextlib.suppress(TypeError):  # (not weakly referable: no encoding known)
            _ENCODINGS[inner] = ", ".join(values)


def inflate_bounded(
    data: bytes, encoding: str, limit: int, too_large: Callable[[int], NoReturn]
) -> bytes:
    """``data`` inflated as ``encoding`` (one of ``INFLATED_ENCODINGS``), never more than
    ``limit + 1`` bytes of it: past ``limit`` it calls ``too_large(limit + 1)``, which raises.
    Data that does not inflate completely and exactly is INVALID_REQUEST."""
    inflater = zlib.decompressobj(INFLATED_ENCODINGS[encoding])
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as exc:
        raise RelayError.invalid_request(f"corrupt {encoding} request: {exc}") from None
    if len(out) > limit:
        too_large(len(out))
    if not inflater.eof:
        raise RelayError.invalid_request(f"corrupt {encoding} request: its data is cut short")
    if inflater.unused_data:
        raise RelayError.invalid_request(f"corrupt {encoding} request: bytes after its end")
    return out


def missing_request_needs(stream: Any) -> list[str]:
    """``where.attribute`` for each of ``REQUEST_NEEDS`` that ``stream`` lacks."""
    objects = {"stream": stream, "inner": getattr(stream, "_stream", None)}
    objects["connection"] = getattr(objects["inner"], "connection", None)
    return [f"{w}.{a}" for w, a in REQUEST_NEEDS if not hasattr(objects[w], a)]


async def recv_request(
    stream: Any, max_bytes: int, guards: RequestGuards | None = None
) -> Any | None:
    """The next request message of ``stream`` (a grpclib server stream), decoded by its codec,
    or None when the client sent none; raises ``RelayError`` for a claim over ``max_bytes``, one
    the port's request budget has no room for (``guards``; counted), broken framing, or a
    compressed request that inflates past the limits or not at all, and
    ``GRPCError(UNIMPLEMENTED)`` for one compressed in an encoding it cannot inflate."""
    if missing_request_needs(stream):
        try:
            return await stream.recv_message()
        except (AssertionError, NotImplementedError) as exc:
            raise RelayError.invalid_request(f"broken request framing: {exc}") from None
    inner = stream._stream
    held = 0
    try:
        encoding = _ENCODINGS.get(inner)
    except TypeError:  # (not weakly referable: nothing was noted for it)
        encoding = None

    def judge(size: int, inbound: str, request: str) -> None:
        if size > max_bytes:
            raise RelayError.resource_limit(f"{inbound} exceeds {max_bytes}")
        if size > MAX_REQUEST_BYTES:
            raise RelayError.invalid_request(
                f"{request}: larger than any valid request ({MAX_REQUEST_BYTES})"
            )

    def inflated(size: int) -> NoReturn:  # (inflate_bounded stopped at one byte past the limit)
        what = f"{encoding} request that inflates to over {size - 1} bytes"
        judge(size, f"inbound message: a {what}", f"a {what}")
        raise AssertionError(f"{size} bytes: not over the limit")  # (judge raised)

    inflate: Callable[[bytes], bytes] | None = None
    if encoding in INFLATED_ENCODINGS:
        limit = min(max_bytes, MAX_REQUEST_BYTES)
        inflate = functools.partial(
            inflate_bounded, encoding=encoding, limit=limit, too_large=inflated
        )

    def check(size: int) -> None:
        nonlocal held
        judge(size, f"inbound message of {size} bytes", f"request of {size} bytes")
        if guards is not None and size > SMALL_REQUEST_BYTES:
            budget = guards.budget
            if not budget.take(size):
                guards.counters.count("request_bytes")
                raise RelayError.resource_limit(
                    f"request of {size} bytes: the relay is reading {budget.held} bytes of "
                    f"requests, its limit is {budget.limit}"
                )
            held = size

    try:
        body = await read_framed(inner, check, inflate)
    except CompressedMessage as exc:
        if encoding is not None and encoding != _IDENTITY:
            await _tell_accepted_encodings(stream)
            raise GRPCError(
                Status.UNIMPLEMENTED,
                f"a request compressed as grpc-encoding {encoding!r}: this relay inflates "
                f"only {', '.join(INFLATED_ENCODINGS)}",
            ) from None
        raise RelayError.invalid_request(f"broken request framing: {exc}") from None
    except BrokenFraming as exc:
        raise RelayError.invalid_request(f"broken request framing: {exc}") from None
    finally:
        if held:
            guards.budget.give(held)  # type: ignore[union-attr]
    if body is None:
        return None
    message = stream._codec.decode(body, stream._recv_type)
    stream._messages_received += 1
    inner.connection.messages_received += 1
    return message


async def _tell_accepted_encodings(stream: Any) -> None:
    """Response headers with ``grpc-accept-encoding`` (see the module docstring), unless the
    response's headers went out already (a later request on a reflection stream)."""
    if stream._send_initial_metadata_done:
        return
    headers = [(":status", "200"), ("content-type", stream._content_type),
               ("grpc-accept-encoding", ACCEPTED_ENCODINGS)]  # fmt: skip
    with contextlib.suppress(Exception):  # the stream or its connection ended meanwhile
        await stream._stream.send_headers(headers)
        stream._send_initial_metadata_done = True


async def recv_within(
    stream: Any, max_bytes: int, timeout_s: float, guards: RequestGuards | None = None
) -> Any:
    """The one request of a call, within ``timeout_s``: none, or none in time (counted as
    ``request_timeout``), is INVALID_ARGUMENT / INVALID_REQUEST. With ``guards`` the wait holds
    a place among the port's waiting streams, and one that is ended to make room is
    RESOURCE_EXHAUSTED / RESOURCE_LIMIT (counted as ``request_evicted``); one ended by the
    drain (``PendingRequests.end_all``) raises the error it was ended with. A call cancelled
    while it waited (its client's reset, its deadline, the server's close) raises
    ``CancelledError``, also when its request arrived in the same loop turn (``bounded``)."""
    read = asyncio.ensure_future(recv_request(stream, max_bytes, guards))
    if guards is None:
        return await _in_time(read, timeout_s, None)
    pending = guards.pending
    place, ended = pending.enter(read)
    if ended:
        guards.counters.count("request_evicted", ended)
    try:
        return await _in_time(read, timeout_s, guards.counters)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        ending = place.ending
        if ending is None or (task is not None and task.cancelling()):
            raise  # the call itself is cancelled (a reset, a deadline): its wait was not ended
        raise RelayError(ending.reason, ending.message) from None
    finally:
        pending.leave(place)


async def _in_time(read: asyncio.Future[Any], timeout_s: float, counters: H2Counters | None) -> Any:
    try:
        request = await bounded(read, timeout_s)
    except TimeoutError:
        if counters is not None:
            counters.count("request_timeout")
        raise RelayError.invalid_request(f"no request message within {timeout_s} s") from None
    if request is None:
        raise RelayError.invalid_request("missing request message")
    return request


async def finish_early(stream: Any) -> None:
    """End ``stream`` (a grpclib server stream) with status OK, then, if its client has not
    finished its requests, RST_STREAM ``NO_ERROR``: how a server whose response is complete
    asks for no more (RFC 9113 §8.1), as grpc-go's does. Without it grpc-core keeps the call
    open for the requests it may still send, and the connection's close a moment later turns
    the OK into UNAVAILABLE "Socket closed"."""
    await stream.send_trailing_metadata()
    parts = stream_internals(stream)
    if parts is None:
        return  # the trailers alone, as grpclib sends them
    h2_stream = parts.h2.streams.get(parts.inner.id)
    if h2_stream is not None and h2_stream.state_machine.state is EARLY_END_STATE:
        with contextlib.suppress(Exception):  # the connection broke meanwhile: nothing to tell
            parts.inner.reset_nowait(NO_ERROR)


class BoundedRequests:
    """grpclib handlers (an object with ``__mapping__``, such as its health and reflection
    services) whose streams read each request with ``recv_request``: grpclib's
    ``recv_message`` buffers whatever a length prefix claims before anything can refuse it.
    The first request must come within ``timeout_s``, under the port's ``guards``; later ones
    (reflection is a bidirectional stream a tool may keep open, idle between requests) may be
    ``SMALL_REQUEST_BYTES`` at most, so an idle stream pins no more than that. ``streams`` caps
    the bidirectional calls open at once (each costs its state for as long as the tool keeps
    it). ``refuse`` ends the call for a refused request (the relay's own: counted, with the
    reason trailer); ``internal`` gives what a bug in a handler ends its call with (the relay's
    own, which logs it), given the RPC's path without its leading slash."""

    def __init__(
        self,
        handlers: Any,
        max_bytes: int,
        timeout_s: float,
        refuse: Callable[[RelayError], NoReturn],
        guards: RequestGuards | None = None,
        streams: PermitCounter | None = None,
        internal: Callable[[str, Exception], RelayError] | None = None,
    ) -> None:
        self._handlers = handlers
        self._internal = internal
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._refuse = refuse
        self._guards = guards
        self._streams = streams

    def __mapping__(self) -> dict[str, Handler]:
        return {
            path: h._replace(func=self._bounded(h.func, h.cardinality, path.lstrip("/")))
            for path, h in self._handlers.__mapping__().items()
        }

    def _bounded(
        self, func: Callable[[Any], Awaitable[None]], cardinality: Cardinality, rpc: str
    ) -> Callable[[Any], Awaitable[None]]:
        streams = self._streams if cardinality is Cardinality.STREAM_STREAM else None
        later_bytes = min(self._max_bytes, SMALL_REQUEST_BYTES)

        async def handle(stream: Any) -> None:
            if streams is not None and not streams.try_acquire():
                self._refuse(RelayError.resource_limit(
                    f"{streams.capacity} {streams.name} streams already open"
                ))  # fmt: skip
            try:
                await bounded_call(stream)
            except (asyncio.CancelledError, GRPCError, StreamTerminatedError):
                raise  # a status, the call's own end, or its client's reset: no bug
            except Exception as exc:
                if self._internal is None:
                    raise
                self._refuse(self._internal(rpc, exc))
            finally:
                if streams is not None:
                    streams.release()

        async def bounded_call(stream: Any) -> None:
            first = True

            async def recv_message() -> Any:
                nonlocal first
                try:
                    if first:
                        first = False
                        return await recv_within(
                            stream, self._max_bytes, self._timeout_s, self._guards
                        )
                    return await recv_request(stream, later_bytes)
                except RelayError as err:
                    self._refuse(err)

            stream.recv_message = recv_message
            await func(stream)

        return handle
