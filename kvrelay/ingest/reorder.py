"""Bounded buffer of raw live messages waiting for an earlier sequence (replay in flight).

Bounded in messages and in payload bytes. ``put`` returns False when either bound would be
exceeded; the subscriber then treats the hole as unrecoverable (member reset), because holding
more would mean unbounded memory for a stalled replay.
"""

from __future__ import annotations

import heapq


class ReorderBuffer:
    __slots__ = ("_bytes", "_heap", "_seqs", "max_bytes", "max_messages")

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._heap: list[tuple[int, bytes]] = []
        self._seqs: set[int] = set()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._heap)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, seq: int, payload: bytes) -> bool:
        """Adds a message (a seq already held is ignored); False = bound exceeded, not added."""
        if seq in self._seqs:
            return True
        if len(self._heap) >= self.max_messages or self._bytes + len(payload) > self.max_bytes:
            return False
        heapq.heappush(self._heap, (seq, payload))
        self._seqs.add(seq)
        self._bytes += len(payload)
        return True

    def min_seq(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def pop(self) -> tuple[int, bytes]:
        seq, payload = heapq.heappop(self._heap)
        self._seqs.discard(seq)
        self._bytes -= len(payload)
        return seq, payload

    def clear(self) -> None:
        self._heap.clear()
        self._seqs.clear()
        self._bytes = 0
