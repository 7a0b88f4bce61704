"""``/kvrelay.v1.Spacing/HoldPublication``: a downstream kvrelay asks for publication spacing.

Why: a relay spaces its publications while one of its subscribers catches up (its snapshot,
then the deltas queued meanwhile), so that a large lane joined under load completes. A mirror —
and so every fan-out worker of ``workers = N`` — forwards its upstream's sequences one for one
and cannot space them; its joiners would be ended as lagged. So while a mirror's own joiners
catch up it asks its upstream for the spacing they need, and the upstream honours it as it would
for a joiner of its own: at most ``snapshot_publication_delay_s``, lapsing unless renewed
(``PublicationHub.request_hold``). Not part of Dynamo's contract: a separate service, which a
Dynamo relay answers with UNIMPLEMENTED (the mirror then stops asking).

Request: a ``SubscribeKvPoolRequest`` (contract marker, subscriber id = the requester,
expected producer), checked as a subscription is; the spacing in milliseconds in the
``kvrelay-hold-ms`` header (0 ends the request). Reply: ``RelayInfo``. Errors are the
subscription's (POOL_NOT_FOUND, PRODUCER_CHANGED, RESOURCE_LIMIT, …), with its reason trailer,
counted as the relay's other calls are. Under
``[[authorization]]`` a client no rule with ``spacing = true`` names is refused
PERMISSION_DENIED before its pool is looked at (asking slows every other reader of the pool),
and a pool it may not see is answered as an absent one (POOL_NOT_FOUND; a mirror's
``absent_hold``).
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay._text import is_decimal
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import producer_key
from kvrelay.service.authz import not_visible
from kvrelay.service.h2.request import REQUEST_TIMEOUT_S, recv_within
from kvrelay.service.status import status_of
from kvrelay.service.validation import validate_stream_request

SPACING = "/kvrelay.v1.Spacing/"
HOLD_METHOD = SPACING + "HoldPublication"
HOLD_HEADER = "kvrelay-hold-ms"
#: The longest spacing a request may name (the relay caps it at its own bound anyway).
MAX_HOLD_MS = 60_000
#: The refusal's message: what the operator of the asking mirror needs to change.
NOT_GRANTED = "no [[authorization]] rule with spacing = true names this client"


class SpacingService:
    """The handler; ``view`` is the served ``RelayView`` (its ``hold_pool``, when it has one)."""

    def __init__(self, view: Any, relay_info: Any, rights: Any, max_message_bytes: int) -> None:
        self.view = view
        self._max_message_bytes = max_message_bytes
        self._relay_info = relay_info  # () -> RelayInfo bytes
        #: the relay service: its ``may_see``/``deny`` (``[[authorization]]``) and its
        #: ``request_guards``; None: no rules, no guards
        self._rights = rights
        self.requests = 0
        self.refused = 0

    def __mapping__(self) -> dict[str, Handler]:
        return {
            HOLD_METHOD: Handler(
                self._hold, Cardinality.UNARY_UNARY, pb.SubscribeKvPoolRequest, pb.RelayInfo
            )
        }

    async def _hold(self, stream: Stream[Any, Any]) -> None:
        hold = getattr(self.view, "hold_pool", None)
        if hold is None:
            raise GRPCError(Status.UNIMPLEMENTED, "this relay does not space for mirrors")
        self.requests += 1
        try:
            request = await recv_within(
                stream, self._max_message_bytes, REQUEST_TIMEOUT_S,
                getattr(self._rights, "request_guards", None),
            )  # fmt: skip
            validate_stream_request(request.contract_marker, request.subscriber_id)
            producer_key(request.expected_producer)
            raw = dict(stream.metadata or {}).get(HOLD_HEADER, "")
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            if not is_decimal(text) or int(text) > MAX_HOLD_MS:
                raise RelayError.invalid_request(f"{HOLD_HEADER} must be 0..{MAX_HOLD_MS}")
            rights = self._rights
            if rights is not None and not rights.may_space(stream):
                self.refused += 1
                raise GRPCError(Status.PERMISSION_DENIED, NOT_GRANTED)
            if rights is not None and not rights.may_see(stream, request.expected_producer):
                rights.deny("HoldPublication", request.expected_producer)
                absent = getattr(self.view, "absent_hold", None)  # a mirror's own answer
                raise absent() if absent is not None else not_visible()
            await hold(request.expected_producer, request.subscriber_id, int(text) / 1000.0)
            info = self._relay_info()
        except RelayError as err:
            self.refused += 1
            self._refuse(err)
        except (GRPCError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: INTERNAL with the trailer, as the relay's calls end
            internal = getattr(self._rights, "internal_error", None)
            if internal is None:
                self._refuse(RelayError.internal(f"internal error: {type(exc).__name__}"))
            self._refuse(internal("HoldPublication", exc))
        await stream.send_message(info)

    def _refuse(self, err: RelayError) -> NoReturn:
        refuse = getattr(self._rights, "refuse", None)  # the relay's: counted, with the
        if refuse is not None:  # reason trailer, as its own calls are
            refuse(err)
        raise GRPCError(status_of(err), err.message) from None
