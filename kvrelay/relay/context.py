"""What a pool needs from the relay that owns it, passed down instead of a back-pointer.

``PoolRuntime`` and ``Generation`` get one shared ``RelayContext``: the relay identity their
producer identities and frames carry, the limits, the shared bounds (hub permits, the snapshot
encode gate), the layout-generation counter, a way to run owned background work, the signal that
the catalog/topology must be recomputed, and the observers. Nothing here lets a pool reach the
other pools or the relay's internals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import PermitCounter, RelayLimits
from kvrelay.relay.observer import Observers


@dataclass(frozen=True, slots=True)
class RelayContext:
    relay_identity: pb.RelayIdentity
    dc_id: int
    limits: RelayLimits
    hub_permits: PermitCounter
    encode_gate: asyncio.Semaphore
    #: Next ``layout_generation`` (relay-wide, starts at 1, never reused).
    next_layout_generation: Callable[[], int]
    #: Run a coroutine owned by the relay (cancelled when the relay stops).
    schedule: Callable[[Coroutine[Any, Any, Any]], None]
    #: The pool's catalog descriptor or topology may have changed: recompute the planes.
    changed: Callable[[], None]
    #: At the initialized-hub cap: retire the longest-idle hub (no subscribers); False if none.
    evict_idle_hub: Callable[[], bool]
    observers: Observers
    #: how engines' live streams are read (``RelaySettings.zmq_reader``)
    zmq_reader: str = "zmtp"

    @property
    def relay_incarnation(self) -> int:
        return int(self.relay_identity.relay_incarnation)
