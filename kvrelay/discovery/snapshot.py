"""``EngineSnapshot``: everything discovery learned about one engine frontend at one instant."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.discovery.endpoints import SourceInfo


@dataclass(frozen=True, slots=True)
class LoraEntry:
    lora_id: int
    name: str
    source_path: str


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Immutable view of one engine. ``reachable=False`` snapshots carry only address + error.

    ``sources_via`` says where the sources came from: ``control``, ``kv_transfer``, ``static``
    or ``none`` (engine reachable but exposes no source discovery and no static config given).
    """

    host: str
    port: int | None
    reachable: bool
    error: str | None = None
    engine_version: str = ""
    api_version: str = ""
    instance_id: str = ""
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_size_local: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int = 0
    kv_block_size: int = 0
    total_kv_blocks: int = 0
    max_running_requests: int = 0
    max_batched_tokens: int = 0
    max_loras: int = 0
    model_id: str = ""
    served_model_name: str = ""
    served_model_aliases: tuple[str, ...] = ()
    loras: tuple[LoraEntry, ...] = ()
    sources: tuple[SourceInfo, ...] = ()
    sources_via: str = "none"
    sleeping: bool = False
    paused: bool = False
    #: Optional fields whose Control RPC failed this time (values kept from the last snapshot).
    unknown: frozenset[str] = frozenset()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if self.port is not None else self.host

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset(lo.name for lo in self.loras)
