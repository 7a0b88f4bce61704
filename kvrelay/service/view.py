"""The read-only view the gRPC service needs from the orchestrator (shared with the planes).

The service never mutates pool state: it reads planes (versioned complete messages) and asks the
orchestrator for a generation's publication hub.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

from kvrelay._proto.dynamo.kvrelay import v1 as pb

if TYPE_CHECKING:
    from kvrelay.publication.hub import PublicationHub

T_co = TypeVar("T_co", covariant=True)


class PlaneClosed(Exception):
    """The plane will never publish again (shutdown or publisher failure)."""


class Plane(Protocol[T_co]):
    """A versioned stream of complete messages; readers only ever need the newest one."""

    def current(self) -> tuple[int, T_co]:
        """(version, full message). Catalog/readiness: revision; load: window_sequence."""
        ...

    async def wait_newer(self, version: int) -> tuple[int, T_co]:
        """Return once a version > `version` exists; raise PlaneClosed on close."""
        ...


class GenerationHandle(Protocol):
    """One active producer generation of a pool."""

    producer: pb.ProducerIdentity

    async def hub(self) -> PublicationHub:
        """Lazily create the hub (barrier snapshot).

        Raises RelayError(PUBLICATION_UNAVAILABLE) if the generation retired and
        RelayError(RESOURCE_LIMIT) at the initialized-hub cap.
        """
        ...


class RelayView(Protocol):
    """What the orchestrator exposes to the gRPC service."""

    # Read-only members (properties), so an implementation may hold concrete plane classes.
    @property
    def relay_identity(self) -> pb.RelayIdentity: ...

    @property
    def catalog(self) -> Plane[pb.KvPoolCatalogUpdate]: ...

    @property
    def readiness(self) -> Plane[pb.ServingReadinessUpdate]: ...

    @property
    def load(self) -> Plane[pb.KvPoolLoadUpdate]: ...

    def resolve_pool(self, expected: pb.ProducerIdentity) -> GenerationHandle:
        """Raise RelayError(POOL_NOT_FOUND) or RelayError(PRODUCER_CHANGED)."""
        ...
