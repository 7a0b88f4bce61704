"""Engine discovery: vLLM ``Control`` gRPC client, static sources, watcher, /metrics scrape."""

from kvrelay.discovery.client import KV_TRANSFER_SOURCES_PATH, EngineClient
from kvrelay.discovery.endpoints import (
    SourceInfo,
    StaticSourceConfig,
    dp_offset,
    static_sources,
    substitute_wildcard,
)
from kvrelay.discovery.errors import (
    DiscoveryError,
    DiscoveryTimeout,
    EngineUnreachable,
    InvalidEndpoint,
    KvSourcesUnsupported,
    RpcFailed,
)
from kvrelay.discovery.events import (
    ChangeEvent,
    EngineDiscovered,
    EngineReachable,
    EngineUnreachableEvent,
    EngineUpdated,
    IncarnationChanged,
    LorasChanged,
    PauseChanged,
    SleepChanged,
    SourcesAdded,
    SourcesRemoved,
)
from kvrelay.discovery.snapshot import EngineSnapshot, LoraEntry
from kvrelay.discovery.watcher import EngineTarget, EngineWatcher, diff_snapshots, snapshot_target

__all__ = [
    "KV_TRANSFER_SOURCES_PATH",
    "ChangeEvent",
    "DiscoveryError",
    "DiscoveryTimeout",
    "EngineClient",
    "EngineDiscovered",
    "EngineReachable",
    "EngineSnapshot",
    "EngineTarget",
    "EngineUnreachable",
    "EngineUnreachableEvent",
    "EngineUpdated",
    "EngineWatcher",
    "IncarnationChanged",
    "InvalidEndpoint",
    "KvSourcesUnsupported",
    "LoraEntry",
    "LorasChanged",
    "PauseChanged",
    "RpcFailed",
    "SleepChanged",
    "SourceInfo",
    "SourcesAdded",
    "SourcesRemoved",
    "StaticSourceConfig",
    "diff_snapshots",
    "dp_offset",
    "snapshot_target",
    "static_sources",
    "substitute_wildcard",
]
