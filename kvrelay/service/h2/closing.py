"""``ClosingServer``: a grpclib ``Server`` that also closes live HTTP/2 connections on shutdown.

Why: ``Server.close()`` stops listening and cancels running requests but leaves accepted
connections open, so a client could keep calling a relay that has shut down (and see its old
identity). kvrelay closes every connection once all streams have ended (their EOFs and trailers
are already written; the transport flushes them before closing). It needs grpclib's private
``Server._protocol_factory`` (listed in ``internals.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

from grpclib.server import Server

from kvrelay.service.h2.internals import H2Protocol

__all__ = ["ClosingServer"]


class ClosingServer(Server):
    """grpclib ``Server`` with ``close_connections()`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        self._protocols.add(proto)
        return proto

    def close_connections(self) -> None:
        for proto in list(self._protocols):
            conn = getattr(proto, "connection", None)
            processor = getattr(proto, "processor", None)
            if conn is None or processor is None:
                continue
            processor.close("relay shut down")
