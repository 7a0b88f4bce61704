"""Probe the daemon's listen addresses before the kernel warm-up.

A first compile can take a minute on a busy machine; a port already in use must fail the start
at once, not after it, and say which setting holds the address (the error of a bind alone names
only the address). The probe binds each address the way the listeners will (``SO_REUSEADDR``,
every address the host resolves to) and closes it again; a port of 0 is left alone.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


class ListenerUnavailable(OSError):
    """A configured listen address cannot be bound (in use, not local, not permitted)."""


@dataclass(frozen=True, slots=True)
class Listener:
    setting: str  # "relay.bind"
    env: str  # "KVRELAY_RELAY_BIND"
    host: str
    port: int


def probe(listeners: list[Listener]) -> None:
    """Raise ``ListenerUnavailable`` naming the first listener that cannot bind."""
    for ln in listeners:
        if ln.port == 0:
            continue
        try:
            infos = socket.getaddrinfo(
                ln.host or None, ln.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError as exc:
            raise ListenerUnavailable(_why(ln, f"cannot resolve: {exc}")) from exc
        for family, kind, proto, _name, addr in infos:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    s.bind(addr)
                    s.listen(1)
                except OSError as exc:
                    raise ListenerUnavailable(_why(ln, exc.strerror or str(exc))) from exc


def _why(ln: Listener, what: str) -> str:
    where = f"[{ln.host}]:{ln.port}" if ":" in ln.host else f"{ln.host}:{ln.port}"
    return (
        f"{ln.setting} = {where!r}: {what}. Another process holds it (another kvrelay, or a "
        f"mirror on this host?): set {ln.setting} (or {ln.env}) to a free address"
    )
