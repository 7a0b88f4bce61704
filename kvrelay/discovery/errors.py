"""Typed discovery errors: callers branch on the class, never on message text."""

from __future__ import annotations


class DiscoveryError(Exception):
    """Base class; ``address`` is ``host:port`` of the engine frontend."""

    def __init__(self, address: str, detail: str) -> None:
        super().__init__(f"{address}: {detail}")
        self.address = address
        self.detail = detail


class EngineUnreachable(DiscoveryError):
    """Connection refused/reset, UNAVAILABLE, or transport failure."""


class DiscoveryTimeout(EngineUnreachable):
    """The RPC did not complete within the client's timeout."""


class RpcFailed(DiscoveryError):
    """The engine answered with a non-OK gRPC status other than UNAVAILABLE."""

    def __init__(self, address: str, detail: str, status: str) -> None:
        super().__init__(address, f"{status}: {detail}")
        self.status = status


class KvSourcesUnsupported(RpcFailed):
    """Neither ``vllm.Control`` nor ``vllm.KvTransfer`` implements ``GetKvEventSources``."""


class InvalidEndpoint(ValueError):
    """An endpoint string cannot be parsed or offset (bad port, unknown scheme)."""
