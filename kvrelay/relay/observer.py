"""Extension point: whoever wants to hear about the relay's events (metrics, tests, tools).

The relay calls these on its own event loop, synchronously and cheaply; an observer must not
block or raise (one that raises is logged and dropped, the relay goes on). Counters are not
events: they are read on demand through ``Relay.stats()``.
"""

from __future__ import annotations

from typing import Protocol

from kvrelay.logging import get_logger

_log = get_logger(__name__)


class RelayObserver(Protocol):
    def delta_published(self, pool: str, seconds: float) -> None:
        """A delta was published; ``seconds`` from its first applied command to publication."""
        ...

    def pool_removed(self, pool: str) -> None:
        """``pool`` left the configuration: whatever is kept under its name can go."""
        ...


class Observers:
    """Fan-out to every registered observer (the relay holds exactly one of these)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[RelayObserver] = []

    def add(self, observer: RelayObserver) -> None:
        if observer not in self._items:
            self._items.append(observer)

    def remove(self, observer: RelayObserver) -> None:
        if observer in self._items:
            self._items.remove(observer)

    def __bool__(self) -> bool:
        return bool(self._items)

    def delta_published(self, pool: str, seconds: float) -> None:
        for obs in tuple(self._items):
            try:
                obs.delta_published(pool, seconds)
            except Exception:
                _log.exception("observer_failed", observer=type(obs).__name__)
                self.remove(obs)

    def pool_removed(self, pool: str) -> None:
        for obs in tuple(self._items):
            try:
                obs.pool_removed(pool)
            except Exception:
                _log.exception("observer_failed", observer=type(obs).__name__)
                self.remove(obs)
