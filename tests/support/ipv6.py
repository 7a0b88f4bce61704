"""Whether this machine has an IPv6 loopback (``::1``): IPv6 tests skip without one (some
containers and CI runners have IPv6 disabled)."""

from __future__ import annotations

import socket

import pytest


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


IPV6 = has_ipv6_loopback()
#: Marks a test that needs ``::1``.
NEEDS_IPV6 = pytest.mark.skipif(not IPV6, reason="no IPv6 loopback (::1)")
