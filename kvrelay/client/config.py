"""Client settings: every bound the SDK keeps lives here (documented behaviour when hit)."""

from __future__ import annotations

import random
from dataclasses import dataclass

MiB = 1024 * 1024


class ClientConfigError(ValueError):
    """A ClientConfig field is out of range."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Defaults suit a router; tests shrink the backoff.

    * ``max_message_bytes``: inbound messages above this fail the stream (8 MiB, §3.4).
    * ``max_pools_per_relay``: catalog entries beyond this are ignored and counted
      (``pools_over_limit``); 64 = the relay's own stream limit.
    * ``max_bucket_count``: pools with a larger lane are quarantined (``too_large``) rather than
      allocating their table (2^24 buckets = 128 MiB, the wire maximum).
    * backoff: jittered exponential, ``delay = min(max, initial * 2**attempt) * U(1-jitter, 1)``;
      the attempt counter resets after a stream that stayed live 1 s (a pool's from its
      install, the catalog's and a plane's from their first message: ``rpc.Backoff``).
    * ``verification_window``: deprecated, no effect (still checked to be in 1..8, so configs
      written for it keep loading): ``overlap()`` probes every block and reports the exact
      longest present prefix; ``prefix_depth`` takes its window as an argument.
    * ``heartbeat_interval_s`` × ``silence_heartbeats``: a pool, readiness, load or serving-load
      stream silent that long (no frame, not even a heartbeat; the relay sends one every 10 s,
      load windows every second; a window plane waits at least three of the windows its updates
      announce) is ended as ``silent`` and resubscribed; a stream's first
      message may wait for its turn behind other streams of its channel, at most four times that.
    """

    subscriber_id: str = "kvrelay-client"
    max_message_bytes: int = 8 * MiB
    max_pools_per_relay: int = 64
    max_bucket_count: int = 1 << 24
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    backoff_jitter: float = 0.5
    verification_window: int = 2
    watch_readiness: bool = True
    watch_load: bool = True
    #: Dynamo 1.7's SubscribeServingLoad (a relay without it answers UNIMPLEMENTED: see
    #: ``ServingLoadViews.unsupported``).
    watch_serving_load: bool = True
    heartbeat_interval_s: float = 10.0
    silence_heartbeats: int = 3

    def __post_init__(self) -> None:
        sid = self.subscriber_id
        if not sid or len(sid.encode()) > 128 or any(ord(c) < 32 or 127 <= ord(c) <= 159
                                                     for c in sid):
            raise ClientConfigError("subscriber_id must be 1..128 bytes without control chars")
        if self.max_message_bytes < 4_194_368 + 64 * 1024:
            raise ClientConfigError("max_message_bytes must hold a full snapshot chunk")
        if self.max_pools_per_relay < 1:
            raise ClientConfigError("max_pools_per_relay must be >= 1")
        if not 2 <= self.max_bucket_count <= 1 << 24:
            raise ClientConfigError("max_bucket_count must be in [2, 2^24]")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s <= 3600:
            raise ClientConfigError("need 0 < backoff_initial_s <= backoff_max_s <= 3600")
        if not 0 <= self.backoff_jitter < 1:
            raise ClientConfigError("backoff_jitter must be in [0, 1)")
        if not 1 <= self.verification_window <= 8:
            raise ClientConfigError("verification_window must be in 1..8")
        if not 0 < self.heartbeat_interval_s <= 3600 or self.silence_heartbeats < 1:
            raise ClientConfigError(
                "need 0 < heartbeat_interval_s <= 3600 and silence_heartbeats >= 1"
            )

    @property
    def silence_s(self) -> float:
        """How long a heartbeating stream may stay silent before it is ended."""
        return self.heartbeat_interval_s * self.silence_heartbeats

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Delay before retry number ``attempt`` (0-based), bounded by ``backoff_max_s``."""
        base = min(self.backoff_max_s, self.backoff_initial_s * (2 ** min(attempt, 32)))
        r = float((rng or random).random())
        return float(base * (1.0 - self.backoff_jitter * r))
