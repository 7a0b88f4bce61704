"""``StreamWriter``: the relay's ways of writing on one grpclib server stream, in one object.

Why: the publication hub's pump takes a writer for each kind of message it sends — a pre-encoded
delta at once while the stream is idle (``send_now``), several queued deltas as one DATA write
(``send_batch``), a snapshot chunk from its parts (``bulk``) — a way to reset a stream whose
client stopped reading (``reset``), and the count of DATA bytes the stream has written
(``written``): a send that has written nothing of its message when the stream ends (a drain,
a fence) is given up by the hub, so the status goes out at once instead of waiting for a window
its client may never open. Every writer here, and grpclib's ``send_message``, leaves nothing
behind when cancelled before its first byte. Each works beside grpclib on its private state,
with the same window accounting as h2's ``send_data``. When the installed grpclib or h2 lacks
any internal ``internals.py`` lists, every one of them is None and the pump sends through
grpclib's public ``send_message`` (slower, the same bytes); trailers always go through grpclib.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kvrelay._aio import GiveUpUnwritten
from kvrelay.publication.hub import SendBatch
from kvrelay.service.h2.bulk import BulkSender, abandon, bulk_sender
from kvrelay.service.h2.direct import direct_writer
from kvrelay.service.h2.internals import CANCEL, stream_internals

__all__ = ["StreamWriter", "send_unless", "stream_resetter"]


class StreamWriter:
    """The writers for one grpclib server stream (see the module docstring); ``close()`` when
    the stream's subscription ends."""

    __slots__ = ("bulk", "reset", "send_batch", "send_now", "written")

    def __init__(self, stream: Any, max_message_bytes: int) -> None:
        self.bulk: BulkSender | None = bulk_sender(stream, max_message_bytes)
        self.send_batch: SendBatch | None = _batch_sender(stream)
        self.reset: Callable[[], None] | None = _resetter(stream)
        self.send_now: Callable[[bytes], bool] | None = direct_writer(stream)
        self.written: Callable[[], int] | None = _written(stream)

    def close(self) -> None:
        """Give up the stream's place among the bulk writers of its connection."""
        if self.bulk is not None:
            self.bulk.close()


def stream_resetter(stream: Any) -> Callable[[], None] | None:
    """The reset alone, for a plane stream whose client stopped reading (it needs no other
    writer); None when the internals are missing."""
    return _resetter(stream)


def _resetter(stream: Any) -> Callable[[], None] | None:
    """RST_STREAM for a stream whose client stopped reading (it is written even then)."""
    parts = stream_internals(stream)
    if parts is None:
        return None
    inner = parts.inner

    def reset() -> None:
        with contextlib.suppress(Exception):  # already closed: nothing left to reset
            inner.reset_nowait(CANCEL)

    return reset


async def send_unless(
    stream: Any,
    sending: Awaitable[None],
    ends: Iterable[asyncio.Future[Any]],
    size: int | None = None,
) -> bool:
    """Await ``sending`` (a send on ``stream``, in the calling task); False when one of ``ends``
    completed while it had written nothing of its message, and it was given up
    (``GiveUpUnwritten``, the rule a pool stream's pump follows too): the stream's status can
    go out at once. Without the internals the send is awaited whole.

    A send cancelled otherwise (the call's deadline, the server's close) with part of its
    message written (``size``: its framed bytes, when known) resets the stream, as a pool
    stream's cut chunk does (``abandon``): trailers after it would read as its rest."""
    written = _written(stream)
    sends = GiveUpUnwritten(written)
    mark = None if written is None else written()

    def give_up(_end: asyncio.Future[Any]) -> None:
        # a done callback: never runs inside the task (one scheduled for an end already done
        # may run after the send is over: then there is nothing to give up)
        sends.give_up()

    ends = tuple(ends)
    for end in ends:
        end.add_done_callback(give_up)
    try:
        return await sends.send(sending)
    except asyncio.CancelledError:
        if written is not None and mark is not None:
            n = written() - mark
            parts = stream_internals(stream)
            if n > 0 and (size is None or n < size) and parts is not None:
                abandon(stream, parts.inner)
        raise
    finally:
        for end in ends:
            end.remove_done_callback(give_up)


def _written(stream: Any) -> Callable[[], int] | None:
    """The DATA bytes written on the stream so far (every writer here and grpclib count them)."""
    parts = stream_internals(stream)
    if parts is None:
        return None
    inner = parts.inner

    def written() -> int:
        return int(inner.data_sent)

    return written


def _batch_sender(stream: Any) -> SendBatch | None:
    """Write several pre-encoded messages as one DATA write (gRPC framing: 0, u32 BE length),
    keeping the counters grpclib's ``send_message`` keeps."""
    parts = stream_internals(stream)
    if parts is None:
        return None
    inner, connection = parts.inner, parts.connection

    async def send_batch(frames: list[bytes]) -> None:
        if not stream._send_initial_metadata_done:
            await stream.send_initial_metadata()
        pieces: list[bytes] = []
        for f in frames:
            pieces.append(b"\x00" + len(f).to_bytes(4, "big"))
            pieces.append(f)
        data = b"".join(pieces)
        before = inner.data_sent
        try:
            await inner.send_data(data)
        except BaseException:
            if 0 < inner.data_sent - before < len(data):  # a message cut short
                abandon(stream, inner)
            raise
        stream._send_message_done = True
        stream._messages_sent += len(frames)
        connection.messages_sent += len(frames)
        connection.last_message_sent = time.monotonic()

    return send_batch
