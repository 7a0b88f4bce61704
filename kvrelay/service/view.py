"""What the gRPC service needs from whatever produces the contract (the relay, or a mirror).

The service never mutates pool state: it reads planes (versioned complete messages) and asks for
a pool subscription by the exact producer identity a router copied from the catalog. Admission —
which generation is live, whether it changed or retired while its hub was being set up — is
decided where that state lives, so the service resolves nothing itself.

Optional members, looked up by the service: ``hold_pool`` (publication spacing for mirrors)
and ``catalog_trails`` (the catalog trails its source's, as a mirror's does: under
``[[authorization]]`` a pool it does not list yet is waited for a moment).

The service only ever sends plane messages, so a plane may hold any message that converts to its
wire bytes: the relay's planes hold betterproto2 messages, a mirror's hold the bytes it received.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, SupportsBytes

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.hub import Subscription
from kvrelay.publication.plane import Plane


class RelayView(Protocol):
    """What the orchestrator exposes to the gRPC service."""

    # Read-only members (properties), so an implementation may hold concrete plane classes.
    @property
    def relay_identity(self) -> pb.RelayIdentity:
        """May raise ``RelayError`` (a mirror with no upstream session to vouch for)."""
        ...

    @property
    def catalog(self) -> Plane[SupportsBytes]: ...

    @property
    def readiness(self) -> Plane[SupportsBytes]: ...

    @property
    def load(self) -> Plane[SupportsBytes]: ...

    @property
    def serving_load(self) -> Plane[SupportsBytes]:
        """Dynamo 1.7's ``SubscribeServingLoad`` plane. Its ``current`` may raise
        ``PlaneUnsupported`` (a mirror whose upstream does not implement the RPC)."""
        ...

    async def open_pool(
        self, expected: pb.ProducerIdentity, on_release: Callable[[], None] | None = None
    ) -> Subscription:
        """A subscription to exactly ``expected`` (already validated by the caller);
        ``on_release`` is called once when the subscription stops counting (failed or ended).

        Raises ``RelayError``: POOL_NOT_FOUND (no live generation of that pool), PRODUCER_CHANGED
        (another generation is live), PUBLICATION_UNAVAILABLE (the generation retired while its
        hub was being initialized), RESOURCE_LIMIT (hub or per-pool subscriber bound).
        Raises ``PlaneEnded`` when the view's source drained while this admission waited (a
        mirror's upstream ended its sync cleanly): the stream ends with status OK, as the
        source's own admissions did.
        """
        ...
