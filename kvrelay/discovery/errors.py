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


class InvalidReply(RpcFailed):
    """The engine answered what no engine would (status ``INVALID_REPLY``). ``kind``, one of
    ``REPLY_REFUSALS``: ``too_large`` (a length prefix over the bound, refused before its body is
    read), ``undecodable`` (broken framing, or bytes that are not the message), ``implausible``
    (parallelism, sources, adapters, aliases or fields no engine has), ``flood`` (the connection
    was closed for frames past their budget: ``_grpc.ServerFrameBudget``). Each is counted in
    ``REFUSED`` (``kvrelay_control_reply_refusals_total``)."""

    def __init__(self, address: str, detail: str, kind: str) -> None:
        super().__init__(address, detail, "INVALID_REPLY")
        self.kind = kind
        REFUSED[kind] += 1


#: Why Control replies were refused (the labels of ``kvrelay_control_reply_refusals_total``).
REPLY_REFUSALS = ("too_large", "undecodable", "implausible", "flood")
#: Control replies refused in this process, by kind: discovery runs in the relay process only,
#: and a refusal must be counted even where the RPC was optional (its value then stays unknown).
REFUSED: dict[str, int] = dict.fromkeys(REPLY_REFUSALS, 0)


class KvSourcesUnsupported(RpcFailed):
    """Neither ``vllm.Control`` nor ``vllm.KvTransfer`` implements ``GetKvEventSources``."""


class InvalidEndpoint(ValueError):
    """An endpoint string cannot be parsed or offset (bad port, unknown scheme)."""
