"""One producer generation of a pool: its exact state, identity, sequence and lazy hub.

A generation is immutable in identity: any doubt about its exact state fences it (the pool
withdraws it from the catalog and materializes a fresh one), so a delta is never shipped that the
relay cannot vouch for. Sequences count published batches; the first batch after a snapshot cut
at S is S→S+1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.pool.pool import Pool
from kvrelay.publication.hub import PublicationHub, PublicationInvariantError
from kvrelay.publication.splice import FilterUpdateEncoder
from kvrelay.service.errors import RelayError
from kvrelay.service.limits import PermitCounter, RelayLimits
from kvrelay.service.validation import ProducerKey, producer_key

FenceCallback = Callable[["Generation", str], None]
#: Called after each published batch with the seconds between the first command of the batch
#: arriving and its publication (the relay's own share of delta latency).
PublishObserver = Callable[[float], None]


class Generation:
    """Implements ``kvrelay.service.view.GenerationHandle`` for the gRPC service."""

    def __init__(
        self,
        *,
        pool: Pool,
        producer: pb.ProducerIdentity,
        relay_identity: pb.RelayIdentity,
        dc_id: int,
        limits: RelayLimits,
        hub_permits: PermitCounter,
        encode_gate: asyncio.Semaphore,
        on_fence: FenceCallback,
    ) -> None:
        self.pool = pool
        self.producer = producer
        self.key: ProducerKey = producer_key(producer)
        self.dc_id = dc_id
        self.limits = limits
        self.sequence = 0
        self.batches_published = 0
        self.retired = False
        self._encoder = FilterUpdateEncoder(relay_identity, producer)
        self._hub_permits = hub_permits
        self._encode_gate = encode_gate
        self._on_fence = on_fence
        self._hub: PublicationHub | None = None
        self._pending_events = 0
        self._pending_since: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False
        self.on_publish: PublishObserver | None = None

    @property
    def layout_generation(self) -> int:
        return int(self.producer.layout_generation)

    @property
    def has_hub(self) -> bool:
        return self._hub is not None

    @property
    def subscriber_count(self) -> int:
        return 0 if self._hub is None else self._hub.subscriber_count

    def hub_stats(self) -> dict[str, int]:
        """Read-only hub counters for metrics (zeros before the first subscription)."""
        hub = self._hub
        if hub is None:
            return {"resets": 0, "lagged": 0, "snapshots_served": 0, "snapshots_built": 0}
        return {
            "resets": hub.resets,
            "lagged": hub.lagged,
            "snapshots_served": hub.snapshots_served,
            "snapshots_built": hub.snapshots_built,
        }

    # ---- producer side ---------------------------------------------------------------------------

    def note_events(self, n: int) -> None:
        """Count applied commands; publish once ``publish_every_n_events`` accumulated (at the end
        of the current loop iteration) or after ``publication_delay_s``, whichever comes first.

        Boundaries fall only between whole commands because callers note after a full batch.
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
            if not self._soon:
                self._soon = True
                asyncio.get_running_loop().call_soon(self._on_soon)
        elif self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.limits.publication_delay_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def _on_soon(self) -> None:
        self._soon = False
        if self._pending_events:
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
        publication = self.pool.take_publication()
        if publication is None:
            return
        buckets, words = publication
        self.sequence += 1
        self.batches_published += 1
        if self.on_publish is not None and since is not None:
            self.on_publish(time.monotonic() - since)
        if self._hub is None:
            return  # no subscriber lease: dirty tracking ran, payload materialization skipped
        try:
            self._hub.publish(self.sequence, buckets, words)
        except PublicationInvariantError as exc:
            self._on_fence(self, f"publication invariant: {exc}")

    # ---- service side ----------------------------------------------------------------------------

    async def hub(self) -> PublicationHub:
        if self.retired:
            raise RelayError.publication_unavailable("producer generation retired")
        if self._hub is None:
            if not self._hub_permits.try_acquire():
                raise RelayError.resource_limit(
                    f"initialized pool hub limit {self._hub_permits.capacity} reached"
                )
            self.flush()  # barrier: the snapshot is cut after every applied command
            self._hub = PublicationHub(
                self._encoder,
                seed=int(self.pool.seed),
                bucket_count=int(self.pool.bucket_count),
                dc_id=self.dc_id,
                table=self.pool.table,
                sequence=self.sequence,
                limits=self.limits,
                encode_gate=self._encode_gate,
            )
        return self._hub

    def retire(self, error: RelayError | None) -> None:
        """Stop publishing; end subscribers with ``error`` (or a clean EOF on shutdown)."""
        if self.retired:
            return
        self.retired = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._hub is not None:
            self._hub.retire(error)
            self._hub_permits.release()
