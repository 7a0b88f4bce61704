"""Consumer SDK and inspection CLI for ``dynamo.kvrelay.v1.KvEventRelay`` (kvrelay or Dynamo)."""

from kvrelay.client.client import RelayClient
from kvrelay.client.config import ClientConfig
from kvrelay.client.errors import ConsumerViolation
from kvrelay.client.replica import PoolReplica
from kvrelay.client.rpc import RelayAddress
from kvrelay.client.search import linear_depth, prefix_depth
from kvrelay.client.views import (
    LoadView,
    ModelServingView,
    PoolKey,
    PoolServingView,
    ReadinessView,
    ReplicaStats,
    ServingLoadViews,
)

__all__ = [
    "ClientConfig",
    "ConsumerViolation",
    "LoadView",
    "ModelServingView",
    "PoolKey",
    "PoolReplica",
    "PoolServingView",
    "ReadinessView",
    "RelayAddress",
    "RelayClient",
    "ReplicaStats",
    "ServingLoadViews",
    "linear_depth",
    "prefix_depth",
]
