"""Typed settings of the orchestrator (the TOML loader fills these; tests build them directly)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.discovery.endpoints import StaticSourceConfig, host_key, split_tcp, static_sources
from kvrelay.hashing.identity import DEFAULT_CKF_SEED, bucket_count_for
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.live_source import require_reader
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.topic_pattern import TopicPattern

#: Default of ``checkpoint_bytes_per_second``.
CHECKPOINT_BYTES_PER_SECOND = 256 << 20

@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One vLLM frontend behind a pool.

    ``name`` is the operator's stable name: ``worker_id`` derives from it, never from the engine
    incarnation, so a restart is the same member with cleared state. Engines reached through
    ``vllm.Control`` give ``host`` + ``grpc_port``; engines without gRPC (vLLM < 0.27) give
    ``static`` sources, and then the pool's ``model`` / ``kv_block_size`` are required.
    ``kind`` names the engine family: SGLang engines have no ``vllm.Control``, so they are
    always static (§21).
    """

    name: str
    host: str = "127.0.0.1"
    grpc_port: int | None = None
    static: StaticSourceConfig | None = None
    metrics_port: int | None = None
    total_kv_blocks: int | None = None  # capacity for static engines (load plane)
    kind: EngineKind = EngineKind.VLLM
    #: A DNS name standing for a set of engines (a headless Service): every A/AAAA record is an
    #: engine ``name@address`` on these ports; with ``dns_srv`` the name is an SRV name whose
    #: targets and ports are the engines' Control endpoints.
    dns: str | None = None
    dns_srv: bool = False

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip():
            raise ValueError("engine name must be non-empty without surrounding whitespace")
        if self.dns_srv and not self.dns:
            raise ValueError(f"engine {self.name!r}: dns_srv needs a dns name")
        if self.grpc_port is None and self.static is None and not self.dns_srv:
            raise ValueError(f"engine {self.name!r} needs grpc_port or static sources")
        if self.kind is EngineKind.SGLANG and (self.grpc_port is not None or self.static is None):
            raise ValueError(f"SGLang engine {self.name!r} needs static sources and no grpc_port")


#: Where the relay reaches an engine: ("control", host, port) for its ``vllm.Control``,
#: ("tcp", host, port) for a static ZMQ publisher, ("zmq", endpoint, "") for an ipc:// one.
Reach = tuple[str, str, str]


def engine_reach(spec: EngineSpec) -> list[tuple[Reach, str]]:
    """Where the relay reaches ``spec`` (its ``vllm.Control`` endpoint, each static rank's
    publisher; nothing for a DNS template), with what each is. Two engines that share one are one
    engine entered twice: the relay keys engines by their Control endpoint, so written alike one of
    them was never watched, and spelled two ways (``::1``, ``0:0::1``) its blocks were counted
    twice. Hosts compare as ``host_key`` spells them. Raises ``InvalidEndpoint`` (a static rank's
    port past 65535)."""
    if spec.dns is not None:
        return []
    out: list[tuple[Reach, str]] = []
    if spec.grpc_port is not None:
        host = spec.host.removeprefix("[").removesuffix("]")
        where = f"[{host}]:{spec.grpc_port}" if ":" in host else f"{host}:{spec.grpc_port}"
        out.append((("control", host_key(spec.host), str(spec.grpc_port)),
                    f"vllm.Control endpoint {where}"))  # fmt: skip
    if spec.static is not None:
        for src in static_sources(spec.static, spec.host):
            ep = src.endpoint
            if ep.startswith("tcp://"):
                host, port = split_tcp(ep)
                if port == 0:
                    continue  # ephemeral: nothing to connect to, nothing to share
                key: Reach = ("tcp", host_key(host), str(port))
            else:
                key = ("zmq", ep, "")
            out.append((key, f"rank {src.dp_rank} publisher {ep}"))
    return out


@dataclass(frozen=True, slots=True)
class ConnectConfig:
    """A pool-level bound ingest endpoint that engines' PUB sockets connect to (§22).

    ``topic_pattern`` names each message's member (``ingest/topic_pattern.py``); ``kind`` is the
    publishers' engine family. There is no replay: a gap or a restart resets the member, and a
    member silent for ``member_silence_s`` is removed.
    """

    bind: tuple[str, ...]
    topic_pattern: str
    kind: EngineKind = EngineKind.VLLM
    max_members: int = 1024
    member_silence_s: float = 600.0
    #: Publisher addresses/networks accepted (empty: any); see ``ingest/connect.py``.
    allow: tuple[str, ...] = ()
    #: (engine, addresses/networks it may publish from); others bind to their first address.
    addresses: tuple[tuple[str, tuple[str, ...]], ...] = ()
    max_topic_bytes: int = 256
    max_batch_bytes: int = 16 * 1024 * 1024
    max_member_blocks: int = 1 << 22
    #: CURVE secret key (Z85) read from ``curve_secret_key_file``; None: plaintext ZMTP.
    curve_secret_key: str | None = field(default=None, repr=False)
    #: Publishers' CURVE public keys (Z85) from ``curve_client_keys_file``; empty: any key.
    curve_client_keys: tuple[str, ...] = field(default=(), repr=False)
    #: (key, engines) for keys the file binds to engines: only the keys naming an engine may
    #: publish it, and such a key only those.
    curve_key_engines: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.bind:
            raise ValueError("connect mode needs at least one bind endpoint")
        import ipaddress

        for a in (*self.allow, *(x for _n, xs in self.addresses for x in xs)):
            ipaddress.ip_network(a, strict=False)  # raises ValueError
        if min(self.max_topic_bytes, self.max_batch_bytes, self.max_member_blocks) < 1:
            raise ValueError("connect caps must be >= 1")
        TopicPattern(self.topic_pattern)  # raises PatternError (a ValueError)
        if self.max_members < 1 or self.member_silence_s <= 0:
            raise ValueError("max_members must be >= 1 and member_silence_s > 0")
        if self.curve_client_keys and self.curve_secret_key is None:
            raise ValueError("CURVE client keys need a CURVE secret key")



@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One serving endpoint ``(namespace, component, endpoint)`` and the engines behind it."""

    namespace: str
    component: str
    endpoint: str
    engines: tuple[EngineSpec, ...]
    role: pb.WorkerRole = pb.WorkerRole.AGGREGATED
    #: DNF of roles this endpoint needs elsewhere in the namespace (e.g. DECODE needs PREFILL).
    needs: tuple[frozenset[pb.WorkerRole], ...] = ()
    hash_format: pb.KvQueryHashFormat = pb.KvQueryHashFormat.DYNAMO_STANDARD_V1
    expected_blocks: int = 1_048_576
    ckf_seed: int = DEFAULT_CKF_SEED
    #: Canonical model id; default: the engines' ``served_model_name``.
    model: str | None = None
    #: Source path for the default cache-semantics digest; default: ``ModelInfo.model_id``.
    model_source: str | None = None
    #: Block size for static engines; with Control it comes from ``ServerInfo.kv_block_size``.
    kv_block_size: int | None = None
    decode: DecodeOptions = field(default_factory=DecodeOptions)
    #: The engines may re-announce prefix-cache hits as stores (vLLM ``kv_cache_report_mode =
    #: "full"``): a store with no parent whose blocks are all held is then taken as a report, not
    #: as new physical copies (docs/contract.md, "Duplicate stores").
    engine_reports: bool = False
    #: Engines that connect to a bound endpoint of the pool (then ``engines`` may be empty,
    #: and ``model`` and ``kv_block_size`` are required).
    connect: ConnectConfig | None = None
    #: A member holding more blocks than this is reset (``block_cap``): no engine's device tier
    #: holds millions of blocks, and an engine that announces stores and never removes them
    #: would otherwise grow the exact state without bound.
    max_member_blocks: int = 1 << 22
    #: LoRA adapters the pool's engines serve, declared: what an engine without ``vllm.Control``
    #: (SGLang, a static or connecting publisher) cannot report. Registered in the catalog beside
    #: those Control reports, and served while an engine of the pool is.
    lora_adapters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_member_blocks < 1:
            raise ValueError("max_member_blocks must be >= 1")
        bad = [n for n in self.lora_adapters if not n or n != n.strip()]
        if bad or len(set(self.lora_adapters)) != len(self.lora_adapters):
            raise ValueError(f"lora_adapters: names must be distinct, non-empty, without "
                             f"surrounding whitespace: {list(self.lora_adapters)!r}")  # fmt: skip
        for name in ("namespace", "component", "endpoint"):
            value = getattr(self, name)
            if not value or value != value.strip():
                raise ValueError(f"pool {name} must be non-empty without surrounding whitespace")
        if not self.engines and self.connect is None:
            raise ValueError("a pool needs at least one engine or a connect endpoint")
        if self.connect is not None and (self.model is None or self.kv_block_size is None):
            raise ValueError("a pool with a connect endpoint needs model and kv_block_size")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError("engine names must be unique within a pool")
        bucket_count_for(self.expected_blocks)  # raises when over 2^24 buckets

    @property
    def triple(self) -> tuple[str, str, str]:
        return (self.namespace, self.component, self.endpoint)

    @property
    def bucket_count(self) -> int:
        return bucket_count_for(self.expected_blocks)


@dataclass(frozen=True, slots=True)
class RelaySettings:
    dc_name: str
    pools: tuple[PoolSpec, ...] = ()
    limits: RelayLimits = field(default_factory=RelayLimits)
    drt_instance_id: int | None = None
    discovery_interval_s: float = 5.0
    #: Engines from DNS: how often each ``dns`` name is resolved again, and the resolver to ask
    #: (``host:port``; the system resolver when unset).
    dns_interval_s: float = 10.0
    dns_server: str | None = None
    discovery_timeout_s: float = 2.0
    metrics_scrape_interval_s: float = 1.0
    #: An engine unreachable on Control *and* disconnected on every ZMQ source this long is down:
    #: its members are cleared.
    engine_down_grace_s: float = 30.0
    #: Where a clean stop saves each pool's exact state and a start restores it (None: off).
    state_dir: str | None = None
    #: A state file older than this is ignored (its members would need history long gone).
    state_max_age_s: float = 3600.0
    #: With ``state_dir``: how often each pool's state is also checkpointed while running, so a
    #: crash loses no more than the engines' replay buffers cover (0: only at a clean stop).
    checkpoint_interval_s: float = 30.0
    #: How fast a checkpoint reads a pool's state (0: as fast as it can): its stream through
    #: memory shares the CPU caches the event loop's next batch needs.
    checkpoint_bytes_per_second: int = CHECKPOINT_BYTES_PER_SECOND
    #: How often a full scrub pass checks each pool's filter against its exact state (0: off).
    scrub_interval_s: float = 300.0
    #: How engines' live streams are read: ``"zmtp"``, the relay's own ZMTP reader on the event
    #: loop for ``tcp://`` and ``ipc://`` endpoints (libzmq for others), or ``"libzmq"`` always.
    zmq_reader: str = "zmtp"

    def __post_init__(self) -> None:
        require_reader(self.zmq_reader, "zmq_reader")
        if not self.dc_name or self.dc_name != self.dc_name.strip():
            raise ValueError("dc_name must be non-empty without surrounding whitespace")
        triples = [p.triple for p in self.pools]
        if len(set(triples)) != len(triples):
            raise ValueError("two pools share one serving endpoint")
        engine_names = [e.name for p in self.pools for e in p.engines]
        if len(set(engine_names)) != len(engine_names):
            raise ValueError("an engine name appears in more than one pool")
        binds = [b for p in self.pools if p.connect is not None for b in p.connect.bind]
        if len(set(binds)) != len(binds):
            raise ValueError("two pools bind the same connect endpoint")
