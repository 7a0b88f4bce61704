"""Typed change events emitted by ``EngineWatcher`` (one dataclass per kind of change)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.discovery.endpoints import SourceInfo
from kvrelay.discovery.snapshot import EngineSnapshot


@dataclass(frozen=True, slots=True)
class EngineDiscovered:
    """First successful contact with the engine."""

    target: str
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class EngineUnreachableEvent:
    """Engine went (or started) unreachable; emitted once per outage."""

    target: str
    snapshot: EngineSnapshot
    error: str


@dataclass(frozen=True, slots=True)
class EngineReachable:
    """Engine answers again after an outage (followed by any diffs vs. the last good view)."""

    target: str
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class IncarnationChanged:
    """``instance_id`` changed: consumers must clear all per-rank state of this engine."""

    target: str
    snapshot: EngineSnapshot
    old_instance_id: str
    new_instance_id: str


@dataclass(frozen=True, slots=True)
class SourcesAdded:
    target: str
    snapshot: EngineSnapshot
    sources: tuple[SourceInfo, ...]


@dataclass(frozen=True, slots=True)
class SourcesRemoved:
    target: str
    snapshot: EngineSnapshot
    sources: tuple[SourceInfo, ...]


@dataclass(frozen=True, slots=True)
class LorasChanged:
    target: str
    snapshot: EngineSnapshot
    added: tuple[str, ...]
    removed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SleepChanged:
    target: str
    snapshot: EngineSnapshot
    sleeping: bool


@dataclass(frozen=True, slots=True)
class PauseChanged:
    target: str
    snapshot: EngineSnapshot
    paused: bool


@dataclass(frozen=True, slots=True)
class EngineUpdated:
    """Anything else the engine's Control answer says differently (model names, model source,
    block size, capacity, which optional RPCs failed, ...): the pool's identity, catalog
    descriptor and metrics are computed again from it."""

    target: str
    snapshot: EngineSnapshot


ChangeEvent = (
    EngineDiscovered
    | EngineUnreachableEvent
    | EngineReachable
    | IncarnationChanged
    | SourcesAdded
    | SourcesRemoved
    | LorasChanged
    | SleepChanged
    | PauseChanged
    | EngineUpdated
)
