"""Fair shares of each stream limit, enforced by preemption only when the relay is full.

The contract's stream limits (``max_catalog_subscribers`` and the like, and the health ``Watch``
streams' ``MAX_HEALTH_WATCHERS``, kind ``health``) are relay-wide. While a
kind has room, any client is admitted: a lone client may hold the whole limit (a mirror or SDK
puts every pool of a relay on one connection), and the stream after the limit gets the
contract's ``RESOURCE_LIMIT``. A share is what one HTTP/2 connection, and one peer address, is
*guaranteed* when the relay is full: ``share_percent`` of the limit (rounded up, at least 1). A
stream that finds the kind full, from a connection and address both below their shares, makes
room: the newest stream of the connection (or address) furthest over its share is ended with
``RESOURCE_LIMIT`` and its permit handed back at once. A requester at or over either share, or a
full relay where nobody is over a share, is refused as before.

Connections without a TCP peer address (the daemon's internal UNIX socket to its own workers,
whose peers are checked by credentials) have no share: they are never preempted and never
preempt. The tables hold only open streams, so they are bounded by the stream limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import PermitCounter

#: A connection key: the peer's (host, port); a peer key: its host.
Addr = tuple[str, int]
SCOPES = ("connection", "peer")
K = TypeVar("K")
#: What a full kind is refused with, where "subscriber limit" would not fit the kind.
FULL_MESSAGES = {
    "pool": "Relay total pool stream limit {capacity} reached",
    "health": "Relay health Watch stream limit {capacity} reached",
}


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


class StreamTicket:
    """One admitted stream: its permit, its place in the share tables, and how to end it.

    ``release`` is idempotent (the stream handler's ``finally`` and a subscription's release
    both call it). ``on_preempt`` is set by the handler once it can end the stream; a stream
    preempted before that finds ``error`` set at its next check."""

    __slots__ = ("_shares", "addr", "error", "kind", "on_preempt", "permits", "released")

    def __init__(
        self, shares: StreamShares, kind: str, permits: PermitCounter, addr: Addr | None
    ) -> None:
        self._shares = shares
        self.kind = kind
        self.permits = permits
        self.addr = addr
        self.error: RelayError | None = None
        self.on_preempt: Callable[[RelayError], None] | None = None
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.permits.release()
            self._shares._drop(self)

    def check(self) -> None:
        """Raise the error this stream was preempted with, if any."""
        if self.error is not None:
            raise self.error


class StreamShares:
    """Open streams per (kind, connection) and (kind, peer), oldest first, against shares."""

    def __init__(self, per_connection_percent: int, per_peer_percent: int) -> None:
        self.per_connection_percent = per_connection_percent
        self.per_peer_percent = per_peer_percent
        self._conns: dict[tuple[str, Addr], dict[StreamTicket, None]] = {}
        self._peers: dict[tuple[str, str], dict[StreamTicket, None]] = {}
        #: (kind, scope) → streams refused on a full relay because the requester's share was
        #: already held.
        self.refusals: dict[tuple[str, str], int] = {}
        #: (kind, scope) → streams ended to make room, by the scope that was over its share.
        self.preemptions: dict[tuple[str, str], int] = {}

    def limits(self, capacity: int) -> tuple[int, int]:
        """(per-connection share, per-peer share) of a kind whose relay-wide limit is
        ``capacity``."""
        return (
            share_of(capacity, self.per_connection_percent),
            share_of(capacity, self.per_peer_percent),
        )

    def admit(
        self,
        kind: str,
        permits: PermitCounter,
        addr: Addr | None,
        admissible: Callable[[], bool] | None = None,
    ) -> StreamTicket:
        """Admit one stream of ``kind`` for ``addr``, preempting when the kind is full and the
        requester is below its shares; raises RESOURCE_LIMIT when it cannot. ``admissible``:
        asked before another client's stream is ended for this one; False (a pool that is not
        listed, or that the client may not see) refuses instead, so a request that would fail
        anyway never costs a bystander its stream."""
        if not permits.try_acquire():
            self._make_room(kind, permits, addr, admissible)
        ticket = StreamTicket(self, kind, permits, addr)
        if addr is not None:
            self._conns.setdefault((kind, addr), {})[ticket] = None
            self._peers.setdefault((kind, addr[0]), {})[ticket] = None
        return ticket

    def _make_room(
        self,
        kind: str,
        permits: PermitCounter,
        addr: Addr | None,
        admissible: Callable[[], bool] | None = None,
    ) -> None:
        """Take a permit from the stream furthest over its share, or raise RESOURCE_LIMIT."""
        full = RelayError.resource_limit(
            FULL_MESSAGES.get(kind, "Relay {name} subscriber limit {capacity} reached").format(
                name=permits.name, capacity=permits.capacity
            )
        )
        if addr is None:
            raise full  # the internal socket has no share: it never preempts
        per_conn, per_peer = self.limits(permits.capacity)
        conn_held, peer_held = self.held(kind, addr)
        mine = (("connection", conn_held, per_conn), ("peer", peer_held, per_peer))
        for scope, held, share in mine:
            if held >= share:
                self.refusals[(kind, scope)] = self.refusals.get((kind, scope), 0) + 1
                raise RelayError.resource_limit(
                    f"{full.message}; this {scope} already holds its share ({share})"
                )
        victim = self._victim(kind, per_conn, per_peer)
        if victim is None or (admissible is not None and not admissible()):
            raise full
        ticket, scope = victim
        self.preemptions[(kind, scope)] = self.preemptions.get((kind, scope), 0) + 1
        err = RelayError.resource_limit(
            f"stream ended to make room for another client: relay {permits.name} limit "
            f"{permits.capacity} reached and this {scope} held more than its share"
        )
        ticket.error = err
        if ticket.on_preempt is not None:
            ticket.on_preempt(err)  # wakes the handler, which ends the stream with the status
        ticket.release()  # the permit is free now, whether or not the client reads the status
        if not permits.try_acquire():
            raise full

    def _victim(self, kind: str, per_conn: int, per_peer: int) -> tuple[StreamTicket, str] | None:
        """The newest stream of the connection or address furthest over its share."""
        best: tuple[int, dict[StreamTicket, None], str] | None = None
        groups = (
            ((k, held) for (k, _c), held in self._conns.items()),
            ((k, held) for (k, _p), held in self._peers.items()),
        )
        for scope, share, group in zip(SCOPES, (per_conn, per_peer), groups, strict=True):
            for k, held in group:
                over = len(held) - share
                if k == kind and over > 0 and (best is None or over > best[0]):
                    best = (over, held, scope)
        if best is None:
            return None
        return next(reversed(best[1])), best[2]

    def _drop(self, ticket: StreamTicket) -> None:
        addr = ticket.addr
        if addr is None:
            return
        _discard(self._conns, (ticket.kind, addr), ticket)
        _discard(self._peers, (ticket.kind, addr[0]), ticket)

    def held(self, kind: str, addr: Addr) -> tuple[int, int]:
        """(streams of ``kind`` held by this connection, by its peer address)."""
        return (
            len(self._conns.get((kind, addr), ())),
            len(self._peers.get((kind, addr[0]), ())),
        )


def _discard(table: dict[K, dict[StreamTicket, None]], key: K, ticket: StreamTicket) -> None:
    held = table.get(key)
    if held is not None:
        held.pop(ticket, None)
        if not held:
            del table[key]
