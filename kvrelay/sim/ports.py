"""Find a contiguous block of free TCP ports (DP port offsets need base..base+n free)."""

from __future__ import annotations

import random
import socket


def _free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(
    n: int, host: str = "0.0.0.0", lo: int = 20000, hi: int | None = None, attempts: int = 200
) -> int:
    """Base port ``p`` such that ``p .. p+n-1`` are bindable now, for a process started next to
    bind (racy by nature: another pick may take them; tests retry). ``hi`` defaults to the start
    of the kernel's ephemeral range (at least ``lo`` + 4096): a port bound to 0 and every outgoing
    connection's own port come from that range, so one of them cannot take the block between
    this check and the bind ("Address already in use" at a daemon's start, more often with the
    suite's two processes)."""
    if hi is None:
        hi = max(ephemeral_low(), lo + 4096)
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(lo, hi - n)
        if all(_free(base + i, host) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found")
