"""Simulated engine configuration (what ``vllm serve`` flags would set) and LoRA records."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.sim.sglang_wire import SglLayout
from kvrelay.sim.traffic import TrafficConfig
from kvrelay.sim.wire import Era, HashMode


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Engine configuration. ``pub_port``/``replay_port`` 0 = ephemeral (vLLM >= 0.31 style).

    ``flavor="sglang"``: the engine speaks SGLang's stream instead (``sim/sglang_wire.py``):
    events in ``sglang_layout`` (positional, or tagged maps from ``map``), signed hashes, one
    store per page (coalesced in the aligned and map layouts), 3-frame replay replies (4 with
    the topic in ``map_lora``; ``replay_frames`` is vLLM's), LoRA adapters only in ``map_lora``
    (the only layout that names them), no Control. ``sglang_epoch`` puts a per-incarnation
    epoch in the topic frame (a publisher with a snapshot endpoint); ``eagle`` publishes bigram
    pages. ``pub_connect``: the PUB connects to this endpoint (DP offset applied) instead of
    binding, as both engines do for an endpoint without a wildcard.
    """

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
    #: vLLM with EAGLE/MTP speculative decoding: the last block of a prefix-cache hit is dropped
    #: and recomputed (a second physical block under the same hash)
    spec_eagle: bool = False
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    flavor: str = "vllm"  # "vllm" | "sglang"
    sglang_layout: SglLayout = SglLayout.ALIGNED
    sglang_rank_in_envelope: bool = True
    sglang_epoch: bool = False
    eagle: bool = False
    pub_connect: str | None = None

    def __post_init__(self) -> None:
        if self.flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor must be 'vllm' or 'sglang', got {self.flavor!r}")
        if self.eagle and self.flavor != "sglang":
            raise ValueError("eagle bigram pages are an SGLang feature (flavor='sglang')")
        if (self.spec_eagle or self.report_reused) and self.flavor != "vllm":
            raise ValueError("spec_eagle and report_reused are vLLM features (flavor='vllm')")

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
