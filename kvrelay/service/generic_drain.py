"""``GenericDrain``: the long-lived streams of the generic gRPC services end with a status.

On a drain every health ``Watch`` sends NOT_SERVING and ends with status OK, and every reflection
stream ends OK once the answer it is writing is sent, as the relay's own streams end (contract
§4.8): grpclib's ``Server.close`` cancels what is still running, and a cancelled handler writes
no trailers (grpcio then reports UNAVAILABLE "Socket closed").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, NoReturn, TypeVar

from grpclib.const import Cardinality, Handler

from kvrelay._aio import cancel_and_wait
from kvrelay.contract.errors import RelayError
from kvrelay.service.h2.request import finish_early

T = TypeVar("T")


class GenericDrain:
    """The drain of the generic services' long-lived streams (health ``Watch``, reflection):
    they end with status OK before grpclib's ``Server.close`` would cancel them without one."""

    def __init__(self) -> None:
        self.started = False
        self._start = asyncio.Event()
        self._started: asyncio.Future[None] | None = None  # see ``when_started``
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """One stream open: ``drain`` waits until it is over."""
        self._open += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                self._idle.set()

    async def unless_started(self, aw: Coroutine[Any, Any, T]) -> T | None:
        """``aw``'s result, or None (``aw`` cancelled) when the drain starts first. ``aw`` runs
        in its own task, in a copy of this context whose values are then set here too: a
        refusal in the read sets the reason its trailer carries (``KvEventRelayService.refuse``)."""
        context = contextvars.copy_context()
        task = asyncio.get_running_loop().create_task(aw, context=context)
        start: asyncio.Task[Any] | None = None
        try:
            if not self.started:
                start = asyncio.ensure_future(self._start.wait())
                await asyncio.wait((task, start), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if start is not None:
                start.cancel()
            if not task.done():  # the drain started first, or the caller is cancelled
                await cancel_and_wait(task)
            for var, value in context.items():
                var.set(value)
        return None if task.cancelled() else task.result()

    def when_started(self) -> asyncio.Future[None]:
        """Done once the drain starts: a send that waits for a flow-control window with nothing
        of its message written is given up then (``send_unless``), so its stream ends at once."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            if self.started:
                self._started.set_result(None)
        return self._started

    async def drain(self, grace_s: float) -> None:
        """Ask every stream to end; wait up to ``grace_s`` for them."""
        self.started = True
        self._start.set()
        if self._started is not None and not self._started.done():
            self._started.set_result(None)
        if self._open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)

    def ending(
        self, handlers: Any, refuse: Callable[[RelayError], NoReturn]
    ) -> _EndingOnDrain:
        """``handlers``' bidirectional streams (reflection) ended OK by the drain: a read after
        the first (which is waited for and answered, as a relay stream's request is) finds the
        end of the requests; one opened during the drain is refused UNAVAILABLE /
        PUBLICATION_UNAVAILABLE (``refuse``), as the relay's streams are."""
        return _EndingOnDrain(handlers, self, refuse)


class _EndingOnDrain:
    """See ``GenericDrain.ending``. Wraps handlers whose ``stream.recv_message`` is the
    relay's bounded reader (``h2/request.py``), so it goes inside ``BoundedRequests``."""

    def __init__(
        self, handlers: Any, drain: GenericDrain, refuse: Callable[[RelayError], NoReturn]
    ) -> None:
        self._handlers = handlers
        self._drain = drain
        self._refuse = refuse

    def __mapping__(self) -> dict[str, Handler]:
        mapping: dict[str, Handler] = self._handlers.__mapping__()
        return {
            path: h._replace(func=self._ending(h.func))
            if h.cardinality is Cardinality.STREAM_STREAM else h
            for path, h in mapping.items()
        }  # fmt: skip

    def _ending(self, func: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        drain = self._drain

        async def handle(stream: Any) -> None:
            if drain.started:
                self._refuse(RelayError.publication_unavailable("the relay is shutting down"))
            read = stream.recv_message
            first = True

            async def recv_message() -> Any:
                nonlocal first
                if first:
                    first = False
                    return await read()
                return await drain.unless_started(read())

            stream.recv_message = recv_message
            with drain.held():
                await func(stream)
                if drain.started:  # it ended for the drain, its client may still be sending
                    await finish_early(stream)

        return handle
