"""Standard health checking (``grpc.health.v1``), for generic gRPC tools and probes.

Health answers for ``dynamo.kvrelay.v1.KvEventRelay`` and for the whole server (``""``): SERVING
once the listener is up, NOT_SERVING from the first moment of a drain, so Kubernetes gRPC probes,
load balancers and ``grpcurl`` see the relay leave before its streams end. ``Watch`` streams are
held at most ``MAX_HEALTH_WATCHERS`` at once (each is a task and a stream that stay until the
client leaves); one more is answered ``RESOURCE_EXHAUSTED``. On a drain every ``Watch`` sends
NOT_SERVING and ends with status OK (``generic_drain.py``): at once, without it, when its client
has not opened a flow-control window for its message. Reflection: ``reflection.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.health.v1.health_pb2 import HealthCheckResponse

from kvrelay.contract.limits import PermitCounter
from kvrelay.service.generic_drain import GenericDrain
from kvrelay.service.h2.writer import send_unless

RELAY_SERVICE = "dynamo.kvrelay.v1.KvEventRelay"
#: Health ``Watch`` streams held at once.
MAX_HEALTH_WATCHERS = 256
_WATCH = "/grpc.health.v1.Health/Watch"


class RelayHealth:
    """``grpc.health.v1.Health`` over one status shared by the relay service and the server.
    ``Check`` is grpclib's; ``Watch`` is the relay's, to end it on the drain."""

    def __init__(self, service: Any, drain: GenericDrain | None = None) -> None:
        self._status = ServiceStatus()  # None (UNKNOWN) until the listener is up
        self._changed = asyncio.Event()  # set, and replaced, at each change of the status
        self._drain = drain if drain is not None else GenericDrain()
        # the names grpclib's Health answers for: the relay service's, and the server's ("")
        self._names = frozenset(path.split("/")[1] for path in service.__mapping__()) | {""}
        self.watchers = PermitCounter("health_watchers", MAX_HEALTH_WATCHERS)
        self.service = _Watched(Health({service: [self._status]}), self.watchers, self._watch)

    @property
    def serving(self) -> bool:
        return self._status.__status__() is True

    def set_serving(self, serving: bool) -> None:
        self._status.set(serving)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _now(self, service: str) -> HealthCheckResponse.ServingStatus.ValueType:
        if service not in self._names:
            return HealthCheckResponse.SERVICE_UNKNOWN  # and it stays so (grpclib's, grpc's)
        serving = self._status.__status__()
        if serving is None:
            return HealthCheckResponse.UNKNOWN
        return HealthCheckResponse.SERVING if serving else HealthCheckResponse.NOT_SERVING

    async def _watch(self, stream: Any) -> None:
        """The status now, then each change; on the drain, the status then (NOT_SERVING: the
        server's close sets it before the drain) if not sent yet, then the end of the stream
        (status OK); a message still waiting for a flow-control window then, with nothing of
        it written, is given up and the stream ends at once. The drain waits for a request on
        its way, as for a relay stream's, up to its
        grace; one still not come then is refused (``PendingRequests.end_all``)."""
        drain = self._drain
        with drain.held():
            request = await stream.recv_message()
            sent = None
            while True:
                changed = self._changed
                status = self._now(request.service)
                if status != sent:
                    message = stream.send_message(HealthCheckResponse(status=status))
                    if not await send_unless(stream, message, (drain.when_started(),)):
                        return  # the drain, the message waiting for a window: OK at once
                    sent = status
                if drain.started:
                    return
                await drain.unless_started(changed.wait())


class _Watched:
    """grpclib's ``Health`` with ``watch`` as its ``Watch``, counted against ``watchers``."""

    def __init__(
        self,
        health: Health,
        watchers: PermitCounter,
        watch: Callable[[Any], Awaitable[None]],
    ) -> None:
        self._health = health
        self._watchers = watchers
        self._watch = watch

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = self._health.__mapping__()
        mapping[_WATCH] = mapping[_WATCH]._replace(func=self._limited)
        return mapping

    async def _limited(self, stream: Any) -> None:
        if not self._watchers.try_acquire():
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"{self._watchers.capacity} health watchers already")  # fmt: skip
        try:
            await self._watch(stream)
        finally:
            self._watchers.release()
