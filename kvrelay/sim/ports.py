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


def free_port_block(
    n: int, host: str = "0.0.0.0", lo: int = 20000, hi: int = 60000, attempts: int = 200
) -> int:
    """Base port ``p`` such that ``p .. p+n-1`` are bindable now (racy by nature; tests retry)."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(lo, hi - n)
        if all(_free(base + i, host) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free ports found")
