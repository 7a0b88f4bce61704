"""The daemon's TOML configuration: parse, apply ``KVRELAY_*`` overrides, validate, build.

Validation never stops at the first problem: an operator fixing a file wants every mistake at
once, each with the exact key path (``pools[0].engines[1].grpc_port``) and a reason. Only a file
with no *error* builds a :class:`DaemonConfig`; *warnings* (e.g. plaintext gRPC on a non-loopback
address) are reported and kept on the config so the daemon can log them.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay._text import is_decimal
from kvrelay.contract.limits import MAY_BE_ZERO, RelayLimits
from kvrelay.discovery.endpoints import (
    IPAddress,
    StaticSourceConfig,
    canonical_ip,
    connects_instead_of_binding,
    host_key,
    is_wildcard_host,
    split_tcp,
)
from kvrelay.discovery.errors import InvalidEndpoint
from kvrelay.hashing.identity import DEFAULT_CKF_SEED, bucket_count_for
from kvrelay.ingest.kinds import ENGINE_KINDS
from kvrelay.ingest.live_source import READERS
from kvrelay.ingest.options import DecodeOptions
from kvrelay.ingest.topic_pattern import PatternError, TopicPattern
from kvrelay.mirror.settings import MAX_PERIOD_S as MAX_MIRROR_PERIOD_S
from kvrelay.ops import curve_keys, early_signals
from kvrelay.ops.private_dirs import INTERNAL_SOCKET, socket_path_problem
from kvrelay.ops.tls import (
    CrlSignatureError,
    ServerTlsFiles,
    TlsConfigError,
    client_ssl_context,
    crl_problems,
    is_loopback,
    server_ssl_context,
)
from kvrelay.relay.settings import (
    CHECKPOINT_BYTES_PER_SECOND,
    ConnectConfig,
    EngineSpec,
    PoolSpec,
    Reach,
    RelaySettings,
    engine_reach,
)
from kvrelay.service.authz import AuthorizationRule

DEFAULT_BIND = "127.0.0.1:50161"
DEFAULT_METRICS_BIND = "127.0.0.1:50162"
#: A mirror's own default: a relay and a mirror of it on one host must not collide on 50162.
MIRROR_METRICS_BIND = "127.0.0.1:50172"
ENV_PREFIX = "KVRELAY_"
#: Dynamo's variables for the data-centre name, dc_name's last fallbacks, first found wins:
#: 1.7's Pool Relay ``--cluster-id`` / DYN_CLUSTER_ID, then 1.6's ``--dc-id`` / DYN_DC_ID.
DYNAMO_DC_ENVS = ("DYN_CLUSTER_ID", "DYN_DC_ID")
U64_MAX = (1 << 64) - 1

ROLES: dict[str, pb.WorkerRole] = {
    "aggregated": pb.WorkerRole.AGGREGATED,
    "prefill": pb.WorkerRole.PREFILL,
    "decode": pb.WorkerRole.DECODE,
    "encode": pb.WorkerRole.ENCODE,
    "legacy": pb.WorkerRole.LEGACY,
}
HASH_FORMATS: dict[str, pb.KvQueryHashFormat] = {
    "standard": pb.KvQueryHashFormat.DYNAMO_STANDARD_V1,
    "eagle": pb.KvQueryHashFormat.DYNAMO_EAGLE_V1,
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("auto", "json", "console")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem at one key path. ``severity="warning"`` never blocks start-up."""

    path: str
    reason: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.reason}"


class ConfigError(Exception):
    """The file has errors; ``problems`` holds all of them (errors and warnings)."""

    def __init__(self, problems: Iterable[ConfigProblem]) -> None:
        self.problems = tuple(problems)
        errors = [p for p in self.problems if p.severity == "error"]
        super().__init__(f"{len(errors)} configuration error(s)")


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = "info"
    format: str = "auto"  # auto: JSON unless stderr is a terminal


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 50162
    per_member: bool = True  # ingest series per (pool, worker, dp_rank); False: summed per pool


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None  # set: clients must present a certificate signed by it (mTLS)
    client_crl: str | None = None  # set: CRLs of the client CA(s); a revoked client is refused

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def files(self) -> ServerTlsFiles | None:
        """The listener's files (None: TLS is off)."""
        if self.cert is None or self.key is None:
            return None
        return ServerTlsFiles(self.cert, self.key, self.client_ca, self.client_crl)


@dataclass(frozen=True, slots=True)
class MirrorConfig:
    """``[mirror]``: serve another relay's contract instead of ingesting engines."""

    upstream: str  # HOST:PORT or unix:/path
    subscriber_id: str = "kvrelay-mirror"
    sync_wait_s: float = 10.0
    upstream_heartbeat_s: float = 10.0
    #: a mirrored pool idle this long is released (its upstream stream ends); 0: never
    release_idle_s: float = 60.0
    tls_ca: str | None = None  # set: TLS to the upstream, verified against this CA
    tls_cert: str | None = None  # client certificate (mTLS upstream)
    tls_key: str | None = None


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    relay: RelaySettings
    bind_host: str = "127.0.0.1"
    bind_port: int = 50161
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    event_loop: str = "auto"
    shutdown_timeout_s: float = 10.0
    warnings: tuple[ConfigProblem, ...] = ()
    #: processes serving gRPC: 1 = the relay itself; N ≥ 2 = ingest + N−1 fan-out workers
    workers: int = 1
    mirror: MirrorConfig | None = None
    #: where ``workers = N`` puts its internal socket's private directory (None: $TMPDIR)
    runtime_dir: str | None = None
    #: ``[[authorization]]`` rules; None: no table at all (every client sees every pool)
    authorization: tuple[AuthorizationRule, ...] | None = None

    def summary(self) -> str:
        """One line for ``check-config`` and the start-up log."""
        n_engines = sum(len(p.engines) for p in self.relay.pools)
        workers = f"; {self.workers} processes" if self.workers > 1 else ""
        mode = "plaintext"
        if self.tls.enabled:
            mode = "mTLS" if self.tls.client_ca else "TLS"
        if self.authorization is not None:
            mode += f", {len(self.authorization)} authorization rule(s)"
        grpc = f"{format_bind(self.bind_host, self.bind_port)} ({mode})"
        metrics = (
            format_bind(self.metrics.host, self.metrics.port) if self.metrics.enabled else "off"
        )
        if self.mirror is not None:
            up = "TLS" if self.mirror.tls_ca else "plaintext"
            source = f"mirror of {self.mirror.upstream} ({up})"
        else:
            n_connect = sum(1 for p in self.relay.pools if p.connect is not None)
            connect = f", {n_connect} connect endpoint(s)" if n_connect else ""
            source = (
                f"dc {self.relay.dc_name!r}: {len(self.relay.pools)} pool(s), "
                f"{n_engines} engine(s){connect}"
            )
        return (
            f"{source}; gRPC {grpc}{workers}; metrics {metrics}; "
            f"{len(self.warnings)} warning(s)"
        )


# ---------------------------------------------------------------------------------------------
# addresses


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*$"
)


def parse_bind(text: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` → (host, port); port 0 = ephemeral. Raises ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if not is_decimal(port) or int(port) > 65535:
        raise ValueError(f"port must be 0..65535, got {port!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad IPv6 address {host!r}") from None
        return host, int(port)
    if ":" in host:
        raise ValueError(f"IPv6 addresses need brackets: [{host}]:{port}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise ValueError(f"bad host {host!r}") from None
    return host, int(port)


def _overlap(a: str, b: str, *, a_zmq: bool = False, b_zmq: bool = False) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` (one port) would collide, as the OS decides
    for the relay's listeners (an IPv6 one is IPv6-only): one address however spelled
    (``::1`` and ``0:0::1``; ``::ffff:127.0.0.1`` is ``127.0.0.1``), or the unspecified address
    and any address of its family (``[::]`` and ``0.0.0.0`` do not collide). A name counts as
    every address it resolves to (``localhost``); one that does not resolve is left to the
    start to report. ``a_zmq``/``b_zmq``: that host is a connect-mode bind, which holds the
    addresses libzmq binds (``_zmq_bind_addresses``)."""
    if a == b:
        return True
    xs = _zmq_bind_addresses(a) if a_zmq else _host_addresses(a)
    ys = _zmq_bind_addresses(b) if b_zmq else _host_addresses(b)
    return any(
        x.version == y.version and (x == y or x.is_unspecified or y.is_unspecified)
        for x in xs
        for y in ys
    )


def _zmq_bind_addresses(host: str) -> set[IPAddress]:
    """What a connect-mode bind on ``host`` (``split_tcp``'s) holds, as libzmq binds it: the SUB
    sets ZMQ_IPV6 for an IPv6 literal alone (``ingest/connect.py``), so ``*`` and a name are
    IPv4 only (a name binds its IPv4 addresses), and an IPv6 literal binds a dual-stack socket
    (libzmq clears IPV6_V6ONLY): ``[::]`` holds ``0.0.0.0`` too, and ``[::ffff:a.b.c.d]`` is
    ``a.b.c.d``."""
    if host == "*":
        return {ipaddress.IPv4Address(0)}
    addr = canonical_ip(host)
    if addr is None:
        return {x for x in _host_addresses(host) if x.version == 4}
    if addr.version == 6 and addr.is_unspecified:
        return {addr, ipaddress.IPv4Address(0)}
    return {addr}


def _host_addresses(host: str) -> set[IPAddress]:
    """``host``'s IP addresses (``canonical_ip``): itself when it is one, else what it resolves
    to (none when it does not)."""
    addr = canonical_ip(host)
    if addr is not None:
        return {addr}
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    found = (canonical_ip(str(info[4][0]).partition("%")[0]) for info in infos)
    return {x for x in found if x is not None}


def format_bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# schema


Check = Callable[[Any], "str | None"]


@dataclass(frozen=True, slots=True)
class _Key:
    kind: str  # str | int | float | bool | roles | dnf | ints
    default: Any = None
    required: bool = False
    check: Check | None = None
    lower: bool = False  # case-insensitive keyword: stored lower-cased


def _int_range(lo: int, hi: int) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be in {lo}..{hi}, got {v}"


def _positive_s(v: float) -> str | None:
    return None if 0 < v <= 365 * 24 * 3600 else f"must be > 0 and <= 1 year (seconds), got {v}"


def _off_or_positive_s(v: float) -> str | None:
    """0 is allowed (off, or at once): the range says so."""
    if v == 0 or 0 < v <= 365 * 24 * 3600:
        return None
    return f"must be >= 0 and <= 1 year (seconds; 0 = off or at once), got {v}"


def _one_of(options: Iterable[str]) -> Check:
    opts = tuple(options)
    return lambda v: None if v.lower() in opts else f"must be one of {', '.join(opts)}, got {v!r}"


def _kw(default: str, options: Iterable[str]) -> _Key:
    return _Key("str", default, check=_one_of(options), lower=True)


def _text(v: str) -> str | None:
    if not v or v != v.strip():
        return "must be non-empty without surrounding whitespace"
    return None


def _adapter_names(v: list[str]) -> str | None:
    if any(_text(n) for n in v):
        return f"adapter names must be non-empty without surrounding whitespace, got {v!r}"
    if len(set(v)) != len(v):
        return f"duplicate adapter names in {v!r}"
    return None


def _bind_check(v: str) -> str | None:
    try:
        parse_bind(v)
    except ValueError as exc:
        return f"bad bind address: {exc}"
    return None


def _listen_check(v: str) -> str | None:
    """A listen address (``relay.bind``, ``metrics.bind``). The relay's IPv6 listeners are
    IPv6-only, where an IPv4-mapped address (``[::ffff:127.0.0.1]``) cannot be bound: the start
    failed with "Invalid argument" after ``check-config`` passed."""
    problem = _bind_check(v)
    if problem is not None:
        return problem
    host = parse_bind(v)[0]
    addr = canonical_ip(host)
    if addr is not None and addr.version == 4 and ":" in host:
        return (f"bad bind address: an IPv4-mapped address cannot be bound (IPv6 listeners are "
                f"IPv6-only); write {format_bind(str(addr), parse_bind(v)[1])}")  # fmt: skip
    return None


def _dns_server_check(v: str) -> str | None:
    """``IP:PORT`` (``[v6]:PORT``): the DNS client asks that server alone, by address (a host
    name there is refused at start, after ``check-config`` passed, and mid-reload), on a port
    it can send to: 1..65535 (port 0 passed as a bind's ephemeral port, and every lookup then
    failed with EINVAL)."""
    want = "the DNS server must be an IP address and port (IP:PORT, [IPv6]:PORT), port 1..65535"
    host, sep, port = v.rpartition(":")
    if not sep or not is_decimal(port) or not 1 <= int(port) <= 65535:
        return f"{want}, got {v!r}"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            return f"{want}, got {v!r}"
    elif ":" in host:
        return f"{want}; an IPv6 address needs brackets: [{host}]:{port}"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"{want}, got {v!r}"
    return None


def _expected_blocks(v: int) -> str | None:
    try:
        bucket_count_for(v)
    except ValueError as exc:
        return str(exc)
    return None


def _endpoint(v: str) -> str | None:
    if v.startswith("tcp://"):
        try:
            split_tcp(v)
        except ValueError as exc:
            return str(exc)
        return None
    if v.startswith(("ipc://", "inproc://")):
        return None
    return f"must be a tcp://, ipc:// or inproc:// ZMQ endpoint, got {v!r}"


def _limits_schema() -> dict[str, _Key]:
    out: dict[str, _Key] = {}
    defaults = RelayLimits()
    for f in fields(RelayLimits):
        value = getattr(defaults, f.name)
        if f.name in MAY_BE_ZERO:  # 0 = at once (publication_delay_s)
            out[f.name] = _Key("float", value, check=_off_or_positive_s)
        elif f.name.endswith("_s"):
            out[f.name] = _Key("float", value, check=_positive_s)
        else:
            out[f.name] = _Key("int", value, check=_int_range(1, 1 << 62))
    return out


RELAY_KEYS: dict[str, _Key] = {
    "bind": _Key("str", DEFAULT_BIND, check=_listen_check),
    "dc_name": _Key("str", required=True, check=_text),
    "drt_instance_id": _Key("int", None, check=_int_range(1, U64_MAX)),
    "discovery_interval_s": _Key("float", 5.0, check=_positive_s),
    "discovery_timeout_s": _Key("float", 2.0, check=_positive_s),
    "metrics_scrape_interval_s": _Key("float", 1.0, check=_positive_s),
    "engine_down_grace_s": _Key("float", 30.0, check=_positive_s),
    "dns_interval_s": _Key("float", 10.0, check=_positive_s),
    "dns_server": _Key("str", None, check=_dns_server_check),
    "state_dir": _Key("str", None, check=lambda v: None if v == "" else _text(v)),
    "state_max_age_s": _Key("float", 3600.0, check=_positive_s),
    "checkpoint_interval_s": _Key("float", 30.0, check=_off_or_positive_s),
    "checkpoint_bytes_per_second": _Key(
        "int", CHECKPOINT_BYTES_PER_SECOND, check=_int_range(0, 1 << 40)
    ),
    "scrub_interval_s": _Key("float", 300.0, check=_off_or_positive_s),
    "event_loop": _kw("auto", EVENT_LOOPS),
    "zmq_reader": _kw("zmtp", READERS),
    "workers": _Key("int", 1, check=_int_range(1, 256)),
    "runtime_dir": _Key("str", None, check=_text),
    "shutdown_timeout_s": _Key(
        "float", 10.0, check=lambda v: None if 0 < v <= 300 else f"must be in (0, 300], got {v}"
    ),
}
LIMITS_KEYS = _limits_schema()
LOGGING_KEYS: dict[str, _Key] = {
    "level": _kw("info", LOG_LEVELS),
    "format": _kw("auto", LOG_FORMATS),
}
METRICS_KEYS: dict[str, _Key] = {
    "enabled": _Key("bool", True),
    "bind": _Key("str", DEFAULT_METRICS_BIND, check=_listen_check),
    "per_member": _Key("bool", True),
}
TLS_KEYS: dict[str, _Key] = {
    "cert": _Key("str", None, check=_text),
    "key": _Key("str", None, check=_text),
    "client_ca": _Key("str", None, check=_text),
    "client_crl": _Key("str", None, check=_text),
}
def _upstream_check(v: str) -> str | None:
    from kvrelay.mirror.settings import UpstreamAddress

    try:
        UpstreamAddress.parse(v)
    except ValueError as exc:
        return str(exc)
    return None


def _subscriber_id(v: str) -> str | None:
    if not v or len(v.encode()) > 128 or any(ord(c) < 32 or 127 <= ord(c) <= 159 for c in v):
        return "must be 1..128 bytes of UTF-8 without control characters"
    return None


def _mirror_s(v: float) -> str | None:
    """``MirrorSettings``' own bound, so a value it refuses fails here, not at start."""
    return None if 0 < v <= MAX_MIRROR_PERIOD_S else (
        f"must be in (0, {MAX_MIRROR_PERIOD_S:g}] seconds, got {v}"
    )


def _mirror_off_or_s(v: float) -> str | None:
    """``_mirror_s``, or 0 (never)."""
    return None if 0 <= v <= MAX_MIRROR_PERIOD_S else (
        f"must be 0 (never) or in (0, {MAX_MIRROR_PERIOD_S:g}] seconds, got {v}"
    )


MIRROR_KEYS: dict[str, _Key] = {
    "upstream": _Key("str", required=True, check=_upstream_check),
    "subscriber_id": _Key("str", "kvrelay-mirror", check=_subscriber_id),
    "sync_wait_s": _Key("float", 10.0, check=_mirror_s),
    "upstream_heartbeat_s": _Key("float", 10.0, check=_mirror_s),
    "release_idle_s": _Key("float", 60.0, check=_mirror_off_or_s),
    "tls_ca": _Key("str", None, check=_text),
    "tls_cert": _Key("str", None, check=_text),
    "tls_key": _Key("str", None, check=_text),
}
POOL_KEYS: dict[str, _Key] = {
    "namespace": _Key("str", required=True, check=_text),
    "component": _Key("str", required=True, check=_text),
    "endpoint": _Key("str", required=True, check=_text),
    "role": _kw("aggregated", ROLES),
    "needs": _Key("dnf", []),
    "hash_format": _kw("standard", HASH_FORMATS),
    "expected_blocks": _Key("int", 1_048_576, check=_expected_blocks),
    "ckf_seed": _Key("int", DEFAULT_CKF_SEED, check=_int_range(0, U64_MAX)),
    "model": _Key("str", None, check=_text),
    "model_source": _Key("str", None, check=_text),
    "kv_block_size": _Key("int", None, check=_int_range(1, 1 << 20)),
    "cache_salt_namespacing": _Key("bool", False),
    "multimodal_hashing": _Key("bool", False),
    "engine_reports": _Key("bool", False),
    "max_member_blocks": _Key("int", 1 << 22, check=_int_range(1, 1 << 31)),
    "lora_adapters": _Key("strs", [], check=_adapter_names),
}
ENGINE_KEYS: dict[str, _Key] = {
    "name": _Key("str", required=True, check=_text),
    "host": _Key("str", "127.0.0.1", check=_text),
    "grpc_port": _Key("int", None, check=_int_range(1, 65535)),
    "metrics_port": _Key("int", None, check=_int_range(1, 65535)),
    "total_kv_blocks": _Key("int", None, check=_int_range(1, 1 << 40)),
    "kind": _kw("vllm", ENGINE_KINDS),
    "dns": _Key("str", None, check=_text),
    "dns_srv": _Key("bool", False),
}
STATIC_KEYS: dict[str, _Key] = {
    "endpoint": _Key("str", required=True, check=_endpoint),
    "replay_endpoint": _Key("str", None, check=_endpoint),
    "dp_ranks": _Key("ints", [0]),
    "topic": _Key("str", ""),
    "buffer_steps": _Key("int", 10000, check=_int_range(1, 1 << 31)),
    "hwm": _Key("int", 100000, check=_int_range(0, 1 << 31)),
    "max_queue_size": _Key("int", 100000, check=_int_range(1, 1 << 31)),
}
def _pattern(v: str) -> str | None:
    try:
        TopicPattern(v)
    except PatternError as exc:
        return f"bad topic pattern: {exc}"
    return None


def _bind_endpoints(v: list[str]) -> str | None:
    for ep in v:
        problem = _endpoint(ep)
        if problem is not None:
            return problem
    if len(set(v)) != len(v):
        return f"duplicate endpoints in {v!r}"
    return None


def _addresses(v: list[str]) -> str | None:
    import ipaddress

    for a in v:
        try:
            ipaddress.ip_network(a, strict=False)
        except ValueError:
            return f"{a!r} is not an IP address or network (10.0.0.5, 10.0.0.0/24, ::1)"
    return None


CONNECT_KEYS: dict[str, _Key] = {
    "bind": _Key("strs", required=True, check=_bind_endpoints),
    "topic_pattern": _Key("str", required=True, check=_pattern),
    "kind": _kw("vllm", ENGINE_KINDS),
    "max_members": _Key("int", 1024, check=_int_range(1, 65536)),
    "member_silence_s": _Key("float", 600.0, check=_positive_s),
    "allow": _Key("strs", None, check=_addresses),
    "max_topic_bytes": _Key("int", 256, check=_int_range(8, 65536)),
    "max_batch_bytes": _Key("int", 16 * 1024 * 1024, check=_int_range(1024, 1 << 30)),
    "max_member_blocks": _Key("int", 1 << 22, check=_int_range(1, 1 << 31)),
    "curve_secret_key_file": _Key("str", None, check=_text),
    "curve_client_keys_file": _Key("str", None, check=_text),
}
#: Sections reachable through environment overrides (scalar keys only), longest prefix first.
ENV_SECTIONS: tuple[tuple[str, str, dict[str, _Key]], ...] = (
    ("RELAY_LIMITS_", "relay.limits", LIMITS_KEYS),
    ("RELAY_", "relay", RELAY_KEYS),
    ("LOGGING_", "logging", LOGGING_KEYS),
    ("METRICS_", "metrics", METRICS_KEYS),
    ("TLS_", "tls", TLS_KEYS),
    ("MIRROR_", "mirror", MIRROR_KEYS),
)
TOP_KEYS = ("relay", "pools", "logging", "metrics", "tls", "mirror", "authorization")
#: ``[[authorization]]``: who (any of uri/dns/cn) sees which pools (any of the selectors);
#: every value is a list of exact names or fnmatch globs (``service/authz.py``).
def _names(v: list[str]) -> str | None:
    for name in v:
        problem = _text(name)
        if problem is not None:
            return f"{name!r}: {problem}"
    return None


AUTHORIZATION_KEYS: dict[str, _Key] = {
    **{
        name: _Key("strs", None, check=_names)
        for name in ("uri", "dns", "cn", "namespaces", "pools", "models")
    },
    # its clients may ask for publication spacing (HoldPublication: mirrors, service/spacing.py)
    "spacing": _Key("bool", False),
}

#: Keys people bring from Dynamo's relay, and what kvrelay calls them (docs/dynamo.md).
KEY_HINTS: dict[str, str] = {
    "dc_id": "dc_name",  # Dynamo 1.6's --dc-id / DYN_DC_ID
    "cluster_id": "dc_name",  # Dynamo 1.7's --cluster-id / DYN_CLUSTER_ID
    "expected_unique_blocks": "expected_blocks",  # --expected-unique-blocks
}

_TYPE_NAMES = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean (true/false)",
    "ints": "a list of integers",
    "strs": "a string or a non-empty list of strings",
    "dnf": "a list of lists of roles, e.g. [[\"prefill\"]]",
}


# ---------------------------------------------------------------------------------------------
# reader


class _Reader:
    """Collects problems while reading typed values out of nested TOML tables."""

    def __init__(self, origins: Mapping[str, str]) -> None:
        self.problems: list[ConfigProblem] = []
        self.origins = origins  # key path → environment variable that set it

    def err(self, path: str, reason: str) -> None:
        env = self.origins.get(path)
        if env is not None:
            reason = f"{reason} (set by {env})"
        self.problems.append(ConfigProblem(path, reason))

    def warn(self, path: str, reason: str) -> None:
        self.problems.append(ConfigProblem(path, reason, "warning"))

    def table(self, path: str, value: Any) -> dict[str, Any] | None:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.err(path, f"must be a table, got {_tname(value)}")
            return None
        return value

    def tables(self, path: str, value: Any) -> list[dict[str, Any]]:
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            self.err(path, f"must be an array of tables ([[{path.split('.')[-1]}]])")
            return []
        return value

    def keys(
        self,
        path: str,
        raw: Mapping[str, Any],
        schema: Mapping[str, _Key],
        extra: Iterable[str] = (),
    ) -> dict[str, Any]:
        """Typed values for every schema key (defaults filled); unknown keys are problems."""
        allowed = set(schema) | set(extra)
        for k in raw:
            if k not in allowed:
                hint = [KEY_HINTS[k]] if KEY_HINTS.get(k) in allowed else difflib.get_close_matches(
                    k, sorted(allowed), n=1
                )
                known = ", ".join(sorted(allowed))
                more = f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {known}"
                if k in KEY_HINTS:
                    more += f" (Dynamo's {k} is kvrelay's {KEY_HINTS[k]})"
                self.err(_join(path, k), f"unknown key{more}")
        out: dict[str, Any] = {}
        for k, spec in schema.items():
            p = _join(path, k)
            if k not in raw:
                if spec.required:
                    self.err(p, "required key is missing")
                out[k] = spec.default
                continue
            value = self._typed(p, raw[k], spec)
            if value is _BAD:
                out[k] = spec.default
                continue
            if spec.check is not None and value is not None:
                problem = spec.check(value)
                if problem is not None:
                    self.err(p, problem)
                    out[k] = spec.default
                    continue
            if spec.lower:
                value = value.lower()
            out[k] = value
        return out

    def _typed(self, path: str, v: Any, spec: _Key) -> Any:
        kind = spec.kind
        ok = (
            (kind == "str" and isinstance(v, str))
            or (kind == "int" and isinstance(v, int) and not isinstance(v, bool))
            or (kind == "float" and isinstance(v, int | float) and not isinstance(v, bool))
            or (kind == "bool" and isinstance(v, bool))
        )
        if kind == "float" and ok:
            return float(v)
        if ok:
            return v
        if kind == "strs" and (
            isinstance(v, str)
            # (empty only where the default is: an empty list of adapters is the default's)
            or (
                isinstance(v, list)
                and (bool(v) or spec.default == [])
                and all(isinstance(x, str) for x in v)
            )
        ):
            return [v] if isinstance(v, str) else list(v)
        if kind == "ints" and isinstance(v, list):
            if not v:
                self.err(path, "must list at least one value")
                return _BAD
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1024 for x in v):
                self.err(path, f"must be a list of integers in 0..1023, got {v!r}")
                return _BAD
            if len(set(v)) != len(v):
                self.err(path, f"duplicate values in {v!r}")
                return _BAD
            return list(v)
        if kind == "dnf" and isinstance(v, list):
            return self._dnf(path, v)
        self.err(path, f"must be {_TYPE_NAMES[kind]}, got {_tname(v)} {v!r}")
        return _BAD

    def _dnf(self, path: str, v: list[Any]) -> Any:
        out: list[frozenset[pb.WorkerRole]] = []
        bad = False
        for i, alt in enumerate(v):
            if not isinstance(alt, list) or not alt:
                self.err(f"{path}[{i}]", "must be a non-empty list of roles, e.g. [\"prefill\"]")
                bad = True
                continue
            roles: set[pb.WorkerRole] = set()
            for j, r in enumerate(alt):
                name = r.lower() if isinstance(r, str) else None
                if name not in ROLES or name == "legacy":
                    allowed = ", ".join(n for n in ROLES if n != "legacy")
                    self.err(f"{path}[{i}][{j}]", f"must be one of {allowed}, got {r!r}")
                    bad = True
                    continue
                roles.add(ROLES[name])
            out.append(frozenset(roles))
        return _BAD if bad else out


_BAD = object()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _tname(v: Any) -> str:
    return {
        bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
        dict: "table",
    }.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------------------------
# environment overrides


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def apply_env(
    raw: dict[str, Any], env: Mapping[str, str]
) -> tuple[dict[str, str], list[ConfigProblem]]:
    """Apply ``KVRELAY_<SECTION>_<KEY>`` overrides to ``raw`` in place.

    Returns (key path → variable name, problems). Variables whose section is not one of relay,
    relay.limits, logging, metrics, tls, mirror (e.g. ``KVRELAY_CONFIG``) are ignored.
    """
    origins: dict[str, str] = {}
    problems: list[ConfigProblem] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        match = next((sec for sec in ENV_SECTIONS if rest.startswith(sec[0])), None)
        if match is None:
            continue
        prefix, section, schema = match
        key = rest[len(prefix) :].lower()
        path = f"{section}.{key}"
        spec = schema.get(key)
        if spec is None or spec.kind not in ("str", "int", "float", "bool"):
            hint = [KEY_HINTS[key]] if KEY_HINTS.get(key) in schema else difflib.get_close_matches(
                key, sorted(schema), n=1
            )
            more = f"; did you mean {ENV_PREFIX}{prefix}{hint[0].upper()}?" if hint else ""
            problems.append(ConfigProblem(f"env.{name}", f"no scalar key {path}{more}"))
            continue
        text = env[name]
        try:
            value = _convert(text, spec.kind)
        except ValueError as exc:
            problems.append(ConfigProblem(f"env.{name}", f"{path}: {exc}"))
            continue
        target = raw
        for part in section.split("."):
            nxt = target.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                target[part] = nxt
            target = nxt
        target[key] = value
        origins[path] = name
    return origins, problems


def _convert(text: str, kind: str) -> Any:
    t = text.strip()
    if kind == "str":
        return text
    if kind == "int":
        try:
            return int(t, 0)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if kind == "float":
        try:
            return float(t)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if t.lower() in _TRUE:
        return True
    if t.lower() in _FALSE:
        return False
    raise ValueError(f"expected a boolean (true/false/1/0/yes/no/on/off), got {text!r}")


# ---------------------------------------------------------------------------------------------
# build


def parse_config(
    raw: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    """Validate a parsed TOML document (plus overrides); config is None when any error exists."""
    data: dict[str, Any] = _deep_copy(dict(raw))
    environ = os.environ if env is None else env
    origins, problems = apply_env(data, environ)
    _dynamo_dc_fallback(data, environ, origins)
    r = _Reader(origins)
    r.problems.extend(problems)
    for k in data:
        if k not in TOP_KEYS:
            hint = difflib.get_close_matches(k, TOP_KEYS, n=1)
            r.err(k, "unknown section" + (f"; did you mean {hint[0]!r}?" if hint else ""))

    relay_raw = r.table("relay", data.get("relay")) or {}
    mirror_raw = r.table("mirror", data.get("mirror")) if "mirror" in data else None
    if "relay" not in data and mirror_raw is None:
        r.err("relay", "required section [relay] is missing (it needs at least dc_name)")
    relay_schema = RELAY_KEYS
    if mirror_raw is not None:  # a mirror's identity comes from its upstream: no dc_name needed
        relay_schema = {**RELAY_KEYS, "dc_name": _Key("str", "mirror", check=_text)}
    relay = r.keys("relay", relay_raw, relay_schema, extra=("limits",))
    limits_raw = r.table("relay.limits", relay_raw.get("limits")) or {}
    limits_vals = r.keys("relay.limits", limits_raw, LIMITS_KEYS)
    logging_vals = r.keys("logging", r.table("logging", data.get("logging")) or {}, LOGGING_KEYS)
    metrics_schema = METRICS_KEYS
    if mirror_raw is not None:
        mirror_bind = _Key("str", MIRROR_METRICS_BIND, check=_listen_check)
        metrics_schema = {**METRICS_KEYS, "bind": mirror_bind}
    metrics_vals = r.keys("metrics", r.table("metrics", data.get("metrics")) or {}, metrics_schema)
    tls_vals = r.keys("tls", r.table("tls", data.get("tls")) or {}, TLS_KEYS)

    limits = _limits(r, limits_vals)

    _check_tls(r, tls_vals)
    authorization = _authorization(r, data.get("authorization"), tls_vals)
    mirror = None
    if mirror_raw is not None:
        mirror = _mirror(r, mirror_raw)
        pools: list[PoolSpec] | None = []
        if "pools" in data:
            r.err("pools", "a mirror has no [[pools]]: it serves its upstream's pools")
    else:
        pools = _pools(r, data.get("pools"))
        if pools is not None:
            _port_collisions(r, pools)
            _connecting_publishers(r, pools)
            _unmet_needs(r, pools)

    bind_host, bind_port = parse_bind(relay["bind"])
    m_host, m_port = parse_bind(metrics_vals["bind"])
    if not tls_vals["cert"] and not is_loopback(bind_host):
        r.warn(
            "relay.bind",
            f"plaintext gRPC on non-loopback address {relay['bind']}; "
            "configure [tls] cert/key (and client_ca) for anything beyond one host",
        )
    if metrics_vals["enabled"] and m_port == bind_port != 0 and _overlap(m_host, bind_host):
        r.err("metrics.bind", f"same address as relay.bind ({metrics_vals['bind']} and "
                              f"{relay['bind']} listen on one port)")  # fmt: skip
    if pools:
        listeners = [("relay.bind", relay["bind"], bind_host, bind_port)]
        if metrics_vals["enabled"]:
            listeners.append(("metrics.bind", metrics_vals["bind"], m_host, m_port))
        _connect_collisions(r, pools, listeners)

    if relay["workers"] >= 2:
        too_long = socket_path_problem(_runtime_dir(relay["runtime_dir"], environ),
                                       INTERNAL_SOCKET)  # fmt: skip
        if too_long is not None:
            r.err("relay.runtime_dir", f"the internal socket of workers ≥ 2 goes there: "
                                       f"{too_long}")  # fmt: skip
    if limits is not None and relay["workers"] >= 2:  # each worker mirrors at these periods
        for name in ("pool_heartbeat_s", "readiness_heartbeat_s"):
            if getattr(limits, name) > MAX_MIRROR_PERIOD_S:
                r.err(f"relay.limits.{name}",
                      f"at most {MAX_MIRROR_PERIOD_S:g} s with workers ≥ 2: each fan-out "
                      "worker mirrors the ingest process at this period")  # fmt: skip

    errors = [p for p in r.problems if p.severity == "error"]
    if errors or limits is None or pools is None or (mirror_raw is not None and mirror is None):
        return None, r.problems
    try:
        settings = RelaySettings(
            dc_name=relay["dc_name"],
            pools=tuple(pools),
            limits=limits,
            drt_instance_id=relay["drt_instance_id"],
            discovery_interval_s=relay["discovery_interval_s"],
            discovery_timeout_s=relay["discovery_timeout_s"],
            metrics_scrape_interval_s=relay["metrics_scrape_interval_s"],
            engine_down_grace_s=relay["engine_down_grace_s"],
            dns_interval_s=relay["dns_interval_s"],
            dns_server=relay["dns_server"],
            state_dir=_state_dir(relay["state_dir"], environ),
            state_max_age_s=relay["state_max_age_s"],
            checkpoint_interval_s=relay["checkpoint_interval_s"],
            checkpoint_bytes_per_second=relay["checkpoint_bytes_per_second"],
            scrub_interval_s=relay["scrub_interval_s"],
            zmq_reader=relay["zmq_reader"],
        )
    except ValueError as exc:  # a rule checked only by the settings themselves
        r.err("relay", str(exc))
        return None, r.problems
    warnings = tuple(p for p in r.problems if p.severity == "warning")
    cfg = DaemonConfig(
        relay=settings,
        bind_host=bind_host,
        bind_port=bind_port,
        logging=LoggingConfig(level=logging_vals["level"], format=logging_vals["format"]),
        metrics=MetricsConfig(
            enabled=metrics_vals["enabled"], host=m_host, port=m_port,
            per_member=metrics_vals["per_member"],
        ),
        tls=TlsConfig(
            cert=tls_vals["cert"], key=tls_vals["key"], client_ca=tls_vals["client_ca"],
            client_crl=tls_vals["client_crl"],
        ),
        event_loop=relay["event_loop"],
        shutdown_timeout_s=relay["shutdown_timeout_s"],
        warnings=warnings,
        workers=relay["workers"],
        mirror=mirror,
        runtime_dir=_runtime_dir(relay["runtime_dir"], environ),
        authorization=authorization,
    )
    return cfg, r.problems


def _authorization(
    r: _Reader, value: Any, tls: dict[str, Any]
) -> tuple[AuthorizationRule, ...] | None:
    """``[[authorization]]`` rules; they need client certificates (``[tls] client_ca``)."""
    if value is None:
        return None
    raws = r.tables("authorization", value)
    rules: list[AuthorizationRule] = []
    for i, raw in enumerate(raws):
        path = f"authorization[{i}]"
        v = r.keys(path, raw, AUTHORIZATION_KEYS)
        rule = AuthorizationRule(
            **{k: tuple(v[k] or ()) for k in AUTHORIZATION_KEYS if k != "spacing"},
            spacing=bool(v["spacing"]),
        )
        if not (rule.uri or rule.dns or rule.cn):
            r.err(path, "names no client: set uri, dns or cn (exact names or globs)")
        if not (rule.namespaces or rule.pools or rule.models):
            r.err(path, "selects no pool: set namespaces, pools or models (names or globs)")
        for pattern in rule.pools:
            if pattern.count("/") < 2:
                r.err(f"{path}.pools", f"{pattern!r} is not namespace/component/endpoint")
        rules.append(rule)
    if not tls["client_ca"]:
        r.err("authorization", "rules need client certificates: set [tls] cert, key and "
              "client_ca (mutual TLS)")  # fmt: skip
    return tuple(rules)


def _runtime_dir(value: str | None, env: Mapping[str, str]) -> str | None:
    """``runtime_dir``: the file's value, else systemd's ``RuntimeDirectory=``
    (``$RUNTIME_DIRECTORY``), else ``$XDG_RUNTIME_DIR``, else None (the temp directory)."""
    if value:
        return value
    for name in ("RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"):
        found = env.get(name, "").split(":")[0]
        if found:
            return found
    return None


def _on_this_host(
    checked: tuple[DaemonConfig | None, list[ConfigProblem]],
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    """``checked`` with warnings about the directories the relay would use here, for the user
    this process runs as (``check-config``, ``serve``, a reload): a ``runtime_dir`` workers
    cannot use passed ``check-config`` and ``serve`` then exited 1, a ``state_dir`` others can
    write to passed and ``serve`` then ran without saving state. Added to what a file gives,
    not to ``parse_config``'s, which judges the document wherever it is (a pod's manifest, on a
    host without its volumes)."""
    cfg, problems = checked
    if cfg is None:
        return checked
    r = _Reader({})
    runtime = cfg.runtime_dir
    if cfg.workers >= 2 and runtime is not None and (unusable := _unwritable_dir(runtime)):
        r.warn("relay.runtime_dir",
               f"{unusable}: workers ≥ 2 make their internal socket's directory there, so "
               "serve would exit 1 (start_failed). Set runtime_dir (KVRELAY_RELAY_RUNTIME_DIR) "
               "to a directory the relay's user can write, e.g. an emptyDir on "
               "Kubernetes")  # fmt: skip
    state = cfg.relay.state_dir
    if cfg.mirror is None and state is not None and (unsafe := _state_dir_problem(state)):
        r.warn("relay.state_dir",
               f"{unsafe}: the relay would neither restore nor save state there "
               "(state_dir_unusable). It must be a directory owned by the relay's user that "
               "nobody else can write to (chmod 0700), or one the relay can create")  # fmt: skip
    if not r.problems:
        return checked
    return replace(cfg, warnings=cfg.warnings + tuple(r.problems)), [*problems, *r.problems]


def _unwritable_dir(path: str) -> str | None:
    """Why this user cannot make a directory in ``path`` (None: it can), as the start finds out
    (``PrivateDir``): missing, not a directory, or not writable (a read-only mount too)."""
    try:
        if not os.path.isdir(path):
            return f"{path!r} is not a directory" if os.path.lexists(path) else (
                f"{path!r} does not exist")  # fmt: skip
    except OSError as exc:
        return f"{path!r}: {exc.strerror}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path!r} is not writable by this user"
    return None


def _state_dir_problem(path: str) -> str | None:
    """Why the relay, run as this user, would refuse ``state_dir`` (``Relay._state_dir``): one
    that others can write to, or owned by another user (``safe_files``), or one it cannot
    create. None when it would use it. A warning, not an error: the relay serves without it
    (state saving off), and ``check-config`` may run where the directory is not made yet."""
    from kvrelay.relay import safe_files

    try:
        if os.path.lexists(path):
            safe_files.check_private_dir(path)
            return None
    except safe_files.UnsafeDirectory as exc:
        return str(exc)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path}: does not exist, and this user cannot create it in {parent}"
    return None


def _state_dir(value: str | None, env: Mapping[str, str]) -> str | None:
    """``state_dir``: the file's value (``""`` = off), else systemd's ``StateDirectory=``
    (``$STATE_DIRECTORY``), else off."""
    if value is not None:
        return value or None
    systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    return systemd or None


def _dynamo_dc_fallback(
    data: dict[str, Any], env: Mapping[str, str], origins: dict[str, str]
) -> None:
    """``dc_name`` from Dynamo's ``DYN_CLUSTER_ID`` (1.7), else ``DYN_DC_ID`` (1.6), when neither
    the file nor KVRELAY_RELAY_DC_NAME sets it, so a relay deployed beside Dynamo's shares its
    data-centre identity by default."""
    relay = data.get("relay")
    source = next((name for name in DYNAMO_DC_ENVS if env.get(name) is not None), None)
    if source is None or (isinstance(relay, dict) and "dc_name" in relay):
        return
    value = env[source]
    if relay is None:
        relay = data["relay"] = {}
    if isinstance(relay, dict):
        relay["dc_name"] = value
        origins["relay.dc_name"] = source


def _unmet_needs(r: _Reader, pools: list[PoolSpec]) -> None:
    """Warn when no alternative of a pool's ``needs`` can be met by the configured pools of its
    namespace: readiness then keeps the model UNAVAILABLE for ever (an aggregated fleet that
    kept the example's decode pool but deleted its prefill pool)."""
    roles: dict[str, set[pb.WorkerRole]] = {}
    for pool in pools:
        roles.setdefault(pool.namespace, set()).add(pool.role)
    names = {v: k for k, v in ROLES.items()}
    for i, pool in enumerate(pools):
        if not pool.needs:
            continue
        present = roles[pool.namespace]
        if any(alt <= present for alt in pool.needs):
            continue
        wanted = " or ".join(
            "+".join(sorted(names.get(x, str(int(x))) for x in alt)) for alt in pool.needs
        )
        have = ", ".join(sorted(names.get(x, str(int(x))) for x in present))
        r.warn(
            f"pools[{i}].needs",
            f"needs {wanted} in namespace {pool.namespace!r}, but its configured pools there "
            f"have only {have}: readiness will keep the model UNAVAILABLE. Add the pool that "
            "provides it, or remove `needs` (and make the role aggregated) for a fleet without it",
        )


def _port_collisions(r: _Reader, pools: list[PoolSpec]) -> None:
    """Warn when two static sources need one host:port.

    vLLM adds the DP rank to the publisher *and* the replay port, so bases fewer than dp-size
    ports apart collide (5557/5558 with two ranks: rank 1 publishes on 5558, rank 0's replay
    port) and the engine fails to start with "Address already in use". Engines on one host need
    distinct ranges too. Warnings, because the relay itself binds none of these ports.

    Hosts are compared as addresses (``host_key``: ``::ffff:10.0.0.5`` is ``10.0.0.5``), and
    a wildcard endpoint binds every address of its engine's host, so it collides with any
    endpoint of that host on its port.
    """
    # port → what binds it: (the engine's host, the bound host: None for a wildcard, what)
    seen: dict[int, list[tuple[str, str | None, str]]] = {}
    for i, pool in enumerate(pools):
        for j, eng in enumerate(pool.engines):
            st = eng.static
            if st is None or eng.dns is not None:  # a DNS engine's host comes from records
                continue
            base = f"pools[{i}].engines[{j}].static"
            machine = host_key(eng.host)
            for key, ep in (("endpoint", st.endpoint), ("replay_endpoint", st.replay_endpoint)):
                if not ep or not ep.startswith("tcp://"):
                    continue
                host, port = split_tcp(ep)
                if port == 0:
                    continue  # ephemeral: the engine picks distinct ports itself
                bound = None if is_wildcard_host(host) else host_key(host)
                shown = eng.host if bound is None else host
                role = "publisher" if key == "endpoint" else "replay"
                for rank in sorted(set(st.dp_ranks)):
                    what = f"rank {rank} {role} port {port + rank}"
                    claims = seen.setdefault(port + rank, [])
                    other = next(
                        (o for m, b, o in claims if _binds_overlap(machine, bound, m, b)), None
                    )
                    claims.append((machine, bound, f"the {what} of {base}"))
                    if other is not None:
                        r.warn(
                            f"{base}.{key}",
                            f"{what} on {shown} is also {other}: vLLM adds the DP rank to both "
                            "endpoints' ports, so keep the bases at least as many ports apart as "
                            "there are ranks (e.g. tcp://*:5557 and tcp://*:5657), and give "
                            "engines on one host distinct ranges",
                        )


def _connecting_publishers(r: _Reader, pools: list[PoolSpec]) -> None:
    """Warn about a static publisher endpoint vLLM would connect to instead of binding
    (``connects_instead_of_binding``): the relay's endpoint is copied from the engine's
    ``--kv-events-config``, and the relay connects too, so no message would ever flow. A warning:
    the engine's own config may say ``*``."""
    for i, pool in enumerate(pools):
        for j, eng in enumerate(pool.engines):
            ep = eng.static.endpoint if eng.static is not None else ""
            if connects_instead_of_binding(ep):
                _host, port = split_tcp(ep)
                r.warn(
                    f"pools[{i}].engines[{j}].static.endpoint",
                    f"{ep}: vLLM binds its publisher only when the endpoint contains '*' or '::'; "
                    f"an engine given this one connects to it instead of listening, and nothing "
                    f"reaches the relay. Write tcp://*:{port} in vLLM's --kv-events-config and "
                    "here ([pools.connect] is for engines that connect)",
                )


_IN_USE = "the later bind fails at start (Address already in use); give each its own port"


def _connect_collisions(
    r: _Reader, pools: list[PoolSpec], listeners: list[tuple[str, str, str, int]]
) -> None:
    """Refuse connect-mode binds (``[pools.connect] bind``) that hold one address and port as
    another pool's, another of the pool's own, or one of the relay's ``listeners`` ((key path,
    as written, host, port)), compared as ``_overlap`` does (``tcp://*:5557`` and
    ``tcp://127.0.0.1:5557``). Errors, because the relay binds them all: the later bind failed
    at start ("Address already in use"; its pool retried for ever). An ipc:// path bound twice
    (however spelled) failed worse: the later bind took the socket file, silently, and the
    earlier pool never heard from an engine again."""
    # (key path, as written, host, port, a connect bind?)
    tcp: list[tuple[str, str, str, int, bool]] = [(*ln, False) for ln in listeners if ln[3]]
    files: dict[str, tuple[str, str]] = {}  # ipc file or inproc name → (key path, as written)
    for i, pool in enumerate(pools):
        if pool.connect is None:
            continue
        path = f"pools[{i}].connect.bind"
        for ep in pool.connect.bind:
            if ep.startswith("tcp://"):
                host, port = split_tcp(ep)
                clash = next(
                    (
                        (where, shown)
                        for where, shown, h, p, by_zmq in tcp
                        if p == port and _overlap(host, h, a_zmq=True, b_zmq=by_zmq)
                    ),
                    None,
                )
                tcp.append((path, ep, host, port, True))
            else:
                first = files.setdefault(_zmq_path(ep), (path, ep))
                clash = None if first == (path, ep) else first
            why = _IN_USE
            if ep.startswith("ipc://"):
                why = ("the later bind takes the socket file from the earlier, whose pool "
                       "then hears from no engine; give each its own path")  # fmt: skip
            if clash is not None:
                r.err(path, f"{ep} binds what {clash[0]} ({clash[1]}) does: {why}")


def _zmq_path(endpoint: str) -> str:
    """An ipc:// endpoint's socket file as an absolute path (``ipc://run/./kv.sock`` is
    ``ipc://run/kv.sock``: relative to the directory ``check-config`` runs in, as the relay's
    are to its own), an abstract (``ipc://@name``) or inproc:// one as written."""
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        return "ipc://" + os.path.abspath(endpoint[len("ipc://") :])
    return endpoint


def _binds_overlap(
    machine_a: str, bound_a: str | None, machine_b: str, bound_b: str | None
) -> bool:
    """Whether two engine binds of one port collide: one address (a wildcard stands for its
    engine's host), or a wildcard and anything on its engine's host."""
    if (bound_a or machine_a) == (bound_b or machine_b):
        return True
    return machine_a == machine_b and (bound_a is None or bound_b is None)


def _mirror(r: _Reader, raw: dict[str, Any]) -> MirrorConfig | None:
    n_before = len(r.problems)
    m = r.keys("mirror", raw, MIRROR_KEYS)
    ca, cert, key = m["tls_ca"], m["tls_cert"], m["tls_key"]
    if (cert is None) != (key is None):
        r.err("mirror.tls_key" if cert else "mirror.tls_cert",
              "tls_cert and tls_key go together (a client certificate for mTLS)")  # fmt: skip
    if cert is not None and ca is None:
        r.err("mirror.tls_ca", "required when a client certificate is set (TLS to the upstream)")
    for name in ("tls_ca", "tls_cert", "tls_key"):
        path = m[name]
        if path and not os.access(path, os.R_OK):
            why = "does not exist" if not os.path.exists(path) else "is not readable"
            r.err(f"mirror.{name}", f"file {path!r} {why}")
    if ca and len(r.problems) == n_before:
        try:
            client_ssl_context(ca, cert, key)
        except TlsConfigError as exc:
            r.err("mirror.tls_cert" if cert else "mirror.tls_ca", str(exc))
    upstream = m["upstream"]
    if upstream is not None and not upstream.startswith("unix:") and ca is None:
        host = upstream.rpartition(":")[0].strip("[]")
        if not is_loopback(host):
            r.warn("mirror.upstream", f"plaintext gRPC to non-loopback upstream {upstream}; "
                   "set mirror.tls_ca (and tls_cert/tls_key for mTLS)")  # fmt: skip
    if upstream is None or any(q.severity == "error" for q in r.problems[n_before:]):
        return None
    return MirrorConfig(
        upstream=upstream,
        subscriber_id=m["subscriber_id"],
        sync_wait_s=m["sync_wait_s"],
        upstream_heartbeat_s=m["upstream_heartbeat_s"],
        release_idle_s=m["release_idle_s"],
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
    )


def _limits(r: _Reader, values: dict[str, Any]) -> RelayLimits | None:
    """Cross-field limit rules (bad single values were already replaced by defaults)."""
    try:
        return RelayLimits(**values)
    except ValueError as exc:
        # RelayLimits stops at its first rule: try each set value alone (the other fields at
        # their defaults) so that every limit in error is reported at once, as the page says
        texts = []
        for key, value in values.items():
            if value != LIMITS_KEYS[key].default:
                try:
                    RelayLimits(**{key: value})
                except ValueError as one:
                    texts.append(str(one))
        for text in texts or [str(exc)]:
            name = next((k for k in LIMITS_KEYS if text.startswith(k)), None)
            r.err("relay.limits" + (f".{name}" if name else ""), text)
        return None


def _check_tls(r: _Reader, tls: dict[str, Any]) -> None:
    cert, key, ca = tls["cert"], tls["key"], tls["client_ca"]
    if cert and not key:
        r.err("tls.key", "required when tls.cert is set")
    if key and not cert:
        r.err("tls.cert", "required when tls.key is set")
    if ca and not cert:
        r.err("tls.cert", "required when tls.client_ca is set (mTLS needs a server certificate)")
    crl = tls["client_crl"]
    if crl and not ca:
        r.err("tls.client_crl", "needs tls.client_ca: CRLs revoke client certificates (mTLS)")
    n_before = len(r.problems)
    for name in ("cert", "key", "client_ca", "client_crl"):
        path = tls[name]
        if path and not os.access(path, os.R_OK):
            why = "does not exist" if not os.path.exists(path) else "is not readable"
            r.err(f"tls.{name}", f"file {path!r} {why}")
    if cert and key and len(r.problems) == n_before:
        try:  # PEM, a key that matches the certificate, a CA bundle that loads: here, not at start
            server_ssl_context(cert, key, ca, crl if ca else None)
        except CrlSignatureError:
            pass  # said below by crl_problems, beside anything else wrong with the CRLs
        except TlsConfigError as exc:
            r.err("tls.client_crl" if crl and "CRL" in str(exc) else "tls.cert", str(exc))
            return
        if crl and ca:  # issued (and signed) by a configured CA, and current: else OpenSSL
            # refuses clients
            try:
                errors, warnings = crl_problems(crl, ca)
            except TlsConfigError as exc:
                errors, warnings = [str(exc)], []
            for text in errors:
                r.err("tls.client_crl", text)
            for text in warnings:
                r.warn("tls.client_crl", text)


def _pools(r: _Reader, value: Any) -> list[PoolSpec] | None:
    if value is None:
        r.err("pools", "no pools configured: add at least one [[pools]] table")
        return None
    raws = r.tables("pools", value)
    if not raws:
        if isinstance(value, list):
            r.err("pools", "no pools configured: add at least one [[pools]] table")
        return None
    out: list[PoolSpec] = []
    seen_triples: dict[str, int] = {}
    seen_engines: dict[str, str] = {}
    seen_endpoints: dict[Reach, str] = {}
    ok = True
    for i, praw in enumerate(raws):
        path = f"pools[{i}]"
        n_before = len(r.problems)
        p = r.keys(path, praw, POOL_KEYS, extra=("engines", "connect"))
        connect = _connect(r, path, praw)
        triple = (p["namespace"], p["component"], p["endpoint"])
        if None not in triple:
            # the name is the key of the pool's state file, metrics and logs: two triples that
            # join to one name ("a/b", "c" and "a", "b/c") would share them
            name = "/".join(triple)
            if name in seen_triples:
                r.err(path, f"same pool name {name!r} (namespace/component/endpoint) as "
                            f"pools[{seen_triples[name]}]")  # fmt: skip
            seen_triples.setdefault(name, i)
        # a connect section in error still makes the pool one whose engines connect: no
        # "needs [[pools.engines]]" beside its own problem
        if "connect" in praw and "engines" not in praw:
            engines: list[EngineSpec] = []  # every engine connects to the pool's endpoint
        else:
            engines = _engines(r, path, praw.get("engines"), seen_engines, seen_endpoints)
        # (a key given and refused already has its error: it is not also "required")
        if "connect" in praw:
            for k in ("model", "kv_block_size"):
                if p[k] is None and k not in praw:
                    r.err(f"{path}.{k}", "required with [pools.connect] (no engine reports it)")
        if engines and any(e.grpc_port is None for e in engines):
            for k in ("model", "kv_block_size"):
                if p[k] is None and k not in praw:
                    r.err(
                        f"{path}.{k}", "required when an engine has no grpc_port (static sources)"
                    )
        if p["role"] == "legacy" and p["needs"]:
            r.err(f"{path}.needs", "a legacy pool (no worker type) cannot declare needs")
        if len(r.problems) != n_before and any(
            q.severity == "error" for q in r.problems[n_before:]
        ):
            ok = False
            continue
        try:
            out.append(
                PoolSpec(
                    namespace=p["namespace"],
                    component=p["component"],
                    endpoint=p["endpoint"],
                    engines=tuple(engines),
                    role=ROLES[p["role"]],
                    needs=tuple(p["needs"]),
                    hash_format=HASH_FORMATS[p["hash_format"]],
                    expected_blocks=p["expected_blocks"],
                    ckf_seed=p["ckf_seed"],
                    model=p["model"],
                    model_source=p["model_source"],
                    kv_block_size=p["kv_block_size"],
                    decode=DecodeOptions(
                        cache_salt_namespacing=p["cache_salt_namespacing"],
                        multimodal_hashing=p["multimodal_hashing"],
                    ),
                    engine_reports=p["engine_reports"],
                    connect=connect,
                    max_member_blocks=p["max_member_blocks"],
                    lora_adapters=tuple(p["lora_adapters"]),
                )
            )
        except ValueError as exc:
            r.err(path, str(exc))
            ok = False
    return out if ok else None


def _connect(r: _Reader, pool_path: str, praw: dict[str, Any]) -> ConnectConfig | None:
    """``[pools.connect]``: the pool's bound ingest endpoint (§22), or None."""
    if "connect" not in praw:
        return None
    path = f"{pool_path}.connect"
    raw = r.table(path, praw["connect"])
    if raw is None:
        return None
    n_before = len(r.problems)
    c = r.keys(path, raw, CONNECT_KEYS, extra=("addresses",))
    addresses: list[tuple[str, tuple[str, ...]]] = []
    table = r.table(f"{path}.addresses", raw.get("addresses")) or {}
    for name, v in table.items():
        vals = [v] if isinstance(v, str) else v
        if not (isinstance(vals, list) and vals and all(isinstance(x, str) for x in vals)):
            r.err(f"{path}.addresses.{name}", "a string or a non-empty list of strings")
        elif (problem := _addresses(vals)) is not None:
            r.err(f"{path}.addresses.{name}", problem)
        else:
            addresses.append((str(name), tuple(vals)))
    curve = None
    if c["curve_secret_key_file"] is not None:
        curve = _curve_key(r, f"{path}.curve_secret_key_file", c["curve_secret_key_file"])
    clients = _curve_client_keys(r, path, c)
    if any(q.severity == "error" for q in r.problems[n_before:]):
        return None
    for ep in c["bind"]:
        if ep.startswith("tcp://") and split_tcp(ep)[1] == 0:
            r.err(f"{path}.bind", f"{ep}: engines need a fixed port to connect to")
            return None
    _open_connect_binds(r, path, c["bind"], bool(c["allow"] or clients.keys))
    try:
        return ConnectConfig(
            bind=tuple(c["bind"]),
            topic_pattern=c["topic_pattern"],
            kind=ENGINE_KINDS[c["kind"]],
            max_members=c["max_members"],
            member_silence_s=c["member_silence_s"],
            allow=tuple(c["allow"] or ()),
            addresses=tuple(addresses),
            max_topic_bytes=c["max_topic_bytes"],
            max_batch_bytes=c["max_batch_bytes"],
            max_member_blocks=c["max_member_blocks"],
            curve_secret_key=curve,
            curve_client_keys=clients.keys,
            curve_key_engines=clients.engines,
        )
    except ValueError as exc:
        r.err(path, str(exc))
        return None


def _curve_key(r: _Reader, path: str, file: str) -> str | None:
    """A Z85 CURVE secret key (40 characters) from ``file`` (the key never sits in the config)."""
    try:
        return curve_keys.read_secret_key(file)
    except curve_keys.KeyFileError as exc:
        r.err(path, str(exc))
        return None


def _curve_client_keys(r: _Reader, path: str, c: dict[str, Any]) -> curve_keys.ClientKeys:
    """The publishers' CURVE public keys from ``curve_client_keys_file`` (none when unset), and
    the engines some of them are bound to. They authenticate publishers only on a CURVE socket:
    without ``curve_secret_key_file`` the file is refused, not ignored."""
    none = curve_keys.ClientKeys(())
    file = c["curve_client_keys_file"]
    if file is None:
        return none
    where = f"{path}.curve_client_keys_file"
    if c["curve_secret_key_file"] is None:
        r.err(where, "needs curve_secret_key_file (publishers' keys are checked only on a CURVE "
                     "socket)")  # fmt: skip
        return none
    try:
        return curve_keys.read_client_keys(file)
    except curve_keys.KeyFileError as exc:
        r.err(where, str(exc))
        return none


def _open_connect_binds(r: _Reader, path: str, binds: list[str], guarded: bool) -> None:
    """Warn about a TCP bind off loopback that any publisher may use (as for plaintext gRPC):
    without ``allow`` or client keys, whoever reaches it publishes into the pool."""
    if guarded:
        return
    for ep in binds:
        if ep.startswith("tcp://") and not is_loopback(split_tcp(ep)[0].rpartition(";")[2]):
            r.warn(
                f"{path}.bind",
                f"connect socket on non-loopback address {ep} admits any publisher; set allow "
                "(the engines' addresses) or curve_client_keys_file (their CURVE keys) for "
                "anything beyond one host",
            )


def _engines(
    r: _Reader,
    pool_path: str,
    value: Any,
    seen: dict[str, str],
    endpoints: dict[Reach, str],
) -> list[EngineSpec]:
    path = f"{pool_path}.engines"
    raws = r.tables(path, value)
    if not raws:
        if value is None or isinstance(value, list):
            r.err(path, "a pool needs at least one [[pools.engines]] table")
        return []
    out: list[EngineSpec] = []
    names: dict[str, int] = {}
    for j, eraw in enumerate(raws):
        epath = f"{path}[{j}]"
        n_before = len(r.problems)
        e = r.keys(epath, eraw, ENGINE_KEYS, extra=("static",))
        static: StaticSourceConfig | None = None
        if "static" in eraw:
            sraw = r.table(f"{epath}.static", eraw["static"])
            if sraw is not None:
                s = r.keys(f"{epath}.static", sraw, STATIC_KEYS)
                if s["endpoint"] is not None:
                    static = StaticSourceConfig(
                        endpoint=s["endpoint"],
                        replay_endpoint=s["replay_endpoint"],
                        dp_ranks=tuple(s["dp_ranks"]),
                        topic=s["topic"],
                        buffer_steps=s["buffer_steps"],
                        hwm=s["hwm"],
                        max_queue_size=s["max_queue_size"],
                    )
        name = e["name"]
        if name is not None:
            if name in names:
                r.err(
                    f"{epath}.name", f"duplicate engine name {name!r} (also {path}[{names[name]}])"
                )
            elif name in seen:
                r.err(f"{epath}.name", f"engine name {name!r} already used in {seen[name]}")
            names.setdefault(name, j)
            seen.setdefault(name, epath)
        if e["kind"] == "sglang":
            if "grpc_port" in eraw or e["dns_srv"]:
                r.err(f"{epath}.grpc_port", "SGLang has no vllm.Control: give static sources")
            if "static" not in eraw:
                r.err(f"{epath}.static", "required for an SGLang engine (no gRPC discovery)")
        elif "grpc_port" not in eraw and "static" not in eraw and not e["dns_srv"]:
            r.err(
                f"{epath}.grpc_port",
                "required unless [pools.engines.static] sources are given (vLLM < 0.27)"
                " or dns_srv names SRV records",
            )
        if name is not None and "@" in name:
            r.err(f"{epath}.name", "'@' is reserved for engines found by DNS (name@address)")
        if e["dns_srv"] and not e["dns"]:
            r.err(f"{epath}.dns_srv", "needs dns = the SRV name to resolve")
        if e["dns"] and "host" in eraw:
            r.err(f"{epath}.host", "an engine found by DNS takes its host from the records")
        if any(q.severity == "error" for q in r.problems[n_before:]):
            continue
        try:
            spec = EngineSpec(
                name=name,
                host=e["host"],
                grpc_port=e["grpc_port"],
                static=static,
                metrics_port=e["metrics_port"],
                total_kv_blocks=e["total_kv_blocks"],
                kind=ENGINE_KINDS[e["kind"]],
                dns=e["dns"],
                dns_srv=e["dns_srv"],
            )
        except ValueError as exc:
            r.err(epath, str(exc))
            continue
        if _claim_endpoints(r, epath, spec, endpoints):
            out.append(spec)
    return out


def _claim_endpoints(
    r: _Reader, epath: str, spec: EngineSpec, seen: dict[Reach, str]
) -> bool:
    """Record where the relay reaches ``spec`` (``engine_reach``), refusing any an earlier engine
    of any pool has already (one engine entered twice). An engine found by DNS takes its host
    from the records: the relay checks it as it is found."""
    try:
        reach = engine_reach(spec)
    except InvalidEndpoint as exc:  # a rank's port past 65535
        r.err(f"{epath}.static.dp_ranks", f"{exc} (rank r publishes on the port + r)")
        return False
    ok = True
    for key, what in reach:
        path = f"{epath}.grpc_port" if key[0] == "control" else f"{epath}.static.endpoint"
        other = seen.setdefault(key, f"{what} of {path}")
        if other != f"{what} of {path}":
            r.err(path, f"{what} is also the {other}: two entries for one engine (its blocks "
                        "counted twice, or one entry never watched); configure each engine "
                        "once")  # fmt: skip
            ok = False
    return ok


def _deep_copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _deep_copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_deep_copy(x) for x in v]
    return v


def _read_toml(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[ConfigProblem]]:
    """One file's TOML document; unreadable files and syntax errors are problems."""
    p = Path(path)
    try:
        text = early_signals.read_bytes(p)  # (a stop comes through a blocked read: its doc)
    except OSError as exc:
        return None, [ConfigProblem(str(p), f"cannot read the file: {exc.strerror or exc}")]
    try:
        return tomllib.loads(text.decode("utf-8")), []
    except UnicodeDecodeError as exc:
        return None, [ConfigProblem(str(p), f"not UTF-8 text: {exc}")]
    except tomllib.TOMLDecodeError as exc:
        return None, [ConfigProblem(str(p), f"TOML syntax error: {exc}")]


def check_file(
    path: str | os.PathLike[str], env: Mapping[str, str] | None = None
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    """Read and validate one file; unreadable files and TOML syntax errors are problems too."""
    raw, problems = _read_toml(path)
    return (None, problems) if raw is None else _on_this_host(parse_config(raw, env))


@dataclass(frozen=True, slots=True)
class MirrorFlags:
    """``kvrelay mirror``'s options. Each overrides its key of the file and that key's
    ``KVRELAY_*`` variable (which a pod sets): kept whole, so a reload applies them again."""

    upstream: str | None = None
    bind: str | None = None
    workers: int | None = None
    metrics_bind: str | None = None  # "off": metrics disabled


def mirror_config(
    path: str | os.PathLike[str] | None, flags: MirrorFlags, env: Mapping[str, str] | None = None
) -> tuple[DaemonConfig | None, list[ConfigProblem]]:
    """The configuration ``kvrelay mirror`` runs: ``path`` (None: no file) with ``flags`` on
    top. The one rule for its start and for each of its reloads, so a reload never loses a flag
    to the file (nor to the environment)."""
    raw: dict[str, Any] = {}
    if path is not None:
        read, problems = _read_toml(path)
        if read is None:
            return None, problems
        raw = read
    section = raw.setdefault("mirror", {})
    relay = raw.setdefault("relay", {})
    metrics = raw.get("metrics", {})  # added to the document only by --metrics-bind
    if not all(isinstance(t, dict) for t in (section, relay, metrics)):
        where = "(flags)" if path is None else os.fspath(path)
        return None, [ConfigProblem(where, "[mirror], [relay] and [metrics] must be tables")]
    environ = dict(os.environ if env is None else env)
    if flags.upstream:
        section["upstream"] = flags.upstream
        environ.pop(ENV_PREFIX + "MIRROR_UPSTREAM", None)
    if flags.bind:
        relay["bind"] = flags.bind
        environ.pop(ENV_PREFIX + "RELAY_BIND", None)
    if flags.workers is not None:
        relay["workers"] = flags.workers
        environ.pop(ENV_PREFIX + "RELAY_WORKERS", None)
    if flags.metrics_bind:
        raw["metrics"] = metrics
        if flags.metrics_bind == "off":
            metrics["enabled"] = False
        else:
            metrics["bind"] = flags.metrics_bind
        environ.pop(ENV_PREFIX + "METRICS_BIND", None)
        environ.pop(ENV_PREFIX + "METRICS_ENABLED", None)
    return _on_this_host(parse_config(raw, environ))


def load_config(
    path: str | os.PathLike[str], env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """``check_file`` that raises :class:`ConfigError` listing every problem."""
    cfg, problems = check_file(path, env)
    if cfg is None:
        raise ConfigError(problems)
    return cfg
