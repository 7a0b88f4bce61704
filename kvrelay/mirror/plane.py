"""``MirrorPlane``: a ``Plane`` of the bytes an upstream plane stream delivered.

Each upstream stream is one *epoch*. While it delivers, the plane holds its newest message (kept
as received) under a local version that preserves the upstream's differences (revision or
window sequence), so the service's per-version logic — load lag (§4.5), readiness re-sends —
behaves as on the upstream. When the stream ends, every reader of that epoch ends the way the
upstream ended it (its error, or cleanly), and new readers are refused until another stream
delivers: a mirror never serves a plane message from a source it has lost. The next epoch starts
above every version used before, so a reader of an old epoch can never mistake a new message
for the continuation of its own stream.

A new reader is served only while the mirror holds its upstream session (the ``session``
check, ``Mirror.in_session``: what its health says too): without one it is refused
``PUBLICATION_UNAVAILABLE``, also by a plane whose own stream still delivers (a catalog, sent
only on change, while the upstream's load plane went silent). Readers already following the
plane go on until its stream ends.

An upstream that does not implement the plane's RPC makes new readers' streams end
``UNIMPLEMENTED``, but only while the mirror holds the upstream session that answered so: with
none, or once the upstream's identity changes or asking it again fails, that answer says
nothing of the upstream now, and readers are refused ``PUBLICATION_UNAVAILABLE`` as on every
other plane (an upstream that went away may come back upgraded).

A re-send at the version already held (readiness heartbeats) is not published again. Its bytes
need not be the same: another encoder may order fields or pack repeated ones differently. With
``same`` (the mirror passes canonical protobuf equality), a re-send whose bytes differ but whose
message is the one held is counted (``equivalent_resends``) and dropped. A different message at
the version held replaces it (``replaced``): a relay whose ``[[authorization]]`` rules were
reloaded re-sends its current message filtered anew under the same version, and a direct
subscriber takes it; the mirror's readers get it as the next local version.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from kvrelay.client import plane_rules
from kvrelay.client.errors import ConsumerViolation
from kvrelay.contract.errors import RelayError
from kvrelay.publication.plane import PlaneEnded, PlaneUnsupported

#: Ended epochs remembered for readers that come back to wait after their epoch ended.
ENDED_EPOCHS = 16


class PlaneViolation(Exception):
    """An upstream plane stream broke a rule (version went backwards, changed at one version)."""


class MirrorPlane:
    """Latest upstream message of one plane, with epochs. Single event loop; never blocks."""

    def __init__(
        self,
        name: str,
        same: Callable[[bytes, bytes], bool] | None = None,
        session: Callable[[], bool] | None = None,
    ) -> None:
        """``same(held, resent)``: whether two encodings carry one message (default: equal
        bytes); ``session()``: whether the mirror holds an upstream session now (default:
        always), without which new readers are refused (neither the message held nor an
        ``UNIMPLEMENTED`` verdict is given)."""
        self.name = name
        self._same = same
        self._session = session
        self._version = -1
        self._data: bytes | None = None
        self._live = False
        self._base = 0  # local version of this epoch's first message
        self._first = 0  # upstream version of this epoch's first message
        self._upstream = -1  # newest upstream version of this epoch
        self._ends: deque[tuple[int, RelayError | None]] = deque(maxlen=ENDED_EPOCHS)
        self._down = self._unavailable("not connected to the upstream yet")
        self._event = asyncio.Event()
        self._unsupported: str | None = None
        self.epochs = 0
        self.messages = 0
        self.equivalent_resends = 0  # re-sends with other bytes for the same message
        self.replaced = 0  # other messages under the version held (a rules reload upstream)

    def _unavailable(self, why: str) -> RelayError:
        return RelayError.publication_unavailable(f"mirror {self.name} plane: {why}")

    @property
    def live(self) -> bool:
        return self._live

    @property
    def synced(self) -> bool:
        """Whether the mirror has this plane in sync: a stream delivers it, or the upstream
        answered its RPC ``UNIMPLEMENTED`` (new readers get ``UNIMPLEMENTED`` too, as from the
        upstream). Why: a mirror that waited for such a plane to deliver would never serve."""
        return self._live or self._unsupported is not None

    @property
    def upstream_version(self) -> int | None:
        """Newest upstream version of the live epoch (None while down)."""
        return self._upstream if self._live else None

    # --- Plane ---
    @property
    def unsupported(self) -> bool:
        """The upstream answered this plane's RPC ``UNIMPLEMENTED`` (and has not since served
        it)."""
        return self._unsupported is not None

    def current(self) -> tuple[int, bytes]:
        served = self._live or self._unsupported is not None
        if served and self._session is not None and not self._session():
            raise self._unavailable("the mirror has no upstream session")
        if not self._live or self._data is None:
            if self._unsupported is not None:
                raise PlaneUnsupported(self._unsupported)
            raise RelayError(self._down.reason, self._down.message)
        return self._version, self._data

    async def wait_newer(self, version: int) -> tuple[int, bytes]:
        while True:
            if version < self._base or not self._live:
                raise self._end_of(version)
            if self._version > version:
                assert self._data is not None
                return self._version, self._data
            await self._event.wait()

    def _end_of(self, version: int) -> Exception:
        for base, error in reversed(self._ends):
            if base <= version:
                if error is None:
                    return PlaneEnded(f"upstream {self.name} stream ended")
                return RelayError(error.reason, error.message)
        return self._unavailable("the upstream stream this reader followed is gone")

    # --- fed by the mirror ---
    def offer(self, upstream_version: int, data: bytes) -> bool:
        """One upstream message; True if it is new. Raises PlaneViolation if the upstream went
        backwards (``plane_rules.plane_version``, the SDK's rule too). Other content under the
        version it already sent replaces the held message (a relay re-sends its current message
        filtered anew when its ``[[authorization]]`` rules are reloaded, under the same version;
        consumers replace their state with each message), and local readers get it as the next
        local version."""
        if not self._live:
            self._live = True
            self._unsupported = None
            self.epochs += 1
            self._base = self._version + 1
            self._first = upstream_version
            self._publish(self._base, upstream_version, data)
            return True
        try:
            newer = plane_rules.plane_version(self.name, self._upstream, upstream_version)
        except ConsumerViolation as v:
            raise PlaneViolation(v.detail) from None
        if not newer:
            if data == self._data:
                return False  # a re-send (readiness heartbeat): the mirror's own server re-sends
            held = self._data
            if held is not None and self._same is not None and self._same(held, data):
                self.equivalent_resends += 1
                return False
            self.replaced += 1
            self._first -= 1  # upstream version v is local base + v - first: one more now
            self._publish(self._version + 1, upstream_version, data)
            return True
        self._publish(self._base + upstream_version - self._first, upstream_version, data)
        return True

    def _publish(self, version: int, upstream_version: int, data: bytes) -> None:
        self._version = version
        self._upstream = upstream_version
        self._data = data
        self.messages += 1
        self._wake()

    def end(self, error: RelayError | None, why: str = "upstream stream ended") -> None:
        """The epoch's upstream stream ended: its readers end with ``error`` (None: cleanly) and
        new readers are refused until the next stream delivers. It also ends an
        ``UNIMPLEMENTED`` verdict: it was the answer of the upstream this stream reached (a
        stream that fails to reach it, or a new upstream identity, says nothing of the next)."""
        self._down = self._unavailable(why if error is None else f"{why}: {error.message}")
        self._unsupported = None
        if not self._live:
            return
        self._live = False
        self._ends.append((self._base, error))
        self._wake()

    def mark_unsupported(self, why: str) -> None:
        """The upstream does not implement this plane's RPC: new readers get ``UNIMPLEMENTED``
        until a stream delivers again (the upstream was upgraded)."""
        self.end(None, why)
        self._unsupported = f"mirror {self.name} plane: {why}"

    def _wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()
