"""One asyncio subscriber per (engine, dp_rank): SUB live stream + DEALER replay, in seq order.

Algorithm (``docs/contract.md`` §16, kvrelay's decisions in §16.5):

* The live stream connects first (SUB), then (if a replay endpoint exists) a DEALER asks for
  ``[b"", seq_be8]`` from 0 (or ``start_seq``). Live messages arriving meanwhile wait in a
  bounded ``ReorderBuffer``; replayed and live batches are applied in sequence order, duplicates
  dropped.
* The first replayed seq later than asked = missing history: the member is reset and rebuilt from
  what is available.
* At runtime a gap triggers one replay; a hole that is still open afterwards resets the member and
  continues from the first available seq. Without a replay endpoint a gap resets at once.
* A live seq lower than expected (outside the window the last replay covered) is a new engine
  incarnation: reset, then replay from 0 if possible.
* Reorder-buffer overflow (bound in messages and bytes) = unrecoverable gap: reset, drop the
  buffer, restart from the next live message.
* Replay inactivity timeout = replay failure (counted); same hole handling.

Vouching for the incarnation. A restarted engine numbers its batches from 0 again, so after a
reconnect (seen on the SUB socket's monitor) or before a gap is filled, the relay cannot tell its
new batches from the old ones by sequence alone. It remembers a digest of the last batch it
applied and asks the replay for that batch first: the same bytes mean the same incarnation; any
other answer (other bytes, a later first batch, nothing, no answer within the replay timeout: a
replay that does not answer is not a vouch) means the state can no longer be vouched for, and the
member is reset and rebuilt from the replay at 0 (or, if that does not answer either, from the
live stream). Without a replay
endpoint a reconnect resets the member.

SGLang publishers with a snapshot endpoint name their epoch (incarnation) in the topic frame
(§21.3): a change of epoch is a restart, handled like a backwards sequence whatever the sequence.

Bad batches. A batch that fails to decode (or that the pool rejects as malformed) leaves the
member's state untouched but stale: the relay asks the replay for that batch again (a corrupted
live message repairs itself); if it is bad again, or no replay exists, the member is reset and
continues after it. A subscriber that crashes reports it to its sink (which resets the member and
restarts the source); it never keeps running as if its state were exact.

Receive loop: the live source (``live_source.py``: the ZMTP reader on the event loop, or libzmq's
SUB socket and its monitor) calls back when input may be waiting, and the callback drains up to
``drain`` messages right there (again on the next iteration when more remain); the subscriber
task sleeps until the callback hands it something that needs awaiting (a reconnect to vouch for,
a replay, a crash). pyzmq's asyncio layer is not used: its Poller builds futures and watchers for
every wait, which cost about as much as the decoding of a small batch. Only state changes are
logged; per-message outcomes are counters. What a publisher's input can repeat at every message
(a bad batch, a restart, a replay's outcome, and the state changes each of them causes: with a
replay, every bad message resets the member and rebuilds it) is logged at most once per 10 s per
event (``subscriber_state``: per state), the next line counting those not logged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import xxhash
import zmq

from kvrelay._aio import cancel_and_wait
from kvrelay.ingest import zmq_context
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import (
    DecodeError,
    DpRankMismatchError,
    FrameError,
    TopicMismatchError,
)
from kvrelay.ingest.frames import MAX_FRAME_BYTES, check_live, check_live_sglang, check_replay
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.live_source import LiveSource, open_source, readable, require_reader
from kvrelay.ingest.reorder import ReorderBuffer
from kvrelay.ingest.sink import DETACHED, BatchSink, ResetReason, SourceSpec
from kvrelay.ingest.zmtp import CONNECTED, DISCONNECTED, HEALTHY_S
from kvrelay.logging import INPUT_LOG_S, LogThrottle, get_logger
from kvrelay.pool.errors import MalformedBatch

_LOGGER = "kvrelay.ingest"
#: A connection that ends within this many seconds without a message is a flap: the source is
#: not live (state ``flapping``) until a message arrives. The ZMTP reader's rule for a
#: connection that was a publisher's, one value for both.
FLAP_S = HEALTHY_S
#: ``source_reconnected`` is logged at most this often per source.
RECONNECT_LOG_S = 10.0
#: ``subscriber_state`` is logged at most this often per source and state.
STATE_LOG_S = INPUT_LOG_S

_ABORTED = 2  # replay outcome: reorder overflow, buffer dropped
_DONE = 1
_FAILED = 0
_RESTARTED = 3  # the replay does not hold the last applied batch: another incarnation
_UNVOUCHED = 4  # asked to vouch for the last applied batch, the replay did not answer in time
_GAPPED = 5  # the reply skipped a batch after its first one: asked again from there, once
_REFUSED = 6  # the reply ended with a batch of it refused: as _FAILED, and asked again once

_NOBLOCK = int(zmq.NOBLOCK)
#: Replayed batches whose digests are kept while their duplicate window is open (the first
#: ones: a restarted engine counts from 0 again); about 100 bytes each, 400 KiB at most
REPLAY_DIGESTS = 4096


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Subscriber:
    """Lifecycle: ``await start()`` … ``await stop()``. Counters in ``.counters``.

    Liveness for the pool: ``connected``, ``disconnected_since`` (monotonic; since start when it
    never connected), ``last_message_at``, and ``failure`` once the task crashed.
    """

    def __init__(
        self,
        spec: SourceSpec,
        sink: BatchSink,
        *,
        context: zmq.Context[Any] | None = None,
        start_seq: int = 0,
        drain: int = 256,
        rcvhwm: int = 100_000,
        reorder_max_messages: int = 10_000,
        reorder_max_bytes: int = 64 << 20,
        replay_timeout: float = 2.0,
        resume: tuple[int, int] | None = None,
        reader: str = "zmtp",
        groups: Mapping[int, bool] | None = None,
        groups_unsure: bool = False,
    ) -> None:
        """``resume=(seq, digest)``: the member's state is already that of every batch up to
        ``seq`` (restored from a state file), ``digest`` being that batch's. The subscriber
        vouches for it first — the replay must still hold that batch with the same bytes — and
        then goes on from ``seq + 1``; anything else resets the member and rebuilds it. The sink
        hears ``on_vouched`` once the replay from ``seq + 1`` on is applied as well.
        ``groups``: with ``resume``, the group kinds its decoder had learned (``learned_groups``);
        ``groups_unsure``: they were not saved, so any other group may be full attention
        (``Decoder.assume_unsure_groups``).
        ``reader``: how the live stream is read (``live_source.READERS``)."""
        self._reader = require_reader(reader)
        self.spec = spec
        self.key = spec.key
        self.counters = SubscriberCounters()
        self._rebuilding = False  # a reset member being rebuilt from the replay
        self.state = "new"
        self.connected = False
        self._connected_at = 0.0
        self._messages_at_connect = 0
        self._reconnect_log = LogThrottle(RECONNECT_LOG_S)  # ``source_reconnected``
        self.disconnected_since: float | None = time.monotonic()
        self._down_before: float | None = None  # disconnected_since before this connection
        self.last_message_at: float | None = None
        self.failure: BaseException | None = None
        self._sink = sink
        ctx = context if context is not None else zmq_context.shared()
        self._ctx: zmq.Context[Any] = zmq.Context.shadow(ctx.underlying)  # plain sockets
        self._drain = drain
        self._rcvhwm = rcvhwm
        self._replay_timeout_ms = max(1, int(replay_timeout * 1000))
        self._buf = ReorderBuffer(reorder_max_messages, reorder_max_bytes)
        self._decoder = Decoder(
            kv_block_size=spec.kv_block_size,
            dp_rank=spec.dp_rank,
            hash_format=spec.hash_format,
            options=spec.options,
            kind=spec.kind,
        )
        if resume is not None and groups:
            self._decoder.learn_groups(groups)
        if resume is not None and groups_unsure:
            self._decoder.assume_unsure_groups()
        self._sglang = spec.kind is EngineKind.SGLANG
        self._epoch: bytes | None = None  # SGLang: the publisher epoch last seen
        self._epoch_known = False
        self._start_seq = start_seq
        self._next: int | None = None
        self._dup_lo, self._dup_hi = 0, -1
        #: (seq, digest) of the first batch the last replay gave (the vouch compares it)
        self._dup_first: tuple[int, int] | None = None
        #: seq → digest of the batches the last replay gave, the first ``REPLAY_DIGESTS`` of
        #: them (``_replaced``); emptied as the duplicate window closes
        self._dup_digests: dict[int, int] = {}
        #: the last sequence the live stream delivered (-1: none since the last incarnation). A
        #: live stream never repeats a number, so one at or below it is another incarnation's,
        #: never a duplicate of what a replay applied (``_repeats_live``)
        self._live_hi = -1
        self._replay_from: int | None = None
        self._dirty = start_seq > 0
        self._last: tuple[int, int] | None = None  # (seq, digest) of the last batch handled
        self._bad_seq: int | None = None  # a batch that failed once and is being re-fetched
        self._in_replay = False
        self._resume = resume
        self._resume_pending = resume is not None  # restored state nobody vouched for yet
        #: the replay vouched for the restored state; the sink is told once the replay after it
        #: is applied too (until then the state is the saved one, behind the engine)
        self._vouch_seen = False
        if resume is not None:
            self._next, self._last, self._dirty = resume[0] + 1, resume, True
        self._ever_connected = False
        #: a batch (live or replayed) was handled: a later baseline follows a reset, not a join
        self._applied_any = False
        #: where a bootstrap replay that did not answer started: asked again at the first live
        #: message before that message becomes the baseline (``_on_live``)
        self._unanswered_from: int | None = None
        self._reconnected = False
        #: a replay saw the live connection end: the live stream is not read by a replay until
        #: the reconnect's vouch is asked for (``_after_reconnect``), as what the next
        #: connection delivers may be another incarnation's, and applied after the replay
        #: (contiguous with it) nothing would tell
        self._held_live = False
        self._src: LiveSource | None = None
        self._errors_logged: set[str] = set()
        # what the publisher sends (live, or as its replay's reply, or by not answering it) can
        # repeat each event at every message: ``bad_batch``, ``bad_batch_repaired``,
        # ``sequence_backwards``, ``epoch_changed``, ``incarnation_unverified``,
        # ``vouch_unanswered``, ``replay_timeout``, ``replay_gap``, ``replay_history_missing``,
        # ``reorder_overflow``: at most one line per event per 10 s (each is counted)
        self._input_log = LogThrottle()
        # ``subscriber_state`` by state: a publisher can make a source flip between replaying
        # and live at every message; the first flip into a state is logged at once
        self._state_log = LogThrottle(STATE_LOG_S)
        self._task: asyncio.Task[None] | None = None
        self._live = False  # the reader callback drains (the task waits for a hand-over)
        self._wake_fut: asyncio.Future[None] | None = None  # what the task awaits, if anything
        self._crash: BaseException | None = None  # raised in the callback, re-raised by the task
        self._again_soon = False
        self._topic_warned = False
        # operator names, not hashed ids: which engine, pool and rank a line is about
        self._log = get_logger(
            _LOGGER, pool=spec.pool, engine=spec.engine or str(spec.worker_id),
            dp_rank=spec.dp_rank,
        )

    @property
    def next_seq(self) -> int | None:
        """Next expected sequence (``None`` before a baseline exists)."""
        return self._next

    def learned_groups(self) -> dict[int, bool]:
        """The group kinds learned since the member's last reset (saved with its resume point)."""
        return self._decoder.learned_groups()

    @property
    def groups_unsure(self) -> bool:
        """Resumed without the group kinds learned before, and not reset since."""
        return self._decoder.groups_unsure

    def resume_point(self) -> tuple[int, int] | None:
        """``(seq, digest)`` of the last applied batch when the member's state is exactly that
        of every batch up to it (what a state file may record); None when it is not (nothing
        applied, a bad batch being re-fetched, a rebuild under way, a crash)."""
        last = self._last
        if self.state == "failed" or last is None or self._bad_seq is not None:
            return None
        if self._next is None or last[0] != self._next - 1:
            return None
        return last

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._src = open_source(
            self._ctx, self.spec.endpoint, self._rcvhwm, self._reader, self._transport_error
        )
        self.disconnected_since = time.monotonic()
        self._task = asyncio.create_task(self._run(), name=f"kvrelay-sub-{self.key}")

    def detach(self) -> None:
        """Feed the pool nothing more, from now on (``stop`` ends the task later): the pool has
        dropped this member's state and may build a new generation before the task is gone, and
        a batch applied there would be applied again by the subscriber that replaces this one."""
        self._sink = DETACHED

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self._live = False
        if self._src is not None:
            self._src.close()
        self._src = None
        if self.state != "failed":
            self.state = "stopped"

    # ---- main loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._src is not None
        loop = asyncio.get_running_loop()
        self._src.open(self._on_readable)
        try:
            if self._resume is not None:
                if self.spec.replay_endpoint:
                    await self._sync(self._resume[0] + 1, bootstrap=False)
                    if self._resume_pending and self._vouch_seen:
                        # vouched, and the replay from the saved position on is applied: the
                        # state is the engine's now, not the saved one (told at the vouch, the
                        # pool was published while the batches after it were still being applied:
                        # a crash's checkpoint, up to an interval old, served as current)
                        self._resume_pending = False
                        self._sink.on_vouched(self.key)
                else:  # nothing can vouch for the restored state
                    self._reset(ResetReason.RESTORE_UNVERIFIED)
                    self._next, self._last = None, None
            elif self.spec.replay_endpoint:
                self._next = self._start_seq
                await self._sync(self._start_seq, bootstrap=True)
            elif self._start_seq > 0:
                self._next = self._start_seq
            self._end_rebuild()
            self._set_state("live")
            while True:
                fut = loop.create_future()
                self._wake_fut = fut
                self._live = True
                self._on_readable()  # whatever is queued already: the FDs signal changes only
                if self._live:
                    await fut
                self._live = False
                self._wake_fut = None
                if self._crash is not None:
                    raise self._crash
                if self._reconnected:
                    self._reconnected = False
                    self._after_reconnect()
                while self._replay_from is not None:  # a replay may ask for another
                    start, self._replay_from = self._replay_from, None
                    await self._sync(start, bootstrap=False)
                    if self._replay_from is None:
                        self._end_rebuild()
                    self._set_state("live")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failure = exc
            self.state = "failed"
            self._log.exception("subscriber_crashed", error=f"{type(exc).__name__}: {exc}")
            self._sink.on_failed(self.key, exc)
        finally:
            self._end_rebuild()
            self._live = False
            self._wake_fut = None
            self._src.detach()

    def _on_readable(self) -> None:
        """The source's callback (and its own continuation). Live: drain here. Otherwise (a
        replay in progress) wake whatever the task waits for."""
        self._again_soon = False
        if not self._live:
            self._poke()
            return
        src = self._src
        if src is None:
            return
        try:
            if src.has_events():
                self._watch_connection()
            if self._reconnected or self._replay_from is not None:
                self._hand_over()
                return
            for i in range(self._drain):
                frames = src.next_message(i == 0)
                if frames is None:
                    return
                self._on_live(frames)
                if self._replay_from is not None:
                    self._hand_over()
                    return
            # more may be queued: go on after the loop has run everything else once
            if not self._again_soon:
                self._again_soon = True
                asyncio.get_running_loop().call_soon(self._on_readable)
        except Exception as exc:  # the task reports it (crash path), never the event loop
            self._crash = exc
            self._hand_over()

    def _hand_over(self) -> None:
        self._live = False
        self._poke()

    def _poke(self) -> None:
        fut = self._wake_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _wait_input(self, dealer: zmq.Socket[Any], timeout: float) -> None:
        """Until the live stream or ``dealer`` may have input or ``timeout`` s passed (spurious
        wakes happen: callers check again). A held live stream's messages wake nothing."""
        src = self._src
        if (src is not None and not self._held_live and src.readable()) or readable(dealer):
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._wake_fut = fut
        handle = loop.call_later(timeout, _wake, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._wake_fut = None

    def _set_state(self, state: str) -> None:
        """A change of state, logged at once unless the source went into ``state`` less than 10 s
        ago (then counted in the next line's ``not_logged``; ``kvrelay_ingest_sources`` shows
        the current state)."""
        if state != self.state:
            self.state = state
            not_logged = self._state_log.due(state)
            if not_logged is not None:
                self._log.info("subscriber_state", state=state, next_seq=self._next,
                               not_logged=not_logged)  # fmt: skip

    # ---- connection monitor -----------------------------------------------------------------
    def _watch_connection(self, *, replaying: bool = False) -> None:
        """Apply the source's connect/disconnect events. A disconnect first drains what the
        old connection delivered (those batches precede any reconnect); a connect after a
        disconnect is a reconnect the next loop step must vouch for. ``replaying``: seen by a
        replay, which applies nothing live; the live stream is held instead (``_held_live``)."""
        assert self._src is not None
        for event in self._src.take_events():
            if event == CONNECTED and not self.connected:
                self.connected = True
                self._down_before, self.disconnected_since = self.disconnected_since, None
                self._connected_at = time.monotonic()
                self._messages_at_connect = self.counters.messages
                if self._ever_connected:
                    self.counters.reconnects += 1
                    self._reconnected = True
                    self._held_live = self._held_live or replaying
                self._ever_connected = True
            elif event == DISCONNECTED and self.connected:
                self.connected = False
                now = time.monotonic()
                # a peer that accepts and drops the connection without a message (no publisher
                # behind the port, a proxy, a crash loop): not a live source, and down since
                # before that connection (so that ``engine_down_grace_s`` runs out for an
                # engine whose port such a peer holds, as for one whose port refuses)
                brief = now - self._connected_at < FLAP_S
                silent = self.counters.messages == self._messages_at_connect
                flap = brief and silent and self._down_before is not None
                self.disconnected_since = self._down_before if flap else now
                if replaying:
                    self._held_live = True
                else:
                    self._drain_queued()
                if brief and silent and self.state == "live":
                    self._set_state("flapping")

    def _drain_queued(self) -> None:
        assert self._src is not None
        while self._replay_from is None:
            frames = self._src.next_message()
            if frames is None:
                return
            self._on_live(frames)

    def _transport_error(self, kind: str) -> None:
        """A protocol error of the publisher's connection (the ZMTP reader's; it reconnects):
        counted by kind, logged once per kind."""
        self.counters.reject(f"zmtp_{kind}")
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            self._log.warning("source_protocol_error", kind=kind, endpoint=self.spec.endpoint)

    def _after_reconnect(self) -> None:
        """The publisher may have restarted: vouch for the incarnation before going on (the
        vouch's replay reads the live stream again)."""
        self._held_live = False
        self._log_reconnect()
        if self._next is None or self._last is None:
            return  # nothing applied yet: whatever comes is a baseline
        if not self.spec.replay_endpoint:
            self._reset(ResetReason.RECONNECT)
            self._next = None  # the next live message is the new baseline
            return
        if self._replay_from is None:
            self._replay_from = self._next  # the replay checks the last batch first

    def _log_reconnect(self) -> None:
        """``source_reconnected`` at most once per ``RECONNECT_LOG_S`` per source, with how many
        reconnects the lines in between would have been (a peer that accepts and drops
        connections reconnects several times a second)."""
        not_logged = self._reconnect_log.due("source_reconnected")
        if not_logged is not None:
            self._log.info("source_reconnected", next_seq=self._next,
                           reconnects_not_logged=not_logged)  # fmt: skip

    # ---- live path ------------------------------------------------------------------------
    def _check(self, frames: list[bytes]) -> tuple[int, bytes, bool]:
        """``(seq, payload, new_epoch)``; raises ``FrameError``. ``new_epoch``: an SGLang
        publisher announced an epoch other than the one seen before (it restarted)."""
        if not self._sglang:
            seq, payload = check_live(frames, self.spec.topic)
            return seq, payload, False
        seq, payload, epoch = check_live_sglang(frames, self.spec.topic)
        if not self._epoch_known:
            self._epoch, self._epoch_known = epoch, True
            return seq, payload, False
        if epoch == self._epoch:
            return seq, payload, False
        self._epoch = epoch
        self.counters.epoch_changes += 1
        return seq, payload, True

    def _on_live(self, frames: list[bytes]) -> None:
        c = self.counters
        c.messages += 1
        self.last_message_at = time.monotonic()
        if self.state == "flapping":
            self._set_state("live")  # a message: there is a publisher after all
        known = self._epoch_known
        try:
            seq, payload, new_epoch = self._check(frames)
        except FrameError as exc:
            self._rejected(exc)
            return
        repeated = self._repeats_live(seq)
        if new_epoch:
            self._incarnation(seq, payload, epoch=True)
            return
        nxt = self._next
        if (
            self._sglang and not known and self._last is not None and nxt is not None
            and seq >= nxt and self.spec.replay_endpoint
        ):  # fmt: skip
            # The first epoch seen, after batches applied from the replay alone (a start, a
            # resume): its replies name no epoch, so the engine may have restarted since and
            # numbered up to here again. Vouch for the state as after a reconnect (the replay
            # re-reads the last applied batch) before this batch applies.
            if not self._buf.put(seq, payload):
                self._overflow()
                return
            if self._replay_from is None:
                self._replay_from = nxt
            return
        if nxt is None:
            asked, self._unanswered_from = self._unanswered_from, None
            if asked is not None and seq > asked:
                # the replay from ``asked`` did not answer (an engine frozen or too busy to):
                # it publishes again, so it is asked once more before this batch is taken as
                # the baseline and the history before it given up
                if not self._buf.put(seq, payload):
                    self._overflow()
                    return
                self._next = self._replay_from = asked
                return
            if not self._applied_any and seq > self._start_seq:
                # The first batch this subscriber takes is its baseline, and the engine numbered
                # others before it (it published before the relay joined, or its first batches
                # went out before the subscription reached its PUB): with nothing to replay them,
                # the member holds only what follows. Counted as a bootstrap replay that started
                # late is, and as a connect-mode member's first sequence above 0 is.
                self.counters.missing_history += 1
                self._log.warning("live_history_missing", first=seq, expected=self._start_seq,
                                  replay=bool(self.spec.replay_endpoint))  # fmt: skip
            self._apply(seq, payload)
            return
        if seq == nxt:
            if seq > self._dup_hi:
                self._close_dups()
            self._apply(seq, payload)
            if len(self._buf):
                self._drain_buffer()
            return
        if seq < nxt:
            if (
                not repeated
                and self._dup_lo <= seq <= self._dup_hi
                and not self._replaced(seq, payload)
            ):
                c.duplicates += 1
                return
            self._incarnation(seq, payload)
            return
        # seq > nxt: a hole
        if not self.spec.replay_endpoint:
            c.gaps += 1
            self._reset(ResetReason.GAP_NO_REPLAY)
            self._apply(seq, payload)
            return
        if not self._buf.put(seq, payload):
            self._overflow()
            return
        if self._replay_from is None:
            c.gaps += 1
            self._replay_from = nxt

    def _repeats_live(self, seq: int) -> bool:
        """Whether the live stream already delivered ``seq`` or a later number (then records
        ``seq`` as its position). The replay's duplicates are batches the live stream had not
        delivered yet when the replay applied them; a number the stream itself goes back to is
        a restarted engine's, whatever replay range it falls in (a gap's replay leaves that
        range open until a live batch past it is applied, and the restarted engine's batch
        there was dropped as a duplicate: the member kept the old incarnation's blocks)."""
        repeated = seq <= self._live_hi
        self._live_hi = seq
        return repeated

    def _replaced(self, seq: int, payload: bytes) -> bool:
        """A live batch numbered as one the last replay gave, with other bytes: the engine
        restarted and counts from there again (a proxy between them hides the reconnect; or
        live batches past the replay's top were lost, so the live stream's own position does
        not show it going back), so it is no duplicate of what the replay applied."""
        known = self._dup_digests.get(seq)
        return known is not None and _digest(payload) != known

    def _incarnation(self, seq: int, payload: bytes, *, epoch: bool = False) -> None:
        self._log_restart(seq, epoch=epoch)
        replay = seq > 0 and bool(self.spec.replay_endpoint)
        self._restart_from_zero(ResetReason.INCARNATION, replay=replay, live_seq=seq)
        if replay:
            self._buf.put(seq, payload)
        else:
            self._apply(seq, payload)

    def _log_restart(self, seq: int, *, epoch: bool, during: str = "live") -> None:
        """``epoch_changed`` / ``sequence_backwards`` (``during="replay"``: told by the live
        stream while a replay was read): counted (incarnations, resets); logged at most every
        10 s per event, live or during a replay alike."""
        not_logged = self._input_log.due("epoch_changed" if epoch else "sequence_backwards")
        if not_logged is None:
            return
        if epoch:  # (event names stay literals: tests/test_log_events.py)
            self._log.warning("epoch_changed", seq=seq, expected=self._next, during=during,
                              not_logged=not_logged)  # fmt: skip
        else:
            self._log.warning("sequence_backwards", seq=seq, expected=self._next, during=during,
                              not_logged=not_logged)  # fmt: skip

    def _restart_from_zero(
        self, reason: ResetReason, *, replay: bool = True, live_seq: int = -1
    ) -> None:
        """Another incarnation: drop the member's state and rebuild from its replay at 0.
        ``live_seq``: the new incarnation's live batch that told the restart (-1: something
        else told it, a vouch): the live position starts over there. The old incarnation's
        would take the new one's live batches that the rebuild's replay applied already (its
        duplicates) for the stream going back: a needless second reset and rebuild."""
        self._live_hi = live_seq
        if replay and self.spec.replay_endpoint:
            self._begin_rebuild()
        self._reset(reason)
        self._buf.clear()
        self._replay_from = None
        self._close_dups()
        self._last = None
        self._bad_seq = None
        if replay and self.spec.replay_endpoint:
            self._next = 0
            self._replay_from = 0
        else:
            self._next = None

    def _overflow(self) -> None:
        c = self.counters
        c.reorder_overflows += 1
        not_logged = self._input_log.due("reorder_overflow")
        if not_logged is not None:
            self._log.warning("reorder_overflow", messages=len(self._buf),
                              bytes=self._buf.nbytes, not_logged=not_logged)  # fmt: skip
        self._reset(ResetReason.REORDER_OVERFLOW)
        self._buf.clear()
        self._replay_from = None
        self._next = None
        self._close_dups()

    def _close_dups(self) -> None:
        """No live batch is a duplicate of a replay's any more (the live stream passed it, or
        the member starts over)."""
        self._dup_lo, self._dup_hi = 0, -1
        self._dup_digests.clear()

    def _apply(self, seq: int, payload: bytes) -> None:
        c = self.counters
        self._next = seq + 1
        self._applied_any = True
        try:
            res = self._decoder.decode(payload, packed=True)
        except DpRankMismatchError as exc:  # another rank's batch: not this member's, dropped
            c.reject(exc.kind)
            self._last = (seq, _digest(payload))  # its sequence is consumed all the same
            if exc.kind not in self._errors_logged:
                self._errors_logged.add(exc.kind)
                self._log.warning("batch_for_another_rank", seq=seq, error=str(exc))
            return
        except DecodeError as exc:
            c.reject(exc.kind)
            self._bad_batch(seq, payload, exc.kind)
            return
        c.add_stats(res.stats)
        batch = res.batch
        try:
            self._sink.on_batch(self.key, seq, batch)
        except MalformedBatch as exc:  # rejected whole, state untouched
            c.reject("malformed_batch")
            self._bad_batch(seq, payload, f"malformed_batch: {exc}")
            return
        c.batches += 1
        c.events += batch.n_events
        c.blocks += batch.n_blocks
        self._dirty = True
        self._last = (seq, _digest(payload))
        if self._bad_seq == seq:
            self._bad_seq = None
            c.repairs += 1
            not_logged = self._input_log.due("bad_batch_repaired")
            if not_logged is not None:
                self._log.info("bad_batch_repaired", seq=seq, not_logged=not_logged)
        # replayed history would count its own age, not the relay's lag: live messages only
        c.observe_applied(res.ts, live=not self._in_replay)

    def _rejected(self, exc: FrameError) -> None:
        """Count a rejected message; the first topic mismatch of a source is logged with the
        topic it carried (a misconfigured topic otherwise looks like a silent engine)."""
        self.counters.reject(exc.kind)
        if isinstance(exc, TopicMismatchError) and not self._topic_warned:
            self._topic_warned = True
            self._log.warning(
                "topic_mismatch",
                topic=self.spec.topic.decode(errors="replace"),
                seen=exc.seen[:128].decode(errors="replace"),
                hint="the configured topic must be a prefix of the engine's (\"\" = any)",
            )

    def _bad_batch(self, seq: int, payload: bytes, why: str) -> None:
        """``seq`` could not be applied: re-fetch it once from the replay, else reset."""
        c = self.counters
        c.bad_batches += 1
        retry = (
            self.spec.replay_endpoint
            and not self._in_replay
            and self._bad_seq != seq
            and self._last is not None
            and self._last[0] == seq - 1
        )
        if retry:
            self._bad_seq = seq
            self._next = seq
            self._buf.clear()
            self._replay_from = seq  # verified against the batch before it, then re-fetched
            self._log_bad_batch(seq, why, "replay")
            return
        self._log_bad_batch(seq, why, "reset")
        self._bad_seq = None
        self._reset(ResetReason.BAD_BATCH)
        self._last = (seq, _digest(payload))

    def _log_bad_batch(self, seq: int, why: str, action: str) -> None:
        not_logged = self._input_log.due("bad_batch")
        if not_logged is not None:
            self._log.warning("bad_batch", seq=seq, why=why, action=action, not_logged=not_logged)

    def _begin_rebuild(self) -> None:
        """The member is about to be reset and rebuilt from the replay: one transaction."""
        if not self._rebuilding:
            self._rebuilding = True
            self._sink.on_rebuild(self.key, True)

    def _end_rebuild(self) -> None:
        if self._rebuilding:
            self._rebuilding = False
            self._sink.on_rebuild(self.key, False)

    def _reset(self, reason: ResetReason) -> None:
        self._decoder.reset()
        self._resume_pending = False  # the restored state is gone with the rest
        if not self._dirty:
            return
        self._dirty = False
        if self.state == "replaying":  # reset inside a replay: what follows rebuilds it
            self._begin_rebuild()
        self.counters.count_reset(reason.value)
        self._sink.on_reset(self.key, reason)  # the pool logs member_reset

    def _below_replay(self, seq: int) -> bool:
        """``seq`` is below where the replay's batches begin (its history was gone, or the
        reply skipped ahead and the member was reset there): a batch the member never had,
        not one of the replay's duplicates."""
        return self._dup_lo <= self._dup_hi and seq < self._dup_lo

    def _restart_at(self, seq: int, payload: bytes, *, epoch: bool) -> None:
        """A live batch, read while a replay runs or buffered during it, tells another
        incarnation: logged, the member rebuilt from 0, the batch kept for after the rebuild."""
        self._log_restart(seq, epoch=epoch, during="replay")
        self._restart_from_zero(ResetReason.INCARNATION, live_seq=seq)
        self._buf.put(seq, payload)

    def _drain_buffer(self) -> bool:
        """Applies buffered messages that are now in order; True if a hole remains before them."""
        buf = self._buf
        while len(buf):
            s = buf.min_seq()
            assert s is not None and self._next is not None
            if self._replay_from is not None:
                return True  # a bad batch asked for a re-fetch: the rest waits for it
            if s < self._next:
                seq, payload = buf.pop()
                if self._below_replay(seq):  # (a reply that skipped ahead past it)
                    self._restart_at(seq, payload, epoch=False)
                    return True
                self.counters.duplicates += 1
            elif s == self._next:
                seq, payload = buf.pop()
                self._apply(seq, payload)
            else:
                return True
        return False

    def _jump_hole(self, reason: ResetReason) -> None:
        """Give up on the hole: reset and continue from the first buffered seq."""
        self._reset(reason)
        s = self._buf.min_seq()
        if s is not None:
            self._next = s
            self._drain_buffer()

    # ---- replay ---------------------------------------------------------------------------
    async def _sync(self, start: int, *, bootstrap: bool) -> None:
        """Replay from ``start`` until contiguous with the buffered live stream (≤ 2 requests:
        the second one covers a slow-joining SUB that missed batches after the first replay).

        Outside the bootstrap, the replay first re-reads the last applied batch: if it is not
        there with the same bytes, the engine is another incarnation and the member is rebuilt
        from 0."""
        self._set_state("replaying")
        # subscribed before the replay answers: a batch published meanwhile is then in the
        # replay or on the live stream (after a connect or reconnect; at once otherwise)
        if self._src is not None:
            await self._src.wait_ready(self._replay_timeout_ms / 1000)
        attempt = 0
        restarted = False
        while attempt < 2:
            verify = None if bootstrap else self._last
            if verify is not None and verify[0] != start - 1:
                verify = None  # the last handled batch is not the one before the hole
            outcome = await self._replay_once(
                start, bootstrap=bootstrap and attempt == 0, verify=verify,
                retry_gap=attempt == 0,
            )  # fmt: skip
            if outcome == _ABORTED:
                return
            refused = outcome == _REFUSED  # asked again even where nothing of it applied
            if refused:
                outcome = _FAILED
            if outcome == _GAPPED:
                # a reply with a hole after its first batch: the history is there (it came
                # first), the reply lost some of it (a ROUTER past its send high-water mark
                # drops what it cannot queue); what was applied stays, the rest is asked again
                assert self._next is not None
                start, bootstrap, attempt = self._next, False, attempt + 1
                continue
            if outcome == _UNVOUCHED and len(self._buf):
                # the live stream went on meanwhile: no rebuild from 0 (the replay does not
                # answer); the member goes on from the live stream. Its state is not vouched
                # for: a hole before the buffered batches resets it (below); with none, it is
                # reset here, before they apply (they may be another incarnation's)
                first_buffered = self._buf.min_seq()
                if first_buffered is not None and self._next is not None and (
                    first_buffered <= self._next
                ):
                    self._log_vouch_unanswered(start - 1)
                    self._reset(ResetReason.VOUCH_TIMEOUT)
                outcome = _FAILED
            if outcome == _UNVOUCHED or (outcome == _RESTARTED and not restarted):
                restarted = True  # rebuild once from 0; a second mismatch is a plain hole
                if outcome == _RESTARTED:
                    self.counters.incarnations_detected += 1
                    not_logged = self._input_log.due("incarnation_unverified")
                    if not_logged is not None:
                        self._log.warning("incarnation_unverified", asked=start,
                                          not_logged=not_logged)  # fmt: skip
                    self._restart_from_zero(ResetReason.INCARNATION)
                else:  # a replay that does not answer is not a vouch
                    self._log_vouch_unanswered(start - 1)
                    self._restart_from_zero(ResetReason.VOUCH_TIMEOUT)
                self._replay_from = None
                start, bootstrap, attempt = 0, True, 0
                continue
            first_try = attempt == 0
            attempt += 1
            replayed_to = self._next
            hole = self._drain_buffer()
            if self._replay_from is not None:  # a buffered batch was bad: re-fetch it
                start, self._replay_from = self._replay_from, None
                continue
            if refused and first_try:
                # a batch of the reply was refused: asked once more from where it stopped,
                # vouching for its last batch (a hole after it or not)
                assert self._next is not None
                start, bootstrap = self._next, False
                continue
            if not hole:
                if outcome == _FAILED and self._next == replayed_to:
                    if first_try and self._next != start:
                        # it went silent part way (a slow engine, a reply cut short): asked
                        # once more from where it stopped, vouching for its last batch
                        assert self._next is not None
                        start, bootstrap = self._next, False
                        continue
                    self._replay_unfinished(start, ask_again=bootstrap and first_try)
                return
            if outcome == _FAILED:
                self._jump_hole(ResetReason.REPLAY_FAILED)
                return
            assert self._next is not None
            start = self._next
        self._jump_hole(ResetReason.GAP_UNRECOVERABLE)

    def _replay_unfinished(self, start: int, *, ask_again: bool) -> None:
        """The replay stopped without its end marker (it went silent: a hung engine, a reply
        cut short, a batch too large for the reader), also when asked again from where it
        stopped, and no live batch continued what it gave: whether the engine published more
        before the live stream's subscription, nothing tells, and a removal among those would
        leave blocks the engine no longer holds. What it applied is not vouched for: the member
        is reset, and the next live batch is its baseline (a bootstrap's replay that gave
        nothing is asked once more at that batch)."""
        self._reset(ResetReason.REPLAY_FAILED)
        self._next = self._last = None
        if ask_again:
            self._unanswered_from = start

    def _log_vouch_unanswered(self, asked: int) -> None:
        not_logged = self._input_log.due("vouch_unanswered")
        if not_logged is not None:
            self._log.warning("vouch_unanswered", asked=asked, not_logged=not_logged)

    def _log_replay_timeout(self, start: int) -> None:
        not_logged = self._input_log.due("replay_timeout")
        if not_logged is not None:
            self._log.warning("replay_timeout", start=start, not_logged=not_logged)

    async def _replay_once(
        self, start: int, *, bootstrap: bool, verify: tuple[int, int] | None = None,
        retry_gap: bool = False,
    ) -> int:  # fmt: skip
        """One replay request and its reply. ``retry_gap``: a reply that skips a batch after
        its first one ends there (``_GAPPED``, nothing reset) instead of resetting the member
        and going on from the batch after the hole."""
        c = self.counters
        c.replays += 1
        src = self._src
        assert self.spec.replay_endpoint and src is not None
        dealer: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # as the live readers
        ask = start if verify is None else verify[0]
        self._in_replay = True
        loop = asyncio.get_running_loop()
        dfd = int(dealer.getsockopt(zmq.FD))
        loop.add_reader(dfd, self._poke)
        try:
            dealer.connect(self.spec.replay_endpoint)
            timeout = self._replay_timeout_ms / 1000
            deadline = loop.time() + timeout  # replay inactivity; live traffic does not extend it
            request = [b"", ask.to_bytes(8, "big")]
            while True:  # a fresh DEALER queues at once; a full pipe waits (within the timeout)
                try:
                    dealer.send_multipart(request, _NOBLOCK)
                    break
                except zmq.Again:
                    if loop.time() >= deadline:
                        c.replay_failures += 1
                        self._log_replay_timeout(ask)
                        return _FAILED if verify is None else _UNVOUCHED
                    await asyncio.sleep(0.001)
            self._dup_lo, self._dup_hi = ask, ask - 1
            self._dup_first = None
            self._dup_digests.clear()
            self._next = start if self._next is None else self._next
            first = True
            replayed = False
            rejected = False  # a frame of this reply was refused: its end vouches for nothing
            topic = self.spec.topic
            while True:
                remaining = deadline - loop.time()
                if remaining > 0:
                    await self._wait_input(dealer, remaining)
                if src.has_events():
                    self._watch_connection(replaying=True)
                sub_ready = not self._held_live and src.readable()
                dealer_ready = readable(dealer)
                if not (sub_ready or dealer_ready) and loop.time() >= deadline:
                    c.replay_failures += 1
                    self._log_replay_timeout(ask)
                    return _UNVOUCHED if first and verify is not None else _FAILED
                if sub_ready and not self._buffer_live():
                    return _ABORTED
                if not dealer_ready:
                    continue
                deadline = loop.time() + timeout
                for _ in range(self._drain):
                    try:
                        frames = dealer.recv_multipart(_NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        item = check_replay(frames, topic)
                    except FrameError as exc:
                        self._rejected(exc)
                        rejected = True
                        continue
                    if item is None:
                        if rejected:
                            # a batch of the reply was refused: if it was the last one, nothing
                            # after it shows the hole, and a removal in it would be missed.
                            # As a reply that went silent there: asked again, else reset
                            return _UNVOUCHED if first and verify is not None else _REFUSED
                        return _RESTARTED if first and verify is not None else _DONE
                    seq, payload = item
                    c.messages += 1
                    c.replayed_messages += 1
                    digest = _digest(payload)
                    if len(self._dup_digests) < REPLAY_DIGESTS:
                        self._dup_digests[seq] = digest  # (its bytes tell a repeat: _replaced)
                    if not replayed:
                        # the duplicate window starts at the first batch the replay gave: when
                        # history was gone, a live batch numbered below it duplicates nothing
                        # (it is another incarnation's), and the first one's bytes tell a
                        # restart behind a proxy from a repeat whatever its number
                        replayed = True
                        self._dup_first = (seq, digest)
                        self._dup_lo = max(ask, seq)
                    if first and verify is not None and seq == verify[0]:
                        first = False
                        if digest != verify[1]:  # (the reply may start before it)
                            return _RESTARTED  # same number, other bytes: another incarnation
                        self._dup_hi = seq
                        c.duplicates += 1
                        if self._resume_pending:
                            self._vouch_seen = True  # told once the rest is applied (``_run``)
                        continue
                    # (a first batch later than the one asked for: history is gone, handled
                    # below like any missing history — reset, then go on from here; so is a
                    # vouch whose batch is gone, even when the reply starts right after it)
                    if seq > self._dup_hi:
                        self._dup_hi = seq
                    nxt = self._next
                    assert nxt is not None
                    if seq < nxt:
                        c.duplicates += 1
                        continue
                    if seq > nxt and not first and retry_gap:
                        c.replay_gaps += 1
                        not_logged = self._input_log.due("replay_gap")
                        if not_logged is not None:
                            self._log.warning("replay_gap", asked=nxt, next=seq,
                                              not_logged=not_logged)  # fmt: skip
                        return _GAPPED
                    if seq > nxt or (first and (seq > start or verify is not None)):
                        c.missing_history += 1
                        not_logged = self._input_log.due("replay_history_missing")
                        if not_logged is not None:
                            self._log.warning("replay_history_missing", asked=nxt, first=seq,
                                              not_logged=not_logged)  # fmt: skip
                        self._reset(
                            ResetReason.MISSING_HISTORY
                            if bootstrap
                            else ResetReason.GAP_UNRECOVERABLE
                        )
                        # the state starts here: a live batch numbered below duplicates
                        # nothing held (one the reply skipped, or a number it made up)
                        self._dup_lo = seq
                    first = False
                    self._apply(seq, payload)
                await asyncio.sleep(0)
        finally:
            self._in_replay = False
            loop.remove_reader(dfd)
            dealer.close(linger=0)

    def _buffer_live(self) -> bool:
        """Moves ready live messages into the reorder buffer; False on overflow (reset done)."""
        assert self._src is not None
        c = self.counters
        for _ in range(self._drain):
            frames = self._src.next_message()
            if frames is None:
                break
            c.messages += 1
            self.last_message_at = time.monotonic()
            try:
                seq, payload, new_epoch = self._check(frames)
            except FrameError as exc:
                self._rejected(exc)
                continue
            repeated = self._repeats_live(seq)
            # a restart while replaying (a new epoch, the live stream going back, or the first
            # replayed number with other bytes behind a proxy): start over from the new
            # incarnation's 0
            if new_epoch or (repeated and self._next is not None and seq < self._next) or (
                self._replaced(seq, payload)
            ):
                self._restart_at(seq, payload, epoch=new_epoch)
                return False
            if self._next is not None and seq < self._next:
                if self._below_replay(seq):  # (from an engine that restarted behind a proxy)
                    self._restart_at(seq, payload, epoch=False)
                    return False
                c.duplicates += 1
                continue
            if not self._buf.put(seq, payload):
                self._overflow()
                return False
        return True
