"""Per-connection and per-peer shares of each stream limit.

The contract's stream limits (``max_catalog_subscribers`` and the like) are relay-wide, so
without a share one client that opens 64 streams and never reads them locks every router out.
A share caps what one HTTP/2 connection, and one peer address, may hold of each kind: at most
``share_percent`` of that kind's limit (rounded up, at least 1). A stream is admitted only if its
connection's share, its address's share and the relay-wide permit all have room, in that order.

Connections without a TCP peer address (the daemon's internal UNIX socket to its own workers,
whose peers are checked by credentials) have no share: they count against the relay-wide limit
only. Every entry is removed when its count drops to zero, so the tables are bounded by the open
streams.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

#: A connection key: the peer's (host, port); a peer key: its host.
Addr = tuple[str, int]
SCOPES = ("connection", "peer")
K = TypeVar("K")


def share_of(limit: int, percent: int) -> int:
    """The share of ``limit`` that ``percent`` allows (at least one stream)."""
    return max(1, math.ceil(limit * percent / 100))


def peer_addr(addr: object) -> Addr | None:
    """A TCP peer address from ``Peer.addr()``; None for UNIX sockets and unknown shapes."""
    if isinstance(addr, Sequence) and not isinstance(addr, str | bytes) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        if isinstance(host, str) and host and isinstance(port, int):
            return host, port
    return None


class StreamShares:
    """Counts of open streams per (kind, connection) and (kind, peer) against their shares."""

    def __init__(self, per_connection_percent: int, per_peer_percent: int) -> None:
        self.per_connection_percent = per_connection_percent
        self.per_peer_percent = per_peer_percent
        self._conns: dict[tuple[str, Addr], int] = {}
        self._peers: dict[tuple[str, str], int] = {}
        #: (kind, scope) → streams refused because that share was full.
        self.refusals: dict[tuple[str, str], int] = {}

    def limits(self, capacity: int) -> tuple[int, int]:
        """(per-connection share, per-peer share) of a kind whose relay-wide limit is
        ``capacity``."""
        return (
            share_of(capacity, self.per_connection_percent),
            share_of(capacity, self.per_peer_percent),
        )

    def try_acquire(self, kind: str, capacity: int, addr: Addr | None) -> str | None:
        """Take one stream of ``kind`` for ``addr``; None when admitted, else the full scope."""
        if addr is None:
            return None
        per_conn, per_peer = self.limits(capacity)
        ck, pk = (kind, addr), (kind, addr[0])
        # a share of the whole limit never bites first: the relay-wide limit reports it
        if per_conn < capacity and self._conns.get(ck, 0) >= per_conn:
            scope = "connection"
        elif per_peer < capacity and self._peers.get(pk, 0) >= per_peer:
            scope = "peer"
        else:
            self._conns[ck] = self._conns.get(ck, 0) + 1
            self._peers[pk] = self._peers.get(pk, 0) + 1
            return None
        self.refusals[(kind, scope)] = self.refusals.get((kind, scope), 0) + 1
        return scope

    def release(self, kind: str, addr: Addr | None) -> None:
        if addr is None:
            return
        _decrement(self._conns, (kind, addr))
        _decrement(self._peers, (kind, addr[0]))

    def held(self, kind: str, addr: Addr) -> tuple[int, int]:
        """(streams of ``kind`` held by this connection, by its peer address)."""
        return self._conns.get((kind, addr), 0), self._peers.get((kind, addr[0]), 0)


def _decrement(table: dict[K, int], key: K) -> None:
    left = table[key] - 1
    if left:
        table[key] = left
    else:
        del table[key]
