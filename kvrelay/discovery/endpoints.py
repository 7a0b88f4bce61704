"""Endpoint handling: wildcard-host substitution, DP port offsets, static (pre-0.27) sources,
and the one spelling of an IP address that address comparisons use (``canonical_ip``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from kvrelay._text import is_decimal
from kvrelay.discovery.errors import InvalidEndpoint

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: Where IPv4-mapped IPv6 addresses live (``::ffff:a.b.c.d``).
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def canonical_ip(text: str) -> IPAddress | None:
    """The IP address ``text`` spells (brackets allowed), an IPv4-mapped IPv6 one as its IPv4
    address (a dual-stack socket names an IPv4 peer ``::ffff:a.b.c.d``); None for anything
    else (a DNS name is never resolved here). Two spellings of one address compare equal."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def canonical_host(host: str) -> str:
    """``host`` in one spelling where it is an IP literal (``[0:0::1]`` → ``::1``,
    ``::FFFF:10.0.0.5`` → ``10.0.0.5``); any other host as written."""
    addr = canonical_ip(host)
    return host if addr is None else str(addr)


def host_key(host: str) -> str:
    """``host`` as two spellings of one host compare equal: an IP address in its canonical
    spelling (``canonical_host``), a name in lower case (DNS names ignore case)."""
    return canonical_host(host).lower()


def canonical_network(text: str) -> IPNetwork:
    """An address or network (``10.0.0.0/24``, ``::1``) as ``canonical_ip`` would match it: an
    IPv4-mapped IPv6 network as its IPv4 network, else ``10.0.0.5`` (the address every IPv4
    peer is compared as) would never be in ``::ffff:10.0.0.5``. Raises ``ValueError``."""
    net = ipaddress.ip_network(text, strict=False)
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96 and net.subnet_of(_MAPPED):
        mapped = net.network_address.ipv4_mapped
        assert mapped is not None
        return ipaddress.IPv4Network((mapped, net.prefixlen - 96))
    return net


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` is a bind wildcard (``*``, or the unspecified address however spelled:
    ``0.0.0.0``, ``[::]``, ``[0:0:0:0:0:0:0:0]``), which a connecting peer must replace."""
    if host in WILDCARD_HOSTS:
        return True
    addr = canonical_ip(host)
    return addr is not None and addr.is_unspecified


def connects_instead_of_binding(endpoint: str) -> bool:
    """A publisher endpoint on the unspecified address spelled without ``*`` or ``::``
    (``tcp://0.0.0.0:5557``). vLLM's publisher binds only an endpoint that contains ``*`` or
    ``::``; given this one it connects to it instead of listening, so a relay that subscribes
    there finds nothing (the engine's ``--kv-events-config`` should say ``tcp://*:5557``)."""
    if not endpoint.startswith("tcp://") or "*" in endpoint or "::" in endpoint:
        return False
    try:
        host, _port = split_tcp(endpoint)
    except InvalidEndpoint:
        return False
    return is_wildcard_host(host)


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """One DP rank's KV event source, with connectable (wildcard-free) endpoints."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    topic: str = ""
    transport: str = "zmq"
    encoding: str = "msgpack"
    schema_version: int = 1
    buffer_steps: int = 0
    hwm: int = 0
    max_queue_size: int = 0
    advertised_endpoint: str = ""  # as returned by the engine, before substitution

    @property
    def key(self) -> tuple[int, str, str | None, str]:
        """Identity used by the watcher to diff sources."""
        return (self.dp_rank, self.endpoint, self.replay_endpoint, self.topic)


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def split_tcp(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` → (host, port); IPv6 hosts keep their brackets."""
    if not endpoint.startswith("tcp://"):
        raise InvalidEndpoint(f"not a tcp endpoint: {endpoint!r}")
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not is_decimal(port) or int(port) > 65535:
        raise InvalidEndpoint(f"bad port in endpoint: {endpoint!r}")
    return host, int(port)


def substitute_wildcard(endpoint: str, host: str) -> str:
    """Replace a bind-wildcard host (``*``, ``0.0.0.0``, ``::``, ``[::]``, or another spelling
    of the unspecified address) with ``host``.

    Non-tcp endpoints (ipc/inproc) and empty strings are returned unchanged.
    """
    if not endpoint or not endpoint.startswith("tcp://"):
        return endpoint
    h, port = split_tcp(endpoint)
    if is_wildcard_host(h):
        return f"tcp://{_fmt_host(host)}:{port}"
    return endpoint


def dp_offset(endpoint: str, rank: int) -> str:
    """vLLM's per-rank rewrite (§15.2): tcp port + rank (port 0 unchanged), inproc ``_dp{r}``."""
    if rank < 0:
        raise InvalidEndpoint(f"negative dp rank {rank}")
    if rank == 0 or not endpoint:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not is_decimal(port):
            raise InvalidEndpoint(f"bad port in endpoint: {endpoint!r}")
        p = int(port)
        if p == 0:
            return endpoint
        if p + rank > 65535:
            raise InvalidEndpoint(f"port {p}+{rank} out of range")
        return f"{head}:{p + rank}"
    raise InvalidEndpoint(f"unsupported endpoint scheme: {endpoint!r}")


@dataclass(frozen=True, slots=True)
class StaticSourceConfig:
    """Operator-configured sources for engines without gRPC discovery (vLLM < 0.27)."""

    endpoint: str  # rank-0 PUB endpoint as in --kv-events-config, e.g. tcp://*:5557
    replay_endpoint: str | None = None
    dp_ranks: tuple[int, ...] = (0,)
    topic: str = ""
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000


def static_sources(cfg: StaticSourceConfig, host: str) -> tuple[SourceInfo, ...]:
    """Expand a static config into per-rank sources (offsets applied, wildcards → ``host``)."""
    out = []
    for r in _unique(cfg.dp_ranks):
        ep = dp_offset(cfg.endpoint, r)
        rep = dp_offset(cfg.replay_endpoint, r) if cfg.replay_endpoint else None
        out.append(
            SourceInfo(
                dp_rank=r,
                endpoint=substitute_wildcard(ep, host),
                replay_endpoint=substitute_wildcard(rep, host) if rep else None,
                topic=cfg.topic,
                buffer_steps=cfg.buffer_steps,
                hwm=cfg.hwm,
                max_queue_size=cfg.max_queue_size,
                advertised_endpoint=ep,
            )
        )
    return tuple(out)


def _unique(xs: Iterable[int]) -> list[int]:
    return sorted(set(xs))
