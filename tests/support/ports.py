"""Ports a test needs together, picked together."""

from __future__ import annotations

import socket


def distinct_ports(n: int, host: str = "127.0.0.1", *, dual_stack: bool = False) -> list[int]:
    """``n`` distinct ports free on ``host`` now (``dual_stack``: an IPv6 wildcard that takes
    IPv4 too, so a port is free on every address). All are held until the last is picked: one at
    a time, the kernel may hand a just-closed port out again, and two that happen to be equal
    collide for a reason the test did not mean. Raises OSError where ``host`` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)
            if dual_stack:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()
