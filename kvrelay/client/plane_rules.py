"""The consumer rules of the plane streams (catalog, readiness, load, serving load), written once.

The SDK's ``RelayConnection`` (on parsed messages) and the mirror's ``MirrorPlane`` (on the
version its wire envelope carries) both check every plane message with these functions, so the
two never disagree on what a relay may send on a plane: as ``stream_rules.py`` is for the pool
streams. A broken rule raises :class:`ConsumerViolation` with the reason from ``errors.py``.
"""

from __future__ import annotations

from kvrelay.client import errors as E
from kvrelay.client.errors import ConsumerViolation

__all__ = ["plane_version"]


def plane_version(plane: str, held: int | None, version: int) -> bool:
    """A plane message's version (catalog or readiness ``revision``, a load window's
    ``window_sequence``) against the newest one its stream delivered (``held``; None before the
    first, or after a new relay identity): True if newer, False if equal (a re-send, a readiness
    heartbeat). A lower one is refused: taking it would show a state the relay has left as
    current (a catalog listing a withdrawn pool, a revision that was READY) until the next
    change."""
    if held is None or version > held:
        return True
    if version == held:
        return False
    raise ConsumerViolation(E.VERSION_BACKWARDS, f"{plane} version went backwards: "
                                                 f"{version} < {held}")  # fmt: skip
