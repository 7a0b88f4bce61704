"""Server-streaming calls with grpclib that keep the ``kv-relay-error-reason`` trailer.

The generated stub raises ``GRPCError`` without trailers, so streams go through
``Channel.request`` and ``stream.trailing_metadata``. Every way a stream ends becomes
one :class:`StreamEnd` with a stable reason string; consumer violations raised by the message
callback propagate unchanged (the ``async with`` then resets the HTTP/2 stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import h2.exceptions
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from kvrelay._grpc import (
    NO_STATUS,
    ChannelClosed,
    CompressedReply,
    RelayChannel,
    SslSource,
    UndecodableReply,
    count_own_cancels,
    effective_status,
    ended_without_status,
    recv_reply,
)
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay._text import is_decimal
from kvrelay.client import errors as E
from kvrelay.client.codec import ClientCodec
from kvrelay.contract.wire import CONTRACT_MARKER

SERVICE = "/dynamo.kvrelay.v1.KvEventRelay/"
_DEFAULT_BOUND = 8 << 20  # a codec that says none: the relay's message limit
T = TypeVar("T")
_TRANSPORT_ERRORS = (
    OSError,
    StreamTerminatedError,
    ProtocolError,
    h2.exceptions.H2Error,
    asyncio.IncompleteReadError,
    ConnectionError,
    TimeoutError,
)


@dataclass(frozen=True, slots=True)
class RelayAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> RelayAddress:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not is_decimal(port) or not 0 < int(port) < 65536:
            raise ValueError(f"relay address must be HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a stream ended: ``reason`` is ``eof``, ``connection``, a relay reason
    (``subscriber_lagged``, ``producer_changed``, …) or ``status_<code>`` without a trailer."""

    reason: str
    status: Status | None = None
    message: str = ""
    messages: int = 0
    #: the call never left this process: its channel was closed (``ChannelClosed``)
    unsent: bool = False


#: After a relay ended the catalog stream cleanly (a drain), the old channel stays open this long
#: at most for the other streams on it to read their own clean ends (``RelayChannel.retire``):
#: the SDK's and the mirror's.
DRAIN_READ_S = 5.0


def open_channel(
    address: RelayAddress, ssl: SslSource | None = None, max_message_bytes: int = 8 << 20
) -> RelayChannel:
    """A grpclib channel with the relay's 8 MiB message bound (inbound checked by the codec),
    whose ended streams keep their status when the connection closes (``RelayChannel``).
    ``ssl``: a context the channel keeps, or what gives the one to use now, asked at each
    connection it makes (``RelayChannel``)."""
    return RelayChannel(
        address.host,
        address.port,
        ssl=ssl,
        codec=ClientCodec(max_message_bytes),
        config=Configuration(_keepalive_time=20.0, _keepalive_timeout=10.0),
    )


#: A stream's first message comes within this many times its ``silence_s``, however busy its
#: channel is with other streams (a plane's periodic windows would otherwise keep a pool stream
#: that never answers waiting for ever).
FIRST_MESSAGE_FACTOR = 4
#: The longest window period taken from a relay's updates (one day): a window plane waits three
#: stated periods before it calls its stream silent, and a stated year would hold a stopped
#: relay's plane for ever.
MAX_WINDOW_MS = 86_400_000


#: A pool stream that installed its snapshot and then ended counts as a success (its retries
#: start over from no backoff) only if it was live this long (``lived``): a relay that ends every
#: stream right after its snapshot is otherwise asked for a whole snapshot once per round trip,
#: hundreds a second.
LIVE_RESUBSCRIBE_S = 1.0


def lived(live_s: float | None) -> bool:
    """A pool stream live for ``live_s`` seconds (None: it never installed) may be resubscribed
    as after a success. One rule for the SDK and the mirror."""
    return live_s is not None and live_s >= LIVE_RESUBSCRIBE_S


class Backoff:
    """The retry delays of one stream loop (a pool, the catalog, a plane): one rule for all.

    ``live()`` marks the stream's success (a pool's snapshot installed, a plane's first message
    taken); ``next_delay()`` after the stream ended gives the wait before the next attempt. The
    attempts start over only if the stream was live at least ``LIVE_RESUBSCRIBE_S``
    (``lived``): a relay or proxy that ends every stream right after its first message is
    otherwise asked again once per round trip, and an ended catalog stream also costs a new
    connection."""

    __slots__ = ("_delay", "_live_since", "attempt")

    def __init__(self, delay: Callable[[int], float]) -> None:
        self._delay = delay  # attempt (0-based) -> seconds, e.g. ``ClientConfig.backoff``
        self._live_since: float | None = None
        self.attempt = 0

    def live(self) -> None:
        """The current stream succeeded (from its first success on)."""
        if self._live_since is None:
            self._live_since = time.monotonic()

    def next_delay(self) -> float:
        """The current stream ended: the delay before the next attempt, which it counts."""
        since, self._live_since = self._live_since, None
        if lived(None if since is None else time.monotonic() - since):
            self.attempt = 0
        delay = self._delay(self.attempt)
        self.attempt += 1
        return delay


def window_period_s(known_s: float, window_ms: int) -> float:
    """A window plane's period after an update stating ``window_ms``: the longest stated so
    far (``known_s``), capped at ``MAX_WINDOW_MS``. The SDK and the mirror wait three of them."""
    return max(known_s, min(window_ms, MAX_WINDOW_MS) / 1000.0)


class _ChannelActivity:
    """The silence clocks of one channel's streams that have not received their first message.

    A relay writes the snapshots of one connection's streams one after another: a stream whose
    turn has not come yet receives nothing while the connection is busy with the others. Its
    silence clock therefore runs from the channel's last message until its own first one, and
    never past ``FIRST_MESSAGE_FACTOR`` × its ``silence_s`` from its start."""

    __slots__ = ("last", "probe", "waiting")

    def __init__(self) -> None:
        #: clock → (its silence_s, the latest its first message may come)
        self.waiting: dict[asyncio.Timeout, tuple[float, float]] = {}
        #: when the channel's last message came (from its first stream's start on)
        self.last = time.monotonic()
        #: the round trip ``channel_deaf`` has under way on the channel (one at a time)
        self.probe: asyncio.Task[bool] | None = None

    def message(self, loop: asyncio.AbstractEventLoop) -> None:
        self.last = time.monotonic()
        if self.waiting:
            now = loop.time()
            for clock, (silence_s, last) in self.waiting.items():
                if not clock.expired():  # an expired one is on its way out
                    clock.reschedule(min(now + silence_s, last))


_ACTIVITY: weakref.WeakKeyDictionary[Channel, _ChannelActivity] = weakref.WeakKeyDictionary()


def _activity(channel: Channel) -> _ChannelActivity:
    found = _ACTIVITY.get(channel)
    if found is None:
        found = _ACTIVITY[channel] = _ChannelActivity()
    return found


def channel_dead(channel: Channel, end: StreamEnd, silence_s: float) -> bool:
    """A stream that ended ``silent`` on a channel that received nothing, on any of its
    streams, for ``silence_s``: its connection carries nothing (a black-holed or stalled path
    keeps TCP up) and is replaced; streams opened on it again would go silent in turn until
    grpclib's keepalive closes it (a ping 20 s in, then at most one per 300 s)."""
    if end.reason != E.SILENT:
        return False
    found = _ACTIVITY.get(channel)
    return found is None or time.monotonic() - found.last >= silence_s


async def channel_deaf(channel: Channel, end: StreamEnd, timeout_s: float) -> bool:
    """A stream that ended ``silent`` before its first message, on a channel that still
    receives (``channel_dead`` is false): either it waited for its turn behind other streams,
    or its request never reached the relay (a path dead only towards the relay while TCP stays
    up, the relay's streams still flowing down). Every stream opened on such a channel again
    went silent in turn until grpclib's keepalive closed it, about 30 s. One ``GetRelayInfo``
    round trip tells them apart: True (replace the channel) when nothing comes back within
    ``timeout_s``; any answer, a status too, and False. One round trip per channel at a time,
    shared by the streams that ask meanwhile."""
    if end.reason != E.SILENT or end.messages:
        return False
    activity = _activity(channel)
    probe = activity.probe
    if probe is None:
        probe = activity.probe = asyncio.get_running_loop().create_task(
            _answers(channel, timeout_s)
        )

        def done(task: asyncio.Task[bool], activity: _ChannelActivity = activity) -> None:
            if activity.probe is task:
                activity.probe = None

        probe.add_done_callback(done)
    return not await asyncio.shield(probe)


#: Why a stream's channel is replaced (``channel_verdict``): ``silent``, it carries nothing at
#: all; ``deaf``, it still receives but a round trip on it went unanswered.
ChannelVerdict = Literal["silent", "deaf"]


async def channel_verdict(
    channel: Channel,
    end: StreamEnd,
    *,
    silence_s: float | None,
    timeout_s: float,
    current: Callable[[], Channel],
) -> ChannelVerdict | None:
    """Whether a stream that ended as ``end`` leaves its ``channel`` for a new one: the one
    "dead, else deaf" rule of the SDK and the mirror. ``silent`` when ``channel_dead`` with
    ``silence_s`` (None skips this rule: a plane with long windows may keep a healthy channel
    quieter than that), else ``deaf`` when ``channel_deaf`` within ``timeout_s``, else None.
    A channel that is no longer ``current()`` (another stream already replaced it) gets None,
    before the round trip and after it: it is replaced, and counted, once.
    The silent verdict comes without suspending (the caller's reset falls in the same turn of
    the loop as the stream's end); the deaf one may take ``timeout_s``, so a caller releases
    what the stream held (its subscribers, its replica) before it asks."""
    if current() is not channel:
        return None
    if silence_s is not None and channel_dead(channel, end, silence_s):
        return "silent"
    if await channel_deaf(channel, end, timeout_s) and current() is channel:
        return "deaf"
    return None


async def _answers(channel: Channel, timeout_s: float) -> bool:
    """Whether the relay answers anything on ``channel`` within ``timeout_s``: its reply's
    headers are enough (the call is then cancelled; its message is not read)."""
    request = pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)
    answered = False
    try:
        async with asyncio.timeout(timeout_s):
            async with channel.request(
                SERVICE + "GetRelayInfo", Cardinality.UNARY_UNARY, pb.RelayInfoRequest,
                pb.RelayInfo,
            ) as st:  # fmt: skip
                await st.send_message(request, end=True)
                await st.recv_initial_metadata()
                answered = True
                # a server that sends its whole reply at once (grpcio's; Dynamo's relay) has
                # ended the stream by now: cancelling it raises, and the answer stands
                with contextlib.suppress(Exception):
                    await st.cancel()
    except GRPCError:
        return True  # an answer, even a refusal, crossed the connection both ways
    except Exception:  # a timeout, a transport error: nothing came back (unless it had)
        return answered
    return True


def end_from_error(err: GRPCError, trailers: Any, messages: int) -> StreamEnd:
    value = None
    if trailers is not None:
        raw = trailers.get(E.TRAILER_KEY)
        value = raw.decode() if isinstance(raw, bytes) else raw
    status = effective_status(err.status, err.message)
    reason = E.reason_from_trailer(value) or f"status_{status.name.lower()}"
    return StreamEnd(reason, status, err.message or "", messages)


async def run_stream(
    channel: Channel,
    method: str,
    request: Any,
    reply_type: type[T],
    on_message: Callable[[T], Awaitable[None] | None],
    *,
    silence_s: float | Callable[[], float] | None = None,
    first_message_s: float | None = None,
    yield_every: int = 0,
) -> StreamEnd:
    """Run one server stream to its end, calling ``on_message`` for each reply.

    With ``silence_s``, a stream that delivers nothing for that long is cancelled and ends as
    ``silent``: a relay that stopped sending (even heartbeats) must not hold a replica for ever.
    A callable is asked again after each message (a window plane learns its period from its
    first message, and that message's own stream must wait that long for the next).
    ``on_message`` may return an awaitable: the next reply is read only once it is done (a
    mirror parses a large catalog off the event loop, in order, before it takes the next).
    Until its first message, a stream is silent only while its whole channel is (it may be
    waiting for its turn behind other streams' snapshots on the same connection).
    ``first_message_s`` (without ``silence_s``): the same bound until the first message only,
    for a stream whose relay sends its current state at once and then only on change (the
    catalog): one that never answers is retried, not waited on for ever.
    With ``yield_every`` = N > 0, the loop yields to the event loop after every N messages: a
    burst of buffered messages then never runs far ahead of the tasks they woke (a mirror's
    senders).
    Replies are read with their length checked first (``recv_reply``, the bound the channel's
    codec has); one that does not decode ends the stream as ``envelope``, a compressed one
    (never asked for) as ``compressed``. A stream whose END_STREAM came without a status (no
    trailers) ends at once as ``no_status`` (``ended_without_status``; its status taken as
    ``UNKNOWN``, as grpc does, but told apart from a relay's ``UNKNOWN``): grpclib would wait
    for the trailers until the silence limit, and a ``silent`` end would replace the channel
    that still carries the healthy streams.
    A task cancelled while in here always ends with ``CancelledError``, also when grpclib turned
    it into a transport error (its channel closed in the same turn: ``count_own_cancels``);
    a loop that took that for a lost connection would reconnect after its owner stopped it.
    """
    task = asyncio.current_task()
    cancels = 0 if task is None else task.cancelling()
    own: Callable[[], int] | None = None
    n = 0
    stream = None
    loop = asyncio.get_running_loop()
    activity = _activity(channel)
    quiet: asyncio.Timeout | None = None
    no_status = False  # the stream ended without a status (not a relay's UNKNOWN)

    def silence() -> float | None:
        return silence_s() if callable(silence_s) else silence_s

    limit = silence()
    first_only = limit is None and first_message_s is not None
    if first_only:
        limit = first_message_s
    try:
        async with asyncio.timeout(limit) as quiet:
            if limit is not None:
                first_by = loop.time() + FIRST_MESSAGE_FACTOR * limit
                activity.waiting[quiet] = (limit, first_by)
            async with channel.request(
                SERVICE + method, Cardinality.UNARY_STREAM, type(request), reply_type
            ) as stream:
                own = count_own_cancels(stream)
                await stream.send_message(request, end=True)
                bound = getattr(stream._codec, "max_message_bytes", _DEFAULT_BOUND)
                while True:
                    msg = await recv_reply(stream, bound)
                    if not n:
                        activity.waiting.pop(quiet, None)
                        if first_only:
                            limit = None  # the first message came: no bound from here on
                            quiet.reschedule(None)
                    activity.message(loop)
                    if limit is not None:
                        quiet.reschedule(loop.time() + limit)
                    if msg is None:
                        break
                    n += 1
                    pending = on_message(msg)
                    if pending is not None:
                        await pending
                    if callable(silence_s) and (again := silence()) not in (None, limit):
                        limit = again
                        quiet.reschedule(loop.time() + again)
                    if yield_every and n % yield_every == 0:
                        await asyncio.sleep(0)
                if ended_without_status(stream):  # (trailers that cannot come: not waited on)
                    no_status = True
                    raise GRPCError(Status.UNKNOWN, NO_STATUS)
                await stream.recv_trailing_metadata()
        end = StreamEnd(E.EOF, Status.OK, "", n)
    except TimeoutError:
        if limit is not None and quiet is not None and quiet.expired():
            end = StreamEnd(E.SILENT, None, f"nothing received for {limit:g} s", n)
        else:
            end = StreamEnd(E.CONNECTION, None, "TimeoutError", n)
    except GRPCError as err:
        trailers = None if stream is None else stream.trailing_metadata
        end = (StreamEnd(E.NO_STATUS, Status.UNKNOWN, NO_STATUS, n) if no_status
               else end_from_error(err, trailers, n))  # fmt: skip
    except CompressedReply as exc:
        end = StreamEnd(E.COMPRESSED, None, f"{exc}: the relay must send identity encoding", n)
    except UndecodableReply as exc:
        end = StreamEnd(E.ENVELOPE, None, f"undecodable reply: {exc}", n)
    except ChannelClosed as exc:
        end = StreamEnd(E.CONNECTION, None, f"{type(exc).__name__}: {exc}", n, unsent=True)
    except _TRANSPORT_ERRORS as exc:
        end = StreamEnd(E.CONNECTION, None, f"{type(exc).__name__}: {exc}", n)
    finally:
        if quiet is not None:
            activity.waiting.pop(quiet, None)
    if task is not None and own is not None and task.cancelling() - cancels > own():
        # cancelled by its owner, the CancelledError replaced or swallowed on the way: one
        # still pending is delivered here, else it is raised (never a StreamEnd to act on)
        await asyncio.sleep(0)
        raise asyncio.CancelledError()
    return end


def catalog_request(subscriber_id: str) -> pb.WatchKvPoolCatalogRequest:
    return pb.WatchKvPoolCatalogRequest(
        subscriber_id=subscriber_id, contract_marker=CONTRACT_MARKER
    )


def readiness_request(subscriber_id: str) -> pb.SubscribeServingReadinessRequest:
    return pb.SubscribeServingReadinessRequest(
        subscriber_id=subscriber_id, contract_marker=CONTRACT_MARKER
    )


def load_request(subscriber_id: str) -> pb.SubscribeKvPoolLoadRequest:
    return pb.SubscribeKvPoolLoadRequest(
        subscriber_id=subscriber_id, contract_marker=CONTRACT_MARKER
    )


def serving_load_request(subscriber_id: str) -> pb.SubscribeServingLoadRequest:
    return pb.SubscribeServingLoadRequest(
        subscriber_id=subscriber_id, contract_marker=CONTRACT_MARKER
    )


def pool_request(subscriber_id: str, producer: pb.ProducerIdentity) -> pb.SubscribeKvPoolRequest:
    return pb.SubscribeKvPoolRequest(
        subscriber_id=subscriber_id, expected_producer=producer, contract_marker=CONTRACT_MARKER
    )
