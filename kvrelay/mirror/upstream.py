"""The mirror's connection to its upstream relay: one HTTP/2 channel, replies kept as bytes.

Streams run through the SDK's ``run_stream`` (trailers, silence, transport errors → one
``StreamEnd``); the codec hands every reply over as the bytes received, because the mirror
forwards frames unchanged and parses only what it checks (``client/wire.py``). How a stream ended is
turned back into the upstream's ``RelayError`` (reason and message) so it can be forwarded.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._grpc import RelayChannel, effective_status
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.codec import RawCodec
from kvrelay.contract.errors import Reason, RelayError, reason_from_name
from kvrelay.logging import get_logger
from kvrelay.mirror.settings import MirrorSettings
from kvrelay.service.spacing import HOLD_HEADER, HOLD_METHOD

SERVICE = "/dynamo.kvrelay.v1.KvEventRelay/"
#: After a PERMISSION_DENIED spacing request, the next is asked this much later (the upstream's
#: rules may be reloaded to grant it; meanwhile the mirror's joiners go unspaced).
SPACING_DENIED_RETRY_S = 30.0
_log = get_logger(__name__)
StreamEnd = rpc.StreamEnd


#: Upstream reasons a mirror ends its local streams with as they came (contract §4.9: the same
#: status and message), and those that mean the mirror fell behind (a local error of its own).
FORWARDED = frozenset({int(Reason.PUBLICATION_UNAVAILABLE), int(Reason.INTERNAL)})
BEHIND = frozenset({int(Reason.SUBSCRIBER_LAGGED), int(Reason.SNAPSHOT_PROGRESS_TIMEOUT)})


def upstream_error(end: StreamEnd) -> RelayError | None:
    """The upstream's own error for a stream that ended with a relay reason (None otherwise)."""
    if end.reason in (E.EOF, E.CONNECTION, E.SILENT) or end.reason.startswith("status_"):
        return None
    reason = reason_from_name("RELAY_ERROR_REASON_" + end.reason.upper())
    return None if reason is None else RelayError(reason, end.message)


def hold_requester(subscriber_id: str) -> str:
    """``subscriber_id`` with a random suffix, within the 128 bytes an id may take."""
    base = subscriber_id.encode()[:110].decode(errors="ignore")
    return f"{base}#{secrets.token_hex(6)}"


class Upstream:
    """One channel to the upstream relay, replaced when the upstream goes away."""

    def __init__(self, settings: MirrorSettings) -> None:
        self.settings = settings
        self.resets = 0
        #: connections left because the upstream refused a call as draining, by the channels
        #: ``reset`` replaced (``left_draining`` adds the current one's)
        self._left_draining = 0
        self.spacing = True  # the upstream answers spacing requests (kvrelay does)
        self.hold_failures = 0  # spacing requests that failed (transport, refusal, timeout)
        #: requests refused PERMISSION_DENIED (the upstream's rules grant this mirror no
        #: spacing); the next is asked ``SPACING_DENIED_RETRY_S`` later (a rules reload)
        self.hold_denied = 0
        self._denied_until = 0.0
        self._denial_logged = False
        #: who asks for spacing: the subscriber id made unique to this process, because the
        #: upstream keeps one hold per requester and every mirror may carry the default id
        self.hold_requester = hold_requester(settings.subscriber_id)
        #: channels replaced because a round trip on them went unanswered (``replace_if_unfit``)
        self.deaf = 0
        #: calls made again on the current channel because ``reset`` closed theirs as they
        #: connected (``stream``'s ``follow``)
        self.followed = 0
        self._channel = self._open()

    def _open(self) -> RelayChannel:
        s = self.settings
        config = Configuration(
            _keepalive_time=s.keepalive_s,
            _keepalive_timeout=s.keepalive_timeout_s,
            _keepalive_permit_without_calls=True,
            http2_stream_window_size=s.window_bytes,
            http2_connection_window_size=min(4 * s.window_bytes, 2**31 - 1),
        )
        codec = RawCodec(s.limits.max_message_bytes)
        a = s.upstream
        if a.path is not None:
            return RelayChannel(path=a.path, codec=codec, config=config)
        # a source is asked at each connection: a reload's client files serve the next
        # handshake, also when this channel reconnects (a pool stream may get there before the
        # catalog stream replaced it)
        return RelayChannel(a.host, a.port, ssl=s.ssl, codec=codec, config=config)

    @property
    def channel(self) -> RelayChannel:
        return self._channel

    @property
    def left_draining(self) -> int:
        """Connections the mirror's channels left for new calls because the upstream refused a
        call as draining (``RelayChannel.left_draining``), over every channel ``reset`` made."""
        return self._left_draining + self._channel.left_draining

    def reset(self, used: Channel | None = None, *, drained: bool = False) -> None:
        """Open a fresh channel (unless ``used`` is no longer the current one): a relay that is
        shutting down may still accept streams on its old connection. ``drained``: the upstream
        ended a stream cleanly (a drain); the old channel is closed once the streams still on it
        have read their own ends (``rpc.DRAIN_READ_S`` at most), not at once."""
        if used is not None and used is not self._channel:
            return
        self.resets += 1
        self.spacing = True  # maybe another relay now
        old, self._channel = self._channel, self._open()
        self._left_draining += old.left_draining
        if drained:
            old.retire(rpc.DRAIN_READ_S)
        else:
            old.close()

    async def replace_if_unfit(
        self, channel: Channel, end: StreamEnd, *, silence_s: float | None, timeout_s: float
    ) -> None:
        """A stream ended as ``end`` on ``channel``: replaced when ``rpc.channel_verdict`` says
        so, silent (nothing came on it, on any stream, for ``silence_s``: a black-holed path
        keeps TCP up; None for the planes but the catalog) or deaf (it still receives, but a
        round trip within ``timeout_s`` went unanswered: a path dead only towards the upstream)."""
        verdict = await rpc.channel_verdict(
            channel, end, silence_s=silence_s, timeout_s=timeout_s, current=lambda: self._channel
        )
        if verdict == "deaf":
            self.deaf += 1
            _log.warning("mirror_upstream_deaf", timeout_s=timeout_s)
        if verdict is not None:
            self.reset(channel)

    async def stream(
        self,
        method: str,
        request: Any,
        on_message: Callable[[bytes], Awaitable[None] | None],
        *,
        silence_s: float | Callable[[], float] | None = None,
        first_message_s: float | None = None,
        follow: bool = False,
    ) -> tuple[StreamEnd, Channel]:
        """Run one upstream stream to its end (exceptions raised by ``on_message`` propagate and
        reset the HTTP/2 stream). Returns how it ended and the channel it used.

        With ``follow``, a call its channel refused because ``reset`` closed that channel as the
        call connected (``StreamEnd.unsent``: it never reached the upstream) is made again at once
        on the current channel, as if it had started a moment later. Why: a pool stream whose
        connection dropped resubscribes at once on the channel it ran on, often before the
        catalog stream's end replaced that channel; its attempt would otherwise fail and back
        off (its local joiners refused meanwhile) though nothing upstream failed. (A plane
        checks each message against the channel it started on: it does not follow.)

        The loop yields after every half local queue of messages: a burst of buffered upstream
        deltas must not queue more frames per local subscriber than its bound before the senders
        run, or every local subscriber would lag at once; yielding less often than every frame
        keeps the senders' batched writes (several frames per HTTP/2 write)."""
        every = max(1, self.settings.limits.publication_queue_capacity // 2)
        while True:
            channel = self._channel
            end = await rpc.run_stream(
                channel, method, request, bytes, on_message, silence_s=silence_s,
                first_message_s=first_message_s, yield_every=every,
            )  # fmt: skip
            if not (follow and end.unsent and channel is not self._channel):
                return end, channel
            self.followed += 1  # (each time, ``reset`` made a new channel: finitely many)

    async def hold(self, request: Any, seconds: float) -> bool | None:
        """Ask the upstream to space ``request``'s pool for local joiners
        (``service/spacing.py``): True if granted, False if the upstream cannot (a relay other
        than kvrelay: UNIMPLEMENTED, remembered until the channel is replaced), None if this
        request failed otherwise (the next one may succeed). An upstream whose rules do not grant
        this mirror spacing (PERMISSION_DENIED) is asked again ``SPACING_DENIED_RETRY_S`` later,
        its refusal logged once until a request is granted."""
        if not self.spacing or time.monotonic() < self._denied_until:
            return False
        channel = self._channel
        try:
            async with channel.request(
                HOLD_METHOD, Cardinality.UNARY_UNARY, type(request), bytes, timeout=2.0,
                metadata={HOLD_HEADER: str(max(0, round(seconds * 1000)))},
            ) as st:  # fmt: skip
                await st.send_message(request, end=True)
                await st.recv_message()
                await st.recv_trailing_metadata()
            self._denial_logged = False  # granted: a later refusal is news again
            return True
        except GRPCError as err:
            # UNIMPLEMENTED (tonic: Dynamo), or what a grpclib server's answer to an unknown
            # method reads as (``_grpc.effective_status``); any other UNKNOWN may pass
            status = effective_status(err.status, err.message)
            if status is Status.UNIMPLEMENTED and channel is self._channel:
                self.spacing = False
                return False
            self.hold_failures += 1
            if status is Status.PERMISSION_DENIED:
                if not self._denial_logged:
                    self._denial_logged = True
                    _log.warning("mirror_spacing_denied", detail=err.message)
                self.hold_denied += 1
                self._denied_until = time.monotonic() + SPACING_DENIED_RETRY_S
                return False
            return None
        except Exception:  # transport errors, a closed channel: a request is best effort
            self.hold_failures += 1
            return None

    def close(self) -> None:
        self._channel.close()
