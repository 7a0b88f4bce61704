"""Connect mode: one bound SUB per pool that many engines' PUB sockets connect to (§22).

vLLM and SGLang connect their PUB instead of binding when the endpoint has no wildcard; some
deployments (llm-d) run one such bound socket fed by every pod, topics ``kv@<pod>@<model>``. The
topic pattern names the member: ``{engine}`` (→ ``worker_id``, chosen by the sink) and ``{rank}``
(else the batch's DP rank field, else 0).

There is no replay in this mode (the engines' ROUTER sockets are not known), so each member's
sequence is its only integrity check, and every publisher has its own sequence space:

* A member appears with its first message; that message is its baseline. A first sequence above
  0 means the engine published before the relay saw it (``missing_history``): its earlier blocks
  are unknown, the member holds only what follows.
* Next sequence: applied. A gap: the member is reset, and the message applied as a new baseline.
  A backwards sequence (a restart numbers from 0 again), or a new SGLang epoch: reset, same.
* A batch that cannot be decoded, or that the pool rejects: reset (nothing to re-fetch it from).
* A member silent for ``member_silence_s`` is removed (its state cleared): the engine left, and
  its blocks cannot be vouched for any more.
* At most ``max_members`` members; messages naming a new member past that are counted and
  dropped. Topics the pattern does not accept are counted and dropped.

Who may connect (the socket is reachable by anything that can reach its port): the relay's
own ZAP handler (``ingest/zap.py``, on the socket's context; acquired before the bind, released
after the close) answers each connection's ZMTP handshake, before libzmq takes any message from
it, on a thread of its own (``_decide``: never waiting for the event loop, which libzmq would
meanwhile be reading a stranger's frame for; it shares the monitor and the connection counts
with the loop under a lock). libzmq bounds each frame (``ZMQ_MAXMSGSIZE``), not a message,
and keeps every frame of a message until its last one arrives, so a check per message comes too
late for a peer whose message never ends: a refusal must come at the handshake.

* ``allow`` (IP addresses or networks): a peer at any other address is refused and its
  connection closed at once (``connections_refused``; one libzmq keeps is ended by the relay,
  ``KEPT_REFUSAL_S``). IPC peers have no IP address and are trusted by the socket file's
  permissions.
* ``curve_client_keys`` (a CURVE socket only): a publisher whose public key (the ZAP request's
  credentials) is not listed is refused and its connection closed at once
  (``connections_key_refused``), after ``allow``. CURVE's own check only proves the publisher
  encrypts to the socket's public key, which every engine is given: without this list any
  keypair gets in. A refused connection libzmq keeps is not told from its address's admitted
  ones (the events name no connection), so it stays until ``HANDSHAKE_S``.
* At most ``max_connections`` (default ``connection_limit(max_members)``) open connections from
  admitted addresses: past it a handshake is refused as a temporary failure
  (``connections_over_limit``): libzmq holds it until ``HANDSHAKE_S`` ends it and the publisher
  connects again. Connections are counted from the socket's monitor (accepted, disconnected; the
  peer's address read from the accepted descriptor), including those still in their handshake,
  so those that finished it never pass the limit; strangers' connections are not counted.
* ``ZMQ_ZAP_ENFORCE_DOMAIN``: with no handler bound, libzmq refuses handshakes instead of letting
  them through; ``ZMQ_HANDSHAKE_IVL`` (``HANDSHAKE_S``) bounds how long a connection that never
  finishes its handshake holds a descriptor; TCP keepalive ends the connections of publishers
  that vanished without closing them (they would hold places under the limit).
* Handshakes libzmq fails itself, before the handler is asked (``_take_events``: the monitor's
  handshake-failure events, and a stranger's connection closed without one, which libzmq does
  to a greeting that is not ZMTP 3), are counted by reason (``handshakes_failed_*``) and logged
  at most every ``REFUSAL_LOG_S`` per reason. A refused handshake is counted as refused only:
  a peer that hangs up (or breaks the protocol) while the refusal is on its way makes libzmq
  report a failure as well, which ``_settle`` takes for that refusal (libzmq's events name no
  connection, so refusals and failures are matched by count).

Who may publish (a message can name any member): each message carries its sender's address
(ZMQ's ``Peer-Address`` property, read per message).

* ``allow`` again, as a second line: a message from another address (it can only have passed
  the handshake if libzmq consulted no handler) is counted and dropped.
* A member's engine name is bound to an address: ``addresses`` names them for some engines; any
  other engine is bound to the address its first message came from, for as long as it has a
  member. A message naming that engine from another address is counted and dropped, so another
  peer can neither reset the member (a lower sequence) nor feed it.
* An IPC peer's address is libzmq's ``localhost:uid:gid:pid``: its engine is bound to the user
  and group (the socket file's permissions admitted them), not to the process, so a restarted
  engine, or another DP rank's process, is not refused. Each member remembers the process that
  feeds it: a message from another process of that user is a new incarnation (the member is
  reset and the message is its baseline, whatever its sequence), so the old process's blocks
  never mix with the new one's.
* ``curve_secret_key``: the socket is a CURVE server; only publishers that encrypt to its public
  key can connect (vLLM and SGLang publishers would need CURVE options of their own). That
  authenticates the relay to them, not them to it: ``curve_client_keys`` does that.
* Topics longer than ``max_topic_bytes`` are dropped before they are matched or cached; a payload
  over ``max_batch_bytes`` is never decoded and resets the engine's members (the batch is lost,
  its rank unknown), and a frame more than ``FRAME_SLACK_BYTES`` over it is not even received:
  libzmq ends that publisher's connection at the frame's header (``ZMQ_MAXMSGSIZE``; the
  publisher connects again, and the gap resets its member); a member whose stored blocks
  (stores minus removes since its baseline) pass ``max_member_blocks`` is reset, which drops its
  lineage from the pool. Each is counted.

The socket is drained like a subscriber's (wait, then up to ``drain`` messages with NOBLOCK on a
sync shadow, then yield). A bound SUB attaches new connections only while its owner calls into
it; the loop does so continuously, so a publisher's messages flow once its connection is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from kvrelay._aio import cancel_and_wait
from kvrelay.discovery.endpoints import IPNetwork, canonical_ip, canonical_network
from kvrelay.ingest import zap, zmq_context
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import DecodeError, DpRankMismatchError, FrameError
from kvrelay.ingest.frames import parse_seq
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.live_source import KEEPALIVE
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.sglang import EPOCH_MARKER, split_topic
from kvrelay.ingest.sink import ResetReason, SourceKey
from kvrelay.ingest.topic_pattern import TopicError, TopicMatch, TopicPattern
from kvrelay.logging import LogThrottle, get_logger
from kvrelay.pool.batch import OP_CLEAR, OP_REMOVE, OP_STORE, EventBatch, as_events
from kvrelay.pool.errors import MalformedBatch

_LOGGER = "kvrelay.ingest.connect"
#: libzmq's reports of a handshake's end (the failures name their reason in the value)
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)  # fmt: skip
#: How far past ``max_batch_bytes`` a frame may be and still be received (then counted as too
#: large and dropped); libzmq refuses anything larger at its header.
FRAME_SLACK_BYTES = 1024 * 1024
#: How long a connection may take to finish its ZMTP handshake (``ZMQ_HANDSHAKE_IVL``; libzmq's
#: default is 30 s): one that has not by then (a peer that never speaks ZMTP) is closed.
HANDSHAKE_S = 10.0
#: At most this often (seconds) per reason, a refused handshake is logged (each is counted).
REFUSAL_LOG_S = 10.0
#: A handshake failure libzmq reports is counted this long after (``_settle``): the handler
#: (its own thread, well under a millisecond) has counted its refusal of that connection by
#: then, if it refused it, and the failure is taken for that refusal instead.
SETTLE_S = 1.0
#: Failures waiting for ``SETTLE_S`` at most; past it the oldest is settled at once.
MAX_UNSETTLED = 4096
#: libzmq reports the relay's ``zap.CLOSE`` and ends the connection in one step, or, when it
#: read the answer in the step that asked (its I/O thread was descheduled between the two while
#: the handler answered: 3 of 300 refusals on an idle 2-core host), reports it and keeps the
#: connection until the peer sends more or ``HANDSHAKE_S`` ends it. A report that another event
#: follows, or nothing for this long, is that case: the relay ends that connection itself
#: (``_end_kept``). The handler's thread looks this often while one may be waiting.
KEPT_REFUSAL_S = 0.02
#: The events name no connection: the kept one is among the strangers' connections open at its
#: report, and ended once it is the only one of them left (the others are answered, or fail, in
#: milliseconds), or, when some stay (a stranger that never speaks, answers slowed down under a
#: flood), all of them this long after the report (ended before being asked, those count as
#: unfinished handshakes, not refusals).
KEPT_WAIT_S = 1.0
#: Kept refusals waiting to be ended at most; past it the oldest is ended at once.
MAX_KEPT = 256
#: How long after its last ``zap.CLOSE`` the handler's thread goes on looking (the loop looks
#: at every pass, at least once a second).
KEPT_WATCH_S = 1.0
_IDS = itertools.count(1)


def connection_limit(max_members: int) -> int:
    """Connections the socket admits by default: one per member (each engine DP rank publishes
    on its own connection) plus headroom for restarts, probes and a rollout's overlap."""
    return max_members + max(16, max_members // 4)


class _RankPeek(msgspec.Struct, array_like=True):
    ts: msgspec.Raw
    events: msgspec.Raw
    dp_rank: int | None = None


_PEEK = msgspec.msgpack.Decoder(_RankPeek)


@dataclass(frozen=True, slots=True)
class ConnectSpec:
    """A pool's bound ingest endpoint. ``model``: what a ``{model}`` part must equal."""

    bind: tuple[str, ...]
    pattern: TopicPattern
    kv_block_size: int
    hash_format: int = 1
    options: DecodeOptions = field(default_factory=DecodeOptions)
    kind: EngineKind = EngineKind.VLLM
    model: str | None = None
    max_members: int = 1024
    member_silence_s: float = 600.0
    pool: str = ""  # the operator's pool name, for logs
    #: Publisher addresses or networks messages are accepted from (empty: any).
    allow: tuple[str, ...] = ()
    #: (engine name, addresses or networks it may publish from); other engines are bound to the
    #: address that first published for them.
    addresses: tuple[tuple[str, tuple[str, ...]], ...] = ()
    max_topic_bytes: int = 256
    max_batch_bytes: int = 16 * 1024 * 1024
    max_member_blocks: int = 1 << 22
    #: CURVE: the socket's secret key (Z85, 40 characters): publishers must then encrypt to its
    #: public key, and plaintext peers cannot connect at all.
    curve_secret_key: str | None = None
    #: CURVE: the publishers' public keys (Z85) admitted at the handshake (empty: any key). The
    #: socket's public key is no secret (every engine is given it), so without these CURVE
    #: authenticates the relay to its publishers, never a publisher to the relay.
    curve_client_keys: tuple[str, ...] = ()
    #: (key, engines) for keys bound to engines: only the keys naming an engine may publish
    #: it, and such a key only those; a key not named here may publish any engine no key is
    #: bound to.
    curve_key_engines: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: Open connections (from addresses ``allow`` admits) past which handshakes are refused;
    #: None: ``connection_limit(max_members)``.
    max_connections: int | None = None


@dataclass(slots=True)
class ConnectCounters:
    """Socket-level counters (per-member ones are each member's ``SubscriberCounters``)."""

    messages: int = 0
    topic_unmatched: int = 0
    topic_malformed: int = 0
    model_mismatch: int = 0
    members_added: int = 0
    members_refused: int = 0  # the sink would not admit the name (e.g. a configured engine's)
    members_over_limit: int = 0  # messages dropped because max_members were present
    members_expired: int = 0
    unattributed: int = 0  # undecodable payloads whose rank could not be read
    peer_refused: int = 0  # messages from an address outside ``allow`` (past the handshake)
    connections_refused: int = 0  # handshakes refused: the address is outside ``allow``
    connections_over_limit: int = 0  # handshakes refused: ``max_connections`` were open
    connections_key_refused: int = 0  # handshakes refused: a CURVE key not in the client keys
    # handshakes that failed before the relay's own check (or without reaching it), by reason
    # (``HANDSHAKE_FAILURES``; one field each: the pool flattens these counters to ints)
    handshakes_failed_protocol: int = 0
    handshakes_failed_auth: int = 0
    handshakes_failed_unfinished: int = 0
    handshakes_failed_not_zmtp3: int = 0
    address_mismatch: int = 0  # messages naming an engine bound to another address
    key_mismatch: int = 0  # messages naming an engine the sender's CURVE key may not publish
    topic_too_long: int = 0  # topics over ``max_topic_bytes``
    batch_too_large: int = 0  # payloads over ``max_batch_bytes`` (member reset)
    member_block_cap: int = 0  # members reset past ``max_member_blocks``
    rejections: dict[str, int] = field(default_factory=dict)  # frame checks by kind

    #: reason → its field
    HANDSHAKE_FAILURES: ClassVar[dict[str, str]] = {
        r: f"handshakes_failed_{r}" for r in ("protocol", "auth", "unfinished", "not_zmtp3")
    }

    def reject(self, kind: str) -> None:
        self.rejections[kind] = self.rejections.get(kind, 0) + 1

    def handshake_failed(self, reason: str) -> None:
        name = self.HANDSHAKE_FAILURES[reason]
        setattr(self, name, getattr(self, name) + 1)


class ConnectSink(Protocol):
    def on_batch(self, source: SourceKey, seq: int, batch: EventBatch) -> None:
        """As ``BatchSink.on_batch``: raises ``MalformedBatch`` (state untouched) to reject."""
        ...

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        """Drop everything the member holds."""
        ...

    def admit(self, engine: str, dp_rank: int) -> SourceKey | None:
        """The member key for a new ``(engine, rank)``, or None to refuse it."""
        ...

    def on_member_gone(self, source: SourceKey, counters: SubscriberCounters) -> None:
        """The member was removed (silent too long): drop its state; its final counters."""
        ...

    def on_connect_failed(self, error: BaseException) -> None:
        """The bound socket's task crashed: every member it fed can no longer be vouched for."""
        ...


@dataclass(slots=True)
class _Member:
    name: str
    key: SourceKey
    decoder: Decoder
    last_message_at: float
    counters: SubscriberCounters = field(default_factory=SubscriberCounters)
    next_seq: int | None = None
    epoch: bytes | None = None
    dirty: bool = False
    blocks: int = 0  # stored minus removed blocks since the baseline (an estimate, >= 0)
    process: str = ""  # an IPC publisher's process id ("" for TCP): another one is a restart


class ConnectSource:
    """Lifecycle: ``await start()`` (binds; raises if it cannot) … ``await stop()``."""

    def __init__(
        self,
        spec: ConnectSpec,
        sink: ConnectSink,
        counters: ConnectCounters | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
        drain: int = 256,
        rcvhwm: int = 100_000,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        self.spec = spec
        self.counters = counters if counters is not None else ConnectCounters()
        self.state = "new"
        self.failure: BaseException | None = None
        self.endpoints: tuple[str, ...] = ()  # resolved bind addresses
        self._sink = sink
        self._ctx = context if context is not None else zmq_context.shared_async()
        self._drain = drain
        self._rcvhwm = rcvhwm
        self._handshake_ms = max(1, int(handshake_s * 1000))
        self._members: dict[tuple[str, int], _Member] = {}
        # accepted topics → their match (bounded: cleared when full)
        self._topics: dict[bytes, TopicMatch] = {}
        self._topics_max = 4 * spec.max_members
        self._sub: zmq.asyncio.Socket | None = None
        self._shadow: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._sglang = spec.kind is EngineKind.SGLANG
        self._log = get_logger(_LOGGER, pool=spec.pool)
        self._allow = _networks(spec.allow)
        if spec.curve_client_keys and spec.curve_secret_key is None:
            raise ValueError("CURVE client keys need a CURVE secret key (a CURVE socket)")
        #: the publishers' CURVE public keys (raw, as ZAP gives them); None: any key
        self._client_keys = (
            frozenset(z85.decode(k) for k in spec.curve_client_keys)
            if spec.curve_client_keys else None
        )  # fmt: skip
        #: CURVE key (Z85) → the engines only it may publish; every engine bound to a key
        self._key_engines = {k: frozenset(names) for k, names in spec.curve_key_engines}
        self._keyed = frozenset(n for names in self._key_engines.values() for n in names)
        if self._key_engines and self._client_keys is None:
            raise ValueError("engines bound to CURVE keys need the client keys listed")
        self._pinned = {name: _networks(addrs) for name, addrs in spec.addresses}
        #: engine name → the address it is bound to (engines with a member only: bounded)
        self._owners: dict[str, str] = {}
        # ---- handshakes (ZAP) and connections (the socket's monitor)
        self._domain = f"kvrelay.connect.{next(_IDS)}"
        self._zap: zap.ZapHandler | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._mon_shadow: zmq.Socket[Any] | None = None
        #: IPC binds: a peer without an IP address is one of theirs (file permissions decide)
        self._ipc = any(not ep.startswith("tcp://") for ep in spec.bind)
        self.max_connections = (
            spec.max_connections
            if spec.max_connections is not None
            else connection_limit(spec.max_members)
        )
        #: libzmq's descriptor of each open connection → whether it counts against the limit
        #: (its peer's address is one ``allow`` admits: strangers cannot use up the limit)
        self._conns: dict[int, bool] = {}
        self.connections = 0  # open connections that count against ``max_connections``
        #: descriptors of open connections from addresses ``allow`` refuses, or gone before
        #: their address was read (their handshake can only fail: an admitted one stays open
        #: while the handler is asked, which reads the events first), and whether libzmq just
        #: reported a failure (``_take_events``)
        self._strangers: set[int] = set()
        self._failure_reported = False
        self._refusal_reported = False  # the last event: libzmq's report of a ``zap.CLOSE``
        #: when it was taken, the strangers' connections open then (the refused one among
        #: them), and whether it was found kept
        self._report_at = 0.0
        self._report_strangers: frozenset[int] = frozenset()
        self._report_handled = False
        #: refusals libzmq kept (``_end_kept``): (the strangers' connections open at the report,
        #: when)
        self._kept: deque[tuple[frozenset[int], float]] = deque()
        #: the handler's thread only: its last ``zap.CLOSE``, and whether it looks again
        self._last_close = 0.0
        self._watching = False
        #: handshake failures not counted yet: (when, reason, libzmq's detail); ``_settle``
        self._unsettled: deque[tuple[float, str, int]] = deque()
        #: this socket's refusals (the handler's thread counts them; the counters outlive the
        #: socket, restarts and reloads included) and those matched with the end of their
        #: connection: libzmq's report of the refusal, or a failure reported before it (the
        #: peer hung up while the refusal was on its way)
        self._refusals = 0
        self._refusals_ended = 0
        #: the failures last taken for a refusal, (reason, detail): one is counted after all when
        #: a refusal's own report comes with none left unmatched (the failure took another
        #: connection's refusal, still on its way then)
        self._taken: deque[tuple[str, int]] = deque(maxlen=64)
        #: the ZAP handler's thread and the loop both read the monitor and the connections
        self._lock = threading.RLock()
        self.zap_enforced = False  # ZMQ_ZAP_ENFORCE_DOMAIN set: no handler, no handshake
        self._refusal_log = LogThrottle(REFUSAL_LOG_S)  # ``connect_handshake_refused``, by reason
        #: the loop's own: ``connect_key_mismatch`` and ``connect_members_over_limit``, by event
        self._key_log = LogThrottle(REFUSAL_LOG_S)
        self._failure_log = LogThrottle(REFUSAL_LOG_S)  # ``connect_handshake_failed``, by reason
        # per member: a peer alternating two processes would log one at every message
        self._process_log = LogThrottle()

    # ---- introspection ------------------------------------------------------------------------
    def members(self) -> Iterator[tuple[SourceKey, str, SubscriberCounters]]:
        for m in self._members.values():
            yield m.key, m.name, m.counters

    def __len__(self) -> int:
        return len(self._members)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        # the handler answers before the socket can take a connection, and goes after it closed
        handler = self._zap = await zap.acquire(self._ctx, self._domain, self._decide)
        sub = self._ctx.socket(zmq.SUB)
        mon: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            # libzmq takes a frame in whole before the relay sees it or its sender's address: a
            # frame far over the batch bound ends that publisher's connection at its header
            sub.setsockopt(zmq.MAXMSGSIZE, self.spec.max_batch_bytes + FRAME_SLACK_BYTES)
            sub.setsockopt(zmq.SUBSCRIBE, self.spec.pattern.prefix)
            # every handshake asks the handler (a NULL one only with a domain set), which
            # refuses addresses outside ``allow`` and connections past the limit before any
            # message frame is read; with ENFORCE, no handler means no handshake (libzmq 4.3
            # lets it through otherwise)
            sub.setsockopt(zmq.ZAP_DOMAIN, self._domain.encode())
            try:
                sub.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                self.zap_enforced = True
            except (zmq.ZMQError, AttributeError):  # libzmq before 4.3
                self.zap_enforced = False
            # a peer that never finishes its handshake is closed after this; one that vanished
            # (no FIN) is found by keepalive, so that neither holds a connection for good
            sub.setsockopt(zmq.HANDSHAKE_IVL, self._handshake_ms)
            sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE[0])
            sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE[1])
            sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE[2])
            if self.spec.curve_secret_key is not None:
                sub.curve_secretkey = self.spec.curve_secret_key.encode("ascii")
                sub.curve_server = True
            mon = self._monitor(sub)  # before the bind: every connection is seen
            resolved = []
            for ep in self.spec.bind:
                # libzmq refuses an IPv6 address unless ZMQ_IPV6 is set when it binds (each
                # bind takes the options of its moment); IPv4 and names bind as before (``*``
                # stays IPv4 only). ``[::]`` then also takes IPv4 peers, named ``::ffff:a.b.c.d``:
                # ``allow``, ``addresses`` and the address binding compare ``canonical_ip``s
                sub.setsockopt(zmq.IPV6, int(_ipv6_bind(ep)))
                sub.bind(ep)
                last = sub.getsockopt(zmq.LAST_ENDPOINT)
                resolved.append(last.decode() if isinstance(last, bytes) else ep)
        except BaseException:
            if mon is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                mon.close(linger=0)
            sub.close(linger=0)
            self._zap = None
            await zap.release(self._ctx, handler, self._domain)
            raise
        self.endpoints = tuple(resolved)
        self._sub = sub
        self._shadow = zmq.Socket.shadow(sub.underlying)
        self._mon = mon
        self._mon_shadow = zmq.Socket.shadow(mon.underlying)
        self.state = "live"
        self._task = asyncio.create_task(self._run(), name="kvrelay-connect")
        self._log.info(
            "connect_listening", endpoints=self.endpoints, pattern=self.spec.pattern.text
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        with self._lock:  # the handler's thread may be reading the monitor
            if self._sub is not None:
                if self._mon is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sub.disable_monitor()
                    self._mon.close(linger=0)
                self._sub.close(linger=0)
            self._sub = self._shadow = self._mon = self._mon_shadow = None
            self._conns.clear()
            self._strangers.clear()
            self._kept.clear()
            self.connections = 0
            self._settle(math.inf)  # (every failure reported so far is counted)
        handler, self._zap = self._zap, None
        if handler is not None:  # after the socket: none of its handshakes goes unanswered
            await zap.release(self._ctx, handler, self._domain)
        if self.state != "failed":
            self.state = "stopped"

    # ---- handshakes and connections ---------------------------------------------------------
    def _monitor(self, sub: zmq.asyncio.Socket) -> zmq.asyncio.Socket:
        """The socket's accept, disconnect and handshake events, read without blocking
        (``_take_events``)."""
        addr = f"inproc://{self._domain}.monitor"
        sub.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_EVENTS)
        mon = self._ctx.socket(zmq.PAIR)
        mon.setsockopt(zmq.LINGER, 0)
        # no high-water mark: under a burst of connections a bounded pipe would hold libzmq's
        # I/O thread back or lose a disconnect (a connection then counted for good)
        mon.setsockopt(zmq.RCVHWM, 0)
        mon.connect(addr)
        return mon

    def _take_events(self) -> None:
        """Bring the open connections up to date from the monitor's pending events (on the
        loop, and on the ZAP handler's thread before each answer)."""
        while self._take_event():
            pass
        with self._lock:
            now = time.monotonic()
            self._settle(now - SETTLE_S)
            if self._refusal_reported and now - self._report_at >= KEPT_REFUSAL_S:
                self._found_kept()  # nothing followed the report: its connection was kept
            if self._kept:
                self._end_kept(now)

    def _take_event(self) -> bool:
        """One pending event (the lock held for one only: the handler's thread waits for no
        more than that); whether there was one."""
        with self._lock:
            mon = self._mon_shadow
            if mon is None:
                return False
            try:
                msg = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            event = parse_monitor_message(msg)
            kind, value = event["event"], int(event["value"])
            # the relay's refusal was the event before: this one may be its connection's end
            refused, self._refusal_reported = self._refusal_reported, False
            if refused and not _ends_connection(kind, value):
                self._found_kept()  # the refused connection was kept (``KEPT_REFUSAL_S``)
            if kind == zmq.EVENT_ACCEPTED:
                self._forget(value)  # a descriptor libzmq reused (defensive)
                peer = _fd_peer(value)
                counted = peer is not None and self._admits(peer)
                self._conns[value] = counted
                self.connections += counted
                if not counted and (peer is None or self._allow):
                    self._strangers.add(value)
            elif kind == zmq.EVENT_DISCONNECTED:
                reported, self._failure_reported = self._failure_reported, False
                stranger = self._forget(value)
                if refused:  # closed on the refusal (``zap.CLOSE``)
                    self._refusal_ended()
                elif stranger and not reported:
                    # libzmq closes a peer whose greeting is not ZMTP 3 (noise, ZMTP 1.0:
                    # refused with ZAP on) without a handshake event; a stranger's
                    # connection closing unreported is one (it cannot have passed)
                    self._handshake_failed("not_zmtp3", 0)
            else:
                self._handshake_ended(kind, value, refused)
            return True

    def _handshake_ended(self, kind: int, value: int, refused: bool = False) -> None:
        """A handshake event (libzmq's version 1 events name no connection). A protocol or
        unfinished failure is reported just before the connection's own disconnect, by the one
        I/O thread (the context's default), which ``_take_events`` pairs them by. ``refused``:
        the event before was libzmq's report of the relay's refusal."""
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the connection stays until the peer or
            if value == 300:  # ``HANDSHAKE_S`` ends it; 300: the relay's own temporary refusal
                self._refusal_ended()  # (``connections_over_limit``)
            else:
                self._handshake_failed("auth", value)
            return
        self._failure_reported = True
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZAP_INVALID_STATUS_CODE:
                # the relay's own refusal (``zap.CLOSE``): ``connections_refused``. libzmq
                # closes the connection at once (its disconnect is the next event), or keeps it
                # (``KEPT_REFUSAL_S``): the relay ends it then, reported as a failure
                self._refusal_reported = True
                self._report_at = time.monotonic()
                self._report_strangers = frozenset(self._strangers)
                self._report_handled = False
                return
            reason = "protocol"
        else:  # NO_DETAIL: the peer hung up, or did not finish within ``HANDSHAKE_S``
            reason = "unfinished"
        if refused:  # the refused connection's own end, right after its refusal
            self._refusal_ended()
        else:
            self._unsettle(reason, value)

    # A connection the handler refused ends with libzmq's report of the refusal (and the
    # disconnect, or a failure, right after it), or, when the peer hung up (or broke the
    # protocol) while the refusal was on its way, or stayed after it (above), with a failure
    # (NO_DETAIL, PROTOCOL): counted as refused by the handler, it must not count as failed too.
    # The events name no connection, so the two are matched by count: a failure is settled
    # ``SETTLE_S`` after its report (the handler has counted a refusal of it by then) and taken
    # for a refusal no end has been matched with yet, if there is one, else counted. A failure
    # can take the refusal of another connection whose report is still to come (their ends
    # came close together); that report then finds none unmatched and counts the failure after
    # all, so each connection is counted once (in ``connections_*`` or ``handshakes_failed``).

    def _found_kept(self) -> None:
        """The last refusal reported was kept on its connection: ended by ``_end_kept``."""
        if self._report_handled:
            return
        self._report_handled = True
        self._kept.append((self._report_strangers, time.monotonic()))
        if len(self._kept) > MAX_KEPT:
            self._end_kept(math.inf)

    def _end_kept(self, now: float) -> None:
        """End each kept refusal's connection once it is the only one left of the strangers'
        connections open at its report, or all of those ``KEPT_WAIT_S`` after it. Its end is
        counted as for a peer that hung up after its refusal."""
        waiting: deque[tuple[frozenset[int], float]] = deque()
        for fds, at in self._kept:
            left = fds & self._strangers
            if len(left) == 1 or (left and now - at >= KEPT_WAIT_S):
                for fd in left:
                    _shut_stranger(fd, self._admits)
            elif left:
                waiting.append((fds, at))
        self._kept = waiting

    def _watch_refusal(self) -> None:
        """On the handler's thread, at each ``zap.CLOSE``: look for a kept connection from
        ``KEPT_REFUSAL_S`` on, without waiting for the loop."""
        self._last_close = time.monotonic()
        handler = self._zap
        if not self._watching and handler is not None:
            self._watching = handler.call_later(KEPT_REFUSAL_S, self._look_for_kept)

    def _look_for_kept(self) -> None:
        """The handler's thread: take the events (``_take_events`` ends a kept connection), and
        look again while a report may still come."""
        self._watching = False
        self._take_events()
        handler = self._zap
        pending = (self._refusal_reported and not self._report_handled) or bool(self._kept)
        if handler is not None and (
            pending or time.monotonic() - self._last_close < KEPT_WATCH_S
        ):
            self._watching = handler.call_later(KEPT_REFUSAL_S, self._look_for_kept)

    def _unmatched_refusals(self) -> int:
        # (the handler's thread counts refusals: a plain read of an int)
        return self._refusals - self._refusals_ended

    def _refusal_ended(self) -> None:
        """libzmq reported the relay's refusal of a connection (always after the handler counted
        it)."""
        if self._unmatched_refusals() > 0:
            self._refusals_ended += 1
        else:  # a failure settled before took this refusal: it was one of its own
            self._handshake_failed(*(self._taken.pop() if self._taken else ("unfinished", 0)))

    def _unsettle(self, reason: str, detail: int) -> None:
        """A failure that may be the end of a refused connection: settled later."""
        self._unsettled.append((time.monotonic(), reason, detail))
        if len(self._unsettled) > MAX_UNSETTLED:
            self._settle(self._unsettled[0][0])

    def _settle(self, reported_by: float) -> None:
        """Count the failures reported by ``reported_by`` (monotonic), each taken for a refusal
        still unmatched if there is one."""
        pending = self._unsettled
        while pending and pending[0][0] <= reported_by:
            _, reason, detail = pending.popleft()
            if self._unmatched_refusals() > 0:
                self._refusals_ended += 1
                self._taken.append((reason, detail))
            else:
                self._handshake_failed(reason, detail)

    def _handshake_failed(self, reason: str, detail: int) -> None:
        """Count a failed handshake; log it at most every ``REFUSAL_LOG_S`` per reason."""
        self.counters.handshake_failed(reason)
        not_logged = self._failure_log.due(reason)
        if not_logged is None:
            return
        self._log.warning("connect_handshake_failed", reason=reason, detail=hex(detail),
                          failed=not_logged + 1)  # fmt: skip

    def _forget(self, fd: int) -> bool:
        """Drop a closed connection; whether it was a stranger's."""
        if self._conns.pop(fd, False):
            self.connections -= 1
        if fd in self._strangers:
            self._strangers.discard(fd)
            return True
        return False

    def _admits(self, address: str) -> bool:
        """Whether a peer at ``address`` may connect or publish (``allow``). A TCP peer's address
        is an IP address; an IPC peer's is not ("", or libzmq's ``localhost:uid:gid:pid``), and
        the socket file's permissions decided for it."""
        if not self._allow:
            return True
        addr = _ip(address)
        if addr is None:
            return self._ipc
        return any(addr in n for n in self._allow)

    def _decide(self, req: zap.Request) -> zap.Verdict:
        """The ZAP answer for one handshake (CURVE's own check has passed when it is asked), on
        the handler's thread: never waits for the event loop. A stranger is refused without
        the lock or a system call (the loop may hold the one, each of the others hands a busy
        loop the GIL): what only this thread touches (its counters, its log throttle), ``allow``
        and the client keys (never changed: a reload re-binds a new source) decide."""
        if not self._admits(req.address):
            # closed at once, not 400: libzmq would keep reading the connection after its ERROR
            self.counters.connections_refused += 1
            return self._close(req, "address", "address not allowed")
        keys = self._client_keys
        if keys is not None and not (
            req.mechanism == "CURVE" and req.credentials and req.credentials[0] in keys
        ):  # (only CURVE reaches the handler of a CURVE socket: anything else is refused too)
            self.counters.connections_key_refused += 1
            return self._close(req, "client_key", "CURVE key not allowed")
        with self._lock:
            verdict = self._over_limit(req)
        if self._key_engines and verdict[0] == 200:
            # the key, as each of the connection's messages' User-Id: who may publish what
            return 200, verdict[1], z85.encode(req.credentials[0]).decode()
        return verdict

    def _close(self, req: zap.Request, reason: str, text: str) -> zap.Verdict:
        """Refuse a stranger's handshake and have its connection closed at once (the handler's
        thread; the caller counted it)."""
        self._refusals += 1
        self._refused(reason, req.address, req.credentials[0] if req.credentials else b"")
        self._watch_refusal()
        return zap.CLOSE, text

    def _over_limit(self, req: zap.Request) -> zap.Verdict:
        self._take_events()  # its own accept is among them: libzmq reported it first
        if self.connections > self.max_connections:  # this connection is counted already
            # 300, temporary: libzmq sends no ERROR (after one, a libzmq publisher never
            # connects again); the connection ends with the handshake's time and the publisher
            # connects again, to be asked again
            self.counters.connections_over_limit += 1
            self._refusals += 1
            self._refused("connection_limit", req.address)
            return 300, "connection limit reached"
        return 200, "OK"

    def _refused(self, reason: str, address: str, key: bytes = b"") -> None:
        """Log a refusal at most every ``REFUSAL_LOG_S`` per reason, with the count since (and,
        for a CURVE key refused, that key: an engine left out by mistake is found by it)."""
        not_logged = self._refusal_log.due(reason)
        if not_logged is None:
            return
        shown = reason == "client_key" and len(key) == 32  # (CURVE keys are 32 bytes)
        client_key = z85.encode(key).decode() if shown else ""
        self._log.warning(
            "connect_handshake_refused", reason=reason, address=address, refused=not_logged + 1,
            connections=self.connections, limit=self.max_connections, client_key=client_key,
        )  # fmt: skip

    async def _run(self) -> None:
        assert self._sub is not None and self._shadow is not None
        sub, shadow = self._sub, self._shadow
        period = min(1.0, self.spec.member_silence_s / 4)
        next_sweep = time.monotonic() + period
        try:
            while True:
                timeout = max(1, int((next_sweep - time.monotonic()) * 1000))
                if await sub.poll(timeout):
                    for _ in range(self._drain):
                        try:
                            first = shadow.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(await _rest(shadow, first.bytes), _peer(first),
                                         _user(first) if self._key_engines else "")
                self._take_events()
                now = time.monotonic()
                if now >= next_sweep:
                    self.sweep(now)
                    next_sweep = now + period
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failure = exc
            self.state = "failed"
            self._log.exception("connect_crashed", error=f"{type(exc).__name__}: {exc}")
            self._sink.on_connect_failed(exc)

    # ---- messages -------------------------------------------------------------------------------
    def _on_message(self, frames: list[bytes], peer: str = "", key: str = "") -> None:
        """One message, from ``peer`` (its address) and with ``key`` (the Z85 CURVE key its
        connection was admitted with, where keys are bound to engines)."""
        c = self.counters
        c.messages += 1
        # the handshake refused other addresses already; this is the second line (libzmq
        # without ZMQ_ZAP_ENFORCE_DOMAIN lets a handshake through when no handler answers)
        if peer and not self._admits(peer):
            c.peer_refused += 1
            return
        if len(frames) != 3:
            c.reject("frame_count")
            return
        if len(frames[0]) > self.spec.max_topic_bytes:
            c.topic_too_long += 1
            return
        topic, epoch = bytes(frames[0]), None
        if self._sglang:
            cut = topic.find(EPOCH_MARKER)
            if cut >= 0:
                parts = split_topic(topic, topic[:cut])
                if parts is None:
                    c.topic_malformed += 1
                    return
                topic, epoch = topic[:cut], parts[0]
        match = self._topics.get(topic)
        if match is None:
            try:
                match = self.spec.pattern.match(topic)
            except TopicError as exc:
                if exc.kind == "topic_unmatched":
                    c.topic_unmatched += 1
                else:
                    c.topic_malformed += 1
                return
            if len(self._topics) >= self._topics_max:
                self._topics.clear()
            self._topics[topic] = match
        model = self.spec.model
        if match.model is not None and model is not None and match.model != model:
            c.model_mismatch += 1
            return
        owner, process = _publisher(peer)
        if owner and not self._may_publish(match.engine, peer, owner):
            c.address_mismatch += 1
            return
        if self._key_engines and not self._key_may_publish(match.engine, key):
            c.key_mismatch += 1
            self._key_refused(match.engine, key)
            return
        try:
            seq = parse_seq(frames[1])
        except FrameError as exc:
            c.reject(exc.kind)
            return
        payload = bytes(frames[2])
        if len(payload) > self.spec.max_batch_bytes:  # never decoded, not even for its rank
            c.batch_too_large += 1
            self._reset_engine(match.engine)
            return
        rank = match.rank
        if rank is None:
            try:
                rank = _PEEK.decode(payload).dp_rank or 0
            # msgspec skips nested values recursively: a publisher's deep nesting is a payload
            # like any other that does not decode, never the end of the bound SUB
            except (msgspec.DecodeError, OverflowError, RecursionError):
                self._unattributed(match.engine)
                return
        m = self._members.get((match.engine, rank))
        if m is None:
            m = self._admit(match.engine, rank, seq)
            if m is None:
                return
            m.process = process
            if owner and match.engine not in self._pinned:
                self._owners.setdefault(match.engine, owner)
        elif process != m.process:
            self._new_process(m, seq, process)
        self._on_member_message(m, seq, payload, epoch)

    def _may_publish(self, engine: str, peer: str, owner: str) -> bool:
        """The address binding: named addresses for pinned engines, else the first claimant
        (``owner``: ``_publisher``'s binding of the sender)."""
        pinned = self._pinned.get(engine)
        if pinned is not None:
            return _in(peer, pinned)
        bound = self._owners.get(engine)
        return bound is None or bound == owner

    def _key_may_publish(self, engine: str, key: str) -> bool:
        """A key bound to engines publishes those only; an engine bound to keys is published by
        those only (``curve_key_engines``)."""
        names = self._key_engines.get(key)
        return engine in names if names is not None else engine not in self._keyed

    def _key_refused(self, engine: str, key: str) -> None:
        """Log a message dropped for its key at most every ``REFUSAL_LOG_S`` (counted each)."""
        not_logged = self._key_log.due("key_mismatch")
        if not_logged is not None:
            self._log.warning("connect_key_mismatch", engine=engine, client_key=key,
                              dropped=not_logged + 1)  # fmt: skip

    def _new_process(self, m: _Member, seq: int, process: str) -> None:
        """Another process publishes for ``m`` (an IPC peer's pid changed): the engine restarted
        (or another process took its name). Its sequence space is a new one, and a first
        sequence that happens to continue the old one must not pass for the old stream: reset,
        and this message is the baseline."""
        if m.process and process and m.next_seq is not None:
            m.counters.incarnations_detected += 1
            self._reset(m, ResetReason.INCARNATION)
            m.next_seq = None
            if seq > 0:
                m.counters.missing_history += 1  # it published before the relay saw it
            not_logged = self._process_log.due(f"{m.name} {m.key.dp_rank}")
            if not_logged is not None:
                self._log.info("connect_member_new_process", engine=m.name, dp_rank=m.key.dp_rank,
                               first_seq=seq, not_logged=not_logged)  # fmt: skip
        m.process = process

    def _admit(self, name: str, rank: int, seq: int) -> _Member | None:
        c = self.counters
        if len(self._members) >= self.spec.max_members:
            c.members_over_limit += 1
            # (an engine dropped from routing: said, not only counted; the key is the event's,
            # the engine named is the first of the period, raw input never a key)
            not_logged = self._key_log.due("members_over_limit")
            if not_logged is not None:
                self._log.warning("connect_members_over_limit", engine=name, dp_rank=rank,
                                  limit=self.spec.max_members, dropped=not_logged + 1)  # fmt: skip
            return None
        if not 0 <= rank <= 1023:
            c.topic_malformed += 1
            return None
        key = self._sink.admit(name, rank)
        if key is None:
            c.members_refused += 1
            return None
        s = self.spec
        m = _Member(
            name=name,
            key=key,
            decoder=Decoder(
                kv_block_size=s.kv_block_size, dp_rank=rank, hash_format=s.hash_format,
                options=s.options, kind=s.kind,
            ),
            last_message_at=time.monotonic(),
        )  # fmt: skip
        self._members[(name, rank)] = m
        c.members_added += 1
        if seq > 0:
            m.counters.missing_history += 1  # it published before the relay saw it
        self._log.info("connect_member_added", engine=name, dp_rank=rank, first_seq=seq)
        return m

    def _on_member_message(
        self, m: _Member, seq: int, payload: bytes, epoch: bytes | None
    ) -> None:
        c = m.counters
        c.messages += 1
        m.last_message_at = time.monotonic()
        nxt = m.next_seq
        if self._sglang and nxt is not None and epoch != m.epoch:
            c.epoch_changes += 1
            self._reset(m, ResetReason.INCARNATION)
        elif nxt is None or seq == nxt:
            pass
        elif seq > nxt:
            c.gaps += 1
            self._reset(m, ResetReason.GAP_NO_REPLAY)
        else:  # a restarted publisher numbers from 0 again
            self._reset(m, ResetReason.INCARNATION)
        m.epoch = epoch
        self._apply(m, seq, payload)

    def _apply(self, m: _Member, seq: int, payload: bytes) -> None:
        c = m.counters
        m.next_seq = seq + 1
        try:
            res = m.decoder.decode(payload)
        except DpRankMismatchError as exc:
            # the topic's ``{rank}`` names this member, the batch another rank: one of them is
            # wrong, and the member's sequence moved on past a batch nothing applied (a removal
            # in it would leave blocks the engine dropped): reset, as for any bad batch
            c.reject(exc.kind)
            self._bad_batch(m)
            return
        except DecodeError as exc:
            c.reject(exc.kind)
            self._bad_batch(m)
            return
        c.add_stats(res.stats)
        batch = as_events(res.batch)
        try:
            self._sink.on_batch(m.key, seq, batch)
        except MalformedBatch:
            c.reject("malformed_batch")
            self._bad_batch(m)
            return
        c.batches += 1
        c.events += batch.n_events
        c.blocks += batch.n_blocks
        m.dirty = True
        m.blocks = _held_after(m.blocks, batch)
        if m.blocks > self.spec.max_member_blocks:
            self.counters.member_block_cap += 1
            self._log.warning("connect_member_over_block_cap", engine=m.name,
                              dp_rank=m.key.dp_rank, limit=self.spec.max_member_blocks)  # fmt: skip
            self._reset(m, ResetReason.BLOCK_CAP)  # (as the pool's own cap names it)

    def _bad_batch(self, m: _Member) -> None:
        """What the engine did in that batch is unknown and there is no replay: reset."""
        m.counters.bad_batches += 1
        m.dirty = True  # whatever it held before, it no longer matches the engine
        self._reset(m, ResetReason.BAD_BATCH)

    def _unattributed(self, engine: str) -> None:
        """An undecodable payload whose rank cannot be read: reset every rank of that engine."""
        self.counters.unattributed += 1
        self._reset_engine(engine)

    def _reset_engine(self, engine: str) -> None:
        """A batch of ``engine``'s was lost and its rank is unknown: reset each of its ranks."""
        for m in self._members.values():
            if m.name == engine:
                m.counters.bad_batches += 1
                m.dirty = True
                m.next_seq = None  # its sequence space is unknown now: next message = baseline
                self._reset(m, ResetReason.BAD_BATCH)

    def _reset(self, m: _Member, reason: ResetReason) -> None:
        m.decoder.reset()
        m.blocks = 0
        if not m.dirty:
            return
        m.dirty = False
        m.counters.count_reset(reason.value)
        self._sink.on_reset(m.key, reason)  # the pool logs member_reset

    # ---- silence --------------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Remove members silent for ``member_silence_s``."""
        limit = self.spec.member_silence_s
        for ident, m in list(self._members.items()):
            if now - m.last_message_at < limit:
                continue
            del self._members[ident]
            if not any(other.name == m.name for other in self._members.values()):
                self._owners.pop(m.name, None)  # its last member left: the name is free again
            self.counters.members_expired += 1
            self._log.warning("connect_member_expired", engine=m.name, dp_rank=m.key.dp_rank,
                         silent_s=round(now - m.last_message_at, 1))  # fmt: skip
            self._sink.on_member_gone(m.key, m.counters)


Networks = tuple[IPNetwork, ...]


def _networks(addrs: tuple[str, ...]) -> Networks:
    """Addresses or networks (``10.0.0.5``, ``10.0.0.0/24``, ``::1``; validated by the config),
    spelled as peers are compared (``_ip``): ``::ffff:10.0.0.5`` is ``10.0.0.5``, which a
    legitimate IPv4 publisher was refused as."""
    return tuple(canonical_network(a) for a in addrs)


#: The peer's IP address (an IPv4-mapped IPv6 one as IPv4); None where it is not one.
_ip = canonical_ip


def _publisher(peer: str) -> tuple[str, str]:
    """(what an engine is bound to, the sending process) for a message's ``Peer-Address``.

    TCP: (its IP address as ``canonical_ip`` spells it, ""): libzmq writes it with
    ``inet_ntop``, but an IPv4 peer is ``a.b.c.d`` on an IPv4 bind and ``::ffff:a.b.c.d`` on a
    dual-stack ``[::]`` one, and one engine's ranks may reach one pool through both.
    IPC: libzmq writes ``localhost:uid:gid:pid`` (Linux; ``localhost:uid:gid:`` where only the
    user is known): bound to ``localhost:uid:gid``, the pid apart. A process has a new pid on
    every start, and each DP rank is a process of its own."""
    if peer.startswith("localhost:"):
        owner, _, process = peer.rpartition(":")
        return owner, process
    addr = _ip(peer)  # one spelling per address: an IPv4 peer that reached an IPv6 bind
    return (peer if addr is None else str(addr)), ""  # is ``::ffff:a.b.c.d`` there


def _ipv6_bind(endpoint: str) -> bool:
    """Whether a bind endpoint names an IPv6 address (``tcp://[::1]:5557``, ``tcp://[::]:5557``)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host.startswith("[") or ":" in host


def _in(peer: str, networks: Networks) -> bool:
    addr = _ip(peer)
    return addr is not None and any(addr in n for n in networks)


#: While the parts of one message are read and dropped, the event loop is yielded to after
#: this many: a message of millions of empty frames (2 bytes each on the wire, within
#: ``max_batch_bytes``) held the loop for seconds.
_PARTS_PER_TURN = 4096


async def _rest(sock: zmq.Socket[Any], first: bytes) -> list[bytes]:
    """The message whose first part is ``first``: its other parts (one Frame object per message,
    for the peer address, not one per part); parts past a fourth are read and dropped, so the
    frame-count check sees a bad message without holding all of it. libzmq delivers a message
    whole: its parts are all there, and only this task reads the socket."""
    frames = [first]
    n = 1
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv()
        n += 1
        if len(frames) < 4:
            frames.append(part)
        elif n % _PARTS_PER_TURN == 0:
            await asyncio.sleep(0)
    return frames


def _ends_connection(kind: int, value: int) -> bool:
    """Whether a monitor event is a connection's end (its failure, or its disconnect)."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return value != zmq.PROTOCOL_ERROR_ZAP_INVALID_STATUS_CODE  # (another refusal's report)
    return kind in (zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """libzmq's descriptor ``fd`` as a socket of a duplicate (closed at the end, so libzmq's own
    descriptor never is here); None where the number no longer names a socket (reused)."""
    try:
        dup = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # not a socket (the number was reused): the duplicate is still ours
        os.close(dup)
        yield None
        return
    with sock:
        yield sock


def _shut_stranger(fd: int, admits: Callable[[str], bool]) -> bool:
    """Shut down the connection on libzmq's descriptor ``fd`` if its peer is one ``admits``
    refuses (libzmq then ends it as if the peer had hung up); whether it did. Through a
    duplicate, checked before: if libzmq closed ``fd`` and the number now names another socket,
    that socket's own peer decides, so an admitted peer's connection is never ended here."""
    with _borrowed(fd) as sock:
        if sock is None:
            return False
        try:
            peer = sock.getpeername()
            if not isinstance(peer, tuple) or admits(str(peer[0])):
                return False
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True


def _fd_peer(fd: int) -> str | None:
    """The peer's address on libzmq's descriptor ``fd`` (IP; "" for a Unix socket); None where
    it is no longer a connected socket. If libzmq closed it already, its disconnect event is
    queued behind the accept: a number the process reused meanwhile (another socket's peer read
    here) is forgotten with that event."""
    with _borrowed(fd) as sock:
        if sock is None:
            return None
        try:
            peer = sock.getpeername()
        except OSError:
            return None
    return str(peer[0]) if isinstance(peer, tuple) else ""


def _user(frame: zmq.Frame) -> str:
    """The user id the relay's ZAP handler gave the sender's connection ("" where none)."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def _peer(frame: zmq.Frame) -> str:
    """The sender's address (TCP), or "" where ZMQ has none (IPC, inproc)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def _held_after(held: int, batch: EventBatch) -> int:
    """``held`` plus the blocks ``batch`` stores minus those it removes (a clear empties it)."""
    ops = batch.ops
    if ops.shape[0] == 0:
        return held
    sizes = np.diff(batch.blk_off)
    clears = np.flatnonzero(ops == OP_CLEAR)
    if clears.shape[0]:
        start = int(clears[-1]) + 1
        held, ops, sizes = 0, ops[start:], sizes[start:]
    stored = int(sizes[ops == OP_STORE].sum())
    removed = int(sizes[ops == OP_REMOVE].sum())
    return max(0, held + stored - removed)
