"""What the simulator's front-ends (Control gRPC, ``/metrics``) read and drive on an engine.

A protocol, so the front-ends depend on this small surface and ``SimEngine`` can start them
without the two importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvrelay.sim.config import LoraInfo, SimConfig
from kvrelay.sim.publisher import RankPublisher
from kvrelay.sim.scheduler import RankScheduler


class EngineFace(Protocol):
    cfg: SimConfig
    instance_id: str
    started_at: float
    sleeping: bool
    paused: bool
    loras: dict[str, LoraInfo]

    @property
    def publishers(self) -> Sequence[RankPublisher]: ...

    @property
    def schedulers(self) -> Sequence[RankScheduler]: ...

    def kv_usage(self, dp_rank: int) -> float: ...

    def load_lora(self, name: str, source_path: str = "") -> LoraInfo: ...

    def unload_lora(self, name: str) -> LoraInfo: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def pause(self, clear_cache: bool = False) -> None: ...

    def resume(self) -> None: ...
