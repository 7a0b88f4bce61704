"""The three broadcast planes the gRPC service streams from (catalog, readiness, load).

Each plane holds only its newest complete top-level message and implements
``kvrelay.service.view.Plane``; the orchestrator feeds them, the service only reads them.
"""

from kvrelay.service.planes.broadcast import NonMonotonicVersionError, VersionedBroadcast
from kvrelay.service.planes.catalog import CatalogError, CatalogPlane, LoraSpec, descriptor
from kvrelay.service.planes.load import LoadPlane, RankLoad, load_entry
from kvrelay.service.planes.readiness import (
    EndpointState,
    ReadinessPlane,
    TopologyError,
    topology_entries,
)

__all__ = [
    "CatalogError",
    "CatalogPlane",
    "EndpointState",
    "LoadPlane",
    "LoraSpec",
    "NonMonotonicVersionError",
    "RankLoad",
    "ReadinessPlane",
    "TopologyError",
    "VersionedBroadcast",
    "descriptor",
    "load_entry",
    "topology_entries",
]
