"""One asyncio subscriber per (engine, dp_rank): SUB live stream + DEALER replay, in seq order.

Algorithm (``docs/contract.md`` §16, kvrelay's decisions in §16.5):

* SUB connects first, then (if a replay endpoint exists) a DEALER asks for ``[b"", seq_be8]``
  from 0 (or ``start_seq``). Live messages arriving meanwhile wait in a bounded ``ReorderBuffer``;
  replayed and live batches are applied in sequence order, duplicates dropped.
* The first replayed seq later than asked = missing history: the member is reset and rebuilt from
  what is available.
* At runtime a gap triggers one replay; a hole that is still open afterwards resets the member and
  continues from the first available seq. Without a replay endpoint a gap resets at once.
* A live seq lower than expected (outside the window the last replay covered) is a new engine
  incarnation: reset, then replay from 0 if possible.
* Reorder-buffer overflow (bound in messages and bytes) = unrecoverable gap: reset, drop the
  buffer, restart from the next live message.
* Replay inactivity timeout = replay failure (counted); same hole handling.

Receive loop: await one message, drain up to ``drain`` more with NOBLOCK on a sync shadow socket,
then yield. Only state changes are logged; per-message outcomes are counters.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from kvrelay._aio import cancel_and_wait
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.decoder import Decoder
from kvrelay.ingest.errors import DecodeError, FrameError, TopicMismatchError
from kvrelay.ingest.frames import check_live, check_replay
from kvrelay.ingest.reorder import ReorderBuffer
from kvrelay.ingest.sink import BatchSink, ResetReason, SourceSpec
from kvrelay.logging import get_logger

_LOGGER = "kvrelay.ingest"

_ABORTED = 2  # replay outcome: reorder overflow, buffer dropped
_DONE = 1
_FAILED = 0


class Subscriber:
    """Lifecycle: ``await start()`` … ``await stop()``. Counters in ``.counters``."""

    def __init__(
        self,
        spec: SourceSpec,
        sink: BatchSink,
        *,
        context: zmq.asyncio.Context | None = None,
        start_seq: int = 0,
        drain: int = 256,
        rcvhwm: int = 100_000,
        reorder_max_messages: int = 10_000,
        reorder_max_bytes: int = 64 << 20,
        replay_timeout: float = 2.0,
    ) -> None:
        self.spec = spec
        self.key = spec.key
        self.counters = SubscriberCounters()
        self.state = "new"
        self._sink = sink
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._drain = drain
        self._rcvhwm = rcvhwm
        self._replay_timeout_ms = max(1, int(replay_timeout * 1000))
        self._buf = ReorderBuffer(reorder_max_messages, reorder_max_bytes)
        self._decoder = Decoder(
            kv_block_size=spec.kv_block_size,
            dp_rank=spec.dp_rank,
            hash_format=spec.hash_format,
            options=spec.options,
        )
        self._start_seq = start_seq
        self._next: int | None = None
        self._dup_lo, self._dup_hi = 0, -1
        self._replay_from: int | None = None
        self._dirty = start_seq > 0
        self._sub: zmq.asyncio.Socket | None = None
        self._sub_sync: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._sink_errors = 0
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

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # topic prefix checked in frames.py: mismatches counted
        sub.connect(self.spec.endpoint)
        self._sub = sub
        self._sub_sync = zmq.Socket.shadow(sub.underlying)
        self._task = asyncio.create_task(self._run(), name=f"kvrelay-sub-{self.key}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
            self._sub_sync = None
        self.state = "stopped"

    # ---- main loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._sub is not None and self._sub_sync is not None
        sub, shadow = self._sub, self._sub_sync
        try:
            if self.spec.replay_endpoint:
                self._next = self._start_seq
                await self._sync(self._start_seq, bootstrap=True)
            elif self._start_seq > 0:
                self._next = self._start_seq
            self._set_state("live")
            drain = self._drain
            while True:
                frames = await sub.recv_multipart(copy=True)
                self._on_live(frames)
                for _ in range(drain):
                    if self._replay_from is not None:
                        break
                    try:
                        frames = shadow.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_live(frames)
                if self._replay_from is not None:
                    start, self._replay_from = self._replay_from, None
                    await self._sync(start, bootstrap=False)
                    self._set_state("live")
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("subscriber_crashed")
            self.state = "failed"
            raise

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._log.info("subscriber_state", state=state, next_seq=self._next)

    # ---- live path ------------------------------------------------------------------------
    def _on_live(self, frames: list[bytes]) -> None:
        c = self.counters
        c.messages += 1
        try:
            seq, payload = check_live(frames, self.spec.topic)
        except FrameError as exc:
            self._rejected(exc)
            return
        nxt = self._next
        if nxt is None:
            self._apply(seq, payload)
            return
        if seq == nxt:
            if seq > self._dup_hi:
                self._dup_lo, self._dup_hi = 0, -1
            self._apply(seq, payload)
            if len(self._buf):
                self._drain_buffer()
            return
        if seq < nxt:
            if self._dup_lo <= seq <= self._dup_hi:
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

    def _incarnation(self, seq: int, payload: bytes) -> None:
        self._log.warning("sequence_backwards", seq=seq, expected=self._next)
        self._reset(ResetReason.INCARNATION)
        self._buf.clear()
        self._replay_from = None
        self._dup_lo, self._dup_hi = 0, -1
        if seq == 0 or not self.spec.replay_endpoint:
            self._apply(seq, payload)
            return
        self._next = 0
        self._buf.put(seq, payload)
        self._replay_from = 0

    def _overflow(self) -> None:
        c = self.counters
        c.reorder_overflows += 1
        self._log.warning("reorder_overflow", messages=len(self._buf), bytes=self._buf.nbytes)
        self._reset(ResetReason.REORDER_OVERFLOW)
        self._buf.clear()
        self._replay_from = None
        self._next = None
        self._dup_lo, self._dup_hi = 0, -1

    def _apply(self, seq: int, payload: bytes) -> None:
        c = self.counters
        self._next = seq + 1
        try:
            res = self._decoder.decode(payload)
        except DecodeError as exc:
            c.reject(exc.kind)
            return
        c.add_stats(res.stats)
        batch = res.batch
        c.batches += 1
        c.events += batch.n_events
        c.blocks += batch.n_blocks
        self._dirty = True
        try:
            self._sink.on_batch(self.key, seq, batch)
        except Exception:
            self._sink_errors += 1
            c.reject("sink_error")
            if self._sink_errors == 1:
                self._log.exception("sink_failed", on="batch", seq=seq)
        # replayed history would count its own age, not the relay's lag: live messages only
        c.observe_applied(res.ts, live=self.state == "live")

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

    def _reset(self, reason: ResetReason) -> None:
        self._decoder.reset()
        if not self._dirty:
            return
        self._dirty = False
        c = self.counters
        c.resets += 1
        c.resets_by_reason[reason.value] = c.resets_by_reason.get(reason.value, 0) + 1
        try:
            self._sink.on_reset(self.key, reason)  # the pool logs member_reset
        except Exception:
            c.reject("sink_error")
            self._log.exception("sink_failed", on="reset")

    def _drain_buffer(self) -> bool:
        """Applies buffered messages that are now in order; True if a hole remains before them."""
        buf = self._buf
        while len(buf):
            s = buf.min_seq()
            assert s is not None and self._next is not None
            if s < self._next:
                buf.pop()
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
        the second one covers a slow-joining SUB that missed batches after the first replay)."""
        self._set_state("replaying")
        for attempt in range(2):
            outcome = await self._replay_once(start, bootstrap=bootstrap and attempt == 0)
            if outcome == _ABORTED:
                return
            hole = self._drain_buffer()
            if not hole:
                if outcome == _FAILED and bootstrap and attempt == 0 and self._next == start:
                    self._next = None  # nothing known: take the first live message as baseline
                return
            if outcome == _FAILED:
                self._jump_hole(ResetReason.REPLAY_FAILED)
                return
            assert self._next is not None
            start = self._next
        self._jump_hole(ResetReason.GAP_UNRECOVERABLE)

    async def _replay_once(self, start: int, *, bootstrap: bool) -> int:
        c = self.counters
        c.replays += 1
        assert self.spec.replay_endpoint and self._sub is not None and self._sub_sync is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        try:
            dealer.connect(self.spec.replay_endpoint)
            dsync: zmq.Socket[Any] = zmq.Socket.shadow(dealer.underlying)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            self._dup_lo, self._dup_hi = start, start - 1
            self._next = start if self._next is None else self._next
            poller = zmq.asyncio.Poller()
            poller.register(dealer, zmq.POLLIN)
            poller.register(self._sub, zmq.POLLIN)
            first = True
            topic = self.spec.topic
            loop = asyncio.get_running_loop()
            timeout = self._replay_timeout_ms / 1000
            deadline = loop.time() + timeout  # replay inactivity; live traffic does not extend it
            while True:
                remaining = deadline - loop.time()
                ready = (
                    dict(await poller.poll(max(1, int(remaining * 1000)))) if remaining > 0 else {}
                )
                if not ready and loop.time() >= deadline:
                    c.replay_failures += 1
                    self._log.warning("replay_timeout", start=start)
                    return _FAILED
                if self._sub in ready and not self._buffer_live():
                    return _ABORTED
                if dealer not in ready:
                    continue
                deadline = loop.time() + timeout
                for _ in range(self._drain):
                    try:
                        frames = dsync.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        item = check_replay(frames, topic)
                    except FrameError as exc:
                        self._rejected(exc)
                        continue
                    if item is None:
                        return _DONE
                    seq, payload = item
                    c.messages += 1
                    c.replayed_messages += 1
                    if seq > self._dup_hi:
                        self._dup_hi = seq
                    nxt = self._next
                    assert nxt is not None
                    if seq < nxt:
                        c.duplicates += 1
                        continue
                    if seq > nxt or (first and seq > start):
                        c.missing_history += 1
                        self._log.warning("replay_history_missing", asked=nxt, first=seq)
                        self._reset(
                            ResetReason.MISSING_HISTORY
                            if bootstrap
                            else ResetReason.GAP_UNRECOVERABLE
                        )
                    first = False
                    self._apply(seq, payload)
                await asyncio.sleep(0)
        finally:
            dealer.close(linger=0)

    def _buffer_live(self) -> bool:
        """Moves ready live messages into the reorder buffer; False on overflow (reset done)."""
        assert self._sub_sync is not None
        c = self.counters
        for _ in range(self._drain):
            try:
                frames = self._sub_sync.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            c.messages += 1
            try:
                seq, payload = check_live(frames, self.spec.topic)
            except FrameError as exc:
                self._rejected(exc)
                continue
            if self._next is not None and seq < self._next:
                c.duplicates += 1
                continue
            if not self._buf.put(seq, payload):
                self._overflow()
                return False
        return True
