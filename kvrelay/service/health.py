"""Standard health checking and the descriptors reflection serves, for generic gRPC tools.

Health answers for ``dynamo.kvrelay.v1.KvEventRelay`` and for the whole server (``""``): SERVING
once the listener is up, NOT_SERVING from the first moment of a drain, so Kubernetes gRPC probes,
load balancers and ``grpcurl`` see the relay leave before its streams end. ``Watch`` streams are
held at most ``MAX_HEALTH_WATCHERS`` at once (each is a task and a stream that stay until the
client leaves); one more is answered ``RESOURCE_EXHAUSTED``. Reflection describes
the relay, health and reflection services themselves (``grpcurl describe``, ``buf curl
--list-methods``), not only ``relay.proto``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.health.v1 import health_pb2
from grpclib.reflection.v1 import reflection_pb2 as reflection_v1
from grpclib.reflection.v1alpha import reflection_pb2 as reflection_v1alpha

from kvrelay.contract.limits import PermitCounter
from kvrelay.service.descriptor import RELAY_FILE_DESCRIPTOR_SET

RELAY_SERVICE = "dynamo.kvrelay.v1.KvEventRelay"
#: Health ``Watch`` streams held at once.
MAX_HEALTH_WATCHERS = 256
#: Server reflection streams (v1 and v1alpha together) open at once.
MAX_REFLECTION_STREAMS = 256
_WATCH = "/grpc.health.v1.Health/Watch"


class RelayHealth:
    """``grpc.health.v1.Health`` over one status shared by the relay service and the server."""

    def __init__(self, service: Any) -> None:
        self._status = ServiceStatus()  # None (UNKNOWN) until the listener is up
        self.watchers = PermitCounter("health_watchers", MAX_HEALTH_WATCHERS)
        self.service = _Watched(Health({service: [self._status]}), self.watchers)

    @property
    def serving(self) -> bool:
        return self._status.__status__() is True

    def set_serving(self, serving: bool) -> None:
        self._status.set(serving)


class _Watched:
    """grpclib's ``Health`` with its ``Watch`` streams counted against ``watchers``."""

    def __init__(self, health: Health, watchers: PermitCounter) -> None:
        self._health = health
        self._watchers = watchers

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = self._health.__mapping__()
        watch = mapping.get(_WATCH)
        if watch is not None:
            mapping[_WATCH] = watch._replace(func=self._limited(watch.func))
        return mapping

    def _limited(
        self, func: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        async def watch(stream: Any) -> None:
            if not self._watchers.try_acquire():
                raise GRPCError(Status.RESOURCE_EXHAUSTED,
                                f"{self._watchers.capacity} health watchers already")  # fmt: skip
            try:
                await func(stream)
            finally:
                self._watchers.release()

        return watch


@cache
def reflection_pool() -> descriptor_pool.DescriptorPool:
    """relay.proto plus the health and reflection protos, for the reflection service."""
    pool = descriptor_pool.DescriptorPool()
    for fd in descriptor_pb2.FileDescriptorSet.FromString(RELAY_FILE_DESCRIPTOR_SET).file:
        pool.Add(fd)
    for module in (health_pb2, reflection_v1, reflection_v1alpha):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    return pool
