"""Wire bytes and a private parsed copy of identity messages, computed once per message object.

betterproto2 takes tens of microseconds to serialize a ``ProducerIdentity`` (91 bytes) and as
long to parse it back (``benchmarks/results/planes.json``). The load and serving-load planes list
every pool generation's identity in every window (each second) and key, sort and copy it there:
with 64 pools that was tens of milliseconds of event loop every second, with or without a
subscriber, and it grew with every pool. An identity never
changes once a generation holds it (nothing in the relay assigns its fields), so its encoding
and one parsed copy are kept per object. The copy is what the planes' messages carry: none of
them shares the generation's own object, and windows never change once published.

The catalog plane keeps its descriptors the same way, with their canonical (normalized) bytes
in place of ``bytes(message)``: a pool hands out the same descriptor object until something it is
made of changes, so a catalog of 64 pools costs one pool's serialization when one pool changes.

The memo holds each object it describes (an ``id`` names one object only while it lives) and at
most ``bound`` of them, the least recently used out first. Beyond that many identities in use,
lookups miss and cost what they did before; nothing is ever wrong. An owner that knows every
object still in use (the catalog: its complete list of pools) calls :meth:`IdentityMemo.retain`
with them: the count alone kept 4,096 dead descriptors, whose size follows what engines report
(a descriptor lists every LoRA adapter), so an engine changing its adapters every probe grew the
relay by about 240 KB a probe, up to 4,096 descriptors' worth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

__all__ = ["DEFAULT_BOUND", "IdentityMemo"]

DEFAULT_BOUND = 4096


class _Message(Protocol):
    def __bytes__(self) -> bytes: ...


M = TypeVar("M", bound=_Message)


class IdentityMemo(Generic[M]):
    """``encoded(message)`` → ``(encode(message), a copy parsed from those bytes)``, once per
    object; ``encode`` is ``bytes`` unless given."""

    __slots__ = ("_bound", "_encode", "_items", "hits", "misses")

    def __init__(
        self, bound: int = DEFAULT_BOUND, encode: Callable[[M], bytes] | None = None
    ) -> None:
        if bound < 1:
            raise ValueError(f"bound must be >= 1, got {bound}")
        self._bound = bound
        self._encode: Callable[[M], bytes] = encode if encode is not None else bytes
        self._items: OrderedDict[int, tuple[M, bytes, M | None]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Forget every object (the next lookups miss)."""
        self._items.clear()

    def retain(self, messages: Iterable[M]) -> None:
        """Forget every object but ``messages`` (those the owner still uses)."""
        keep = {id(m): m for m in messages}
        for key in [k for k, (obj, _d, _c) in self._items.items() if keep.get(k) is not obj]:
            del self._items[key]

    def encoded(self, message: M) -> tuple[bytes, M]:
        """The bytes and the private copy (parsed the first time one is asked for)."""
        key = id(message)
        data, copy = self._entry(message)
        if copy is None:
            copy = type(message).parse(data)  # type: ignore[attr-defined]
            self._items[key] = (message, data, copy)
        return data, copy

    def data(self, message: M) -> bytes:
        """The bytes alone (a sort key, say): no copy is parsed for them."""
        return self._entry(message)[0]

    def _entry(self, message: M) -> tuple[bytes, M | None]:
        key = id(message)
        hit = self._items.get(key)
        if hit is not None and hit[0] is message:
            self._items.move_to_end(key)
            self.hits += 1
            return hit[1], hit[2]
        data = self._encode(message)
        self._items[key] = (message, data, None)
        self._items.move_to_end(key)
        self.misses += 1
        while len(self._items) > self._bound:
            self._items.popitem(last=False)
        return data, None
