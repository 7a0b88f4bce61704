"""What a mirror needs to know: where its upstream is, how it talks to it, and its own limits."""

from __future__ import annotations

import random
import ssl as _ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay._text import is_decimal
from kvrelay.contract.limits import RelayLimits

MiB = 1024 * 1024


class MirrorSettingsError(ValueError):
    """A MirrorSettings field is out of range."""


#: The longest duration a mirror takes for its waits and the periods it learns from.
MAX_PERIOD_S = 3600.0

@dataclass(frozen=True, slots=True)
class UpstreamAddress:
    """``HOST:PORT`` / ``[v6]:PORT`` (TCP) or ``unix:/path`` (a local relay's UNIX socket)."""

    host: str | None = None
    port: int | None = None
    path: str | None = None

    @classmethod
    def parse(cls, text: str) -> UpstreamAddress:
        t = text.strip()
        if t.startswith("unix:"):
            path = t[len("unix:") :]
            if not path.startswith("/"):
                raise ValueError(f"unix: address needs an absolute path, got {text!r}")
            return cls(path=path)
        host, sep, port = t.rpartition(":")
        if not sep or not host or not is_decimal(port) or not 0 < int(port) < 65536:
            raise ValueError(f"upstream must be HOST:PORT or unix:/path, got {text!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise ValueError(f"IPv6 upstream addresses need brackets: [{host}]:{port}")
        return cls(host=host, port=int(port))

    def __str__(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        host = self.host or ""
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class MirrorSettings:
    """A mirror's settings. ``limits`` are the mirror's own, for its own subscribers (queues,
    lag, stream and hub caps, heartbeats); the upstream applies its own to the mirror.

    * ``sync_wait_s``: a subscriber to a pool the mirror is still synchronizing (its upstream
      snapshot not assembled yet) waits this long, then gets PUBLICATION_UNAVAILABLE.
    * ``upstream_heartbeat_s``: the upstream's pool heartbeat period until one is observed; the
      mirror stops vouching (local heartbeats) after 1.5 periods (+0.25 s) without an upstream
      frame and drops an upstream stream silent for 3 periods (the SDK's rule).
    * ``upstream_readiness_s``: how often the upstream re-sends an unchanged readiness plane (its
      ``readiness_heartbeat_s``; the contract's 10 s by default): the readiness stream is silent
      only after 3 of whichever period is longer. The window planes (load, serving load) come
      every second unless their updates state a longer window, so they are silent after 3
      windows (3 s by default), whatever the pool heartbeat.
    * ``release_idle_s``: a mirrored pool with no local subscriber (and nobody being admitted)
      for this long is released: its upstream stream ends, its table is dropped, and the
      mirror does not mirror it again until a local subscriber asks for it (then it syncs on
      demand, within ``sync_wait_s``). An idle mirror otherwise held an upstream stream, so an
      upstream hub with a reader, for each pool it mirrored ahead of demand, for ever: at its
      own hub cap the upstream refused its other clients (another mirror, a router) every other
      pool. 0: never (a ``workers = N`` fan-out worker's, whose ingest process admits hubs for
      every worker).
    * ``window_bytes``: HTTP/2 receive window per upstream stream (the connection gets 4×): a
      mirror must drain its upstream faster than the upstream's queue bound, never lag it.
    * ``ssl``: TLS to the upstream: a context, or what gives the one to use now (a daemon's
      reloadable context), asked at each upstream connection the mirror makes (its channel's
      reconnections too: ``RelayChannel``).
    """

    upstream: UpstreamAddress
    limits: RelayLimits = field(default_factory=RelayLimits)
    ssl: _ssl.SSLContext | Callable[[], _ssl.SSLContext] | None = field(default=None, compare=False)
    subscriber_id: str = "kvrelay-mirror"
    sync_wait_s: float = 10.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    upstream_heartbeat_s: float = 10.0
    upstream_readiness_s: float = 10.0
    release_idle_s: float = 0.0
    window_bytes: int = 16 * MiB
    keepalive_s: float = 20.0
    keepalive_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        sid = self.subscriber_id
        if not sid or len(sid.encode()) > 128 or any(
            ord(c) < 32 or 127 <= ord(c) <= 159 for c in sid
        ):
            raise MirrorSettingsError("subscriber_id must be 1..128 bytes without control chars")
        for name in ("sync_wait_s", "backoff_initial_s", "upstream_heartbeat_s", "keepalive_s",
                     "keepalive_timeout_s", "upstream_readiness_s"):
            if not 0 < getattr(self, name) <= MAX_PERIOD_S:
                raise MirrorSettingsError(f"{name} must be in (0, {MAX_PERIOD_S:g}] seconds")
        if not 0 <= self.release_idle_s <= MAX_PERIOD_S:
            raise MirrorSettingsError(f"release_idle_s must be in [0, {MAX_PERIOD_S:g}] seconds")
        if not self.backoff_initial_s <= self.backoff_max_s <= 3600:
            raise MirrorSettingsError("need backoff_initial_s <= backoff_max_s <= 3600")
        if not 64 * 1024 <= self.window_bytes <= 512 * MiB:
            raise MirrorSettingsError("window_bytes must be in 64 KiB..512 MiB")
        if self.upstream.path is None and (self.upstream.host is None or not self.upstream.port):
            raise MirrorSettingsError("upstream needs HOST:PORT or a unix path")

    def backoff(self, attempt: int) -> float:
        """Capped exponential backoff with jitter (every worker of a daemon, and every mirror
        of one relay, reconnects after the same upstream restart)."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2 ** min(attempt, 20))
        return float(cap * random.uniform(0.5, 1.0))
