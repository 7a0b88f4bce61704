"""Reorder buffer: sequence order, duplicate seqs ignored, both bounds enforced without mutation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.ingest.reorder import ReorderBuffer


def test_bounds_in_messages_and_bytes() -> None:
    b = ReorderBuffer(max_messages=3, max_bytes=10)
    assert b.put(5, b"aaaa") and b.put(3, b"bbbb")
    assert not b.put(4, b"ccc")  # 11 bytes > 10: refused, nothing changed
    assert len(b) == 2 and b.nbytes == 8
    assert b.put(4, b"cc") and not b.put(6, b"")  # 3 messages max
    assert b.put(4, b"zz")  # already held: ignored, reported as fine
    assert [b.pop() for _ in range(3)] == [(3, b"bbbb"), (4, b"cc"), (5, b"aaaa")]
    assert b.nbytes == 0 and b.min_seq() is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.binary(max_size=6)), max_size=40))
def test_matches_a_sorted_dict_model(items: list[tuple[int, bytes]]) -> None:
    b = ReorderBuffer(max_messages=10, max_bytes=30)
    model: dict[int, bytes] = {}
    for seq, payload in items:
        fits = len(model) < 10 and sum(map(len, model.values())) + len(payload) <= 30
        ok = b.put(seq, payload)
        if seq in model:
            assert ok
        else:
            assert ok == fits
            if fits:
                model[seq] = payload
    assert [b.pop() for _ in range(len(b))] == sorted(model.items())
