"""Per-generation publication hub: mirror, sequence, encode-once fan-out, bounded queues.

One hub per producer generation holds a mirror of the lane at sequence S. ``publish`` encodes each
delta (CBI1 + FilterUpdate) once and appends the same ``bytes`` object to every subscriber's
bounded queue; a full queue drops only that subscriber (SUBSCRIBER_LAGGED). New subscribers get
snapshot chunks of the mirror at the current sequence, then the shared deltas (§4.3, §8.5).

Bounds: a snapshot cut copies the mirror only after taking a slot of the relay-wide encode gate
(``publication_encoding_concurrency``), so concurrent cuts cost at most that many lane copies;
joiners at one sequence share one cut. A subscriber leaves the per-pool count the moment it
fails or ends, not when its stream handler gets around to closing.

Joining under load: deltas published while a subscriber receives its snapshot wait in its queue
and count against its bound (§4.6). The hub tracks the *joiners* (admitted, not caught up yet)
and tells the producer how far apart to cut publications meanwhile (``publication_hold``, from
what each joiner still has to read and its free queue slots); it calls ``on_hold_released`` when
the last one caught up, so what was held back goes out at once.

Snapshots on one connection go out one stream after another (``service/h2/bulk.py``). A joiner
whose cut is ready but whose turn on its connection has not come (``turn``) holds nothing back:
its clocks have not started (the progress timer runs from its turn, and it is no joiner for
``publication_hold``), and deltas published meanwhile are not queued for it; they make its cut
stale, and at its turn a stale cut is replaced by one at the current sequence, before its first
byte. A stream that fails or is ended while it waits (a drain, a preemption, a fence) stops
waiting at once and gives up its turn unsent: its status does not wait for the streams before it.

A stream that ends while its client is not reading (a drain, a fence, a lag) and whose send in
flight has written nothing of its message yet gives that send up: its status goes out at once
(HEADERS need no flow-control window). One in the middle of a message keeps the end pending: the
send completes when the client reads again, then the stream ends with the status (the frames
already sent come first; trailers after part of a message would read as its rest). A client that
does not read for ``stalled_stream_reset_s`` after that gets its stream reset, so no HTTP/2
stream is left open for ever.

A mirror (``kvrelay.mirror``) feeds a hub with frames another relay already encoded:
``publish_encoded`` applies the images and fans the received bytes out unchanged, ``cut`` seeds
the snapshot at the starting sequence with the received chunk payloads, and ``vouch`` withholds
heartbeats while the mirror cannot vouch that its upstream is alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import ModuleType

import numpy as np
import numpy.typing as npt

from kvrelay._aio import GiveUpUnwritten
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import QUEUE_FRAME_OVERHEAD, RelayLimits
from kvrelay.publication import cbi1
from kvrelay.publication.splice import (
    KIND_DELTA,
    KIND_SNAPSHOT_CHUNK,
    FilterUpdateEncoder,
    now_us,
)

#: Lanes at or below this many buckets are encoded inline (cheaper than a thread hop).
INLINE_SNAPSHOT_BUCKETS = 1 << 16
#: Yield to the event loop after this many frames sent back to back.
YIELD_EVERY = 8

#: Downstream relays whose spacing requests a hub remembers at once (the rest are refused).
MAX_HOLD_REQUESTERS = 320  # every fan-out worker of the largest `workers` (256), and 64 mirrors

#: At most this many queued delta frames / bytes go out in one coalesced write.
BATCH_FRAMES = 16
BATCH_BYTES = 512 * 1024

Send = Callable[[bytes], Awaitable[None]]
SendBatch = Callable[[list[bytes]], Awaitable[None]]
SendParts = Callable[[Sequence[bytes]], Awaitable[None]]
#: Writes one frame at once if the transport takes it without waiting (True), else does nothing.
SendNow = Callable[[bytes], bool]
#: Returns once this stream's turn to write a snapshot chunk on its connection has come.
Turn = Callable[[], Awaitable[None]]
Reset = Callable[[], None]
#: The DATA bytes the stream has written so far: tells a send that has written nothing of its
#: message yet from one that is in the middle of it.
Written = Callable[[], int]


class PublicationInvariantError(Exception):
    """The producer broke a hub invariant (gap, bad bucket, retired hub): fence the generation."""


_delta_body: ModuleType | None = None


def _kernels() -> ModuleType:
    """``delta_body``, imported by the first hub that encodes a delta itself: a mirror's hubs
    (every fan-out worker's) only forward frames another relay encoded, and load no numba."""
    global _delta_body
    if _delta_body is None:
        from kvrelay.publication import delta_body

        _delta_body = delta_body
    return _delta_body


def _scatter(
    mirror: npt.NDArray[np.uint64], b: npt.NDArray[np.uint32], w: npt.NDArray[np.uint64]
) -> None:
    """``mirror[b] = w``: with ``delta_body.scatter`` once a hub of this process loaded it and
    the arrays are its types (a relay's own publications), else with numpy (a mirror's hubs)."""
    kernels = _delta_body
    if kernels is not None:
        try:
            if kernels.scatter(mirror, b, w) == kernels.OK:
                return
        except TypeError:  # not the kernel's array types
            pass
    mirror[b] = w


def _checked(
    buckets: npt.ArrayLike, words: npt.ArrayLike, bucket_count: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64]]:
    """One publication's arrays as (uint32 buckets, uint64 words), every hub invariant checked
    once: 1-D, equal lengths, integers, buckets in range and unique. These checks are all that
    ``cbi1.encode_delta_validated`` relies on. One sort gives both the maximum and duplicates
    (the pool hands over uint32 buckets, which cannot be negative)."""
    b = np.asarray(buckets)
    w = np.asarray(words)
    if b.ndim != 1 or b.shape != w.shape:
        raise PublicationInvariantError("buckets and words must be 1-D of equal length")
    n = b.size
    if n:
        if b.dtype.kind not in "iu" or w.dtype.kind not in "iu":
            raise PublicationInvariantError("buckets/words must be integer arrays")
        if b.dtype.kind == "i" and int(b.min()) < 0:
            raise PublicationInvariantError("bucket index out of range")
        if n == 1:
            if int(b[0]) >= bucket_count:
                raise PublicationInvariantError("bucket index out of range")
        else:
            srt = np.sort(b)
            if int(srt[-1]) >= bucket_count:
                raise PublicationInvariantError("bucket index out of range")
            if bool((srt[1:] == srt[:-1]).any()):
                raise PublicationInvariantError("bucket repeated within one delta")
    return b.astype(np.uint32, copy=False), w.astype(np.uint64, copy=False)


class PublicationHub:
    """Mirror + fan-out for one producer generation. Single event loop; not thread-safe."""

    def __init__(
        self,
        encoder: FilterUpdateEncoder,
        *,
        seed: int,
        bucket_count: int,
        dc_id: int,
        table: npt.NDArray[np.uint64],
        sequence: int,
        limits: RelayLimits | None = None,
        encode_gate: asyncio.Semaphore | None = None,
        cut: list[bytes] | None = None,
        vouch: Callable[[], bool] | None = None,
        late_cut: bool = False,
    ) -> None:
        """``cut``: CBI1 chunk payloads of ``table`` at ``sequence``, already encoded (shared by
        the first joiners instead of a new encode). ``vouch``: called before each heartbeat; a
        heartbeat claims the stream is current, so it is withheld while this returns False.
        ``late_cut``: a joiner's deltas are not queued while its snapshot is being built either
        (a mirror: its upstream's spacing, asked for when the joiner came, is not in effect yet);
        a cut that went stale meanwhile is taken again when its stream begins to send."""
        if table.shape != (bucket_count,):
            raise ValueError(f"table shape {table.shape} != ({bucket_count},)")
        self.encoder = encoder
        #: the encoder's fields 1–3 as an array, for ``delta_body.delta_message``
        self._prefix = np.frombuffer(encoder.prefix, dtype=np.uint8)
        self.seed = seed
        self.bucket_count = bucket_count
        self.dc_id = dc_id
        self.limits = limits or RelayLimits()
        self._mirror: npt.NDArray[np.uint64] = np.array(table, dtype=np.uint64, copy=True)
        self._sequence = sequence
        self._gate = encode_gate or asyncio.Semaphore(self.limits.publication_encoding_concurrency)
        self._subs: set[Subscription] = set()
        self._active = 0  # admitted, not yet ended (counts against max_subscribers_per_pool)
        self._snapshot: tuple[int, asyncio.Future[list[bytes]]] | None = None
        self._joining: set[Subscription] = set()  # admitted, not caught up yet (see joiners)
        #: Called (synchronously) when the last joiner caught up or ended: the producer may
        #: publish what it held back at once (see ``publication_hold``).
        self.on_hold_released: Callable[[], None] | None = None
        if cut is not None:
            done: asyncio.Future[list[bytes]] = asyncio.get_running_loop().create_future()
            done.set_result(list(cut))
            self._snapshot = (sequence, done)
        self.vouch = vouch
        self.late_cut = late_cut
        self._retired = False
        self.idle_since: float | None = time.monotonic()  # None while someone subscribes
        self.resets = 0
        self.lagged = 0
        self.direct_frames = 0  # deltas written by the publisher itself (see Subscription._offer)
        self.snapshots_served = 0  # subscribers given a snapshot
        self.snapshots_built = 0  # snapshot encodes (shared by joiners at one sequence)
        self.recuts = 0  # cuts replaced at a stream's turn (deltas came while it waited)
        self._holds: dict[str, tuple[float, float]] = {}  # requester → (seconds, until)
        self.holds_requested = 0  # spacing requests of downstream relays (request_hold)

    # --- state ---
    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def subscriber_count(self) -> int:
        """Subscriptions that still count against the per-pool limit."""
        return self._active

    def mirror_copy(self) -> npt.NDArray[np.uint64]:
        return self._mirror.copy()

    @property
    def joiners(self) -> int:
        """Subscribers admitted that have not caught up yet: their snapshot is still being sent,
        or the deltas queued meanwhile are (their queue has not been empty since they joined)."""
        return len(self._joining)

    def publication_hold(self) -> float:
        """Seconds the producer should leave between publications now (0.0: no reason to wait).

        Deltas published while a subscriber receives its snapshot wait in its queue (§4.6), so
        each one takes one of its ``publication_queue_capacity`` slots however small it is, and
        after the snapshot it must drain them while new ones keep coming. While any subscriber
        has not caught up (``joiners``), publications are spaced so that a reader at
        ``snapshot_reader_bytes_per_second`` gets through: what it still has to read (the rest of
        its snapshot and its queued deltas) at that rate, spread over its free slots but one, for
        the joiner that needs most — within [``publication_delay_s``,
        ``snapshot_publication_delay_s``]. A fast reader shortens its own hold as it goes; the
        other subscribers' deltas are up to that much later; nothing is dropped or merged.
        """
        held = self._requested_hold() if self._holds else 0.0
        if not self._joining:
            return held
        lim = self.limits
        longest = lim.snapshot_publication_delay_s
        need = 0.0  # bytes to read per free slot, for the joiner that needs most
        for sub in self._joining:
            spare = lim.publication_queue_capacity - len(sub._frames) - 1
            if spare <= 0:
                return longest
            need = max(need, (sub._snapshot_left + sub._bytes) / spare)
        spacing = need / lim.snapshot_reader_bytes_per_second
        return max(held, min(longest, max(lim.publication_delay_s, spacing)))

    def request_hold(self, requester: str, seconds: float, ttl_s: float) -> float:
        """A downstream relay that serves this lane to joiners of its own (a mirror: every
        fan-out worker) asks for the spacing its joiners need, since it forwards this hub's
        sequences and cannot space them itself. Honoured like a joiner of this hub: at most
        ``snapshot_publication_delay_s``, for ``ttl_s`` unless renewed; 0 ends the request.
        Returns the spacing granted (RESOURCE_LIMIT past ``MAX_HOLD_REQUESTERS``)."""
        now = time.monotonic()
        self._holds = {k: v for k, v in self._holds.items() if v[1] > now}
        granted = min(max(0.0, seconds), self.limits.snapshot_publication_delay_s)
        self.holds_requested += 1
        if granted <= 0.0:
            ended = self._holds.pop(requester, None) is not None and not self._requested_hold()
            if ended and not self._joining and self.on_hold_released is not None:
                self.on_hold_released()
            return 0.0
        if requester not in self._holds and len(self._holds) >= MAX_HOLD_REQUESTERS:
            raise RelayError.resource_limit(
                f"publication hold requesters limit {MAX_HOLD_REQUESTERS} reached"
            )
        self._holds[requester] = (granted, now + ttl_s)
        return granted

    def _requested_hold(self) -> float:
        now = time.monotonic()
        return max((s for s, until in self._holds.values() if until > now), default=0.0)

    # --- producer side ---
    def publish(self, sequence: int, buckets: npt.ArrayLike, words: npt.ArrayLike) -> None:
        """Apply one batch as delta S→S+1 and fan it out; raises PublicationInvariantError."""
        if self._retired:
            raise PublicationInvariantError("publish on a retired hub")
        if sequence != self._sequence + 1:
            raise PublicationInvariantError(
                f"sequence gap: hub at {self._sequence}, got {sequence}"
            )
        base = self._sequence
        # Encode before touching the mirror: an encoder failure must not half-apply.
        b, w, frame, size = self._checked_frame(buckets, words, base, sequence)
        oversized = b.size > cbi1.MAX_DELTA_IMAGES
        cost = size + QUEUE_FRAME_OVERHEAD if frame else 0
        self._apply_and_offer(sequence, b, w, frame, cost, oversized)

    def _checked_frame(
        self, buckets: npt.ArrayLike, words: npt.ArrayLike, base: int, sequence: int
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64], bytes, int]:
        """The publication's arrays, checked, and, when it is to be sent (there are subscribers
        and it fits one delta), its FilterUpdate message and CBI1 payload size, else ``b""``
        and 0. The pool's own arrays take one kernel call (``delta_body.delta_message``, or
        ``delta_frame`` to check only); anything else takes the numpy path, its twin (the
        hub's checks, ``cbi1.encode_delta_validated`` and the encoder)."""
        wanted = bool(self._subs)
        if isinstance(buckets, np.ndarray) and isinstance(words, np.ndarray):
            kernels = _kernels()
            k = buckets.shape[0] if buckets.ndim == 1 else -1
            send = wanted and 0 <= k <= cbi1.MAX_DELTA_IMAGES
            out = kernels.NO_FRAME
            n = 0
            try:
                if send:
                    prefix = self._prefix
                    out = np.empty(kernels.delta_message_cap(prefix.shape[0], k), dtype=np.uint8)
                    n = kernels.delta_message(
                        buckets, words, self.bucket_count, base, sequence, now_us(), self.seed,
                        self.dc_id, prefix, out,
                    )  # fmt: skip
                    code = kernels.OK if n > 0 else -n
                else:
                    code = kernels.delta_frame(
                        buckets, words, self.bucket_count, base, kernels.NO_FRAME
                    )
            except TypeError:  # not the kernel's array types
                code = -1
            if code == kernels.OK:
                if send:
                    return buckets, words, out[:n].tobytes(), cbi1.delta_frame_len(k)
                return buckets, words, b"", 0
            if code > 0:
                raise PublicationInvariantError(kernels.ERRORS[code])
        b, w = _checked(buckets, words, self.bucket_count)
        if not wanted or b.size > cbi1.MAX_DELTA_IMAGES:
            return b, w, b"", 0
        payload = cbi1.encode_delta_validated(
            b, w, seed=self.seed, bucket_count=self.bucket_count, dc_id=self.dc_id,
            base_epoch=base, epoch=sequence,
        )  # fmt: skip
        return b, w, self.encoder.encode(KIND_DELTA, base, sequence, payload), len(payload)

    def publish_encoded(
        self,
        sequence: int,
        buckets: npt.NDArray[np.uint32],
        words: npt.NDArray[np.uint64],
        frame: bytes,
        payload_len: int,
    ) -> None:
        """Apply delta S→S+1 that another relay encoded and fan ``frame`` out unchanged.

        ``buckets``/``words`` come from ``cbi1.decode`` of the frame's payload, which already
        checked range, uniqueness and the image bound; only the sequence is checked here."""
        if self._retired:
            raise PublicationInvariantError("publish on a retired hub")
        if sequence != self._sequence + 1:
            raise PublicationInvariantError(
                f"sequence gap: hub at {self._sequence}, got {sequence}"
            )
        if buckets.shape != words.shape or buckets.ndim != 1:
            raise PublicationInvariantError("buckets and words must be 1-D of equal length")
        self._apply_and_offer(
            sequence, buckets, words, frame, payload_len + QUEUE_FRAME_OVERHEAD, False
        )

    def _apply_and_offer(
        self,
        sequence: int,
        b: npt.NDArray[np.uint32],
        w: npt.NDArray[np.uint64],
        frame: bytes,
        cost: int,
        oversized: bool,
    ) -> None:
        _scatter(self._mirror, b, w)
        self._sequence = sequence
        self._snapshot = None
        if oversized:
            # Too big for one CBI1 delta: subscribers must re-bootstrap from a fresh snapshot.
            self.resets += 1
            self._fail_all(
                RelayError.publication_unavailable(
                    f"oversized publication ({b.size} images); requires a fresh snapshot"
                )
            )
            return
        for sub in tuple(self._subs):
            sub._offer(frame, cost, sequence)

    def retire(self, error: RelayError | None = None) -> None:
        """End every subscriber (``error``, or clean EOF when None) and refuse new ones."""
        self._retired = True
        self._snapshot = None
        if error is None:
            for sub in tuple(self._subs):
                sub._close_clean()
        else:
            self._fail_all(error)

    def _fail_all(self, error: RelayError) -> None:
        for sub in tuple(self._subs):
            sub._fail(error)

    # --- consumer side ---
    async def subscribe(self, on_release: Callable[[], None] | None = None) -> Subscription:
        """Register a subscriber at the current sequence (its deltas start queueing now).

        ``on_release`` is called once, as soon as the subscription stops counting (it failed,
        ended or was closed). Raises RESOURCE_LIMIT at ``max_subscribers_per_pool`` and
        PUBLICATION_UNAVAILABLE once the hub retired (also while waiting for a snapshot slot).
        """
        if self._retired:
            raise RelayError.publication_unavailable("publication hub retired")
        if self._active >= self.limits.max_subscribers_per_pool:
            raise RelayError.resource_limit(
                f"Relay per-pool subscriber limit {self.limits.max_subscribers_per_pool} reached"
            )
        self._active += 1  # reserved while waiting for a snapshot slot
        self.idle_since = None
        try:
            snapshot = await self._snapshot_at_current_sequence()
        except BaseException:
            self._slot_released()
            raise
        sub = Subscription(self, self._sequence, snapshot, on_release)
        self._subs.add(sub)
        self._joining.add(sub)
        self.snapshots_served += 1
        return sub

    async def _snapshot_at_current_sequence(self) -> asyncio.Future[list[bytes]]:
        """The snapshot cut at the current sequence: shared when one exists, else a new cut taken
        after a slot of the encode gate is held (the copy is what the gate bounds)."""
        cached = self._snapshot
        if cached is not None and cached[0] == self._sequence:
            return cached[1]
        await self._gate.acquire()
        try:
            if self._retired:
                raise RelayError.publication_unavailable("publication hub retired")
            cached = self._snapshot
            if cached is not None and cached[0] == self._sequence:
                self._gate.release()  # another joiner cut this sequence while we waited
                return cached[1]
            seq = self._sequence
            words = self._mirror.copy()  # the cut at ``seq``; the mirror keeps moving
        except BaseException:
            self._gate.release()
            raise
        fut = asyncio.ensure_future(self._build_snapshot(words, seq))
        self._snapshot = (seq, fut)
        return fut

    async def _build_snapshot(self, words: npt.NDArray[np.uint64], seq: int) -> list[bytes]:
        """CBI1 chunk payloads of the cut (frames are stamped when each is sent)."""
        try:
            if self.bucket_count <= INLINE_SNAPSHOT_BUCKETS:
                return self._encode_snapshot(words, seq)
            return await asyncio.to_thread(self._encode_snapshot, words, seq)
        finally:
            self._gate.release()

    def _encode_snapshot(self, words: npt.NDArray[np.uint64], seq: int) -> list[bytes]:
        self.snapshots_built += 1
        return cbi1.encode_snapshot_chunks(
            words, seed=self.seed, bucket_count=self.bucket_count, dc_id=self.dc_id, epoch=seq
        )

    def _detach(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        self._caught_up(sub)

    def _caught_up(self, sub: Subscription) -> None:
        """``sub`` sent its snapshot and emptied its queue, or ended: it holds nothing back."""
        if sub in self._joining:
            self._joining.discard(sub)
            if not self._joining and self.on_hold_released is not None:
                self.on_hold_released()

    def _slot_released(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.idle_since = time.monotonic()


class Subscription:
    """One subscriber's view: snapshot chunks, then its bounded queue of shared delta frames."""

    __slots__ = (
        "_bytes",
        "_counted",
        "_eof",
        "_error",
        "_frames",
        "_hub",
        "_last_sent",
        "_last_seq",
        "_loop",
        "_on_release",
        "_parked",
        "_reset",
        "_send_now",
        "_sends",
        "_snapshot",
        "_snapshot_left",
        "_stale",
        "_task",
        "_waiter",
        "_waiting",
        "_watchdog",
        "reset_for",
        "start_sequence",
    )

    def __init__(
        self,
        hub: PublicationHub,
        sequence: int,
        snapshot: asyncio.Future[list[bytes]],
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._hub = hub
        self.start_sequence = sequence
        self._last_seq = sequence
        self._last_sent = 0.0  # loop time of the last frame written (heartbeat clock)
        self._parked = False  # pump idle: snapshot sent, queue empty, waiting
        self._send_now: SendNow | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot = snapshot
        # snapshot bytes not yet handed to the stream (estimated until the chunks exist)
        self._snapshot_left = 8 * hub.bucket_count + 128 * cbi1.chunk_count_for(hub.bucket_count)
        self._frames: deque[tuple[bytes, int, int]] = deque()
        self._bytes = 0
        self._error: RelayError | None = None
        self._eof = False
        self._counted = True
        self._on_release = on_release
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._reset: Reset | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        #: the error the stream had ended with when it was reset, its status never read
        self.reset_for: RelayError | None = None
        #: the pump's sends, given up by ``_stop`` while they have written nothing
        self._sends = GiveUpUnwritten(None)
        self._waiting = hub.late_cut  # not sending yet: deltas are not queued (see _take_turn)
        self._stale = False  # a delta was published while it waited: its cut is behind

    @property
    def error(self) -> RelayError | None:
        return self._error

    @property
    def ended(self) -> bool:
        """True once the subscription failed or was ended (it no longer counts)."""
        return self._error is not None or self._eof or not self._counted

    # --- called by the hub (synchronous, never blocks) ---
    def _offer(self, frame: bytes, cost: int, seq: int) -> None:
        if self._waiting:
            self._stale = True  # not sent a byte yet: the cut is taken again at its turn
            return
        if self._parked and not self._frames:
            # The pump is idle and nothing is queued before this frame: write it now, in order,
            # without waking the pump (one task switch and one grpclib pass less per frame).
            # Whatever the transport cannot take at once is queued as usual.
            send_now, loop = self._send_now, self._loop
            if send_now is not None and loop is not None and send_now(frame):
                self._last_seq = seq
                self._last_sent = loop.time()
                self._hub.direct_frames += 1
                return
        limits = self._hub.limits
        if (
            len(self._frames) >= limits.publication_queue_capacity
            or self._bytes + cost > limits.publication_queue_bytes
        ):
            self._hub.lagged += 1
            self._fail(
                RelayError.subscriber_lagged(
                    f"subscriber queue full ({len(self._frames)} frames, {self._bytes} bytes)"
                )
            )
            return
        self._frames.append((frame, cost, seq))
        self._bytes += cost
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: RelayError) -> None:
        if self._error is None and not self._eof:
            self._error = error
        self._stop()

    def _close_clean(self) -> None:
        if self._error is None:
            self._eof = True
        self._stop()

    def _stop(self) -> None:
        self._hub._detach(self)
        self._frames.clear()
        self._bytes = 0
        self._release_slot()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        # the send in flight, if it has written nothing of its message: the status needs no
        # flow-control window, the message would (a client that reads nothing would hold the
        # status until the stall reset, or a drain until its grace)
        self._sends.give_up()
        self._arm_watchdog()

    def _release_slot(self) -> None:
        if self._counted:
            self._counted = False
            self._hub._slot_released()
            if self._on_release is not None:
                self._on_release()

    def _arm_watchdog(self) -> None:
        """A pump still blocked in a send once the stream is over (its client is not reading):
        the status waits for the client; after ``stalled_stream_reset_s`` the stream is reset."""
        if self._watchdog is None and self._task is not None and not self._task.done():
            grace = self._hub.limits.stalled_stream_reset_s
            self._watchdog = asyncio.get_running_loop().call_later(grace, self._give_up)

    def _give_up(self) -> None:
        """Reset the stream (RST_STREAM reaches the client even without reading), then stop the
        pump: it will never complete its send."""
        self._watchdog = None
        if self._task is None or self._task.done():
            return
        self.reset_for = self._error
        if self._reset is not None:
            self._reset()
        self._task.cancel()

    def _on_snapshot_timeout(self) -> None:
        limit = self._hub.limits.snapshot_progress_timeout_s
        self._fail(RelayError.snapshot_progress_timeout(f"snapshot frame not drained in {limit} s"))

    def _check(self) -> bool:
        """True if the stream must end now (raises for errors, returns True for clean EOF)."""
        if self._error is not None:
            raise self._error
        return self._eof

    # --- called by the stream handler ---
    async def pump(
        self,
        send: Send,
        send_batch: SendBatch | None = None,
        reset: Reset | None = None,
        send_parts: SendParts | None = None,
        *,
        send_now: SendNow | None = None,
        turn: Turn | None = None,
        written: Written | None = None,
    ) -> None:
        """Send snapshot, deltas and heartbeats until EOF (return) or error (RelayError).

        With ``send_batch``, frames already queued are written together (one HTTP/2 write for
        several gRPC messages): the per-write cost dominates server CPU under fan-out. With
        ``send_parts``, each snapshot chunk goes out as (envelope head, shared payload, tail),
        so the 4 MiB payload is never joined into a per-subscriber copy. ``reset`` aborts the
        transport stream (used only when a client stalls past the grace). With ``send_now``, a
        delta published while this pump is idle is written by the publisher itself when the
        transport can take it at once (see ``_offer``); the pump then only wakes for
        heartbeats, queued frames and the end of the stream. With ``turn``, each snapshot chunk
        waits for the stream's turn on its connection before its progress timer starts (see
        the module docstring: a cut that went stale meanwhile is taken again). With
        ``written``, a send that has written nothing of its message when the stream ends is
        given up, so the status goes out at once (see the module docstring).
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._task = asyncio.current_task()
        self._reset = reset
        self._sends = GiveUpUnwritten(written)
        hub = self._hub
        limits = hub.limits
        encoder = hub.encoder
        payloads = await self._payloads()
        if turn is not None or self._waiting:
            payloads = await self._take_turn(turn, payloads)
        timeout = limits.snapshot_progress_timeout_s
        seq0 = self.start_sequence
        self._snapshot_left = sum(len(p) for p in payloads)
        for i, payload in enumerate(payloads):
            if i and turn is not None:
                await self._turn(turn)  # the progress timer runs from the turn
            if self._check():
                return
            handle = loop.call_later(timeout, self._on_snapshot_timeout)
            try:
                # stamped now: a cut shared by later joiners must not carry its build time
                if send_parts is not None:
                    parts = encoder.encode_parts(KIND_SNAPSHOT_CHUNK, seq0, seq0, payload)
                    sending = send_parts(parts)
                else:
                    sending = send(encoder.encode(KIND_SNAPSHOT_CHUNK, seq0, seq0, payload))
                if not await self._sends.send(sending):
                    self._check()  # it ended: raises its error, or a clean end
                    return
            finally:
                handle.cancel()
            self._snapshot_left -= len(payload)
            await asyncio.sleep(0)  # a fast reader never hogs the loop for a whole large lane
        del payloads
        self._snapshot = None  # type: ignore[assignment]
        heartbeat_s = limits.pool_heartbeat_s
        self._last_sent = loop.time()
        self._send_now = send_now
        frames = self._frames
        n = 0
        while True:
            if self._check():
                return
            if frames:
                if send_batch is not None:
                    batch: list[bytes] = []
                    size = 0
                    while frames and len(batch) < BATCH_FRAMES and size < BATCH_BYTES:
                        frame, cost, seq = frames.popleft()
                        self._bytes -= cost
                        batch.append(frame)
                        size += len(frame)
                    self._last_seq = seq
                    sending = send_batch(batch)
                else:
                    frame, cost, seq = frames.popleft()
                    self._bytes -= cost
                    self._last_seq = seq
                    sending = send(frame)
                if not await self._sends.send(sending):
                    self._check()
                    return
                self._last_sent = loop.time()
                n += 1
                if n >= YIELD_EVERY:
                    n = 0
                    await asyncio.sleep(0)
                continue
            n = 0
            hub._caught_up(self)  # snapshot sent, queue empty: no longer holds publication back
            delay = self._last_sent + heartbeat_s - loop.time()
            if delay > 0:
                waiter = loop.create_future()
                self._waiter = waiter
                timer = loop.call_later(delay, _wake, waiter)
                self._parked = True
                try:
                    await waiter
                finally:
                    self._parked = False
                    timer.cancel()
                    self._waiter = None
                if frames or self._error is not None or self._eof:
                    continue
                if loop.time() < self._last_sent + heartbeat_s:
                    continue  # frames were written meanwhile: the heartbeat is due later
            vouch = hub.vouch
            if vouch is not None and not vouch():
                # cannot claim the stream is current: stay silent, look again within a second
                self._last_sent = loop.time() - heartbeat_s + min(heartbeat_s, 1.0)
                continue
            if not await self._sends.send(send(encoder.heartbeat(self._last_seq))):
                self._check()
                return
            self._last_sent = loop.time()

    async def _payloads(self) -> list[bytes]:
        try:
            # shield: this stream being cancelled must not cancel a build other subscribers share
            return await asyncio.shield(self._snapshot)
        except RelayError:
            raise
        except Exception as exc:  # encoder bug: never a half-sent snapshot
            raise RelayError.internal(f"snapshot encoding failed: {exc!r}") from exc

    async def _take_turn(self, turn: Turn | None, payloads: list[bytes]) -> list[bytes]:
        """Wait for this stream's turn on its connection without holding anything back: no
        deltas queued (they only make the cut stale), no joiner for the hub's spacing. At the
        turn, a stale cut is replaced by one at the current sequence, once; the queue then
        starts over. Returns the payloads to send (an ended stream sends none)."""
        hub = self._hub
        self._waiting = True
        try:
            if turn is not None:
                hub._caught_up(self)
                await self._turn(turn)
            if self._check() or not self._stale:
                return payloads
            self._frames.clear()  # continuations of the old cut
            self._bytes = 0
            snapshot = await hub._snapshot_at_current_sequence()  # deltas still dropped
            self.start_sequence = self._last_seq = hub.sequence  # the cut's (no await between)
            self._snapshot = snapshot
            hub.recuts += 1
        finally:
            self._waiting = False
            self._stale = False
            if not self.ended:
                hub._joining.add(self)
        return await self._payloads()

    async def _turn(self, turn: Turn) -> None:
        """Wait for ``turn``, or until this stream ends (``_stop`` wakes ``_waiter``): an ended
        stream waits for no turn, so a drain or a failure ends it with its status at once
        instead of when the streams before it on its connection have written theirs. A turn
        not taken is given up (its wait cancelled)."""
        if self.ended:
            return
        taking = asyncio.ensure_future(turn())
        try:
            while not taking.done() and not self.ended:
                waiter = asyncio.get_running_loop().create_future()
                self._waiter = waiter
                try:
                    await asyncio.wait((taking, waiter), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    self._waiter = None
        finally:
            if not taking.done():
                taking.cancel()  # (the turn's own wait gives its place up as it is cancelled)
        if taking.done() and not taking.cancelled():
            taking.result()  # (an error in the turn's wait)

    def fail(self, error: RelayError) -> None:
        """End this stream with ``error`` (a preemption, or its client lost the right to see the
        pool), as a lagged subscriber is ended: the
        slot is released now, the pump raises it, and a client that never reads is reset after
        the stall grace."""
        self._fail(error)

    def shutdown(self) -> None:
        """End this stream with a clean EOF (relay shutdown)."""
        self._close_clean()

    def close(self) -> None:
        """Release the subscriber slot (idempotent); the stream handler calls this last."""
        self._hub._detach(self)
        self._frames.clear()
        self._release_slot()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._task = None


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
