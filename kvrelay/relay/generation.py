"""One producer generation of a pool: its exact state, identity, sequence and lazy hub.

A generation is immutable in identity: any doubt about its exact state fences it (the pool
withdraws it from the catalog and materializes a fresh one), so a delta is never shipped that the
relay cannot vouch for. The member operations (apply, reset, remove, reset an engine) live here so
that the check for an invariant violation — and the fence it triggers — happens in one place,
after every mutation, and no caller has to notice it. Sequences count published batches; the
first batch after a snapshot cut at S is S→S+1.

A member rebuilt from its engine's replay (a reset, then the replayed history) is one
transaction: publication is held from the reset until the replay is applied (``hold`` /
``release``), so subscribers get one delta from the old image to the new one and never see the
member's blocks vanish and come back. The hold is bounded: it ends after ``REBUILD_HOLD_MAX_S``
or once the held delta reaches what a subscriber queue takes (``held_bucket_cap``), counted in
``rebuild_holds_broken``; a subscriber that joins meanwhile gets its snapshot as things are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.ingest.sink import SourceKey
from kvrelay.pool.batch import AnyBatch
from kvrelay.pool.errors import MalformedBatch
from kvrelay.pool.pool import ApplyResult, Pool
from kvrelay.publication.cadence import Pacer, held_bucket_cap
from kvrelay.publication.hub import PublicationHub, PublicationInvariantError
from kvrelay.publication.splice import FilterUpdateEncoder
from kvrelay.relay.context import RelayContext

FenceCallback = Callable[["Generation", str], None]

#: Longest a member rebuild holds the pool's publications (a replay that takes longer publishes
#: the rest as it comes).
REBUILD_HOLD_MAX_S = 2.0


class Generation:
    """A pool generation: exact state + producer identity + publication sequence + hub."""

    def __init__(
        self,
        *,
        name: str,
        pool: Pool,
        producer: pb.ProducerIdentity,
        ctx: RelayContext,
        on_fence: FenceCallback,
    ) -> None:
        self.name = name
        self.pool = pool
        self.producer = producer
        self.key: ProducerKey = producer_key(producer)
        self.limits = ctx.limits
        self.sequence = 0
        self.batches_published = 0
        self.retired = False
        self._ctx = ctx
        self._encoder = FilterUpdateEncoder(ctx.relay_identity, producer)
        self._on_fence = on_fence
        self._hub: PublicationHub | None = None
        self._pending_events = 0
        self._pending_since: float | None = None
        #: the armed cut attempt and when it is due (``loop.time()``): uvloop's ``call_later``
        #: returns a plain ``Handle``, without ``when()``, for a delay under half a millisecond
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._soon = False
        self._loop: asyncio.AbstractEventLoop | None = None  # see _event_loop
        self._last_cut = 0.0  # time.monotonic() of the last publication cut (snapshot hold)
        self._pacer = Pacer(ctx.limits)
        self._bucket_cap = held_bucket_cap(ctx.limits)
        self._holds: dict[SourceKey, float] = {}  # members rebuilding → when they began
        self.rebuild_holds = 0
        self.rebuild_holds_broken = 0

    @property
    def layout_generation(self) -> int:
        return int(self.producer.layout_generation)

    @property
    def has_hub(self) -> bool:
        return self._hub is not None

    @property
    def subscriber_count(self) -> int:
        return 0 if self._hub is None else self._hub.subscriber_count

    def request_hold(self, requester: str, seconds: float, ttl_s: float) -> float:
        """A downstream relay's spacing request (``PublicationHub.request_hold``); without a hub
        nothing is published to anyone, so there is nothing to space."""
        hub = self._hub
        return 0.0 if hub is None else hub.request_hold(requester, seconds, ttl_s)

    def hub_stats(self) -> dict[str, int]:
        """Read-only hub counters (zeros before the first subscription)."""
        hub = self._hub
        if hub is None:
            return {"resets": 0, "lagged": 0, "snapshots_served": 0, "snapshots_built": 0}
        return {
            "resets": hub.resets,
            "lagged": hub.lagged,
            "snapshots_served": hub.snapshots_served,
            "snapshots_built": hub.snapshots_built,
        }

    # ---- member operations (the only way exact state changes) ----------------------------------

    def apply(self, source: SourceKey, batch: AnyBatch) -> ApplyResult | None:
        """Apply one decoded engine batch for ``source``; None once retired (or fenced by it).

        A malformed batch raises ``MalformedBatch`` with the state untouched (the caller repairs
        or resets that member). Anything else that goes wrong — an invariant violation counted by
        the kernel or raised, any unexpected error — fences the generation.
        """
        if self.retired:
            return None
        pool = self.pool
        before = pool.invariant_violations
        try:
            result = pool.apply(pool.add_member(source.worker_id, source.dp_rank), batch)
        except MalformedBatch:
            raise
        except Exception as exc:
            self._on_fence(self, f"applying a batch raised {type(exc).__name__}: {exc}")
            return None
        if self._fenced_by(before, "applying a batch"):
            return None
        self._note_events(batch.n_events)
        return result

    def held(self, source: SourceKey) -> int:
        """Blocks ``source``'s member holds now."""
        pool = self.pool
        return pool.member_blocks(pool.add_member(source.worker_id, source.dp_rank))

    def reset_member(self, source: SourceKey) -> None:
        """Drop everything ``source`` holds (as an ``AllBlocksCleared`` would)."""
        self._mutate(
            "resetting a member",
            lambda p: p.reset_member(p.add_member(source.worker_id, source.dp_rank)),
        )

    def remove_member(self, source: SourceKey) -> None:
        """Drop ``source``'s state and forget the member (its engine or rank left the pool)."""
        self._mutate(
            "removing a member",
            lambda p: p.remove_member(p.add_member(source.worker_id, source.dp_rank)),
        )

    def reset_engine(self, worker_id: int) -> list[int]:
        """Reset every member of one engine (a new incarnation, or the engine is down); returns
        the DP ranks of the members it had."""
        if self.retired:
            return []
        ids = {mid: rank for mid, (wid, rank) in self.pool.members().items() if wid == worker_id}

        def clear(p: Pool) -> None:
            for mid in ids:
                p.reset_member(mid)

        self._mutate("resetting an engine's members", clear)
        return sorted(ids.values())

    def _mutate(self, what: str, op: Callable[[Pool], None]) -> None:
        if self.retired:
            return
        before = self.pool.invariant_violations
        try:
            op(self.pool)
        except Exception as exc:
            self._on_fence(self, f"{what} raised {type(exc).__name__}: {exc}")
            return
        if not self._fenced_by(before, what):
            self._note_events(1)

    def _fenced_by(self, before: int, what: str) -> bool:
        if self.pool.invariant_violations == before:
            return False
        self._on_fence(self, f"exact state invariant violated while {what}")
        return True

    # ---- member rebuilds (one transaction each) --------------------------------------------------

    def hold(self, source: SourceKey) -> None:
        """``source`` is being rebuilt (reset, replay to follow): hold publications until
        ``release``."""
        if self.retired or source in self._holds:
            return
        self._holds[source] = time.monotonic()
        self.rebuild_holds += 1

    def release(self, source: SourceKey) -> None:
        """``source``'s rebuild is applied (or abandoned): publish once no rebuild is left."""
        if self._holds.pop(source, None) is not None and not self._holds:
            self._on_hold_released()

    @property
    def rebuilding(self) -> int:
        return len(self._holds)

    # ---- publication cadence ---------------------------------------------------------------------

    def _note_events(self, n: int) -> None:
        """Count applied commands; publish once ``publish_every_n_events`` accumulated (at the end
        of the current loop iteration), else ``publication_delay_s`` after the previous cut —
        at the end of this iteration when that is past already (a message after a quiet spell
        goes out at once, without a timer and a second wakeup) — and later while publishing is
        expensive or a subscriber catches up (``_cut_or_wait``). A command never waits longer
        than the delay for it, and cuts below the event threshold stay that far apart.

        Boundaries fall only between whole commands because every member operation notes after
        it completed.
        """
        if self.retired or n <= 0:
            return
        if self._pending_since is None:
            self._pending_since = time.monotonic()
        self._pending_events += n
        if self._pending_events >= self.limits.publish_every_n_events:
            # Publish at the end of this loop iteration, not inline: a subscriber draining a
            # burst of engine messages then yields one delta for the burst instead of one per
            # 16 events, so fan-out queues (16 frames) are not filled before any sender runs.
            self._cut_soon()
        elif self._timer is None and not self._soon:
            wait = self._last_cut + self.limits.publication_delay_s - time.monotonic()
            if wait > 0.0:
                self._arm(wait)
            else:  # quiet since the last cut: at the end of this iteration, no timer
                self._cut_soon()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, kept: ``asyncio.get_running_loop`` makes a ``getpid`` system call
        each time (its fork check), twice per engine message on these paths."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _cut_soon(self) -> None:
        """A cut attempt at the end of this loop iteration (once, however often asked)."""
        if not self._soon:
            self._soon = True
            self._event_loop().call_soon(self._on_soon)

    def _arm(self, delay: float) -> None:
        """A cut attempt ``delay`` from now, unless one is already due sooner."""
        loop = self._event_loop()
        timer = self._timer
        at = loop.time() + delay
        if timer is not None:
            if self._timer_at <= at:
                return
            timer.cancel()
        self._timer = loop.call_later(delay, self._on_timer)
        self._timer_at = at

    def _on_timer(self) -> None:
        self._timer = None
        self._cut_or_wait()

    def _on_soon(self) -> None:
        self._soon = False
        self._cut_or_wait()

    def _on_hold_released(self) -> None:
        """The last joiner caught up (or ended): cut what was held back at the end of this loop
        iteration (never inside the hub call that released it)."""
        if not self.retired:
            self._cut_soon()

    def _cut_or_wait(self) -> None:
        """Publish the pending commands now, or later — whichever of two waits is longer:

        * the pacer's (``publication.cadence``): publishing kept to about
          ``publication_cpu_percent`` of the wall clock, never later than
          ``publication_max_delay_s`` after the first pending command;
        * the snapshot hold: while a subscriber catches up (its snapshot, then the deltas queued
          meanwhile), every delta takes one of its queue slots (§4.6), so cuts are spaced as the
          hub asks (``PublicationHub.publication_hold``, at most
          ``snapshot_publication_delay_s`` after the last cut) and more commands go into each
          delta.

        Either way a held delta never grows past what a subscriber queue can take: once the
        pool's touched buckets reach ``held_bucket_cap`` it is cut at once.
        """
        if not self._pending_events or self.retired:
            return
        now = time.monotonic()
        if self._holds:
            left = min(self._holds.values()) + REBUILD_HOLD_MAX_S - now
            if left > 0.0 and self.pool.pending_dirty < self._bucket_cap:
                self._arm(left)  # ``release`` cuts sooner
                return
            self.rebuild_holds_broken += 1
            self._holds.clear()
        wait = self._pacer.wait(now, now if self._pending_since is None else self._pending_since)
        hub = self._hub
        if hub is not None:
            hold = hub.publication_hold()
            if hold > 0.0:
                wait = max(wait, self._last_cut + hold - now)
        if wait > 0.0 and self.pool.pending_dirty < self._bucket_cap:
            self._arm(wait)
            return
        self.flush()

    def flush(self) -> None:
        """Publish the net-changed buckets as the next sequence (nothing when nothing changed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending_events = 0
        since, self._pending_since = self._pending_since, None
        if self.retired:
            return
        started = time.monotonic()
        self._last_cut = started
        publication = self.pool.take_publication()
        if publication is None:
            return
        buckets, words = publication
        self.sequence += 1
        self.batches_published += 1
        observers = self._ctx.observers
        if observers and since is not None:
            observers.delta_published(self.name, started - since)
        if self._hub is None:
            return  # no subscriber lease: dirty tracking ran, payload materialization skipped
        try:
            self._hub.publish(self.sequence, buckets, words)
        except PublicationInvariantError as exc:
            self._on_fence(self, f"publication invariant: {exc}")
            return
        except Exception as exc:  # a bug (encoder, fan-out): the hub is a delta behind the pool
            self._on_fence(self, f"publishing raised {type(exc).__name__}: {exc}")
            return
        self._pacer.record(started, time.monotonic())

    # ---- subscribers -----------------------------------------------------------------------------

    def hub(self) -> PublicationHub:
        """The generation's hub, created by the first subscriber (a barrier snapshot)."""
        if self.retired:
            raise RelayError.publication_unavailable("producer generation retired")
        if self._hub is None:
            permits = self._ctx.hub_permits
            if not permits.try_acquire() and not (
                self._ctx.evict_idle_hub() and permits.try_acquire()
            ):
                raise RelayError.resource_limit(
                    f"initialized pool hub limit {permits.capacity} reached"
                )
            self.flush()  # barrier: the snapshot is cut after every applied command
            self._hub = PublicationHub(
                self._encoder,
                seed=int(self.pool.seed),
                bucket_count=int(self.pool.bucket_count),
                dc_id=self._ctx.dc_id,
                table=self.pool.table,
                sequence=self.sequence,
                limits=self.limits,
                encode_gate=self._ctx.encode_gate,
            )
            self._hub.on_hold_released = self._on_hold_released
        return self._hub

    @property
    def hub_idle_since(self) -> float | None:
        """When the hub lost its last subscriber (monotonic); None without a hub or while used."""
        return None if self._hub is None else self._hub.idle_since

    def drop_hub(self) -> None:
        """Retire an idle hub and give its permit back; the next subscriber cuts a new one."""
        hub, self._hub = self._hub, None
        if hub is not None:
            hub.retire(None)
            self._ctx.hub_permits.release()

    def retire(self, error: RelayError | None) -> None:
        """Stop publishing; end subscribers with ``error`` (or a clean EOF on shutdown)."""
        if self.retired:
            return
        self.retired = True
        self._holds.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._hub is not None:
            self._hub.retire(error)
            self._ctx.hub_permits.release()
