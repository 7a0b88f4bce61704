"""The descriptors server reflection serves, for generic gRPC tools.

Reflection describes the relay, health and reflection services themselves (``grpcurl
describe``, ``buf curl --list-methods``), not only ``relay.proto``, lists all of them, and finds
a method's file by the method's full name (``grpcurl describe Service.Method``), as grpc-go's
reflection does.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpclib.health.v1 import health_pb2
from grpclib.reflection.service import ServerReflection
from grpclib.reflection.v1 import reflection_pb2 as reflection_v1
from grpclib.reflection.v1alpha import reflection_pb2 as reflection_v1alpha

from kvrelay.service.descriptor import RELAY_FILE_DESCRIPTOR_SET

#: Server reflection streams (v1 and v1alpha together) open at once.
MAX_REFLECTION_STREAMS = 256


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


def reflection_services(listed: Sequence[Any]) -> list[Any]:
    """grpclib's reflection services (v1, v1alpha) over ``reflection_pool``: they list
    ``listed`` and themselves, as grpc-go's reflection lists every registered service (grpcio's
    example lists its own too), and find a method's file by the method's name."""
    pool = _MethodSymbols(reflection_pool())
    themselves = ServerReflection.extend([], pool=pool)  # only their names are read
    return ServerReflection.extend([*listed, *themselves], pool=pool)[
        len(listed) + len(themselves):
    ]  # fmt: skip


class _MethodSymbols:
    """A descriptor pool whose ``FindFileContainingSymbol`` also takes a method's full name
    (``pkg.Service.Method``): upb's indexes no methods, grpc-go's reflection resolves them, and
    ``grpcurl describe Service.Method`` asks for one. Everything else is the pool's."""

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            if not service:
                raise
            found = self._pool.FindServiceByName(service)  # KeyError: no such service either
            if method not in found.methods_by_name:
                raise
            return found.file
