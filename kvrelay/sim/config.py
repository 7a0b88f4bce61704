"""Simulated engine configuration (what ``vllm serve`` flags would set) and LoRA records."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.sim.traffic import TrafficConfig
from kvrelay.sim.wire import Era, HashMode


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Engine configuration. ``pub_port``/``replay_port`` 0 = ephemeral (vLLM >= 0.31 style)."""

    name: str = "engine-0"
    seed: int = 0
    dp_size: int = 1
    block_size: int = 16
    capacity_blocks: int = 512
    max_running: int = 16
    era: Era = Era.MAP
    hash_mode: HashMode = HashMode.U64
    replay_frames: int = 4
    engine_version: str = "0.33.0"
    topic: str = ""
    bind_host: str = "*"  # host part of the configured endpoints (vLLM default: wildcard)
    host_ip: str = "127.0.0.1"  # node IP used for port-0 binds and for gRPC/metrics listeners
    pub_port: int = 0
    replay_port: int | None = 0  # None = replay disabled
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    grpc_port: int | None = 0  # None = no gRPC frontend (vLLM < 0.27)
    metrics_port: int | None = 0  # None = no /metrics page
    kv_transfer_only: bool = False  # Control.GetKvEventSources UNIMPLEMENTED, KvTransfer serves it
    kv_sources_unimplemented: bool = False  # neither service serves it (pre-discovery frontend)
    #: False: KV events disabled (GetKvEventSources lists nothing; an ENCODE worker, say).
    kv_events: bool = True
    #: Control RPCs this frontend answers UNIMPLEMENTED (an older vLLM), e.g. ("ListLoras",).
    unimplemented_rpcs: tuple[str, ...] = ()
    model_id: str = "sim/model-7b"
    served_model_name: str = "sim-model"
    aliases: tuple[str, ...] = ("sim-model-alias",)
    max_model_len: int = 8192
    max_loras: int = 4
    medium: str = "GPU"
    report_reused: bool = False  # re-announce prefix-cache hits as duplicate BlockStored
    traffic: TrafficConfig = field(default_factory=TrafficConfig)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.bind_host}:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://{self.bind_host}:{self.replay_port}"


@dataclass(frozen=True, slots=True)
class LoraInfo:
    lora_id: int
    name: str
    source_path: str
