"""When the producer may cut its next publication: duty-cycle pacing and the held-delta cap.

The contract leaves the cadence free; what each delta costs is not free. A publication is
encoded once and then written to every subscriber, so under fan-out its cost is mostly per
subscriber and per frame, hardly per bucket — 64 subscribers at a few hundred small deltas a
second spent most of the relay's CPU (and most of each subscriber process's) on frame overhead.
``Pacer`` keeps the time spent publishing to about ``publication_cpu_percent`` of the wall
clock: after a publication that took ``c`` seconds, the next one is cut no sooner than
``c * (100 / percent - 1)`` later, so fewer, larger deltas go out when publishing is expensive,
and nothing changes when it is cheap (one subscriber: ~0.1 ms per cut, well under the spacing
of light traffic). The wait never goes past ``publication_max_delay_s`` after the first pending
command, and ``held_bucket_cap`` bounds how large a delta held back may grow (a full queue of
such deltas still fits ``publication_queue_bytes``). Every delta remains ``base → base + 1``.
"""

from __future__ import annotations

from kvrelay.contract.limits import QUEUE_FRAME_OVERHEAD, RelayLimits
from kvrelay.publication import cbi1


class Pacer:
    """Duty-cycle pacing for one producer (single event loop; times are ``time.monotonic``)."""

    __slots__ = ("_factor", "_max_delay", "_next_ok")

    def __init__(self, limits: RelayLimits) -> None:
        self._factor = 100.0 / limits.publication_cpu_percent - 1.0
        self._max_delay = limits.publication_max_delay_s
        self._next_ok = 0.0

    def record(self, started: float, ended: float) -> None:
        """A publication ran from ``started`` to ``ended``."""
        self._next_ok = ended + max(0.0, ended - started) * self._factor

    def wait(self, now: float, pending_since: float) -> float:
        """Seconds to wait before cutting the pending commands (0.0: cut now)."""
        wait = min(self._next_ok, pending_since + self._max_delay) - now
        return wait if wait > 0.0 else 0.0


def held_bucket_cap(limits: RelayLimits) -> int:
    """Touched buckets at which a delta being held back is cut anyway: a full subscriber queue
    of deltas this size (12 bytes per image) stays within ``publication_queue_bytes``."""
    per_frame = limits.publication_queue_bytes // limits.publication_queue_capacity
    images = (per_frame - QUEUE_FRAME_OVERHEAD - cbi1.delta_frame_len(0)) // cbi1.DELTA_ENTRY
    return max(1, min(cbi1.MAX_DELTA_IMAGES, images))
