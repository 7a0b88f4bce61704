"""Standard health checking (``grpc.health.v1``), for generic gRPC tools and probes.

Health answers for ``dynamo.kvrelay.v1.KvEventRelay`` and for the whole server (``""``): SERVING
once the listener is up, NOT_SERVING from the first moment of a drain, so Kubernetes gRPC probes,
load balancers and ``grpcurl`` see the relay leave before its streams end. ``Watch`` streams are
held at most ``MAX_HEALTH_WATCHERS`` at once (each is a task and a stream that stay until the
client leaves), admitted once their request has come as every stream kind of the relay is, under
the per-connection and per-address shares of that limit (``shares.py``, kind ``health``): one
more is answered ``RESOURCE_EXHAUSTED`` / ``RESOURCE_LIMIT``, but a client below its shares ends
the newest ``Watch`` of whoever is furthest over theirs (``RESOURCE_EXHAUSTED`` /
``RESOURCE_LIMIT`` there). Without them one connection holding every ``Watch`` stream left gRPC
client-side health checking (which watches) to every other client refused. On a drain every
``Watch`` sends
NOT_SERVING and ends with status OK (``generic_drain.py``): at once, without it, when its client
has not opened a flow-control window for its message. Reflection: ``reflection.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from grpclib.const import Handler
from grpclib.exceptions import GRPCError
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.health.v1.health_pb2 import HealthCheckResponse

from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import PermitCounter
from kvrelay.service.generic_drain import GenericDrain
from kvrelay.service.h2.writer import send_unless
from kvrelay.service.shares import StreamShares, peer_addr
from kvrelay.service.status import status_of

RELAY_SERVICE = "dynamo.kvrelay.v1.KvEventRelay"
#: Health ``Watch`` streams held at once.
MAX_HEALTH_WATCHERS = 256
#: Their kind among the stream shares (``shares.py``) and their metrics.
HEALTH_KIND = "health"
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
        self.watchers = PermitCounter("health watchers", MAX_HEALTH_WATCHERS)
        # the relay service's shares and refusal (counted, reason trailer); a service without
        # them (a bare one) gets shares of the whole limit, so that nothing is ever preempted
        shares, refuse = getattr(service, "shares", None), getattr(service, "refuse", None)
        self._shares = shares if isinstance(shares, StreamShares) else StreamShares(100, 100)
        self._refuse: Callable[[RelayError], NoReturn] = (
            refuse if callable(refuse) else _refuse_plain
        )
        self.service = _Watched(Health({service: [self._status]}), self._watch)

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
        grace; one still not come then is refused (``PendingRequests.end_all``). Admitted
        under the shares once the request has come; preempted, it ends ``RESOURCE_LIMIT`` at
        once (a message still waiting for a window given up as on the drain)."""
        drain = self._drain
        with drain.held():
            request = await stream.recv_message()
            try:
                ticket = self._shares.admit(
                    HEALTH_KIND, self.watchers, peer_addr(stream.peer.addr())
                )
            except RelayError as err:
                self._refuse(err)
            preempted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(_err: RelayError) -> None:
                if not preempted.done():
                    preempted.set_result(None)

            ticket.on_preempt = wake
            try:
                await self._send_changes(stream, request.service, preempted)
            finally:
                ticket.release()
            if ticket.error is not None:
                self._refuse(ticket.error)

    async def _send_changes(
        self, stream: Any, service: str, preempted: asyncio.Future[None]
    ) -> None:
        """``service``'s status now, then each change, until the drain or ``preempted``."""
        drain = self._drain
        sent = None
        while True:
            changed = self._changed
            status = self._now(service)
            if status != sent:
                message = stream.send_message(HealthCheckResponse(status=status))
                if not await send_unless(stream, message, (drain.when_started(), preempted)):
                    return  # the drain or preempted, the message waiting for a window: at once
                sent = status
            if drain.started or preempted.done():
                return
            await drain.unless_started(_until(changed, preempted))


class _Watched:
    """grpclib's ``Health`` with ``watch`` as its ``Watch``."""

    def __init__(self, health: Health, watch: Callable[[Any], Awaitable[None]]) -> None:
        self._health = health
        self._watch = watch

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = self._health.__mapping__()
        mapping[_WATCH] = mapping[_WATCH]._replace(func=self._watch)
        return mapping


async def _until(changed: asyncio.Event, preempted: asyncio.Future[None]) -> None:
    """Until ``changed`` is set or ``preempted`` done (the latter is never cancelled here)."""
    waiting = asyncio.ensure_future(changed.wait())
    try:
        await asyncio.wait((waiting, preempted), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()


def _refuse_plain(err: RelayError) -> NoReturn:
    """A refusal where the service has none of its own: the status alone."""
    raise GRPCError(status_of(err), err.message)
